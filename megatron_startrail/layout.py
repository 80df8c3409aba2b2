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
Work is dispatched on global chunk indices. For query chunk ``x`` and key chunk ``y``
(whole chunks; runs of tokens inside one chunk are handled by :func:`plan_blocks`)::

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

import functools
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


# A run of tokens of one global chunk: (chunk index, start, stop), offsets inside the chunk.
# Local storage holds its segments back to back, in the order listed.
Segment = tuple[int, int, int]


def whole_chunks(chunks: tuple[int, ...], chunk_len: int) -> tuple[Segment, ...]:
    return tuple((c, 0, chunk_len) for c in chunks)


@functools.lru_cache(maxsize=4096)
def split_segments(segments: tuple[Segment, ...], parts: int) -> tuple[tuple[Segment, ...], ...]:
    """Cut every segment into ``parts`` near-equal runs; part ``k`` takes run ``k`` of each.

    Used to spread one transfer over several concurrent rings (TASP): each part travels
    on its own ring and is still a valid set of segments to attend to.
    """
    out: list[list[Segment]] = [[] for _ in range(parts)]
    for chunk, start, stop in segments:
        n = stop - start
        bounds = [start + (n * k) // parts for k in range(parts + 1)]
        for k in range(parts):
            if bounds[k + 1] > bounds[k]:
                out[k].append((chunk, bounds[k], bounds[k + 1]))
    return tuple(tuple(p) for p in out)


def segment_rows(segments: tuple[Segment, ...], within: tuple[Segment, ...]) -> list[tuple[int, int]]:
    """Row ranges of ``segments`` inside storage laid out as ``within`` (which contains them)."""
    offsets, pos = {}, 0
    for seg in within:
        offsets[seg] = pos
        pos += seg[2] - seg[1]
    rows = []
    for chunk, start, stop in segments:
        for (c, a, b), off in offsets.items():
            if c == chunk and a <= start and stop <= b:
                rows.append((off + start - a, off + stop - a))
                break
        else:
            raise ValueError(f"segment {(chunk, start, stop)} is not in {within}")
    return rows


@dataclass(frozen=True)
class Block:
    """One kernel call: query rows against key rows of local storage.

    ``k_rows`` may list several ranges (concatenated for the call). ``causal`` blocks are
    square with the diagonal on the diagonal (top-left aligned), the one mask every
    kernel agrees on.
    """

    q_rows: tuple[int, int]
    k_rows: tuple[tuple[int, int], ...]
    causal: bool


def _offsets(segments):
    offs, pos = [], 0
    for _, a, b in segments:
        offs.append(pos)
        pos += b - a
    return offs, pos


def _coalesce(ranges: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    out: list[tuple[int, int]] = []
    for a, b in sorted(ranges):
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return tuple(out)


@functools.lru_cache(maxsize=4096)  # pure, and called every step with the same few layouts
def plan_blocks(q_segments: tuple[Segment, ...], k_segments: tuple[Segment, ...], causal: bool) -> tuple[Block, ...]:
    """Kernel calls that cover exactly the visible (query, key) pairs; see Note [causal blocks].

    For a query run ``[qa, qb)`` and a key run ``[ka, kb)`` of the same chunk, query ``i``
    sees key ``j`` iff ``j <= i``::

        keys [ka, min(kb, qa))         precede every query row        -> full
        rows/keys [e, e + m), e = max(ka, qa), m = min(qb, kb) - e     -> square causal
        rows [kb, qb) x keys [e, kb)   (queries past the key run)      -> full

    Full blocks of one query run are merged into a single call.
    """
    q_offs, q_total = _offsets(q_segments)
    k_offs, k_total = _offsets(k_segments)
    if not causal:
        return (Block((0, q_total), ((0, k_total),), False),) if q_total and k_total else ()
    blocks: list[Block] = []
    for (qc, qa, qb), qo in zip(q_segments, q_offs):
        full: list[tuple[int, int]] = []
        extra: list[Block] = []
        for (kc, ka, kb), ko in zip(k_segments, k_offs):
            if kc < qc:
                full.append((ko, ko + kb - ka))
            elif kc == qc:
                if ka < min(kb, qa):
                    full.append((ko, ko + min(kb, qa) - ka))
                e = max(ka, qa)
                m = min(qb, kb) - e
                if m > 0:
                    extra.append(Block((qo + e - qa, qo + e - qa + m), ((ko + e - ka, ko + e - ka + m),), True))
                    if qb > kb:
                        extra.append(Block((qo + kb - qa, qo + qb - qa), ((ko + e - ka, ko + kb - ka),), False))
        if full:
            blocks.append(Block((qo, qo + qb - qa), _coalesce(full), False))
        blocks.extend(extra)
    return tuple(blocks)
