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

import functools

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


def sequences_in_batch(x: torch.Tensor, count: int) -> torch.Tensor:
    """Rows ``[count * s, b, h, d]`` of ``count`` sequences of ``s`` rows each -> ``[count * b, h, s, d]``,
    sequence-major samples (sequence i, sample j at ``i * b + j``), each one ``[s, h, d]`` run of
    rows as in storage. A view when ``count == 1`` or ``b == 1``; else one copy."""
    if count == 1:
        return _bhsd(x)
    s, b = x.shape[0] // count, x.shape[1]
    return x.unflatten(0, (count, s)).transpose(1, 2).reshape(count * b, s, *x.shape[2:]).transpose(1, 2)


def _into_rows(dst: torch.Tensor, src: torch.Tensor, count: int, add: bool = False) -> None:
    """The inverse of :func:`sequences_in_batch`: ``src [count * b, h, s, d]`` written (or, with
    ``add``, added) into rows ``dst [count * s, b, h, d]``."""
    s, b = dst.shape[0] // count, dst.shape[1]
    rows = src.transpose(1, 2).unflatten(0, (count, b)).transpose(1, 2)
    view = dst.unflatten(0, (count, s))
    view.add_(rows) if add else view.copy_(rows)


@functools.lru_cache(maxsize=4096)
def sequence_groups(call: KernelCall) -> tuple[tuple[tuple[int, int], tuple[int, int], int], ...]:
    """``((q0, q1), (k0, k1), count)`` per kernel launch: the whole call at once when its sequences
    all have one shape (a dense call: one sequence, or equal ones), else one launch per sequence.
    Once per call (calls are reused every step)."""
    cq, ck = call.cu_seqlens_q, call.cu_seqlens_k
    n = len(cq) - 1
    if n > 1 and len({(cq[i + 1] - cq[i], ck[i + 1] - ck[i]) for i in range(n)}) == 1:
        return (((0, cq[-1]), (0, ck[-1]), n),)
    return tuple(((cq[i], cq[i + 1]), (ck[i], ck[i + 1]), 1) for i in range(n))


