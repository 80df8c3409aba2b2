"""The host-side check every block kernel runs before it launches: the call against its tensors.

A fused kernel trusts its ``cu_seqlens``: a call of 8192 rows handed a tensor of 16 rows
reads and writes out of bounds (an H100 lost its CUDA context that way, issue 49), and on
a CPU slicing clamps silently. :func:`check_call` compares the call's metadata, which is on
the host (plain tuples of :class:`~megatron_startrail.layout.KernelCall`), with the
tensors' shapes, dtypes and strides, which are host facts too: pure Python on ints, no
tensor op and no device sync. A mismatch is a ``ValueError`` naming both sides.

:class:`CheckedKernel` puts it in front of every entry of a kernel (:data:`ENTRIES`: ``forward``,
``backward`` and ``backward_into``, the per-sequence kernels' backward that adds into the
schedule's accumulators; first in the MRO of every adapter), so no adapter carries a copy of it
and no launch goes around it. One check per entry call: an entry that reaches another entry of
its kernel (a padded ``backward_into`` through ``backward``) goes past the other's check.
"""

from __future__ import annotations

import functools

import torch

from ..layout import KernelCall


def _shape(t: torch.Tensor) -> str:
    return f"[{', '.join(str(n) for n in t.shape)}]"


@functools.lru_cache(maxsize=4096)
def _call_problem(call: KernelCall) -> str | None:
    """What is wrong with the call on its own (None: nothing); once per call (calls are reused every step)."""
    cq, ck = call.cu_seqlens_q, call.cu_seqlens_k
    if len(cq) != len(ck) or len(cq) < 2:
        return f"cu_seqlens_q has {len(cq)} entries and cu_seqlens_k {len(ck)}: one more than the sequences, on both"
    for name, cu, longest in (("cu_seqlens_q", cq, call.max_seqlen_q), ("cu_seqlens_k", ck, call.max_seqlen_k)):
        if cu[0] != 0 or any(b < a for a, b in zip(cu, cu[1:])):
            return f"{name} {cu[:8]}{'...' if len(cu) > 8 else ''} does not rise from 0"
        if longest != max(b - a for a, b in zip(cu, cu[1:])):
            return f"max_seqlen of {name} is {longest}, its longest sequence {max(b - a for a, b in zip(cu, cu[1:]))}"
    return None


def _rows(name: str, t: torch.Tensor, rows: int, side: str, dense_last: bool = True) -> str | None:
    if t.dim() != 4:
        return f"{name} must be [rows, batch, heads, head dim], got {_shape(t)}"
    if t.shape[0] != rows:
        return f"call has {rows} {side} rows but {name} holds {t.shape[0]} rows ({_shape(t)})"
    if dense_last and t.stride(-1) != 1 and t.shape[-1] > 1:
        return f"{name} {_shape(t)} has a strided last dim (stride {t.stride(-1)}): kernels read head dims densely"
    return None


def _tensor_problems(q, k, v, out, dout, lse, grads, tq: int, tk: int):
    yield _rows("q", q, tq, "query")
    yield _rows("k", k, tk, "key")
    yield _rows("v", v, tk, "key")
    b, h, hkv = q.shape[1], q.shape[2], k.shape[2]
    if k.shape[1] != b or v.shape[1] != b:
        yield f"q {_shape(q)}, k {_shape(k)} and v {_shape(v)} must have one batch size"
    if v.shape[2] != hkv or hkv == 0 or h % hkv:
        yield f"k {_shape(k)} and v {_shape(v)} need one head count that divides q's {h}"
    if k.shape[3] != q.shape[3]:
        yield f"q {_shape(q)} and k {_shape(k)} need one head dim"
    if k.dtype != q.dtype or v.dtype != q.dtype:
        yield f"q, k and v need one dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
    for name, t in (("out", out), ("dout", dout)):
        if t is None:
            continue
        yield _rows(name, t, tq, "query", dense_last=False)  # the adapters lay out out and dout as their op wants
        if tuple(t.shape[1:]) != (b, h, v.shape[3]) or t.dtype != q.dtype:
            yield f"{name} {_shape(t)} {t.dtype} must be [{tq}, {b}, {h}, {v.shape[3]}] {q.dtype} (q's rows, v's head dim)"
    if lse is not None and tuple(lse.shape) != (b, h, tq):
        yield f"call has {tq} query rows but lse is {_shape(lse)}, not [{b}, {h}, {tq}]"
    if lse is not None and lse.dtype != (torch.float64 if q.dtype == torch.float64 else torch.float32):
        yield f"lse is {lse.dtype}: the kernels' lse is float32 (float64 for float64 inputs)"
    for name, grad, t in zip(("dq", "dk", "dv"), grads or (), (q, k, v)):
        if grad.shape != t.shape:  # backward_into adds a launch's rows into them: any dtype and strides
            yield f"{name} {_shape(grad)} must be {name[1:]}'s shape {_shape(t)} (the call's rows of the accumulator)"


def check_call(kernel: str, call: KernelCall, q, k, v, out=None, dout=None, lse=None, grads=None) -> None:
    """ValueError naming ``kernel``, the call and the tensor when ``call`` does not fit q ``[Tq, b, h, d]``,
    k ``[Tk, b, hkv, d]``, v ``[Tk, b, hkv, dv]`` (and the backward's out / dout ``[Tq, b, h, dv]``,
    lse ``[b, h, Tq]`` float32 (float64 for float64), ``backward_into``'s accumulators ``grads =
    (dq, dk, dv)`` shaped as q, k, v): rows, batch, heads, head dims, one dtype, a dense last dim,
    and the call's own ``cu_seqlens`` / ``max_seqlen``. Host ints only. (Which dtypes a kernel takes is the
    kernel choice's rule, and the ops refuse others themselves before launching.)"""
    plain = getattr(call, "call", call)  # a BoundCall carries its KernelCall
    problem = _call_problem(plain)
    if problem is None:
        tq, tk = plain.cu_seqlens_q[-1], plain.cu_seqlens_k[-1]
        problem = next((p for p in _tensor_problems(q, k, v, out, dout, lse, grads, tq, tk) if p is not None), None)
    if problem is not None:
        raise ValueError(f"{kernel}: {problem} (call of {len(plain.cu_seqlens_q) - 1} sequences, window "
                         f"{plain.window}); refused before launch")


ENTRIES = ("forward", "backward", "backward_into")  # every way into a kernel (tests/test_call_check.py)


class CheckedKernel:
    """Mixin, first in an adapter's bases: :func:`check_call` on the call and the tensors as the
    schedule hands them, then the next class's entry of the same name (:data:`ENTRIES`)."""

    name = "kernel"

    def forward(self, q, k, v, call, *, scale):
        check_call(self.name, call, q, k, v)
        return super().forward(q, k, v, call, scale=scale)

    def backward(self, dout, q, k, v, out, lse, call, *, scale):
        check_call(self.name, call, q, k, v, out, dout, lse)
        return super().backward(dout, q, k, v, out, lse, call, scale=scale)

    def backward_into(self, grads, dout, q, k, v, out, lse, call, *, scale, add=(True, True, True)):
        check_call(self.name, call, q, k, v, out, dout, lse, grads)
        return super().backward_into(grads, dout, q, k, v, out, lse, call, scale=scale, add=add)
