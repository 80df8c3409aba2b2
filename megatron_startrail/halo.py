"""Sliding-window attention by halo exchange: only the keys a window reaches move.

With a window ``(left, right)`` no longer than a chunk, the queries of a chunk see only
their own chunk and the last ``left`` (first ``right``) tokens of the chunks before (after)
it. In Megatron's CP layout rank ``r`` holds chunks ``r`` and ``2CP-1-r``; the chunk before
``r`` is rank ``r-1``'s first, the chunk before ``2CP-1-r`` is rank ``r+1``'s second (and
rank ``CP-1`` holds both ``CP-1`` and ``CP``). So every rank needs rows of its two CP
neighbours only::

    rank r:  sends the K, V rows its neighbours' windows reach   (<= left + right rows
             receives the rows of its neighbours its window reaches  per chunk edge)
             attends its queries to [own rows | halos] with the window mask
    backward: the same blocks; dK, dV of the halo rows go back to their owners

The exchange is planned from the documents alone (:func:`halo_plan`), so every rank
derives what it sends and what it receives, in both layouts of packed documents (a
window never crosses a document). It runs on the CP group before any Ulysses all-to-all
(all heads; no team, no sub-ring), over the transport's P2P on the CP group, as one batch
per direction. A longer window reaches further ranks (a window of 2 chunks: the two
chunks before each chunk); the same plan then exchanges with them, as long as no rank
receives more than a quarter of the sequence (:data:`MAX_HALO_SHARE`). Beyond that
:func:`halo_plan` returns None and the StarTrail schedule runs with masked and skipped
blocks instead.

Bytes per rank and direction: ``rows x b x hkv x (dqk + dv) x dtype bytes``, rows as
planned (dense, causal, a window of at most a chunk: ``left`` rows to each existing neighbour).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from . import blocks
from . import max_logit as max_logits
from .comm import Communicator
from .layout import Documents, Segment, coalesce, cp_rank_segments, normalize_window, segment_rows
from .sinks import sink_grad


@dataclass(frozen=True)
class HaloPlan:
    """What CP rank ``rank`` exchanges: ``recv[s]`` / ``send[s]`` are row ranges of CP rank
    ``s``'s storage / of this rank's storage, per neighbour ``s`` (ascending)."""

    rank: int
    recv: tuple[tuple[int, tuple[tuple[int, int], ...]], ...]
    send: tuple[tuple[int, tuple[tuple[int, int], ...]], ...]

    def key_segments(self, docs: Documents) -> tuple[Segment, ...]:
        """The segments of ``[own rows | halo of each neighbour in order]``."""
        own = cp_rank_segments(docs, self.rank)
        return own + tuple(seg for s, ranges in self.recv for a, b in ranges
                           for seg in segment_rows(cp_rank_segments(docs, s), a, b))


def _reached(docs: Documents, bounds, receiver: int, owner: int) -> tuple[tuple[int, int], ...]:
    """Rows of ``owner``'s storage that some query of ``receiver`` sees under ``bounds``."""
    lo, hi = bounds
    rows, offset = [], 0
    queries = cp_rank_segments(docs, receiver)
    for doc, a, b in cp_rank_segments(docs, owner):
        for qdoc, qa, qb in queries:
            if qdoc != doc or doc < 0:
                continue
            x, y = max(a, qa + lo), min(b, qb - 1 + hi + 1)
            if x < y:
                rows.append((offset + int(x) - a, offset + int(y) - a))
        offset += b - a
    return coalesce(rows)


# The exchange replaces the StarTrail schedule while no rank receives more than this share
# of the sequence's rows: then the window skips most remote keys, and what one rank holds
# at once stays small (the schedule keeps every rank's memory bounded whatever the window).
MAX_HALO_SHARE = 0.25


def halo_plan(docs: Documents, window: tuple[int, int], causal: bool, rank: int) -> HaloPlan | None:
    """The halo exchange of CP rank ``rank``, or None when some rank's window reaches more than
    :data:`MAX_HALO_SHARE` of the sequence (the same answer on every rank). A window no
    longer than a chunk reaches only the two CP neighbours."""
    # Cached by the documents' fields, not the object: a micro-batch's Documents carries its
    # device metadata (microbatch.py), which a cache key would keep alive past the micro-batch.
    return _halo_plan(docs.cp_size, docs.cu_seqlens, docs.cu_seqlens_padded, window, causal, rank)


@functools.lru_cache(maxsize=256)
def _halo_plan(cp_size, cu_seqlens, cu_seqlens_padded, window, causal, rank) -> HaloPlan | None:
    docs = Documents(cp_size, cu_seqlens, cu_seqlens_padded)  # a plain copy, no device metadata
    bounds = normalize_window(window, causal)
    cp = docs.cp_size
    if bounds is None or cp == 1:
        return None
    total = cp * sum(b - a for _, a, b in cp_rank_segments(docs, 0))
    recv, send = [], []
    for receiver in range(cp):
        received = 0
        for owner in range(cp):
            if owner == receiver:
                continue
            rows = _reached(docs, bounds, receiver, owner)
            received += sum(b - a for a, b in rows)
            if rows and receiver == rank:
                recv.append((owner, rows))
            if rows and owner == rank:
                send.append((receiver, rows))
        if received > MAX_HALO_SHARE * total:
            return None
    return HaloPlan(rank, tuple(recv), tuple(send))


