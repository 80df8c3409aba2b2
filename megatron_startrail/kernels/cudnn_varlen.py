"""cuDNN's variable-length attention for packed documents: ``torch_cuda_cudnn_varlen``.

``aten::_cudnn_attention_forward`` / ``_backward`` with ``cum_seq_q`` / ``cum_seq_k`` (cuDNN's
ragged "THD" layout, what torch 2.13's ``nn.attention.varlen`` calls when its cuDNN switch is on;
torch ships it off) attend every document of a call in one launch, as FlashAttention-2's
variable-length op does, where :class:`~.torch_cuda.TorchCUDACudnnKernel` takes one launch per
document of unequal length. Its contract, from PyTorch's sources (``attention.cu``,
``MHA.cpp``'s ``build_graph_and_tensors_nestedtensor``; the double is
``tests/fake_cuda/aten_doubles.py``)::

    q [total_q, h, d]  k, v [total_k, h, d]   half precision, dense [total, h, d] rows
                                              (the ragged offsets count whole rows of h x d)
    cum_seq_q / _k     int32 [n + 1]          max_q / max_k the longest sequence
    out [total_q, h, d]   lse [total_q, h, 1] float32; the backward takes both as returned
    attn_bias          none (refused with cum_seq)
    is_causal          cuDNN's causal mask is top-left aligned (flash-attn's is bottom-right)

So a call goes to the ragged op only where the two agree: no mask, or causal with every
sequence square. A window, or a causal call with a sequence of fewer queries than keys (a
band's edge, a non-square diagonal block), takes the per-sequence cuDNN launches of
:class:`~.varlen.PerSequenceKernel` (the dense adapter's path, an additive mask). GQA: K/V heads
are expanded (torch's own varlen refuses GQA on this backend), and dK/dV summed back per group.

Not in ``auto`` on any device until a committed GPU table shows it PASS and faster than FA2 on
packed documents (``kernels/measured.py``); ``--startrail-kernel torch_cuda_cudnn_varlen``
forces it.

**The ragged op is off** (``ragged_op = False`` on the kernel): on the H200 on 2026-11-28 (torch
2.11, cuDNN 9.19; ``benchmarks/results/gpu/h200-2026-11-28/``) its forward and dV were right and
dQ, dK wrong in every row that reached it (max errors 1e27-1e35, or NaN: memory never written),
bf16 and fp16, MHA and GQA, batch 1 and 2. dV right means P is; what goes wrong is the
backward's rowsum(dO * O) term. So the kernel runs the per-sequence cuDNN launches (the dense
adapter's, which passed those rows) until a GPU shows the op right; the adapter's math around
the op stays tested on CPU against float64 emulations with ``ragged_op`` on.
"""

from __future__ import annotations

import torch

from .call_check import CheckedKernel
from .padding import EqualHeadDimsKernel
from .reference import sum_kv_head_groups
from .torch_cuda import TorchCUDACudnnKernel, _no_rng
from .varlen import PerSequenceKernel, fold_batch, unfold_batch

_aten = torch.ops.aten


def ragged_fits(call) -> bool:
    """Whether cuDNN's ragged op computes flash-attn's rule for this call: no window, and under a
    causal mask every sequence square (top-left and bottom-right alignment agree)."""
    plain = getattr(call, "call", call)
    if plain.window == (-1, -1):
        return True
    if plain.window != (-1, 0):
        return False
    cq, ck = plain.cu_seqlens_q, plain.cu_seqlens_k
    return all(cq[i + 1] - cq[i] == ck[i + 1] - ck[i] for i in range(len(cq) - 1))


