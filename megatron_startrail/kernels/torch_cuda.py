"""Adapters for PyTorch's fused CUDA attention ops (nothing here runs on a CPU-only machine).

``torch_cuda_flash`` (PyTorch's bundled FlashAttention-2, ``aten::_flash_attention_forward``)
takes a whole call at once: variable-length ``cum_seq_q`` / ``cum_seq_k``, flash-attn's
window (``window_size_left`` / ``right``) and GQA natively, ``[total, h, d]`` with the batch
folded into the rows, lse ``[h, total]``. One head dim for q, k and v (MLA pads).

The memory-efficient and cuDNN ops take no variable-length call with flash-attn's window,
so they run :class:`PerSequenceKernel`'s launches: a dense call (one sequence, or equal ones)
in one launch with the sequences folded into the batch, packed documents of different
lengths one launch each; a window or a bottom-right causal sequence as an additive mask,
and K/V heads expanded for GQA (cuDNN: only where a mask goes in). Shapes as the ops return them (checked on the meta device,
tests/test_kernel_selection.py, and against the ops' contracts in tests/fake_cuda/aten_doubles.py)::

    efficient  out [B, h, sq, dv]   lse [B, h, ceil(sq/32)*32]      dv may differ from q/k's
    cudnn      out [B, h, sq, d]    lse [B, h, sq, 1]               q, k, v one head dim

Every adapter checks its call against its tensors on the host before it launches
(:class:`~.call_check.CheckedKernel`).

Dropout is never used (p = 0), so the ops' RNG outputs are not needed by their backward:
zero placeholders stand in.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .call_check import CheckedKernel
from .padding import EqualHeadDimsKernel, cut_head_dim, pad_head_dim, pad_lse_rows, round_up, trim_lse
from .reference import expand_kv_heads, sum_kv_head_groups
from .torch_cpu import additive
from .varlen import PerSequenceKernel, fold_batch, fold_lse, unfold_batch, unfold_lse

_aten = torch.ops.aten
BIAS_KEY_ALIGN = 16  # SDPA's preprocess_mask pads the bias's key dim to this for the memory-efficient op


def _no_rng(device) -> torch.Tensor:
    # Stand-in for the ops' philox seed / offset: only read when dropout_p > 0.
    return torch.zeros((), dtype=torch.int64, device=device)


def _bias(mask, q, key_align: int = 1):
    """A bool mask ``[sq, sk]`` as the additive ``[B, h, sq, sk]`` bias the ops take (a view). With
    ``key_align``, the key dim is padded to a multiple of it before the expand and sliced back
    (what SDPA's ``preprocess_mask`` does), so the rows start aligned: strides
    ``(0, 0, round_up(sk, key_align), 1)``; the padded columns are never read."""
    if mask is None:
        return None
    b, h, sq, _ = q.shape
    sk = mask.shape[1]
    bias = additive(mask, q.dtype)
    if sk % key_align:
        bias = F.pad(bias, (0, round_up(sk, key_align) - sk))
    return bias.expand(b, h, sq, bias.shape[1])[..., :sk]


def _dense_bshd(x, head_dim: int):
    """``x [B, h, s, d]`` (any strides) -> ``[B, h, s, head_dim]`` whose storage is dense ``[B, s, h,
    head_dim]`` (head dim zero-padded): the layout torch's SDPA hands the memory-efficient op, the
    only one its half-precision backward reads ``out`` correctly in (it takes out's row stride to
    be ``h * dv``, ignoring the tensor's). No copy when ``x`` is already so (batch 1, dense rows)."""
    return pad_head_dim(x.transpose(1, 2), head_dim).contiguous().transpose(1, 2)


def _bshd_padded(x, head_dim: int):
    """``x [B, h, s, d]`` with its head dim zero-padded in ``[B, s, h, d]`` order (the op honours
    q/k/v strides, so no copy unless padding)."""
    return pad_head_dim(x.transpose(1, 2), head_dim).transpose(1, 2)


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


class TorchCUDAFlashKernel(CheckedKernel, EqualHeadDimsKernel, _TorchFlashVarlen):
    """``aten::_flash_attention_forward`` (PyTorch's bundled FlashAttention-2), one call at once."""

    name = "torch_cuda_flash"
    workspace_grows_with_keys = False  # fused: out and lse of the query rows (Note [whole key runs])
    head_dim_multiple = 8


class TorchCUDAEfficientKernel(CheckedKernel, PerSequenceKernel):
    """``aten::_scaled_dot_product_efficient_attention`` (xFormers' cutlass kernel): fp32 too,
    and a v head dim different from q/k's, so MLA needs no common dim here. Each head dim is
    padded to a multiple of 8 (16-byte rows for half, what the kernel's aligned variants and
    PyTorch's own dispatch want), which is exact for the same reason as in padding.py.

    Layout (issue 49, measured on an H100): the op takes ``[B, h, s, d]`` views of ``[B, s, h, d]``
    storage, as SDPA hands it. q, k, v keep their strides (the op reads them); out and dout are
    made dense ``[B, s, h, dv]`` (:func:`_dense_bshd`): the half-precision backward computes
    rowsum(dO * O) in the kernel with out's row stride taken as ``h * dv``, which the schedule's
    sequence-major ``[T, b, h, dv]`` views break at batch > 1 (dQ, dK 0.2-2 relative off). The mask
    bias's key dim is padded to :data:`BIAS_KEY_ALIGN` (the kernel wants its row stride a multiple
    of 8 in half, 4 in fp32). GQA: the op wants one head count (it checks q, k, v heads equal),
    so K/V heads are expanded."""

    name = "torch_cuda_efficient"
    workspace_grows_with_keys = False  # fused: out and lse of the query rows (Note [whole key runs])
    head_dim_multiple = 8

    def _dims(self, q, v):
        return round_up(q.shape[-1], self.head_dim_multiple), round_up(v.shape[-1], self.head_dim_multiple)

    def _inputs(self, q, k, v):
        h = q.shape[1]
        d_qk, d_v = self._dims(q, v)
        return (_bshd_padded(q, d_qk), expand_kv_heads(_bshd_padded(k, d_qk), h),
                expand_kv_heads(_bshd_padded(v, d_v), h))

    def _attend(self, q, k, v, *, causal, mask, scale):
        out, lse, _, _ = _aten._scaled_dot_product_efficient_attention(
            *self._inputs(q, k, v), _bias(mask, q, BIAS_KEY_ALIGN), True, 0.0, causal, scale=scale)
        return cut_head_dim(out, v.shape[-1]), trim_lse(lse, q.shape[2])

    def _attend_backward(self, dout, q, k, v, out, lse, *, causal, mask, scale):
        hkv = k.shape[1]
        d_v = self._dims(q, v)[1]
        dq, dk, dv, _ = _aten._scaled_dot_product_efficient_attention_backward(
            _dense_bshd(dout, d_v), *self._inputs(q, k, v), _bias(mask, q, BIAS_KEY_ALIGN), _dense_bshd(out, d_v),
            pad_lse_rows(lse), _no_rng(q.device), _no_rng(q.device), 0.0, [True, True, True, False], causal,
            scale=scale,
        )
        dk, dv = sum_kv_head_groups(dk, hkv), sum_kv_head_groups(dv, hkv)
        return cut_head_dim(dq, q.shape[-1]), cut_head_dim(dk, k.shape[-1]), cut_head_dim(dv, v.shape[-1])


def _last_dense(x):
    """``x`` itself when its last dim is dense (any other strides: the cuDNN op takes them), else a copy."""
    return x if x.stride(-1) == 1 else x.contiguous()


def _dense(x) -> bool:
    """Whether ``x``'s elements fill its storage span without gaps or overlap (any order of dims)."""
    dims = sorted((st, n) for n, st in zip(x.shape, x.stride()) if n > 1)
    span = 1
    for st, n in dims:
        if st != span:
            return False
        span *= n
    return True


def _out_like(dout, out):
    """``(dout, out)`` laid out alike, what cuDNN's backward wants: as they are when they already
    are (the schedule's out and dO are both ``[s, b, h, dv]`` storage), else dO copied into out's
    layout (out as the forward made it, in q's dim order); None where out is not dense. Not
    both made contiguous ``[B, h, s, dv]``: with q in another order, that gave GQA wrong dQ, dK,
    dV (errors 1.3-3.1) on the H200 on 2026-11-28
    (``benchmarks/results/gpu/h200-2026-11-28/``: batch 2, fused-QKV views, every mask; the rows
    whose dO already had out's layout passed)."""
    same = all(x == y for n, x, y in zip(out.shape, out.stride(), dout.stride()) if n > 1)
    if same and out.stride(-1) == 1:
        return dout, out
    if out.stride(-1) == 1 and _dense(out):
        return torch.empty_like(out).copy_(dout), out  # empty_like keeps a dense tensor's strides
    return None  # out laid out as no forward gives it: the caller makes everything contiguous


def _cudnn_kv(k, v, heads: int, bias):
    """K and V ``[B, hkv, s, d]`` as the cuDNN op takes them. Without a bias, GQA's own K/V heads:
    called directly (the SDPA dispatcher's equal-heads check is not the op's), the op is right
    with fewer K/V heads in forward and backward, and a little faster than with them expanded
    (H100, torch 2.11, cuDNN 9.19: ``benchmarks/results/gpu/h100-2026-11-28/probe_cudnn_gqa.txt``,
    32/8 heads, ``[s, b, h, d]`` views and contiguous, batch 1 and 2, full and causal). With a
    bias (windows, cut edges: unmeasured with GQA heads) expanded to the query heads."""
    if bias is None:
        return k, v
    return expand_kv_heads(k, heads), expand_kv_heads(v, heads)


class TorchCUDACudnnKernel(CheckedKernel, EqualHeadDimsKernel, PerSequenceKernel):
    """``aten::_scaled_dot_product_cudnn_attention`` (cuDNN's fused attention); lse comes
    back as ``[B, h, sq, 1]``. Zero-copy: q, k, v, out and dO go in as the schedule holds them,
    ``[B, h, s, d]`` views of ``[s, b, h, d]`` storage (the op takes any strides with a dense
    head dim, and gives out and the gradients q's layout, so they come back as ``[s, b, h, d]``
    rows too); dO and out laid out alike (cuDNN's backward wants it). GQA: K/V go in at their own
    head count, expanded only where a bias goes in (:func:`_cudnn_kv`). A dense call (one sequence, or equal ones) is one launch
    with the sequences folded into the batch (:func:`~.varlen.sequence_groups`); packed
    documents of different lengths take one each (torch 2.13's own ``varlen_attn`` keeps
    cuDNN's variable-length op off, and it takes no window or GQA: flash serves them)."""

    name = "torch_cuda_cudnn"
    workspace_grows_with_keys = False  # fused: out and lse of the query rows (Note [whole key runs])
    head_dim_multiple = 8

    def _attend(self, q, k, v, *, causal, mask, scale):
        bias = _bias(mask, q)
        k, v = _cudnn_kv(k, v, q.shape[1], bias)
        res = _aten._scaled_dot_product_cudnn_attention(
            _last_dense(q), _last_dense(k), _last_dense(v), bias, True, 0.0, causal, False, scale=scale,
        )
        return res[0], trim_lse(res[1], q.shape[2])

    def _attend_backward(self, dout, q, k, v, out, lse, *, causal, mask, scale):
        hkv = k.shape[1]
        alike = _out_like(dout, out)
        if alike is None:  # q, k, v, out and dO all contiguous [B, h, s, d]: one order, as the H100 passed
            q, k, v, dout, out = (x.contiguous() for x in (q, k, v, dout, out))
        else:
            dout, out = alike
        bias = _bias(mask, q)
        k, v = _cudnn_kv(k, v, q.shape[1], bias)
        dq, dk, dv = _aten._scaled_dot_product_cudnn_attention_backward(
            dout, _last_dense(q), _last_dense(k), _last_dense(v), out,
            lse.unsqueeze(-1).contiguous(), _no_rng(q.device), _no_rng(q.device), bias, None, None,
            q.shape[2], k.shape[2], 0.0, causal, scale=scale,
        )
        return dq, sum_kv_head_groups(dk, hkv), sum_kv_head_groups(dv, hkv)  # (no-ops unless expanded)
