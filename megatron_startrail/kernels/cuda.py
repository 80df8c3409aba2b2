"""Fused GPU block kernels (optional; nothing here runs on a CPU-only machine).

Thin adapters from the :class:`~megatron_startrail.kernels.base.BlockKernel` interface
(``[b, h, s, d]``, GQA, lse out) to the GPU kernels' own conventions. They are chosen by
:func:`megatron_startrail.kernels.select_kernel` only for CUDA tensors.
"""

from __future__ import annotations

import inspect

import torch

from .reference import expand_kv_heads, sum_kv_head_groups


class TorchCUDAFlashKernel:
    """``aten::_scaled_dot_product_flash_attention`` (PyTorch's bundled FlashAttention-2).

    It has no GQA support, so K/V heads are expanded for the call and their gradients
    summed back per group.
    """

    name = "torch_cuda_flash"

    def forward(self, q, k, v, *, causal, scale):
        h = q.shape[1]
        res = torch.ops.aten._scaled_dot_product_flash_attention(
            q, expand_kv_heads(k, h), expand_kv_heads(v, h), 0.0, causal, False, scale=scale
        )
        return res[0], res[1]

    def backward(self, dout, q, k, v, out, lse, *, causal, scale):
        h, hkv = q.shape[1], k.shape[1]
        sq, sk = q.shape[2], k.shape[2]
        ke, ve = expand_kv_heads(k, h), expand_kv_heads(v, h)
        empty = torch.empty(0, device=q.device)
        dq, dk, dv = torch.ops.aten._scaled_dot_product_flash_attention_backward(
            dout, q, ke, ve, out, lse, empty, empty, sq, sk, 0.0, causal,
            torch.zeros((), dtype=torch.int64), torch.zeros((), dtype=torch.int64), scale=scale,
        )
        return dq, sum_kv_head_groups(dk, hkv), sum_kv_head_groups(dv, hkv)


class FlashAttnKernel:
    """Dao-AILab ``flash-attn`` 2.x (``[b, s, h, d]`` layout, native GQA)."""

    name = "flash_attn"

    def __init__(self) -> None:
        from flash_attn import flash_attn_interface as fai  # noqa: PLC0415 - optional

        self._fai = fai
        self._bwd_params = set(inspect.signature(fai._flash_attn_backward).parameters)

    def forward(self, q, k, v, *, causal, scale):
        t = lambda x: x.transpose(1, 2)  # [b, h, s, d] <-> [b, s, h, d]
        out, lse, _ = self._fai.flash_attn_func(
            t(q), t(k), t(v), dropout_p=0.0, softmax_scale=scale, causal=causal, return_attn_probs=True
        )
        return t(out), lse

    def backward(self, dout, q, k, v, out, lse, *, causal, scale):
        t = lambda x: x.transpose(1, 2).contiguous()
        qt, kt, vt = t(q), t(k), t(v)
        dq, dk, dv = torch.empty_like(qt), torch.empty_like(kt), torch.empty_like(vt)
        kwargs = dict(dropout_p=0.0, softmax_scale=scale, causal=causal)
        # The window/softcap arguments changed names across 2.x releases.
        if "window_size_left" in self._bwd_params:
            kwargs.update(window_size_left=-1, window_size_right=-1)
        elif "window_size" in self._bwd_params:
            kwargs.update(window_size=(-1, -1))
        if "softcap" in self._bwd_params:
            kwargs["softcap"] = 0.0
        if "alibi_slopes" in self._bwd_params:
            kwargs["alibi_slopes"] = None
        if "deterministic" in self._bwd_params:
            kwargs["deterministic"] = False
        self._fai._flash_attn_backward(t(dout), qt, kt, vt, t(out), lse.contiguous(), dq, dk, dv, **kwargs)
        return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