def _exchange(comm: Communicator, outgoing: list, incoming: list, *, op: str):
    """Post sends ``(tensor, CP rank)`` and receives ``(buffer, CP rank)`` in one batch; wait."""
    comm.post(outgoing, incoming, op=op).wait()


class _HaloAttention(torch.autograd.Function):
    """Windowed attention of this rank's queries over its own and its neighbours' keys."""

    @staticmethod
    def forward(ctx, q, k, v, sink, groups, docs, plan: HaloPlan, window, causal, scale, kernel, fwd_stats, bwd_stats,
                timeline, max_logit=False):
        # q [n, b, h, dqk], k [n, b, hkv, dqk], v [n, b, hkv, dv]  (before any Ulysses all-to-all)
        comm = Communicator(fwd_stats, groups.transports_on(q.device)[1], timeline)
        kv = torch.cat([k, v], dim=-1)  # [n, b, hkv, dqk + dv]
        halos = [kv.new_empty((sum(b - a for a, b in ranges),) + kv.shape[1:]) for _, ranges in plan.recv]
        _exchange(comm, [(blocks.take_rows(kv, ranges).contiguous(), s) for s, ranges in plan.send],
                  [(buf, s) for buf, (s, _) in zip(halos, plan.recv)], op="halo")
        kv_all = torch.cat([kv, *halos])  # [own rows | halos], described by plan.key_segments
        # One step of the attention's block work on the keys that landed (the same
        # accumulators, kernel calls and finish as the StarTrail forward).
        acc_out, acc_lse = blocks.new_partials(q, v.shape[-1])
        best = max_logits.new_accumulator(q) if max_logit else None  # [h]: all heads (no Ulysses here)
        q_segments, k_segments = cp_rank_segments(docs, plan.rank), plan.key_segments(docs)
        blocks.forward_step(kernel, q, kv_all, q_segments, k_segments, acc_out, acc_lse, causal=causal,
                            scale=scale, window=window, max_logit=best)
        out, lse = blocks.finished(acc_out, acc_lse, q.dtype, sink)  # [n, b, h, dv], [n, b, h]
        dqk = q.shape[-1]
        ctx.save_for_backward(q, kv_all, out, lse)
        ctx.meta = (groups, docs, plan, window, causal, scale, kernel, bwd_stats, timeline, dqk)
        ctx.sink = sink
        if best is None:
            return out
        best = max_logits.finish(best, scale)
        ctx.mark_non_differentiable(best)
        ctx.set_materialize_grads(False)  # no zeros made for max_logit's gradient (dout always comes)
        return out, best

    @staticmethod
    def backward(ctx, dout, *_):  # no gradient for max_logit
        q, kv_all, out, lse = ctx.saved_tensors
        groups, docs, plan, window, causal, scale, kernel, bwd_stats, timeline, dqk = ctx.meta
        dsink = sink_grad(dout, out, lse, ctx.sink) if ctx.needs_input_grad[3] else None
        acc = blocks.acc_dtype(q.dtype)
        dq = q.new_zeros(q.shape, dtype=acc)
        dkv_all = kv_all.new_zeros(kv_all.shape, dtype=acc)
        blocks.backward_step(kernel, q, dout.contiguous(), out, lse, kv_all, cp_rank_segments(docs, plan.rank),
                             plan.key_segments(docs), dq, dkv_all, causal=causal, scale=scale, window=window)
        n = q.shape[0]
        dkv, start, back = dkv_all[:n], n, []
        for s, ranges in plan.recv:  # the halo rows' gradients go home
            rows = sum(b - a for a, b in ranges)
            back.append((dkv_all[start : start + rows].contiguous(), s))
            start += rows
        got = [(dkv.new_empty((sum(b - a for a, b in ranges),) + dkv.shape[1:]), s) for s, ranges in plan.send]
        _exchange(Communicator(bwd_stats, groups.transports_on(dout.device)[1], timeline), back, got, op="halo_grad")
        for (buf, _), (_, ranges) in zip(got, plan.send):
            blocks.add_rows(dkv, buf, ranges)
        dtype = q.dtype
        return (dq.to(dtype), *blocks.split_kv(dkv, dqk, dtype), dsink) + (None,) * 11


def halo_attn(q, k, v, sink, groups, docs, plan, window, causal, scale, kernel, fwd_stats, bwd_stats, timeline,
              max_logit=False):
    """:class:`_HaloAttention` on this rank's CP shard: ``[n, b, h, dv]`` (``sink [h]``: attention sinks, or None);
    with ``max_logit``, ``(out, max_logit [h])`` (:mod:`.max_logit`)."""
    return _HaloAttention.apply(q, k, v, sink, groups, docs, plan, window, causal, scale, kernel, fwd_stats,
                                bwd_stats, timeline, max_logit)
