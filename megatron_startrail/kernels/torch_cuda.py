"""Adapters for PyTorch's fused CUDA attention ops (nothing here runs on a CPU-only machine).

``torch_cuda_flash`` (PyTorch's bundled FlashAttention-2, ``aten::_flash_attention_forward``)
takes a whole call at once: variable-length ``cum_seq_q`` / ``cum_seq_k``, flash-attn's
window (``window_size_left`` / ``right``) and GQA natively, ``[total, h, d]`` with the batch
folded into the rows, lse ``[h, total]``. One head dim for q, k and v (MLA pads).

The memory-efficient and cuDNN ops take no variable-length call with flash-attn's window,
so they run the call's sequences one after another (:class:`PerSequenceKernel`: several
launches per call; ``auto`` picks them only where flash cannot run: fp32, head dims over
256), with a window or a bottom-right causal sequence as an additive mask, and K/V heads
expanded for GQA. Shapes as the ops return them (checked on the meta device,
tests/test_kernel_selection.py)::

    efficient  out [b, h, sq, dv]   lse [b, h, ceil(sq/32)*32]      dv may differ from q/k's
    cudnn      out [b, h, sq, d]    lse [b, h, sq, 1]               q, k, v one head dim

Dropout is never used (p = 0), so the ops' RNG outputs are not needed by their backward:
zero placeholders stand in.
"""

from __future__ import annotations

import torch

from .padding import EqualHeadDimsKernel, cut_head_dim, pad_head_dim, pad_lse_rows, round_up, trim_lse
from .reference import expand_kv_heads, sum_kv_head_groups
from .torch_cpu import additive
from .varlen import PerSequenceKernel, fold_batch, fold_lse, unfold_batch, unfold_lse

_aten = torch.ops.aten


def _no_rng(device) -> torch.Tensor:
    # Stand-in for the ops' philox seed / offset: only read when dropout_p > 0.
    return torch.zeros((), dtype=torch.int64, device=device)


def _bias(mask, q):
    """A bool mask ``[sq, sk]`` as the additive ``[b, h, sq, sk]`` bias the ops take (a view)."""
    if mask is None:
        return None
    b, h, sq, _ = q.shape
    return additive(mask, q.dtype).expand(b, h, sq, mask.shape[1])


class _TorchFlashVarlen:
    deterministic = False  # no switch on the op: torch.use_deterministic_algorithms governs it (not seen on a GPU)

    @staticmethod
    def _args(call, batch, device):
        window = (None, None) if call.causal else call.window
        return (call.tensor("cu_seqlens_q", device, batch), call.tensor("cu_seqlens_k", device, batch),
                call.max_seqlen_q, call.max_seqlen_k), dict(window_size_left=window[0], window_size_right=window[1])

    def forward(self, q, k, v, call, *, scale):
        b = q.shape[1]
        lengths, window = self._args(call, b, q.device)
        res = _aten._flash_attention_forward(fold_batch(q), fold_batch(k), fold_batch(v), *lengths, 0.0, call.causal,
                                             False, scale=scale, **window)
        return unfold_batch(res[0], b), unfold_lse(res[1], b)

    def backward(self, dout, q, k, v, out, lse, call, *, scale):
        b = q.shape[1]
        lengths, window = self._args(call, b, q.device)
        dq, dk, dv = _aten._flash_attention_backward(
            fold_batch(dout).contiguous(), fold_batch(q), fold_batch(k), fold_batch(v), fold_batch(out).contiguous(),
            fold_lse(lse), *lengths, 0.0, call.causal, _no_rng(q.device), _no_rng(q.device), scale=scale, **window)
        return unfold_batch(dq, b), unfold_batch(dk, b), unfold_batch(dv, b)


class TorchCUDAFlashKernel(EqualHeadDimsKernel, _TorchFlashVarlen):
    """``aten::_flash_attention_forward`` (PyTorch's bundled FlashAttention-2), one call at once."""

    name = "torch_cuda_flash"
    head_dim_multiple = 8


