"""Every block kernel against float64, and its speed against torch SDPA (part of gpu_check).

Accuracy: each kernel of :data:`megatron_startrail.kernels.RULES` x dtype x head dims x
window x heads x input layout (:data:`LAYOUTS`: batch 1, batch 2, and batch 2 as strided views
of a fused QKV tensor with a transposed dO, as Megatron hands them) runs forward and backward
on one variable-length call (Note [kernel calls]
in megatron_startrail.layout: three sequences of unequal query and key lengths, flash-attn's
window rule, causal aligned bottom-right); out, lse and dq/dk/dv are compared with the
reference kernel in float64 on the same (rounded) inputs. A combination the kernel cannot
take is a SKIP row with the selection rules' reason (or the ImportError), never a PASS.
Lengths are not multiples of 32, so the efficient op's lse row padding is exercised.

Speed: each kernel's forward + backward against SDPA's on the same tensors, after checking
that both compute the same (:func:`agreement`).

``accuracy_part`` and ``timing_part`` are the kit's parts: each runs in its own process
(:mod:`benchmarks.gpu.check_parts`), one item per case.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from benchmarks.gpu.check_parts import device_lost
from megatron_startrail.kernels import (RULES, KernelRequest, ReferenceKernel, kernel_constraint, make_kernel,
                                        usable_backends)
from megatron_startrail.kernels.measured import SM90
from megatron_startrail.layout import KernelCall

# max |error| / max |reference| allowed, per input dtype (as the project's tests use).
TOLERANCE = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}
DTYPES = {name: dtype for dtype, name in DTYPE_NAMES.items()}


@dataclass
class Case:
    kernel: str
    dtype: torch.dtype
    dims: tuple[int, int]  # (q/k head dim, v head dim)
    window: tuple[int, int]  # flash-attn's (left, right) of the call; (-1, 0) causal, (-1, -1) none
    heads: tuple[int, int]  # (query heads, kv heads)
    layout: str = "b2"  # a key of LAYOUTS

    @property
    def causal(self) -> bool:
        return self.window == (-1, 0)


# How the inputs reach the kernel: (batch, strided). "qkv": q, k, v are views of one fused
# tensor as Megatron's SelfAttention splits its linear_qkv output (``[T, b, hkv, (g + 2) * d]``
# split on the last dim: k, v strided views, q a view for MHA), dO a transposed view.
LAYOUTS = {"b1": (1, False), "b2": (2, False), "qkv": (2, True)}


@dataclass
class AccuracyRow:
    case: Case
    status: str  # PASS / FAIL / SKIP
    errors: dict[str, float]
    note: str

    def to_json(self) -> dict:
        c = self.case
        return {"kernel": c.kernel, "dtype": DTYPE_NAMES[c.dtype], "dims": list(c.dims), "window": list(c.window),
                "heads": list(c.heads), "layout": c.layout, "status": self.status, "errors": self.errors,
                "note": self.note}


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


# The window classes the planner makes: none, causal, a causal band, a band's cut edge.
WINDOWS = ((-1, -1), (-1, 0), (37, 0), (0, -1))


def kernel_order(names) -> list[str]:
    """The order the parts run kernels in, so that the end of a part's time cuts the fallbacks,
    not auto's picks: the kernels of the Hopper table (:data:`~megatron_startrail.kernels.measured.SM90`)
    in its order, then the other fused kernels, the reference kernel last."""
    rank = {name: i for i, name in enumerate(dict.fromkeys(rule.kernel for rule in SM90.rules))}
    fallback = len(rank) + len(RULES)
    position = {rule.name: i for i, rule in enumerate(RULES)}
    return sorted(names, key=lambda n: (rank.get(n, len(rank)) if n != "reference" else fallback, position.get(n, 0)))


def all_cases(dtypes, dims_list, kernels=None, layouts=tuple(LAYOUTS)) -> list[Case]:
    names = kernel_order(kernels or [rule.name for rule in RULES])
    return [
        Case(name, dtype, dims, window, heads, layout)
        for name in names for dtype in dtypes for dims in dims_list
        for window in WINDOWS for heads in ((8, 8), (8, 2)) for layout in layouts
    ]


def varlen_call(seq: int, window: tuple[int, int]) -> KernelCall:
    """Three sequences of (queries, keys): (seq, seq), (seq // 2 + 3, seq + 5), (seq - 7, seq + 1):
    never fewer keys than queries, so every row sees a key under every window of WINDOWS
    (what the planner guarantees; flash-attn gives rows without keys lse +inf, not -inf)."""
    return KernelCall.back_to_back([(seq, seq), (seq // 2 + 3, seq + 5), (seq - 7, seq + 1)], window)


def randn(shape, gen: torch.Generator | None, device, dtype) -> torch.Tensor:
    """Normal draws made on ``device`` (a GPU draws them itself: the host never makes billions of
    them on one core, as the H100 session's accuracy and 1M parts did)."""
    return torch.randn(shape, generator=gen, device=device, dtype=dtype)


def generator(device, seed: int) -> torch.Generator:
    return torch.Generator(device=torch.device(device)).manual_seed(seed)


@functools.lru_cache(maxsize=16)
def _draws(shapes: tuple, device: torch.device, seed: int) -> tuple[torch.Tensor, ...]:
    """float64 normals of these shapes, drawn once per process and set of shapes (the accuracy
    part's 1008 cases have 12 distinct input sets: heads x head dims x input layout); each case
    rounds them to its dtype."""
    gen = generator(device, seed)
    return tuple(randn(shape, gen, device, torch.float64) for shape in shapes)


def _inputs(case: Case, call: KernelCall, device, seed: int = 0):
    """q, k, v, dout ``[T, b, h, d]`` in the case's dtype, laid out as ``case.layout`` says."""
    (h, hkv), (dqk, dv) = case.heads, case.dims
    batch, strided = LAYOUTS[case.layout]
    tq, tk = call.cu_seqlens_q[-1], call.cu_seqlens_k[-1]
    device = torch.device(device)
    if not strided:
        shapes = ((tq, batch, h, dqk), (tk, batch, hkv, dqk), (tk, batch, hkv, dv), (tq, batch, h, dv))
        return [x.to(case.dtype, copy=True) for x in _draws(shapes, device, seed)]
    g = h // hkv
    fused, dout = _draws(((max(tq, tk), batch, hkv, g * dqk + dqk + dv), (batch, tq, h, dv)), device, seed)
    q, k, v = torch.split(fused.to(case.dtype, copy=True), [g * dqk, dqk, dv], dim=3)
    q = q[:tq].reshape(tq, batch, h, dqk)  # a strided view for MHA; Megatron's reshape copies for GQA
    return [q, k[:tk], v[:tk], dout.to(case.dtype, copy=True).transpose(0, 1)]


def check_case(case: Case, seq: int, device: torch.device, available: frozenset[str]) -> AccuracyRow:
    (h, hkv), (dqk, dv) = case.heads, case.dims
    request = KernelRequest(device.type, case.dtype, dqk, dv, h // hkv, available)
    why_not = kernel_constraint(case.kernel, request)
    if why_not is not None:
        return AccuracyRow(case, "SKIP", {}, why_not)
    try:
        kernel = make_kernel(case.kernel)
    except ImportError as err:
        return AccuracyRow(case, "SKIP", {}, f"not importable: {err}")
    call = varlen_call(seq, case.window)
    x = _inputs(case, call, device)
    q, k, v, dout = (t.double() for t in x)  # the same values, contiguous, in float64
    scale = dqk**-0.5
    ref = ReferenceKernel()
    ref_out, ref_lse = ref.forward(q, k, v, call, scale=scale)
    ref_grads = ref.backward(dout, q, k, v, ref_out, ref_lse, call, scale=scale)
    try:
        with torch.no_grad():
            out, lse = kernel.forward(x[0], x[1], x[2], call, scale=scale)
            grads = kernel.backward(x[3], x[0], x[1], x[2], out, lse, call, scale=scale)
    except Exception as err:  # noqa: BLE001 - a kernel that raises is a failed row, reported
        if device_lost():
            raise  # the context is gone: the part's process ends, the runner reports this case
        return AccuracyRow(case, "FAIL", {}, f"{type(err).__name__}: {str(err).splitlines()[0][:160]}")
    if out.shape != ref_out.shape or lse.shape != ref_lse.shape or lse.dtype != torch.float32:
        return AccuracyRow(case, "FAIL", {}, f"out {tuple(out.shape)} / lse {tuple(lse.shape)} {lse.dtype}: "
                           f"want {tuple(ref_out.shape)} / {tuple(ref_lse.shape)} float32")
    errors = {"out": relative_error(out, ref_out), "lse": relative_error(lse, ref_lse)}
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads):
        if got.shape != want.shape:
            return AccuracyRow(case, "FAIL", errors, f"{name} shape {tuple(got.shape)} != {tuple(want.shape)}")
        errors[name] = relative_error(got, want)
    ok = all(e <= TOLERANCE[case.dtype] for e in errors.values())
    return AccuracyRow(case, "PASS" if ok else "FAIL", errors, "")


def accuracy_part(items, dtypes: list[str], dims: list[list[int]], kernels: list[str] | None, block_seq: int,
                  device: str, layouts: list[str] | None = None) -> None:
    """The kit's accuracy part (child side): one item per case."""
    dev = torch.device(device)
    available = usable_backends(dev)
    cases = all_cases([DTYPES[d] for d in dtypes], [tuple(d) for d in dims], kernels, layouts or tuple(LAYOUTS))
    items.run(cases, lambda c: [check_case(c, block_seq, dev, available).to_json()], describe,
              group=lambda c: c.kernel)


def describe(case: Case) -> str:
    return (f"accuracy {case.kernel} {DTYPE_NAMES[case.dtype]} {case.dims} window={case.window} "
            f"heads={case.heads} {case.layout}")


# --- speed ------------------------------------------------------------------------------

def _timer(device: torch.device):
    """``run(fn, iters, warm=True)``: the median of ``iters`` timed calls (ms), after one untimed
    call when ``warm``; CUDA events on a GPU, the host clock on the CPU."""
    if device.type == "cuda":
        def clock(fn):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            start.record()
            fn()
            end.record()
            torch.cuda.synchronize(device)
            return start.elapsed_time(end)
    else:
        def clock(fn):
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3

    def run(fn, iters, warm=True):
        if warm:
            fn()  # warm-up (and autotuning)
        times = sorted(clock(fn) for _ in range(iters))
        return times[len(times) // 2]

    return run


@dataclass
class TimingRow:
    kernel: str
    dtype: torch.dtype
    dims: tuple[int, int]
    causal: bool
    shape: str
    kernel_ms: float
    sdpa_ms: float  # the yardstick's time: SDPA's, or for packed documents ``against``'s
    vs_sdpa: float  # max relative difference of out, dq, dk, dv from the yardstick's, checked before timing
    against: str = "sdpa"  # the yardstick: torch SDPA, or (packed documents) auto's packed kernel

    def to_json(self) -> dict:
        return {"kernel": self.kernel, "dtype": DTYPE_NAMES[self.dtype], "dims": list(self.dims),
                "causal": self.causal, "shape": self.shape, "kernel_ms": self.kernel_ms, "sdpa_ms": self.sdpa_ms,
                "vs_sdpa": self.vs_sdpa, "against": self.against}


def timing_inputs(seq: int, heads: int, dims, dtype, device):
    """``(q, k, v, dout)`` ``[seq, 1, heads, d]`` as the block kernels take them, and the same
    tensors as ``[1, heads, seq, d]`` views for SDPA (its leaves q, k, v need grad)."""
    dqk, dv = dims
    gen = generator(device, 1)
    q, k = (randn((seq, 1, heads, dqk), gen, device, dtype) for _ in range(2))
    v, dout = (randn((seq, 1, heads, dv), gen, device, dtype) for _ in range(2))
    block = (q, k, v, dout)
    qs, ks, vs, douts = (t.permute(1, 2, 0, 3) for t in block)
    return block, (*(t.detach().requires_grad_(True) for t in (qs, ks, vs)), douts)


def agreement(block_result, sdpa_result, dtype) -> float:
    """The block kernel's ``(out, (dq, dk, dv))`` (``[seq, 1, h, d]``) against SDPA's
    (``[1, h, seq, d]``): the largest relative difference; a ValueError naming the tensor when
    a shape differs or a difference is over twice the accuracy tolerance (both are rounded).
    A kit that hands the kernel other tensors than SDPA's (9ee7a82: its permuted views) fails here."""
    worst = 0.0
    for name, got, want in zip(("out", "dq", "dk", "dv"), (block_result[0], *block_result[1]),
                               (sdpa_result[0], *sdpa_result[1])):
        got = got.permute(1, 2, 0, 3) if got.dim() == 4 else got
        if got.shape != want.shape:
            raise ValueError(f"the block kernel's {name} has shape {tuple(got.shape)} (as SDPA's layout), SDPA's "
                             f"{tuple(want.shape)}: the kernel was not handed SDPA's tensors")
        err = relative_error(got, want.double())
        if not err <= 2 * TOLERANCE[dtype]:
            raise ValueError(f"the block kernel's {name} differs from SDPA's by {err:.1e} (max |diff| / max |SDPA|), "
                             f"over {2 * TOLERANCE[dtype]:.0e}: not timed")
        worst = max(worst, err)
    return worst


def time_kernel(name: str, dtype, dims, causal: bool, seq: int, heads: int, device, iters: int) -> TimingRow:
    """One block kernel's forward + backward (one call of one sequence) vs
    ``F.scaled_dot_product_attention`` forward + backward (autograd) on the same inputs, after
    checking that both compute the same (:func:`agreement`)."""
    dqk, dv = dims
    (q, k, v, dout), (qs, ks, vs, douts) = timing_inputs(seq, heads, dims, dtype, device)
    scale = dqk**-0.5
    kernel = make_kernel(name)
    timer = _timer(device)
    call = KernelCall(((0, seq),), (((0, seq),),), (-1, 0) if causal else (-1, -1))

    def block():
        with torch.no_grad():
            out, lse = kernel.forward(q, k, v, call, scale=scale)
            return out, kernel.backward(dout, q, k, v, out, lse, call, scale=scale)

    def sdpa():
        out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, scale=scale)
        return out, torch.autograd.grad(out, (qs, ks, vs), douts)

    vs_sdpa = agreement(block(), sdpa(), dtype)
    shape = f"1x{heads}x{seq}x{dqk}/{dv}"
    return TimingRow(name, dtype, dims, causal, shape, timer(block, iters), timer(sdpa, iters), vs_sdpa)


# Packed documents: 4 documents of 10/30/20/40% of the sequence, causal, in one call (what a
# StarTrail rank's diagonal step makes of packed sequences); timed against auto's packed kernel on
# the same tensors, since SDPA takes no packed call. Where cuDNN's ragged adapter is faster than
# FA2 here and PASSes the accuracy part, it may enter auto's sm90 table for packed layers.
PACKED_YARDSTICK = {"cuda": "torch_cuda_flash", "cpu": "reference"}
PACKED_KERNELS = ("torch_cuda_cudnn_varlen", "torch_cuda_cudnn", "torch_cpu_flash")


def packed_call(seq: int) -> KernelCall:
    cuts = [0] + [seq * f // 10 for f in (1, 4, 6)] + [seq]
    return KernelCall.back_to_back([(b - a, b - a) for a, b in zip(cuts, cuts[1:])], (-1, 0))


def time_packed(name: str, dtype, dims, seq: int, heads: int, device, iters: int) -> TimingRow:
    """One block kernel's forward + backward on a packed call (:func:`packed_call`) against the
    yardstick kernel's on the same tensors, after checking they agree."""
    dqk, dv = dims
    (q, k, v, dout), _ = timing_inputs(seq, heads, dims, dtype, device)
    scale, call, timer = dqk**-0.5, packed_call(seq), _timer(device)
    yardstick = PACKED_YARDSTICK[device.type]

    def step(kernel):
        def run():
            with torch.no_grad():
                out, lse = kernel.forward(q, k, v, call, scale=scale)
                return out, kernel.backward(dout, q, k, v, out, lse, call, scale=scale)
        return run

    mine, theirs = step(make_kernel(name)), step(make_kernel(yardstick))
    (out, grads), (want_out, want_grads) = mine(), theirs()
    worst = max(relative_error(a, b.double()) for a, b in zip((out, *grads), (want_out, *want_grads)))
    if not worst <= 2 * TOLERANCE[dtype]:
        raise ValueError(f"{name} differs from {yardstick} on packed documents by {worst:.1e}: not timed")
    shape = f"1x{heads}x{seq}x{dqk}/{dv}, 4 documents"
    return TimingRow(name, dtype, dims, True, shape, timer(mine, iters), timer(theirs, iters), worst, yardstick)


def timing_combinations(kernels, dtypes, dims_list, device, passed=None) -> list[tuple]:
    """(kernel, dtype, dims, causal) to time: the kernel takes them on this device and, when
    ``passed`` (``[kernel, dtype name, dims]`` lists) is given, it passed the accuracy part there."""
    available = usable_backends(device)
    combos = []
    for name in kernel_order(kernels or [rule.name for rule in RULES]):
        if name == "reference":
            continue  # materializes the score matrix: not a speed contender
        for dtype in dtypes:
            for dims in dims_list:
                req = KernelRequest(device.type, dtype, dims[0], dims[1], 1, available)
                if kernel_constraint(name, req) is None and (
                        passed is None or [name, DTYPE_NAMES[dtype], list(dims)] in passed):
                    combos += [(name, dtype, tuple(dims), causal) for causal in (True, False)]
                    if name in PACKED_KERNELS:
                        combos.append((name, dtype, tuple(dims), "packed"))
    return combos


def timing_part(items, kernels: list[str] | None, dtypes: list[str], dims: list[list[int]], seq: int, heads: int,
                device: str, iters: int, passed: list | None = None) -> None:
    """The kit's timing part (child side): one item per (kernel, dtype, dims, causal)."""
    dev = torch.device(device)
    combos = timing_combinations(kernels, [DTYPES[d] for d in dtypes], dims, dev, passed)
    def run(c):
        if c[3] == "packed":
            return [time_packed(*c[:3], seq, heads, dev, iters).to_json()]
        return [time_kernel(*c, seq, heads, dev, iters).to_json()]

    items.run(combos, run, lambda c: f"timing {c[0]} {DTYPE_NAMES[c[1]]} {c[2]} " + (
        "packed" if c[3] == "packed" else f"causal={c[3]}"), group=lambda c: c[0])
