"""PyTorch's native context-parallel ring attention as a benchmark peer, on CPU and gloo.

What a user gets from ``torch.distributed.tensor.experimental.context_parallel`` is
PyTorch's ring attention (``_templated_ring_attention`` and its backward) around the
fused SDPA kernel, with the head-tail load balancer for causal masks (rank ``r`` holds
chunks ``r`` and ``2P-1-r``: Megatron's layout) and K/V rotated by an all-gather by
default (``set_rotate_method("alltoall")`` moves them one hop per step instead, each hop an
all-to-all over all ranks with one non-empty split: ``permute_tensor``).

The public entry point cannot run here: torch 2.13's CP dispatcher only handles the
CUDA SDPA ops (flash / efficient / cuDNN); on CPU, SDPA lowers to
``aten._scaled_dot_product_flash_attention_for_cpu`` and ``context_parallel`` fails with
"does not have a sharding strategy registered". The stand-in below calls the same
PyTorch ring templates directly, with the CPU flash op and its backward in place of the
CUDA ones, under the same options ``context_parallel`` sets (load balancing on,
float32 merges). Everything else -- rotation, merge, causal skipping, the dK/dV ring of
the backward -- is PyTorch's code, unchanged.

Tensors here are PyTorch's SDPA layout ``[b, h, s_local, d]``; callers convert from
Megatron's ``[s_local, b, h, d]``.
"""

from __future__ import annotations

import contextlib

import torch
from torch.distributed.tensor.experimental._context_parallel import _attention as cp

ROTATE_METHODS = ("allgather", "alltoall")

_cpu_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default
_cpu_flash_backward = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward.default


def _forward_op(query, key, value, *, is_causal, scale):
    return _cpu_flash(query, key, value, 0.0, is_causal, attn_mask=None, scale=scale)


def _backward_op(*, grad_out, query, key, value, out, logsumexp, is_causal, scale):
    return _cpu_flash_backward(grad_out, query, key, value, out, logsumexp, 0.0, is_causal,
                               attn_mask=None, scale=scale)


@contextlib.contextmanager
def _options(rotate_method: str, load_balance: bool):
    """The module-level options ``context_parallel`` sets, restored afterwards."""
    if rotate_method not in ROTATE_METHODS:
        raise ValueError(f"rotate_method={rotate_method!r} is not one of {ROTATE_METHODS}")
    opts = cp._cp_options
    saved = (opts.enable_load_balance, opts.rotate_method)
    opts.enable_load_balance = load_balance
    opts.rotate_method = cp._RotateMethod.ALL_GATHER if rotate_method == "allgather" else cp._RotateMethod.ALL_TO_ALL
    try:
        yield
    finally:
        opts.enable_load_balance, opts.rotate_method = saved


class _TorchRingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, group, causal, scale, rotate_method):
        # q, k, v [b, h, s_local, d] (the rank's two zigzag chunks concatenated)
        with _options(rotate_method, load_balance=causal):
            out, lse = cp._templated_ring_attention(group, 2, _forward_op, q, k, v, is_causal=causal, scale=scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.group, ctx.causal, ctx.scale, ctx.rotate_method = group, causal, scale, rotate_method
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        with _options(ctx.rotate_method, load_balance=ctx.causal):
            dq, dk, dv = cp._templated_ring_attention_backward(
                ctx.group, 2, _backward_op, dout.contiguous(), "grad_out", q, k, v, out, lse,
                is_causal=ctx.causal, scale=ctx.scale,
            )[:3]
        return dq, dk, dv, None, None, None, None


def torch_ring_attn(q, k, v, group, *, causal: bool = True, softmax_scale: float | None = None,
                    rotate_method: str = "allgather") -> torch.Tensor:
    """PyTorch's ring attention on Megatron-layout ``[s_local, b, h, d]`` tensors (CP
    rank ``r`` holds chunks ``r`` and ``2P-1-r``); returns ``[s_local, b, h, d]``."""
    if k.shape[2] != q.shape[2]:
        raise ValueError("the PyTorch ring peer runs with kv heads == heads (no GQA): set --kv-heads to --heads")
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    to_sdpa = lambda t: t.permute(1, 2, 0, 3)  # noqa: E731 - [s, b, h, d] -> [b, h, s, d]
    out = _TorchRingAttention.apply(to_sdpa(q), to_sdpa(k), to_sdpa(v), group, causal, scale, rotate_method)
    return out.permute(2, 0, 1, 3)
