"""Block work of one sub-ring step: kernel calls over chunk pairs, and the lse merge.

Tensors here are in Megatron's sequence-first layout, with the sequence made of equal
chunks whose global indices are given alongside (see :mod:`megatron_startrail.layout`)::

    q-side   q, dout, out  [Sq, b, h, d]      lse [b, h, Sq]   (Sq = n_q_chunks * L)
    kv-side  kv            [Sk, 2, b, hkv, d] (K and V stacked, Sk = n_k_chunks * L)

Kernels want ``[b, h, s, d]``; :func:`_bhsd` gives that as a view.
"""

from __future__ import annotations

import torch

from .kernels import BlockKernel
from .layout import BlockPlan, plan_blocks


def _bhsd(x: torch.Tensor) -> torch.Tensor:
    # [s, b, h, d] -> [b, h, s, d] (a view)
    return x.permute(1, 2, 0, 3)


def _rows(x: torch.Tensor, slot: int, chunk: int) -> torch.Tensor:
    return x[slot * chunk : (slot + 1) * chunk]


def _select(kv: torch.Tensor, slots: tuple[int, ...], chunk: int) -> torch.Tensor:
    """K/V rows of ``slots`` as one ``[len * L, 2, b, hkv, d]`` tensor (a view if contiguous)."""
    if slots == tuple(range(slots[0], slots[0] + len(slots))):
        return kv[slots[0] * chunk : (slots[-1] + 1) * chunk]
    return torch.cat([_rows(kv, s, chunk) for s in slots])


def _scatter_add(dst: torch.Tensor, src: torch.Tensor, slots: tuple[int, ...], chunk: int) -> None:
    """Add ``src [len * L, ...]`` into the rows of ``slots`` of ``dst``."""
    for i, s in enumerate(slots):
        _rows(dst, s, chunk).add_(_rows(src, i, chunk))


def merge_lse_(acc_out: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """In place: fold a partial (out, lse) into the accumulator (out ``[b,h,s,d]``, lse ``[b,h,s]``).

    ``acc_lse = -inf`` marks rows that have seen no key yet; they take zero weight (never
    NaN from ``-inf - -inf``).
    """
    new_lse = torch.logaddexp(acc_lse, lse.to(acc_lse.dtype))
    ref = new_lse.masked_fill(new_lse.isneginf(), 0.0)
    acc_out.mul_(torch.exp(acc_lse - ref).unsqueeze(-1))
    acc_out.add_(out.to(acc_out.dtype) * torch.exp(lse.to(ref.dtype) - ref).unsqueeze(-1))
    acc_lse.copy_(new_lse)


def merge_partials(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge ``C`` partial results: outs ``[C, b, h, s, d]``, lses ``[C, b, h, s]`` (acc dtype)."""
    lse = torch.logsumexp(lses, dim=0)
    ref = lse.masked_fill(lse.isneginf(), 0.0)
    weights = torch.exp(lses - ref).unsqueeze(-1)  # rows nobody saw: all weights 0
    return (outs.to(weights.dtype) * weights).sum(dim=0), lse


def _plans(q_chunks, k_chunks, causal) -> tuple[BlockPlan, ...]:
    return plan_blocks(tuple(q_chunks), tuple(k_chunks), causal)


def forward_step(
    kernel: BlockKernel,
    q: torch.Tensor,
    kv: torch.Tensor,
    q_chunks: tuple[int, ...],
    k_chunks: tuple[int, ...],
    acc_out: torch.Tensor,
    acc_lse: torch.Tensor,
    *,
    causal: bool,
    scale: float,
) -> None:
    """Attend ``q`` to ``kv`` and merge into ``acc_out [b, h, Sq, d]`` / ``acc_lse [b, h, Sq]``."""
    if not causal:  # every query sees every key: one call
        out, lse = kernel.forward(_bhsd(q), _bhsd(kv[:, 0]), _bhsd(kv[:, 1]), causal=False, scale=scale)
        merge_lse_(acc_out, acc_lse, out, lse)
        return
    chunk = q.shape[0] // len(q_chunks)
    for plan in _plans(q_chunks, k_chunks, causal):
        qs = _bhsd(_rows(q, plan.query_slot, chunk))
        rows = slice(plan.query_slot * chunk, (plan.query_slot + 1) * chunk)
        for slots, is_diag in ((plan.full, False), ((plan.diagonal,) if plan.diagonal is not None else (), True)):
            if not slots:
                continue
            kvs = _select(kv, slots, chunk)
            out, lse = kernel.forward(qs, _bhsd(kvs[:, 0]), _bhsd(kvs[:, 1]), causal=is_diag, scale=scale)
            merge_lse_(acc_out[:, :, rows], acc_lse[:, :, rows], out, lse)


def backward_step(
    kernel: BlockKernel,
    q: torch.Tensor,
    dout: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    kv: torch.Tensor,
    q_chunks: tuple[int, ...],
    k_chunks: tuple[int, ...],
    dq: torch.Tensor,
    dkv: torch.Tensor,
    *,
    causal: bool,
    scale: float,
) -> None:
    """Add this step's gradients into ``dq [Sq, b, h, d]`` and ``dkv [Sk, 2, b, hkv, d]``."""
    if not causal:
        g = kernel.backward(
            _bhsd(dout), _bhsd(q), _bhsd(kv[:, 0]), _bhsd(kv[:, 1]), _bhsd(out), lse, causal=False, scale=scale
        )
        _bhsd(dq).add_(g[0])
        _bhsd(dkv[:, 0]).add_(g[1])
        _bhsd(dkv[:, 1]).add_(g[2])
        return
    chunk = q.shape[0] // len(q_chunks)
    for plan in _plans(q_chunks, k_chunks, causal):
        qslot = plan.query_slot
        q_rows = [_bhsd(_rows(t, qslot, chunk)) for t in (q, dout, out)]
        lse_rows = lse[:, :, qslot * chunk : (qslot + 1) * chunk].contiguous()
        for slots, is_diag in ((plan.full, False), ((plan.diagonal,) if plan.diagonal is not None else (), True)):
            if not slots:
                continue
            kvs = _select(kv, slots, chunk)
            gq, gk, gv = kernel.backward(
                q_rows[1], q_rows[0], _bhsd(kvs[:, 0]), _bhsd(kvs[:, 1]), q_rows[2], lse_rows,
                causal=is_diag, scale=scale,
            )
            _bhsd(_rows(dq, qslot, chunk)).add_(gq)
            gkv = torch.stack([gk, gv], dim=0).permute(3, 0, 1, 2, 4)  # [len*L, 2, b, hkv, d]
            _scatter_add(dkv, gkv, slots, chunk)
