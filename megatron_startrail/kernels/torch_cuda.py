"""Adapters for PyTorch's fused CUDA attention ops (nothing here runs on a CPU-only machine).

All three take ``[b, h, s, d]`` and no GQA (K/V heads are expanded for the call and
their gradients summed back per group); their backward takes the final out and lse, so
one block's gradients need no other block. Shapes as the ops return them (checked on
the meta device, tests/test_kernel_selection.py)::

    flash      out [b, h, sq, d]    lse [b, h, sq]                  q, k, v one head dim (<= 256)
    efficient  out [b, h, sq, dv]   lse [b, h, ceil(sq/32)*32]      dv may differ from q/k's
    cudnn      out [b, h, sq, d]    lse [b, h, sq, 1]               q, k, v one head dim

The lse handed to the schedule is always ``[b, h, sq]`` float32; the efficient op's
backward gets it re-padded to its own row alignment. Dropout is never used (p = 0), so
the ops' RNG outputs are not needed by their backward: zero placeholders stand in.
"""

from __future__ import annotations

import torch

from .padding import EqualHeadDimsKernel, pad_lse_rows, trim_lse
from .reference import expand_kv_heads, sum_kv_head_groups

_aten = torch.ops.aten


def _no_rng(device) -> torch.Tensor:
    # Stand-in for the ops' philox seed / offset: only read when dropout_p > 0.
    return torch.zeros((), dtype=torch.int64, device=device)


class TorchCUDAFlashKernel(EqualHeadDimsKernel):
    """``aten::_scaled_dot_product_flash_attention`` (PyTorch's bundled FlashAttention-2)."""

    name = "torch_cuda_flash"
    head_dim_multiple = 8

    def _forward(self, q, k, v, *, causal, scale):
        h = q.shape[1]
        res = _aten._scaled_dot_product_flash_attention(
            q, expand_kv_heads(k, h), expand_kv_heads(v, h), 0.0, causal, False, scale=scale
        )
        return res[0], trim_lse(res[1], q.shape[2])

    def _backward(self, dout, q, k, v, out, lse, *, causal, scale):
        h, hkv = q.shape[1], k.shape[1]
        # cum_seq_q / cum_seq_k None: the dense (not varlen) path, as the forward returns them.
        dq, dk, dv = _aten._scaled_dot_product_flash_attention_backward(
            dout, q, expand_kv_heads(k, h), expand_kv_heads(v, h), out, lse.contiguous(), None, None,
            q.shape[2], k.shape[2], 0.0, causal, _no_rng(q.device), _no_rng(q.device), scale=scale,
        )
        return dq, sum_kv_head_groups(dk, hkv), sum_kv_head_groups(dv, hkv)


class TorchCUDAEfficientKernel:
    """``aten::_scaled_dot_product_efficient_attention`` (xFormers' cutlass kernel): fp32 too,
    and a v head dim different from q/k's, so MLA needs no padding here."""

    name = "torch_cuda_efficient"

    def forward(self, q, k, v, *, causal, scale):
        h = q.shape[1]
        out, lse, _, _ = _aten._scaled_dot_product_efficient_attention(
            q, expand_kv_heads(k, h), expand_kv_heads(v, h), None, True, 0.0, causal, scale=scale
        )
        return out, trim_lse(lse, q.shape[2])

    def backward(self, dout, q, k, v, out, lse, *, causal, scale):
        h, hkv = q.shape[1], k.shape[1]
        dq, dk, dv, _ = _aten._scaled_dot_product_efficient_attention_backward(
            dout, q, expand_kv_heads(k, h), expand_kv_heads(v, h), None, out, pad_lse_rows(lse),
            _no_rng(q.device), _no_rng(q.device), 0.0, [True, True, True, False], causal, scale=scale,
        )
        return dq, sum_kv_head_groups(dk, hkv), sum_kv_head_groups(dv, hkv)


class TorchCUDACudnnKernel(EqualHeadDimsKernel):
    """``aten::_scaled_dot_product_cudnn_attention`` (cuDNN's fused attention); lse comes
    back as ``[b, h, sq, 1]``. Inputs are made contiguous: cuDNN's backward wants dO laid
    out like out."""

    name = "torch_cuda_cudnn"
    head_dim_multiple = 8

    def _forward(self, q, k, v, *, causal, scale):
        h = q.shape[1]
        res = _aten._scaled_dot_product_cudnn_attention(
            q.contiguous(), expand_kv_heads(k, h).contiguous(), expand_kv_heads(v, h).contiguous(),
            None, True, 0.0, causal, False, scale=scale,
        )
        return res[0], trim_lse(res[1], q.shape[2])

    def _backward(self, dout, q, k, v, out, lse, *, causal, scale):
        h, hkv = q.shape[1], k.shape[1]
        dq, dk, dv = _aten._scaled_dot_product_cudnn_attention_backward(
            dout.contiguous(), q.contiguous(), expand_kv_heads(k, h).contiguous(),
            expand_kv_heads(v, h).contiguous(), out.contiguous(), lse.unsqueeze(-1).contiguous(),
            _no_rng(q.device), _no_rng(q.device), None, None, None, q.shape[2], k.shape[2], 0.0, causal,
            scale=scale,
        )
        return dq, sum_kv_head_groups(dk, hkv), sum_kv_head_groups(dv, hkv)
