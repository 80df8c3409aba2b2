"""Packed-sample metadata: validate ``cu_seqlens`` and make every CP rank agree on it.

Bad input must be a ``ValueError`` on *every* rank before the attention communicates
(a rank that raised alone would leave its peers waiting in the team all-gather). Each
rank validates locally (:func:`~megatron_startrail.layout.documents_from_cu_seqlens`),
then one tiny all-reduce (MAX) over the CP group carries, per rank::

    [error flag, local tokens, n_docs + 1, layout, sum cu, sum i*cu, sum cu_pad, sum i*cu_pad]
    and the same vector negated (so one MAX gives both the max and the min)

Any rank's error, or any field differing across ranks (token counts, document
boundaries), raises on all of them. The check is counted as its own op,
``"document_check"``, in the forward :class:`~megatron_startrail.comm.CommStats`.
"""

from __future__ import annotations

import torch

from .comm import CommStats, Communicator
from .groups import StarTrailGroups
from .layout import Documents, dense_sequence, documents_from_cu_seqlens

CHECK_OP = "document_check"


def _as_tuple(name: str, cu: torch.Tensor) -> tuple[int, ...]:
    if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.dtype.is_floating_point or cu.dtype == torch.bool:
        raise ValueError(f"{name} must be a 1-D integer tensor (int32 [n_docs + 1]), got {cu!r:.80}")
    return tuple(int(x) for x in cu.tolist())  # one host sync per call


# Two polynomial hashes modulo the Mersenne prime 2^61 - 1 (they fit int64 and their
# negation). Plain moments (sum, sum of i*cu) collide on ordinary inputs: [0,1,4,5,8] and
# [0,2,2,6,8] share both.
_HASH_PRIME = (1 << 61) - 1
_HASH_BASES = (1_000_003, 998_244_353)


def _fingerprint(cu: tuple[int, ...] | None) -> list[int]:
    if cu is None:
        return [0, 0]
    hashes = []
    for base in _HASH_BASES:
        h = 0
        for x in cu:
            h = (h * base + x + 1) % _HASH_PRIME
        hashes.append(h)
    return hashes


def agree_on_documents(
    cu_seqlens: torch.Tensor | None,
    cu_seqlens_padded: torch.Tensor | None,
    local_tokens: int,
    batch: int,
    groups: StarTrailGroups,
    stats: CommStats,
    device: torch.device,
) -> Documents:
    """The :class:`Documents` of this call, identical on every CP rank, or ValueError on all."""
    cp = groups.cp_size
    if cu_seqlens is None:
        if cu_seqlens_padded is not None:
            raise ValueError("cu_seqlens_padded needs cu_seqlens (the real document lengths) as well")
        return dense_sequence(cp, local_tokens)
    cu = padded = None
    try:
        cu = _as_tuple("cu_seqlens", cu_seqlens)
        padded = None if cu_seqlens_padded is None else _as_tuple("cu_seqlens_padded", cu_seqlens_padded)
        if batch != 1:
            raise ValueError(
                f"packed documents hold one packed sample per call, but batch = {batch}: flatten the "
                f"micro-batch (Megatron's flatten_batch_for_packed_sequences) or pass [t, heads, dim]"
            )
        found: Documents | str = documents_from_cu_seqlens(cu, padded, cp, local_tokens)
    except ValueError as exc:  # raised on every rank below, after the check
        found = str(exc)
    error = found if isinstance(found, str) else None
    if cp > 1:
        mine = [int(error is not None), local_tokens, len(cu or ()), int(padded is not None)]
        mine += _fingerprint(cu) + _fingerprint(padded)
        vec = torch.tensor(mine, dtype=torch.int64, device=device)
        both = torch.cat([vec, -vec])
        comm = Communicator(stats, None, ())
        both = comm.all_reduce_max(both, groups.ulysses_group, groups.ulysses_size, op=CHECK_OP)
        both = comm.all_reduce_max(both, groups.startrail_group, groups.topology.size, op=CHECK_OP)
        high, low = both[: len(mine)].tolist(), (-both[len(mine):]).tolist()
        if error is None and high[0]:
            error = "another context-parallel rank rejected its packed-sequence input (see its ValueError)"
        elif error is None and high != low:
            fields = ["local tokens" if i == 1 else "cu_seqlens / cu_seqlens_padded"
                      for i in range(1, len(mine)) if high[i] != low[i]]
            error = (f"{sorted(set(fields))} differ across the {cp} context-parallel ranks: every CP rank "
                     f"must pass the same global cu_seqlens (and cu_seqlens_padded) and hold the same "
                     f"number of tokens of one packed sample")
    if error is not None:
        raise ValueError(error)
    return found
