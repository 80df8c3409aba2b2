"""Attention sinks: a per-head logit in the softmax denominator (gpt-oss; Megatron's
``--softmax-type off-by-one | learnable``, ``TransformerConfig.softmax_type``).

Megatron's softmax with an offset ``s_h`` (``DotProductAttention.softmax_offset``, one value
per head of the TP partition; 0 for off-by-one) appends a column ``s_h`` to every row of
scores and drops it after the softmax: a key whose value is zero. It changes only the
final normalisation of each query row, so it fits the log-sum-exp merge exactly, once per
row after the last merge, with the block kernels unchanged::

    lse' = logaddexp(lse, s_h)          out' = out * exp(lse - lse')

The backward of the block kernels is the one of attention normalised by ``lse'``: run with
``out'`` and ``lse'`` (what the forward saves) and ``dO'``, the kernels recompute
``P' = exp(S - lse')`` and ``D = rowsum(dO' * out')``, which already count the sink's share
(its value is zero, so it adds nothing to ``D``). The sink's own gradient is its
probability times ``-D``, summed over the rows::

    ds_h = - sum over rows of exp(s_h - lse') * rowsum(dO' * out')

A row that sees no key (padding) has ``lse = -inf``: ``out' = 0`` and it adds nothing to
``ds``. Every rank adds its own rows; Megatron's gradient all-reduce over DP x CP sums them
as it does for every other parameter.
"""

from __future__ import annotations

import torch


def lse_with_sink(lse: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """``lse' = logaddexp(lse, s_h)`` for ``lse [b, h, S]`` (accumulator dtype) and ``sink [h]``:
    finite even on rows that saw no key."""
    return torch.logaddexp(lse, sink.detach().to(lse.dtype).view(1, -1, 1))


def add_sink_(acc_out: torch.Tensor, acc_lse: torch.Tensor, sink: torch.Tensor) -> None:
    """In place on a finished merge, in the accumulator dtype (before the cast to the input
    dtype): ``acc_out [b, h, S, dv]``, ``acc_lse [b, h, S]``, ``sink [h]``."""
    new_lse = lse_with_sink(acc_lse, sink)
    acc_out.mul_(torch.exp(acc_lse - new_lse).unsqueeze(-1))
    acc_lse.copy_(new_lse)


def sink_grad(dout: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """``ds [h]`` (the sink's dtype) from this rank's rows: ``dout``, ``out`` ``[S, b, h, dv]``
    (``out`` with the sink applied), ``lse [S, b, h]`` (accumulator dtype, with the sink)."""
    rowsum = (dout.to(lse.dtype) * out.to(lse.dtype)).sum(-1)  # [S, b, h]
    prob = torch.exp(sink.detach().to(lse.dtype).view(1, 1, -1) - lse)  # the sink's probability per row
    return -(prob * rowsum).sum(dim=(0, 1)).to(sink.dtype)


def local_sink(sink: torch.Tensor | None, heads: int, ulysses_size: int, ulysses_rank: int) -> torch.Tensor | None:
    """The sinks of the heads this rank attends after the Ulysses all-to-all (``heads / U``
    of them, Ulysses rank ``u`` taking heads ``u*heads/U ..``): a view, so that autograd
    puts their gradient back in place, zeros elsewhere."""
    if sink is None or ulysses_size == 1:
        return sink
    per = heads // ulysses_size
    return sink[ulysses_rank * per:(ulysses_rank + 1) * per]


def check_sink(sink: torch.Tensor | None, heads: int, device: torch.device) -> None:
    """ValueError naming the setting before any communication."""
    if sink is None:
        return
    if sink.dim() != 1 or sink.shape[0] != heads:
        raise ValueError(f"softmax_offset must be one logit per attention head of this rank ([{heads}], after "
                         f"tensor parallelism), got shape {tuple(sink.shape)}")
    if not sink.is_floating_point() or sink.device != device:
        raise ValueError(f"softmax_offset must be a floating tensor on {device}, got {sink.dtype} on {sink.device}")
