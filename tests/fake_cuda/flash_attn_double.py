"""An interface double of flash-attn 2.8.3 for fake CUDA tensors: its Python surface (the two
functions the adapter calls, with 2.8.3's parameter names) and the preconditions its C++
(``mha_varlen_fwd`` / ``mha_varlen_bwd`` in csrc/flash_attn/flash_api.cpp) checks before it
launches anything. Outputs are empty tensors of the shapes and dtypes flash-attn returns; the
values are the CPU tests' job (tests/flash_attn_fakes.py computes them in float64).
"""

from __future__ import annotations

import sys
import types

import torch

VERSION = "2.8.3"
calls = {"forward": 0, "backward": 0}


def _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, window_size_left,
                  window_size_right):
    for name, t in (("q", q), ("k", k), ("v", v)):
        assert t.device.type == "cuda", f"{name} must be on CUDA"
        assert t.dtype in (torch.float16, torch.bfloat16), "FlashAttention only support fp16 and bf16 data type"
        assert t.stride(-1) == 1, "Input tensor must have contiguous last dimension"
        assert t.dim() == 3, f"{name}: varlen takes [total, heads, head_size], got {tuple(t.shape)}"
    assert k.dtype == q.dtype and v.dtype == q.dtype, "query and key/value must have the same dtype"
    for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)):
        assert cu.dtype == torch.int32, f"{name} must have dtype int32"
        assert cu.device.type == "cuda" and cu.is_contiguous() and cu.dim() == 1, f"{name} must be contiguous on CUDA"
    batch = cu_seqlens_q.numel() - 1
    assert cu_seqlens_k.numel() == batch + 1, "cu_seqlens_q and cu_seqlens_k must describe the same batch"
    head_size = q.shape[-1]
    assert head_size <= 256, "FlashAttention forward only supports head dimension at most 256"
    assert head_size % 8 == 0, "query, key, value, and out_ must have a head_size that is a multiple of 8"
    assert k.shape[-1] == head_size and v.shape[-1] == head_size, "q, k, v must have the same head size"
    assert k.shape == v.shape and k.shape[1] > 0, "k and v must have the same shape"
    assert q.shape[1] % k.shape[1] == 0, "Number of heads in key/value must divide number of heads in query"
    assert isinstance(max_seqlen_q, int) and isinstance(max_seqlen_k, int), "max_seqlen_* are host ints"
    assert window_size_left >= -1 and window_size_right >= -1, "window sizes are -1 (unbounded) or >= 0"


def flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p=0.0,
                           softmax_scale=None, causal=False, window_size=(-1, -1), softcap=0.0, alibi_slopes=None,
                           deterministic=False, return_attn_probs=False, block_table=None):
    _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, *window_size)
    assert dropout_p == 0.0 and block_table is None
    calls["forward"] += 1
    out = torch.empty_like(q)
    lse = torch.empty(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)  # [heads, total_q]
    return (out, lse, None) if return_attn_probs else out


def _flash_attn_varlen_backward(dout, q, k, v, out, softmax_lse, dq, dk, dv, cu_seqlens_q, cu_seqlens_k,
                                max_seqlen_q, max_seqlen_k, dropout_p, softmax_scale, causal, window_size_left,
                                window_size_right, softcap, alibi_slopes, deterministic, rng_state=None,
                                zero_tensors=False):
    _check_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, window_size_left,
                  window_size_right)
    for name, t, like in (("dout", dout, q), ("out", out, q), ("dq", dq, q), ("dk", dk, k), ("dv", dv, v)):
        assert t.dtype == q.dtype, f"{name} must have the dtype of q"
        assert t.stride(-1) == 1, f"{name} must have contiguous last dimension"
        assert t.shape == like.shape, f"{name} must have shape {tuple(like.shape)}, got {tuple(t.shape)}"
    assert softmax_lse.dtype == torch.float32, "softmax_lse must be float32"
    assert tuple(softmax_lse.shape) == (q.shape[1], q.shape[0]), "softmax_lse must be [heads, total_q]"
    # mha_varlen_bwd reads it through its data pointer as dense [heads, total_q], checking nothing
    assert softmax_lse.is_contiguous(), f"softmax_lse must be contiguous, strides {softmax_lse.stride()}"
    calls["backward"] += 1
    return dq, dk, dv, softmax_lse.new_empty(softmax_lse.shape)


def install() -> None:
    """``flash_attn`` and ``flash_attn.flash_attn_interface`` in ``sys.modules`` (this process only)."""
    package = types.ModuleType("flash_attn")
    package.__version__ = VERSION
    interface = types.ModuleType("flash_attn.flash_attn_interface")
    interface.flash_attn_varlen_func = flash_attn_varlen_func
    interface._flash_attn_varlen_backward = _flash_attn_varlen_backward
    package.flash_attn_interface = interface
    sys.modules["flash_attn"], sys.modules["flash_attn.flash_attn_interface"] = package, interface
