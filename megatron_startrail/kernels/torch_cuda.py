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

from .padding import EqualHeadDimsKernel, cut_head_dim, pad_head_dim, pad_lse_rows, round_up, trim_lse
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
    and a v head dim different from q/k's, so MLA needs no common dim here. Each head dim is
    padded to a multiple of 8 (16-byte rows for half, what the kernel's aligned variants and
    PyTorch's own dispatch want), which is exact for the same reason as in padding.py."""

    name = "torch_cuda_efficient"
    head_dim_multiple = 8

    def _dims(self, q, v):
        return round_up(q.shape[-1], self.head_dim_multiple), round_up(v.shape[-1], self.head_dim_multiple)

    def forward(self, q, k, v, *, causal, scale):
        h = q.shape[1]
        d_qk, d_v = self._dims(q, v)
        out, lse, _, _ = _aten._scaled_dot_product_efficient_attention(
            pad_head_dim(q, d_qk), expand_kv_heads(pad_head_dim(k, d_qk), h), expand_kv_heads(pad_head_dim(v, d_v), h),
            None, True, 0.0, causal, scale=scale,
        )
        return cut_head_dim(out, v.shape[-1]), trim_lse(lse, q.shape[2])

    def backward(self, dout, q, k, v, out, lse, *, causal, scale):
        h, hkv = q.shape[1], k.shape[1]
        d_qk, d_v = self._dims(q, v)
        dq, dk, dv, _ = _aten._scaled_dot_product_efficient_attention_backward(
            pad_head_dim(dout, d_v), pad_head_dim(q, d_qk), expand_kv_heads(pad_head_dim(k, d_qk), h),
            expand_kv_heads(pad_head_dim(v, d_v), h), None, pad_head_dim(out, d_v), pad_lse_rows(lse),
            _no_rng(q.device), _no_rng(q.device), 0.0, [True, True, True, False], causal, scale=scale,
        )
        dk, dv = sum_kv_head_groups(dk, hkv), sum_kv_head_groups(dv, hkv)
        return cut_head_dim(dq, q.shape[-1]), cut_head_dim(dk, k.shape[-1]), cut_head_dim(dv, v.shape[-1])


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
