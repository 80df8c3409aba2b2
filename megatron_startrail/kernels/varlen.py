"""flash-attn's variable-length rule for kernels that attend one sequence at a time.

The CPU kernels (and the PyTorch CUDA ops without variable-length inputs) run a call's
sequences one after another inside the call; :class:`PerSequenceKernel` does the loop and
the mask, and its subclasses give the attention of one sequence on ``[b, h, s, d]`` views
with either no mask, a square causal mask (where top-left and bottom-right alignment
agree), or an explicit boolean mask ``[sq, sk]`` (True: visible) built from the call's
window by :func:`visible`. On a GPU the fused kernels take the whole call at once
(``flash_attn_varlen_func``, ``aten::_flash_attention_forward``); see Note [kernel calls]
in :mod:`megatron_startrail.layout`.

Helpers for those: :func:`fold_batch` turns ``[T, b, ...]`` into the ``[b*T, ...]`` the
variable-length kernels take (every sequence once per sample, ``KernelCall.tensor(...,
batch=b)``), and :func:`unfold_lse` brings their lse ``[h, b*T]`` back to ``[b, h, T]``.
"""

from __future__ import annotations

import torch

from ..layout import KernelCall


def visible(sq: int, sk: int, window: tuple[int, int], device) -> torch.Tensor | None:
    """flash-attn's mask of one sequence, bool ``[sq, sk]`` (True: visible), or None when
    every key is visible. Query ``r`` sees key ``c`` iff
    ``r + sk - sq - left <= c <= r + sk - sq + right`` (-1: unbounded)."""
    left, right = window
    if left < 0 and right < 0:
        return None
    offset = torch.arange(sk, device=device)[None, :] - torch.arange(sq, device=device)[:, None] - (sk - sq)
    mask = torch.ones(sq, sk, dtype=torch.bool, device=device)
    if left >= 0:
        mask &= offset >= -left
    if right >= 0:
        mask &= offset <= right
    return mask


def _bhsd(x: torch.Tensor) -> torch.Tensor:
    # [s, b, h, d] -> [b, h, s, d] (a view)
    return x.permute(1, 2, 0, 3)