class PerSequenceKernel:
    """A call as launches of equal-shaped sequences (inside the kernel: the schedule makes one call).

    A dense call (:func:`sequence_groups`: one sequence, or sequences of one shape) is one
    launch with the sequences folded into the batch dim, so no Python loop runs per
    sequence; packed documents of different lengths take one launch each. Subclasses give
    ``_attend(q, k, v, *, causal, mask, scale) -> (out, lse)`` and
    ``_attend_backward(dout, q, k, v, out, lse, *, causal, mask, scale) -> (dq, dk, dv)`` on
    ``[B, h, s, d]`` views (:func:`sequences_in_batch`, B = sequences x batch): ``causal`` only
    for square sequences, ``mask`` bool ``[sq, sk]``."""

    name = "per_sequence"

    def _attend(self, q, k, v, *, causal, mask, scale):  # pragma: no cover - overridden
        raise NotImplementedError

    def _attend_backward(self, dout, q, k, v, out, lse, *, causal, mask, scale):  # pragma: no cover - overridden
        raise NotImplementedError

    @staticmethod
    def _launches(call: KernelCall, device):
        for (q0, q1), (k0, k1), count in sequence_groups(getattr(call, "call", call)):
            sq, sk = (q1 - q0) // count, (k1 - k0) // count
            causal = call.causal and sq == sk  # top-left and bottom-right agree
            mask = None if causal else visible(sq, sk, call.window, device)
            yield (q0, q1), (k0, k1), count, causal, mask

    @staticmethod
    def _launch_inputs(x, rows, n):
        # rows [a, b) of x [T, b, h, d] as the op's [n * b, h, s, d] (see sequences_in_batch)
        return sequences_in_batch(x[rows[0]:rows[1]], n)

    @staticmethod
    def _launch_lse(lse, rows, n):
        # lse [b, h, T] rows [a, b) -> [n * b, h, s], sequence-major like sequences_in_batch
        b, h = lse.shape[:2]
        return lse[:, :, rows[0]:rows[1]].unflatten(2, (n, -1)).permute(2, 0, 1, 3).reshape(n * b, h, -1)

    def forward(self, q, k, v, call: KernelCall, *, scale):
        tq, b, h, _ = q.shape
        launches = list(self._launches(call, q.device))
        if _whole(launches, tq, k.shape[0]):  # one sequence, every row: the op's result as it is (no copy)
            (_, _, _, causal, mask), = launches
            o, lse = self._attend(_bhsd(q), _bhsd(k), _bhsd(v), causal=causal, mask=mask, scale=scale)
            return o.permute(2, 0, 1, 3), lse
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        out = q.new_empty((tq, b, h, v.shape[-1]))
        lse = q.new_empty((b, h, tq), dtype=acc)
        for rq, rk, n, causal, mask in launches:
            o, l = self._attend(self._launch_inputs(q, rq, n), self._launch_inputs(k, rk, n),
                                self._launch_inputs(v, rk, n), causal=causal, mask=mask, scale=scale)
            _into_rows(out[rq[0]:rq[1]], o, n)
            # l [n * b, h, s] -> lse[:, :, q0:q1] as [b, h, n, s]
            lse[:, :, rq[0]:rq[1]].unflatten(2, (n, -1)).copy_(l.unflatten(0, (n, b)).permute(1, 2, 0, 3))
            del o, l  # copied: not held while the next launch runs
        return out, lse

    def _launch_backward(self, dout, q, k, v, out, lse, rq, rk, n, causal, mask, scale):
        """One launch's (dq, dk, dv) as the op returns them, ``[n * b, h, s, d]``."""
        return self._attend_backward(
            self._launch_inputs(dout, rq, n), self._launch_inputs(q, rq, n), self._launch_inputs(k, rk, n),
            self._launch_inputs(v, rk, n), self._launch_inputs(out, rq, n), self._launch_lse(lse, rq, n),
            causal=causal, mask=mask, scale=scale)

    def backward(self, dout, q, k, v, out, lse, call: KernelCall, *, scale):
        launches = list(self._launches(call, q.device))
        if _whole(launches, q.shape[0], k.shape[0]):  # one sequence, every row: no copies of its gradients
            (_, _, _, causal, mask), = launches
            grads = self._attend_backward(_bhsd(dout), _bhsd(q), _bhsd(k), _bhsd(v), _bhsd(out), lse,
                                          causal=causal, mask=mask, scale=scale)
            return tuple(g.permute(2, 0, 1, 3) for g in grads)
        dq, dk, dv = torch.empty_like(q), torch.zeros_like(k), torch.zeros_like(v)
        for rq, rk, n, causal, mask in launches:
            gq, gk, gv = self._launch_backward(dout, q, k, v, out, lse, rq, rk, n, causal, mask, scale)
            _into_rows(dq[rq[0]:rq[1]], gq, n)
            _into_rows(dk[rk[0]:rk[1]], gk, n)
            _into_rows(dv[rk[0]:rk[1]], gv, n)
            del gq, gk, gv  # copied: not held while the next launch runs
        return dq, dk, dv

    def backward_into(self, grads, dout, q, k, v, out, lse, call: KernelCall, *, scale, add=(True, True, True)):
        """:meth:`backward`, each launch's gradients written straight into ``grads = (dq, dk, dv)``
        (accumulators of the call's rows, any dtype): no whole-call gradients beside them.
        ``add[i]``: added into ``grads[i]``; False: copied (its rows hold nothing yet, Note
        [fresh rows] in :mod:`megatron_startrail.blocks`; a call's sequences never share a row)."""
        for rq, rk, n, causal, mask in self._launches(call, q.device):
            parts = self._launch_backward(dout, q, k, v, out, lse, rq, rk, n, causal, mask, scale)
            for acc, part, (a, b), plus in zip(grads, parts, (rq, rk, rk), add):
                _into_rows(acc[a:b], part, n, add=plus)
            del parts  # written: not held while the next launch runs


def _whole(launches, tq: int, tk: int) -> bool:
    """Whether a call is one launch of one sequence over all its ``tq`` query and ``tk`` key rows."""
    return len(launches) == 1 and launches[0][2] == 1 and launches[0][0] == (0, tq) and launches[0][1] == (0, tk)


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
    """``[b, h, T]`` -> contiguous ``[h, b*T]``, what the variable-length backward takes: FlashAttention-2's
    ``mha_varlen_bwd`` reads the lse through its data pointer as dense ``[h, total_q]`` and checks
    neither shape nor strides. The schedule's lse is a view of ``[T, b, h]`` storage, which a
    reshape alone leaves strided at batch 1: copied here."""
    return lse.transpose(0, 1).reshape(lse.shape[1], -1).contiguous()
