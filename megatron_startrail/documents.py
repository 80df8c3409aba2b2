"""Packed-sample metadata: validate ``cu_seqlens`` and make every CP rank agree on it.

Bad input must be a ``ValueError`` on *every* rank before the attention communicates
(a rank that raised alone would leave its peers waiting in the team all-gather). Once
per micro-batch (:class:`~megatron_startrail.microbatch.MicroBatchCache`: every layer
of the micro-batch passes the same ``cu_seqlens`` tensors), each rank builds on its
device, with no host sync::

    [type error, local tokens, n_docs + 1, layout, 2 hashes of cu, 2 hashes of cu_padded]
    and the same vector negated (so one MAX gives both the max and the min)

and one all-reduce (MAX) over the CP group compares them. Then ONE host sync brings the
agreed vector and this rank's ``cu_seqlens`` to the host together, and every rank
validates the boundaries (:func:`~megatron_startrail.layout.documents_from_cu_seqlens`).
Where every field agrees, every rank validates the same input and so raises the same
error; a field that differs raises on all of them. The check is counted as its own op,
``"document_check"``, in the forward :class:`~megatron_startrail.comm.CommStats`.
"""

from __future__ import annotations

import torch

from .comm import CommStats, Communicator
from .device_copy import to_device
from .groups import StarTrailGroups
from .layout import Documents, dense_sequence, documents_from_cu_seqlens

CHECK_OP = "document_check"


def _type_error(name: str, cu) -> str | None:
    """What is wrong with ``cu``'s type or shape (known on the host, no sync), or None."""
    if not isinstance(cu, torch.Tensor) or cu.dim() != 1 or cu.dtype.is_floating_point or cu.dtype == torch.bool:
        return f"{name} must be a 1-D integer tensor (int32 [n_docs + 1]), got {cu!r:.80}"
    return None


# Position-weighted sums modulo the prime 2^31 - 1, on the device (int64 never overflows:
# every product is of two numbers below 2^31). Plain moments (sum, sum of i*cu) collide on
# ordinary inputs: [0,1,4,5,8] and [0,2,2,6,8] share both; pseudo-random weights per
# position do not.
_PRIME = (1 << 31) - 1
_WEIGHTS = ((1_000_003, 12_345, 67_891), (998_244_353 % _PRIME, 54_321, 19_876))


def _fingerprint(cu: torch.Tensor | None, device) -> list[torch.Tensor]:
    """Two int64 scalars on ``device`` identifying ``cu`` (zeros for None)."""
    if cu is None:
        return [torch.zeros((), dtype=torch.int64, device=device)] * 2
    values = (cu.to(device=device, dtype=torch.int64) + 1) % _PRIME
    i = torch.arange(values.shape[0], dtype=torch.int64, device=device)
    out = []
    for a, b, c in _WEIGHTS:
        weight = (a * (i * i % _PRIME) % _PRIME + b * i + c) % _PRIME
        out.append((values * weight % _PRIME).sum() % _PRIME)
    return out


def agree_on_documents(
    cu_seqlens: torch.Tensor | None,
    cu_seqlens_padded: torch.Tensor | None,
    local_tokens: int,
    batch: int,
    groups: StarTrailGroups,
    stats: CommStats,
    device: torch.device,
    cp_group=None,
) -> Documents:
    """The :class:`Documents` of this call, identical on every CP rank, or ValueError on all.

    Computed once per micro-batch (keyed on the ``cu_seqlens`` tensors); ``cp_group`` is the
    CP group to agree over (Megatron's ``pg_collection.cp``; default: the one the StarTrail
    groups built)."""
    if cu_seqlens is None:
        if cu_seqlens_padded is not None:
            raise ValueError("cu_seqlens_padded needs cu_seqlens (the real document lengths) as well")
        # One object per shape on these groups, so its device metadata is made once for every layer
        # and micro-batch of that shape, and goes with the groups (no process-lifetime tensors).
        return groups.documents_cache.get("dense", (), (groups.cp_size, local_tokens),
                                          lambda: dense_sequence(groups.cp_size, local_tokens))
    group = cp_group if cp_group is not None else groups.cp_group
    return groups.documents_cache.get(
        "documents", (cu_seqlens, cu_seqlens_padded), (local_tokens, batch, id(group)),
        lambda: _agree(cu_seqlens, cu_seqlens_padded, local_tokens, batch, groups, stats, device, group))


def _agree(cu_seqlens, cu_seqlens_padded, local_tokens, batch, groups, stats, device, group) -> Documents:
    cp = groups.cp_size
    error = _type_error("cu_seqlens", cu_seqlens)
    if error is None and cu_seqlens_padded is not None:
        error = _type_error("cu_seqlens_padded", cu_seqlens_padded)
    if error is None and batch != 1:
        error = (f"packed documents hold one packed sample per call, but batch = {batch}: flatten the "
                 f"micro-batch (Megatron's flatten_batch_for_packed_sequences) or pass [t, heads, dim]")
    fields = 8
    # The fields the host knows go over in one non-blocking copy (setting them one by one on the
    # device would be a blocking copy each); the fingerprints are made on the device: no host sync.
    ok = error is None
    known = [int(not ok), local_tokens]
    known += [cu_seqlens.shape[0], int(cu_seqlens_padded is not None)] if ok else [0, 0]
    prints = _fingerprint(cu_seqlens if ok else None, device) + _fingerprint(cu_seqlens_padded if ok else None, device)
    vec = torch.cat([to_device(torch.tensor(known, dtype=torch.int64), device), torch.stack(prints)])  # [fields]
    both = torch.cat([vec, -vec])
    if cp > 1:
        both = Communicator(stats, groups.transports_on(device)[0]).all_reduce_max(both, group, cp, op=CHECK_OP)
    local = [] if error is not None else [cu_seqlens.to(device=device, dtype=torch.int64)]
    if error is None and cu_seqlens_padded is not None:
        local.append(cu_seqlens_padded.to(device=device, dtype=torch.int64))
    host = torch.cat([both, *local]).tolist()  # the one host sync of the micro-batch
    high, low = host[:fields], [-x for x in host[fields : 2 * fields]]
    if error is None and high[0]:
        error = "another context-parallel rank rejected its packed-sequence input (see its ValueError)"
    elif error is None and high != low:
        names = sorted({"local tokens" if i == 1 else "cu_seqlens / cu_seqlens_padded"
                        for i in range(1, fields) if high[i] != low[i]})
        error = (f"{names} differ across the {cp} context-parallel ranks: every CP rank "
                 f"must pass the same global cu_seqlens (and cu_seqlens_padded) and hold the same "
                 f"number of tokens of one packed sample")
    found = None
    if high[0] == 0:  # every rank's input has the right type: validate the boundaries here
        n = cu_seqlens.shape[0]
        cu = tuple(host[2 * fields : 2 * fields + n])
        padded = tuple(host[2 * fields + n :]) if cu_seqlens_padded is not None else None
        found = documents_from_cu_seqlens(cu, padded, cp, local_tokens)  # where all agree: one verdict
    if isinstance(found, str):  # this rank's own input is wrong: say what, first
        error = found if error is None else f"{found}; and {error}"
    if error is not None:
        raise ValueError(error)
    return found
