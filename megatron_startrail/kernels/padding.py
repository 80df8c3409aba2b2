"""Local padding for kernels that want other shapes than the schedule has.

Head dims: kernels that need one head dim for q, k and v get zero columns appended to
the narrower tensors (MLA: q/k 192, v 128). Zero columns are exact: q/k columns of zeros
add nothing to Q K^T, V columns of zeros give output columns of zeros, and in the
backward the padded dO/out columns are zero, so dP = dO V^T and D = rowsum(dO * O) are
unchanged and the extra gradient columns come back zero and are cut off.

LSE rows: PyTorch's memory-efficient op returns lse ``[b, h, ceil(sq / 32) * 32]`` and its
backward wants it back in that form (its kernel checks lse strides are multiples of 8).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

LSE_ROW_ALIGN = 32  # the memory-efficient op's lse row padding (kAlignLSE in PyTorch)


def round_up(x: int, multiple: int) -> int:
    return -(-x // multiple) * multiple


def common_head_dim(qk_head_dim: int, v_head_dim: int, multiple: int = 1) -> int:
    """The one head dim a kernel that needs equal dims is called with."""
    return round_up(max(qk_head_dim, v_head_dim), multiple)


def pad_head_dim(x: torch.Tensor, size: int) -> torch.Tensor:
    """``[..., d]`` -> ``[..., size]`` with zero columns appended; ``x`` itself when ``d == size``."""
    d = x.shape[-1]
    if d == size:
        return x
    if d > size:
        raise ValueError(f"cannot pad head dim {d} down to {size}")
    return F.pad(x, (0, size - d))


def cut_head_dim(x: torch.Tensor, size: int) -> torch.Tensor:
    """``[..., d_padded]`` -> ``[..., size]`` (a view)."""
    return x if x.shape[-1] == size else x[..., :size]


def trim_lse(lse: torch.Tensor, rows: int) -> torch.Tensor:
    """A kernel's lse ``[b, h, >= rows]`` (or ``[b, h, rows, 1]``) -> ``[b, h, rows]`` float32."""
    if lse.dim() == 4:
        lse = lse.squeeze(-1)
    return lse[..., :rows]


def pad_lse_rows(lse: torch.Tensor, multiple: int = LSE_ROW_ALIGN) -> torch.Tensor:
    """lse ``[b, h, sq]`` -> contiguous ``[b, h, round_up(sq, multiple)]``; the extra rows are
    never read (they belong to no query) and are set to 0."""
    b, h, sq = lse.shape
    rows = round_up(sq, multiple)
    out = lse.new_zeros((b, h, rows))
    out[..., :sq] = lse
    return out


class EqualHeadDimsKernel:
    """Mixin for the kernels that need one head dim for q, k and v (a multiple of
    ``head_dim_multiple``): :meth:`forward` / :meth:`backward` pad to it, call the next
    class's ``forward`` / ``backward`` in the MRO (the kernel proper) and cut the results
    back (see the module note). Padding is per call: one pad per tensor, not per sequence."""

    head_dim_multiple = 1

    def forward(self, q, k, v, call, *, scale):
        # q/k [Tq|Tk, b, h|hkv, d_qk], v [Tk, b, hkv, d_v] -> out [Tq, b, h, d_v], lse [b, h, Tq]
        d_v = v.shape[-1]
        d = common_head_dim(q.shape[-1], d_v, self.head_dim_multiple)
        out, lse = super().forward(pad_head_dim(q, d), pad_head_dim(k, d), pad_head_dim(v, d), call, scale=scale)
        return cut_head_dim(out, d_v), lse

    def backward(self, dout, q, k, v, out, lse, call, *, scale):
        d_qk, d_v = q.shape[-1], v.shape[-1]
        d = common_head_dim(d_qk, d_v, self.head_dim_multiple)
        dq, dk, dv = super().backward(
            pad_head_dim(dout, d), pad_head_dim(q, d), pad_head_dim(k, d), pad_head_dim(v, d),
            pad_head_dim(out, d), lse, call, scale=scale,
        )
        return cut_head_dim(dq, d_qk), cut_head_dim(dk, d_qk), cut_head_dim(dv, d_v)

    def backward_into(self, grads, dout, q, k, v, out, lse, call, *, scale, add=(True, True, True)):
        """:meth:`backward` written into ``grads = (dq, dk, dv)`` (``add[i]`` False: copied, the
        rows hold nothing yet): by the kernel proper's own ``backward_into`` where nothing is
        padded, else through :meth:`backward`."""
        kernel_into = getattr(super(), "backward_into", None)
        if kernel_into is not None and common_head_dim(q.shape[-1], v.shape[-1], self.head_dim_multiple) == \
                q.shape[-1] == v.shape[-1]:
            return kernel_into(grads, dout, q, k, v, out, lse, call, scale=scale, add=add)
        # EqualHeadDimsKernel's own backward, not self.backward: the entry's call check has run.
        for acc, grad, plus in zip(grads, EqualHeadDimsKernel.backward(self, dout, q, k, v, out, lse, call, scale=scale), add):
            acc.add_(grad) if plus else acc.copy_(grad)
        return None