def _thd(x: torch.Tensor, heads: int) -> torch.Tensor:
    """``[T, b, hkv, d]`` -> dense ``[b*T, heads, d]`` (samples one after another, K/V heads
    expanded to ``heads``): the ragged op's rows. No copy at batch 1 for dense MHA rows."""
    folded = fold_batch(x)
    if folded.shape[1] != heads:
        folded = folded.repeat_interleave(heads // folded.shape[1], dim=1)
    return folded.contiguous()


class _CudnnRagged:
    """The kernel proper: the ragged op where :func:`ragged_fits`, else the next class's
    per-sequence launches. out ``[Tq, b, h, d]`` and lse ``[b, h, Tq]`` as the schedule keeps them."""

    @staticmethod
    def _lengths(call, batch, device):
        return (call.tensor("cu_seqlens_q", device, batch), call.tensor("cu_seqlens_k", device, batch),
                call.max_seqlen_q, call.max_seqlen_k)

    ragged_op = False  # see the module's docstring: wrong dQ, dK on the H200 (2026-11-28)

    def _ragged(self, call) -> bool:
        return self.ragged_op and ragged_fits(call)

    def forward(self, q, k, v, call, *, scale):
        if not self._ragged(call):
            return super().forward(q, k, v, call, scale=scale)
        b, h = q.shape[1], q.shape[2]
        res = _aten._cudnn_attention_forward(
            _thd(q, h), _thd(k, h), _thd(v, h), None, *self._lengths(call, b, q.device), True, 0.0, call.causal,
            False, scale=scale)
        # lse [b*Tq, h, 1] -> [b, h, Tq] (a view)
        lse = res[1].squeeze(-1).view(b, -1, h).permute(0, 2, 1)
        return unfold_batch(res[0], b), lse

    def backward(self, dout, q, k, v, out, lse, call, *, scale):
        if not self._ragged(call):
            return super().backward(dout, q, k, v, out, lse, call, scale=scale)
        b, h, hkv = q.shape[1], q.shape[2], k.shape[2]
        stats = lse.permute(0, 2, 1).reshape(-1, h).unsqueeze(-1).contiguous()  # [b*Tq, h, 1], as returned
        dq, dk, dv = _aten._cudnn_attention_backward(
            _thd(dout, h), _thd(q, h), _thd(k, h), _thd(v, h), _thd(out, h), stats, _no_rng(q.device),
            _no_rng(q.device), None, *self._lengths(call, b, q.device), 0.0, call.causal, scale=scale)
        # dk, dv [b*Tk, h, d] -> [Tk, b, hkv, d]: each group's query heads summed (float32) back to its K/V head
        dk, dv = (sum_kv_head_groups(g.transpose(0, 1).unsqueeze(0), hkv).squeeze(0).transpose(0, 1)
                  for g in (dk, dv))
        return unfold_batch(dq, b), unfold_batch(dk, b), unfold_batch(dv, b)

    def backward_into(self, grads, dout, q, k, v, out, lse, call, *, scale, add=(True, True, True)):
        """Per-sequence launches write into ``grads`` themselves; the ragged op's gradients are
        added (``add[i]`` False: copied, Note [fresh rows] in :mod:`megatron_startrail.blocks`)."""
        if not self._ragged(call):
            return super().backward_into(grads, dout, q, k, v, out, lse, call, scale=scale, add=add)
        for acc, grad, plus in zip(grads, _CudnnRagged.backward(self, dout, q, k, v, out, lse, call, scale=scale), add):
            acc.add_(grad) if plus else acc.copy_(grad)
        return None


class TorchCUDACudnnVarlenKernel(CheckedKernel, EqualHeadDimsKernel, _CudnnRagged, PerSequenceKernel):
    """``aten::_cudnn_attention_forward`` with ``cum_seq``: packed documents in one cuDNN launch."""

    name = "torch_cuda_cudnn_varlen"
    workspace_grows_with_keys = False  # fused: out and lse of the query rows (Note [whole key runs])
    head_dim_multiple = 8
    # the per-sequence fallback's launches are the dense cuDNN adapter's
    _attend = TorchCUDACudnnKernel._attend
    _attend_backward = TorchCUDACudnnKernel._attend_backward
