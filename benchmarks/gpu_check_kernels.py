"""Every block kernel against float64, and its speed against torch SDPA (part of gpu_check).

Accuracy: each kernel of :data:`megatron_startrail.kernels.RULES` x dtype x head dims x
window x heads runs forward and backward on one variable-length call (Note [kernel calls]
in megatron_startrail.layout: three sequences of unequal query and key lengths, flash-attn's
window rule, causal aligned bottom-right); out, lse and dq/dk/dv are compared with the
reference kernel in float64 on the same (rounded) inputs. A combination the kernel cannot
take is a SKIP row with the selection rules' reason (or the ImportError), never a PASS.
Lengths are not multiples of 32, so the efficient op's lse row padding is exercised.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from megatron_startrail.kernels import RULES, KernelRequest, ReferenceKernel, kernel_constraint, make_kernel
from megatron_startrail.layout import KernelCall

# max |error| / max |reference| allowed, per input dtype (as the project's tests use).
TOLERANCE = {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}
DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


@dataclass
class Case:
    kernel: str
    dtype: torch.dtype
    dims: tuple[int, int]  # (q/k head dim, v head dim)
    window: tuple[int, int]  # flash-attn's (left, right) of the call; (-1, 0) causal, (-1, -1) none
    heads: tuple[int, int]  # (query heads, kv heads)

    @property
    def causal(self) -> bool:
        return self.window == (-1, 0)


@dataclass
class AccuracyRow:
    case: Case
    status: str  # PASS / FAIL / SKIP
    errors: dict[str, float]
    note: str


def relative_error(got: torch.Tensor, want: torch.Tensor) -> float:
    return ((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


# The window classes the planner makes: none, causal, a causal band, a band's cut edge.
WINDOWS = ((-1, -1), (-1, 0), (37, 0), (0, -1))


def all_cases(dtypes, dims_list, kernels=None) -> list[Case]:
    names = kernels or [rule.name for rule in RULES]
    return [
        Case(name, dtype, dims, window, heads)
        for name in names for dtype in dtypes for dims in dims_list
        for window in WINDOWS for heads in ((8, 8), (8, 2))
    ]


def varlen_call(seq: int, window: tuple[int, int]) -> KernelCall:
    """Three sequences of (queries, keys): (seq, seq), (seq // 2 + 3, seq + 5), (seq - 7, seq + 1):
    never fewer keys than queries, so every row sees a key under every window of WINDOWS
    (what the planner guarantees; flash-attn gives rows without keys lse +inf, not -inf)."""
    return KernelCall.back_to_back([(seq, seq), (seq // 2 + 3, seq + 5), (seq - 7, seq + 1)], window)


def _inputs(case: Case, call: KernelCall, device, seed: int = 0):
    """q, k, v, dout ``[T, b, h, d]`` in float64, already rounded to the case's dtype."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    (h, hkv), (dqk, dv) = case.heads, case.dims
    tq, tk = call.cu_seqlens_q[-1], call.cu_seqlens_k[-1]
    shapes = [(tq, 2, h, dqk), (tk, 2, hkv, dqk), (tk, 2, hkv, dv), (tq, 2, h, dv)]
    return [torch.randn(s, generator=gen, dtype=torch.float64).to(case.dtype).to(device).double() for s in shapes]


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
    q, k, v, dout = _inputs(case, call, device)
    scale = dqk**-0.5
    ref = ReferenceKernel()
    ref_out, ref_lse = ref.forward(q, k, v, call, scale=scale)
    ref_grads = ref.backward(dout, q, k, v, ref_out, ref_lse, call, scale=scale)
    x = [t.to(case.dtype) for t in (q, k, v, dout)]
    try:
        with torch.no_grad():
            out, lse = kernel.forward(x[0], x[1], x[2], call, scale=scale)
            grads = kernel.backward(x[3], x[0], x[1], x[2], out, lse, call, scale=scale)
    except Exception as err:  # noqa: BLE001 - a kernel that raises is a failed row, reported
        return AccuracyRow(case, "FAIL", {}, f"{type(err).__name__}: {str(err).splitlines()[0][:160]}")
    errors = {"out": relative_error(out, ref_out), "lse": relative_error(lse, ref_lse)}
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref_grads):
        if got.shape != want.shape:
            return AccuracyRow(case, "FAIL", errors, f"{name} shape {tuple(got.shape)} != {tuple(want.shape)}")
        errors[name] = relative_error(got, want)
    shape_ok = out.shape == ref_out.shape and lse.shape == ref_lse.shape and lse.dtype == torch.float32
    ok = shape_ok and all(e <= TOLERANCE[case.dtype] for e in errors.values())
    return AccuracyRow(case, "PASS" if ok else "FAIL", errors, "" if shape_ok else "out/lse shape or lse dtype")


# --- speed ------------------------------------------------------------------------------

def _timer(device: torch.device):
    if device.type == "cuda":
        def run(fn, iters):
            fn()  # warm-up (and autotuning)
            torch.cuda.synchronize(device)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            times = []
            for _ in range(iters):
                start.record()
                fn()
                end.record()
                torch.cuda.synchronize(device)
                times.append(start.elapsed_time(end))
            return sorted(times)[len(times) // 2]
    else:
        def run(fn, iters):
            fn()
            times = []
            for _ in range(iters):
                t0 = time.perf_counter()
                fn()
                times.append((time.perf_counter() - t0) * 1e3)
            return sorted(times)[len(times) // 2]
    return run


@dataclass
class TimingRow:
    kernel: str
    dtype: torch.dtype
    dims: tuple[int, int]
    causal: bool
    shape: str
    kernel_ms: float
    sdpa_ms: float


def time_kernel(name: str, dtype, dims, causal: bool, seq: int, heads: int, device, iters: int) -> TimingRow:
    """One block kernel's forward + backward (one call of one sequence) vs
    ``F.scaled_dot_product_attention`` forward + backward (autograd) on the same inputs."""
    dqk, dv = dims
    gen = torch.Generator(device="cpu").manual_seed(1)
    q, k = (torch.randn(seq, 1, heads, dqk, generator=gen).to(device, dtype) for _ in range(2))
    v, dout = (torch.randn(seq, 1, heads, dv, generator=gen).to(device, dtype) for _ in range(2))
    scale = dqk**-0.5
    kernel = make_kernel(name)
    timer = _timer(device)
    call = KernelCall(((0, seq),), (((0, seq),),), (-1, 0) if causal else (-1, -1))

    def block():
        with torch.no_grad():
            out, lse = kernel.forward(q, k, v, call, scale=scale)
            kernel.backward(dout, q, k, v, out, lse, call, scale=scale)

    q, k, v, dout = (t.permute(1, 2, 0, 3) for t in (q, k, v, dout))  # [1, heads, seq, d] for SDPA
    qs, ks, vs = (t.detach().requires_grad_(True) for t in (q, k, v))

    def sdpa():
        out = F.scaled_dot_product_attention(qs, ks, vs, is_causal=causal, scale=scale)
        torch.autograd.grad(out, (qs, ks, vs), dout)

    shape = f"1x{heads}x{seq}x{dqk}/{dv}"
    return TimingRow(name, dtype, dims, causal, shape, timer(block, iters), timer(sdpa, iters))