class TorchCUDAEfficientKernel(PerSequenceKernel):
    """``aten::_scaled_dot_product_efficient_attention`` (xFormers' cutlass kernel): fp32 too,
    and a v head dim different from q/k's, so MLA needs no common dim here. Each head dim is
    padded to a multiple of 8 (16-byte rows for half, what the kernel's aligned variants and
    PyTorch's own dispatch want), which is exact for the same reason as in padding.py."""

    name = "torch_cuda_efficient"
    head_dim_multiple = 8

    def _dims(self, q, v):
        return round_up(q.shape[-1], self.head_dim_multiple), round_up(v.shape[-1], self.head_dim_multiple)

    def _attend(self, q, k, v, *, causal, mask, scale):
        h = q.shape[1]
        d_qk, d_v = self._dims(q, v)
        out, lse, _, _ = _aten._scaled_dot_product_efficient_attention(
            pad_head_dim(q, d_qk), expand_kv_heads(pad_head_dim(k, d_qk), h), expand_kv_heads(pad_head_dim(v, d_v), h),
            _bias(mask, q), True, 0.0, causal, scale=scale,
        )
        return cut_head_dim(out, v.shape[-1]), trim_lse(lse, q.shape[2])

    def _attend_backward(self, dout, q, k, v, out, lse, *, causal, mask, scale):
        h, hkv = q.shape[1], k.shape[1]
        d_qk, d_v = self._dims(q, v)
        dq, dk, dv, _ = _aten._scaled_dot_product_efficient_attention_backward(
            pad_head_dim(dout, d_v), pad_head_dim(q, d_qk), expand_kv_heads(pad_head_dim(k, d_qk), h),
            expand_kv_heads(pad_head_dim(v, d_v), h), _bias(mask, q), pad_head_dim(out, d_v), pad_lse_rows(lse),
            _no_rng(q.device), _no_rng(q.device), 0.0, [True, True, True, False], causal, scale=scale,
        )
        dk, dv = sum_kv_head_groups(dk, hkv), sum_kv_head_groups(dv, hkv)
        return cut_head_dim(dq, q.shape[-1]), cut_head_dim(dk, k.shape[-1]), cut_head_dim(dv, v.shape[-1])


class TorchCUDACudnnKernel(EqualHeadDimsKernel, PerSequenceKernel):
    """``aten::_scaled_dot_product_cudnn_attention`` (cuDNN's fused attention); lse comes
    back as ``[b, h, sq, 1]``. Inputs are made contiguous: cuDNN's backward wants dO laid
    out like out."""

    name = "torch_cuda_cudnn"
    head_dim_multiple = 8

    def _attend(self, q, k, v, *, causal, mask, scale):
        h = q.shape[1]
        res = _aten._scaled_dot_product_cudnn_attention(
            q.contiguous(), expand_kv_heads(k, h).contiguous(), expand_kv_heads(v, h).contiguous(),
            _bias(mask, q), True, 0.0, causal, False, scale=scale,
        )
        return res[0], trim_lse(res[1], q.shape[2])

    def _attend_backward(self, dout, q, k, v, out, lse, *, causal, mask, scale):
        h, hkv = q.shape[1], k.shape[1]
        dq, dk, dv = _aten._scaled_dot_product_cudnn_attention_backward(
            dout.contiguous(), q.contiguous(), expand_kv_heads(k, h).contiguous(),
            expand_kv_heads(v, h).contiguous(), out.contiguous(), lse.unsqueeze(-1).contiguous(),
            _no_rng(q.device), _no_rng(q.device), _bias(mask, q), None, None, q.shape[2], k.shape[2], 0.0, causal,
            scale=scale,
        )
        return dq, sum_kv_head_groups(dk, hkv), sum_kv_head_groups(dv, hkv)
