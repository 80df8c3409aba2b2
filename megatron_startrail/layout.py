"""Which sequence chunks a rank holds, and which (query chunk, key chunk) blocks to compute.

Megatron's context-parallel layout is used unchanged (what
``megatron.core.utils.get_batch_on_this_cp_rank`` produces): the sequence is cut into
``2 * CP`` chunks of equal length and CP rank ``r`` holds chunks ``r`` and ``2*CP-1-r``,
in that order.

With Ulysses inside CP (``CP = U * S``), CP rank ``s*U + u`` is Ulysses rank ``u`` of
StarTrail position ``s``. The Ulysses all-to-all gathers the sequence of the ``U``
consecutive CP ranks in Ulysses-rank order, so StarTrail position ``s`` then holds the
``2U`` chunks ``[c, 2CP-1-c for c in s*U .. s*U+U-1]`` (still zigzag pairs), for a slice
of the heads.

Note [causal blocks]
--------------------
Work is dispatched on global chunk indices. For query chunk ``x`` and key chunk ``y``::

    y < x   full block     (every query sees every key)
    y == x  diagonal block (causal mask inside the block; lengths are equal, so
                            the kernel's top-left-aligned causal mask is right)
    y > x   skipped        (every query is earlier than every key)

Example, CP = 2 (4 chunks), rank 0 holds chunks (0, 3), rank 1 holds (1, 2)::

                 keys ->  0   1   2   3
    queries  0            D   .   .   .
             1            F   D   .   .
             2            F   F   D   .
             3            F   F   F   D

Every zigzag pair of queries against every zigzag pair of keys holds exactly two
chunk-blocks of work, so the layout is load balanced for causal masks with no extra
data movement.
"""

from __future__ import annotations

from dataclasses import dataclass


def zigzag_chunks(cp_rank: int, cp_size: int) -> tuple[int, int]:
    """Global chunk indices held by CP rank ``cp_rank`` (chunk count ``2 * cp_size``)."""
    return (cp_rank, 2 * cp_size - 1 - cp_rank)


def startrail_position_chunks(position: int, ulysses_size: int, cp_size: int) -> tuple[int, ...]:
    """Chunks held by StarTrail position ``position`` after the Ulysses all-to-all."""
    chunks: list[int] = []
    for u in range(ulysses_size):
        chunks.extend(zigzag_chunks(position * ulysses_size + u, cp_size))
    return tuple(chunks)


@dataclass(frozen=True)
class BlockPlan:
    """Work of one query slot against a set of key slots (slots index local storage).

    ``full`` key slots are computed without a mask, ``diagonal`` (if not None) with the
    causal mask. Query slots with no visible key are not listed at all.
    """

    query_slot: int
    full: tuple[int, ...]
    diagonal: int | None


def plan_blocks(query_chunks: tuple[int, ...], key_chunks: tuple[int, ...], causal: bool) -> tuple[BlockPlan, ...]:
    """Blocks to compute for queries holding ``query_chunks`` against ``key_chunks``.

    See Note [causal blocks]. Without a causal mask every query slot sees every key slot
    (callers then batch the whole thing in one kernel call).
    """
    plans = []
    for qs, qc in enumerate(query_chunks):
        if not causal:
            plans.append(BlockPlan(qs, tuple(range(len(key_chunks))), None))
            continue
        full = tuple(ks for ks, kc in enumerate(key_chunks) if kc < qc)
        diag = next((ks for ks, kc in enumerate(key_chunks) if kc == qc), None)
        if full or diag is not None:
            plans.append(BlockPlan(qs, full, diag))
    return tuple(plans)