class PerSequenceKernel:
    """A call as a loop over its sequences (inside the kernel: the schedule makes one call).

    Subclasses give ``_attend(q, k, v, *, causal, mask, scale) -> (out, lse)`` and
    ``_attend_backward(dout, q, k, v, out, lse, *, causal, mask, scale) -> (dq, dk, dv)`` on
    ``[b, h, s, d]`` views: ``causal`` only for square sequences, ``mask`` bool ``[sq, sk]``."""

    name = "per_sequence"

    def _attend(self, q, k, v, *, causal, mask, scale):  # pragma: no cover - overridden
        raise NotImplementedError

    def _attend_backward(self, dout, q, k, v, out, lse, *, causal, mask, scale):  # pragma: no cover - overridden
        raise NotImplementedError

    @staticmethod
    def _masks(call: KernelCall, device):
        cq, ck = call.cu_seqlens_q, call.cu_seqlens_k
        for i in range(len(cq) - 1):
            sq, sk = cq[i + 1] - cq[i], ck[i + 1] - ck[i]
            causal = call.causal and sq == sk  # top-left and bottom-right agree
            mask = None if causal else visible(sq, sk, call.window, device)
            yield (cq[i], cq[i + 1]), (ck[i], ck[i + 1]), causal, mask

    def forward(self, q, k, v, call: KernelCall, *, scale):
        tq, b, h, _ = q.shape
        sequences = list(self._masks(call, q.device))
        if _whole(sequences, tq, k.shape[0]):  # one sequence, every row: the op's result as it is
            (_, _, causal, mask), = sequences
            o, lse = self._attend(_bhsd(q), _bhsd(k), _bhsd(v), causal=causal, mask=mask, scale=scale)
            return o.permute(2, 0, 1, 3), lse
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        out = q.new_empty((tq, b, h, v.shape[-1]))
        lse = q.new_empty((b, h, tq), dtype=acc)
        for (q0, q1), (k0, k1), causal, mask in sequences:
            o, l = self._attend(_bhsd(q[q0:q1]), _bhsd(k[k0:k1]), _bhsd(v[k0:k1]), causal=causal, mask=mask,
                                scale=scale)
            _bhsd(out[q0:q1]).copy_(o)
            lse[:, :, q0:q1] = l
            del o, l  # copied: not held while the next sequence runs
        return out, lse

    def backward(self, dout, q, k, v, out, lse, call: KernelCall, *, scale):
        sequences = list(self._masks(call, q.device))
        if _whole(sequences, q.shape[0], k.shape[0]):  # one sequence, every row: no copies of its gradients
            (_, _, causal, mask), = sequences
            grads = self._attend_backward(_bhsd(dout), _bhsd(q), _bhsd(k), _bhsd(v), _bhsd(out), lse,
                                          causal=causal, mask=mask, scale=scale)
            return tuple(g.permute(2, 0, 1, 3) for g in grads)
        dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for (q0, q1), (k0, k1), causal, mask in sequences:
            gq, gk, gv = self._attend_backward(
                _bhsd(dout[q0:q1]), _bhsd(q[q0:q1]), _bhsd(k[k0:k1]), _bhsd(v[k0:k1]), _bhsd(out[q0:q1]),
                lse[:, :, q0:q1], causal=causal, mask=mask, scale=scale)
            _bhsd(dq[q0:q1]).copy_(gq)
            _bhsd(dk[k0:k1]).copy_(gk)
            _bhsd(dv[k0:k1]).copy_(gv)
            del gq, gk, gv  # copied: not held while the next sequence runs
        return dq, dk, dv

    def backward_into(self, grads, dout, q, k, v, out, lse, call: KernelCall, *, scale):
        """:meth:`backward`, each sequence's gradients added straight into ``grads = (dq, dk, dv)``
        (accumulators of the call's rows, any dtype): no whole-call gradients beside them."""
        for (q0, q1), (k0, k1), causal, mask in self._masks(call, q.device):
            parts = self._attend_backward(
                _bhsd(dout[q0:q1]), _bhsd(q[q0:q1]), _bhsd(k[k0:k1]), _bhsd(v[k0:k1]), _bhsd(out[q0:q1]),
                lse[:, :, q0:q1], causal=causal, mask=mask, scale=scale)
            for acc, part, (a, b) in zip(grads, parts, ((q0, q1), (k0, k1), (k0, k1))):
                _bhsd(acc[a:b]).add_(part)
            del parts  # added: not held while the next sequence runs


def _whole(sequences, tq: int, tk: int) -> bool:
    """Whether a call is one sequence over all its ``tq`` query and ``tk`` key rows."""
    return len(sequences) == 1 and sequences[0][0] == (0, tq) and sequences[0][1] == (0, tk)


def fold_batch(x: torch.Tensor) -> torch.Tensor:
    """``[T, b, h, d]`` -> ``[b*T, h, d]``, sample after sample (a view when ``b == 1``)."""
    if x.shape[1] == 1:
        return x.squeeze(1)
    return x.transpose(0, 1).reshape(-1, *x.shape[2:])


def unfold_batch(x: torch.Tensor, batch: int) -> torch.Tensor:
    """``[b*T, h, d]`` -> ``[T, b, h, d]`` (a view)."""
    return x.view(batch, -1, *x.shape[1:]).transpose(0, 1)


def unfold_lse(lse: torch.Tensor, batch: int) -> torch.Tensor:
    """A variable-length kernel's lse ``[h, b*T]`` -> ``[b, h, T]`` (a view)."""
    return lse.view(lse.shape[0], batch, -1).transpose(0, 1)


def fold_lse(lse: torch.Tensor) -> torch.Tensor:
    """``[b, h, T]`` -> contiguous ``[h, b*T]``, what the variable-length backward takes."""
    return lse.transpose(0, 1).reshape(lse.shape[1], -1)
