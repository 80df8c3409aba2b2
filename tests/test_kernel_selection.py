"""Block kernel selection (the whole rule table), the forced-kernel errors, the flag,
MLA head dims at the kernel level, and the CPU-executable parts of the CUDA adapters
(padding, lse rows, op argument plumbing on the meta device, flash-attn name binding)."""

import argparse
import functools
import itertools
import logging
import re
import sys
import types
import warnings

import pytest
import torch

from megatron_startrail import kernels
from megatron_startrail import new_startrail_groups, startrail_attn
from megatron_startrail.kernels import (
    BACKENDS,
    RULES,
    KernelRequest,
    ReferenceKernel,
    TorchCPUFlashKernel,
    check_kernel,
    choose_kernel,
    kernel_constraint,
    kernel_for,
)
from megatron_startrail.kernels import builds, measured, selection
from megatron_startrail.kernels.flash_attn import FlashAttnKernel, call_by_name
from megatron_startrail.kernels.padding import (
    EqualHeadDimsKernel,
    common_head_dim,
    cut_head_dim,
    pad_head_dim,
    pad_lse_rows,
    trim_lse,
)
from megatron_startrail.kernels.cudnn_varlen import TorchCUDACudnnVarlenKernel
from megatron_startrail.kernels.torch_cuda import TorchCUDACudnnKernel, TorchCUDAEfficientKernel, TorchCUDAFlashKernel
from megatron_startrail.megatron.arguments import add_startrail_args
from megatron_startrail.layout import KernelCall
from tests import flash_attn_fakes
from tests.attention_cases import TOLERANCE, reference_with_grads, relative_error
from tests.multiproc import run_ranks
from tests.test_kernels_and_merge import float64_call
from tests.test_kernel_contracts import CUDA_ADAPTERS, adapter_id

ALL = frozenset(BACKENDS)
TORCH_ONLY = frozenset({"torch_flash", "torch_efficient", "torch_cudnn"})
HALF = (torch.bfloat16, torch.float16)


H100_SM90, A100_SM80, V100_SM70 = (9, 0), (8, 0), (7, 0)


def req(device="cuda", dtype=torch.bfloat16, qk=128, v=None, gqa=1, available=ALL, *, cap=H100_SM90, batch=1,
        mask="causal", packed=False):
    return KernelRequest(device, dtype, qk, v or qk, gqa, frozenset(available), batch, mask, packed,
                         cap if device == "cuda" else None)


# (request, expected auto choice): the tables of docs/block-kernels.md, row by row.
CASES = [
    (req("cpu", torch.float32), "torch_cpu_flash"),
    (req("cpu", torch.float64, 192, 128), "torch_cpu_flash"),
    (req("cpu", torch.bfloat16, 512, available=()), "torch_cpu_flash"),
    # sm90: cuDNN for dense layers up to 128 (flash-attn 3 installed or not: it is unmeasured)
    (req(dtype=torch.bfloat16), "torch_cuda_cudnn"),
    (req(dtype=torch.float16, batch=4, mask="none"), "torch_cuda_cudnn"),
    (req(dtype=torch.bfloat16, gqa=8, available=TORCH_ONLY), "torch_cuda_cudnn"),
    (req(dtype=torch.bfloat16, available=TORCH_ONLY - {"torch_cudnn"}), "torch_cuda_flash"),  # no cuDNN 9
    (req(dtype=torch.bfloat16, packed=True), "torch_cuda_flash"),  # documents: one launch per call
    (req(dtype=torch.float16, mask="window"), "torch_cuda_flash"),
    (req(dtype=torch.bfloat16, qk=192, v=128, available=TORCH_ONLY), "torch_cuda_flash"),  # MLA: V padded
    (req(dtype=torch.float32, mask="none"), "torch_cuda_efficient"),  # a run without --bf16, no mask
    (req(dtype=torch.float32, qk=192, v=128, mask="none", batch=2), "torch_cuda_efficient"),  # fp32 MLA: native
    (req(dtype=torch.float32), "reference"),  # masked calls raised in the efficient op on the H100
    (req(dtype=torch.bfloat16, qk=320), "reference"),  # wider than flash's 256: nothing measured there
    # unmeasured GPUs (sm80 and older, or not known): 9ee7a82's order less what the H100 showed wrong
    (req(dtype=torch.bfloat16, cap=A100_SM80), "flash_attn"),
    (req(dtype=torch.bfloat16, cap=A100_SM80, available=TORCH_ONLY), "torch_cuda_flash"),
    (req(dtype=torch.bfloat16, cap=None, available=TORCH_ONLY), "torch_cuda_flash"),
    (req(dtype=torch.float32, cap=A100_SM80, mask="none", qk=320), "torch_cuda_efficient"),
    (req(dtype=torch.bfloat16, cap=V100_SM70, available={"torch_efficient"}, mask="none"), "torch_cuda_efficient"),
    (req(dtype=torch.bfloat16, cap=V100_SM70, available={"torch_efficient"}, mask="none", batch=2), "reference"),
    (req(dtype=torch.bfloat16, cap=V100_SM70, available={"torch_efficient"}), "reference"),
    (req(dtype=torch.float64), "reference"),
    (req(dtype=torch.bfloat16, available=()), "reference"),
    (req("mps", torch.float32, available=()), "reference"),
]


@pytest.mark.parametrize("request_, expected", CASES, ids=lambda x: getattr(x, "describe", lambda: x)())
def test_auto_choice_follows_the_rule_table(request_, expected):
    choice = choose_kernel(request_)
    assert choice.name == expected
    assert kernel_constraint(choice.name, request_) is None
    if request_.qk_head_dim != request_.v_head_dim and expected in ("torch_cuda_flash", "torch_cpu_flash"):
        assert "V padded from 128 to 192" in choice.reason


def test_auto_choice_over_every_combination():
    # Every dtype x head dims x backend subset x GPU x layer class on CUDA: auto picks a kernel
    # that takes the inputs, the first row of the GPU's table of measured kernels for the class
    # whose kernel is usable, never a (kernel, class) the table leaves out, and the reference
    # only where no row fits. Elsewhere (GQA ratios too) the device's own kernel.
    subsets = [frozenset(c) for n in range(len(ALL) + 1) for c in itertools.combinations(sorted(ALL), n)]
    dtypes = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
    dims = [(64, 64), (128, 128), (192, 128), (128, 192), (256, 256), (320, 320), (576, 512)]
    count = 0
    for dtype, (qk, v), available, cap, batch, mask, packed in itertools.product(
        dtypes, dims, subsets, (H100_SM90, A100_SM80, None), (1, 2), ("none", "causal", "window"), (False, True),
    ):
        r = req("cuda", dtype, qk, v, 1, available, cap=cap, batch=batch, mask=mask, packed=packed)
        choice = choose_kernel(r)
        assert next(x for x in RULES if x.name == choice.name).auto and kernel_constraint(choice.name, r) is None
        table, cls = measured.device_table(cap), selection._layer_class(r)
        fits = [x.kernel for x in table.rules if x.matches(*cls) and kernel_constraint(x.kernel, r) is None]
        assert choice.name == (fits[0] if fits else "reference")
        assert not any(x.kernel == choice.name and x.matches(*cls) for x in table.left_out)
        count += 1
    assert count == 4 * len(dims) * 2 ** len(ALL) * 3 * 2 * 3 * 2
    for device, dtype, (qk, v), gqa in itertools.product(("cpu", "xpu"), dtypes, dims, (1, 4)):
        r = req(device, dtype, qk, v, gqa)
        assert choose_kernel(r).name == ("torch_cpu_flash" if device == "cpu" else "reference")


@pytest.mark.parametrize(
    "name, request_, constraint",
    [
        ("torch_cuda_flash", req(dtype=torch.float32), "takes bfloat16/float16 inputs, not float32"),
        ("flash_attn", req(available=TORCH_ONLY), "needs flash-attn 2.x"),
        ("flash_attn_3", req(available=TORCH_ONLY), "needs flash-attn 3"),
        ("torch_cuda_cudnn", req(qk=192, v=128), "head dims up to 128, got q/k 192, v 128"),
        ("torch_cuda_flash", req(qk=320), "head dims up to 256"),
        ("torch_cpu_flash", req(), "runs on cpu tensors, these are on cuda"),
        ("torch_cuda_efficient", req("cpu", torch.float32), "runs on cuda tensors, these are on cpu"),
        ("torch_cuda_efficient", req(dtype=torch.float64), "not float64"),
    ],
)
def test_forced_kernel_that_cannot_take_the_inputs_names_the_flag(name, request_, constraint):
    with pytest.raises(ValueError) as err:
        choose_kernel(request_, name)
    message = str(err.value)
    assert "--startrail-kernel" in message and f"kernel={name!r}" in message and constraint in message


def test_forced_kernel_that_fits_and_unknown_names():
    assert choose_kernel(req(dtype=torch.float32), "reference").name == "reference"
    choice = choose_kernel(req(qk=192, v=128), "torch_cuda_flash")
    assert choice.name == "torch_cuda_flash" and "forced" in choice.reason and "V padded" in choice.reason
    with pytest.raises(ValueError, match="--startrail-kernel"):
        choose_kernel(req(), "triton")


def test_check_kernel_reads_the_tensors():
    # fp32 and MLA shapes on this (CPU) machine: the CPU kernel; on CUDA the rules above.
    q, k, v = torch.randn(4, 1, 8, 24), torch.randn(4, 1, 2, 24), torch.randn(4, 1, 2, 16)  # [s, b, h, d]
    r = KernelRequest.of(q, k, v)
    assert (r.device_type, r.dtype, r.qk_head_dim, r.v_head_dim, r.gqa_ratio, r.batch) == ("cpu", torch.float32, 24, 16,
                                                                                          4, 1)
    assert check_kernel("auto", q, k, v).name == "torch_cpu_flash"
    assert isinstance(kernel_for(q, k, v), TorchCPUFlashKernel)
    with pytest.raises(ValueError, match="--startrail-kernel torch_cuda_efficient"):
        check_kernel("torch_cuda_efficient", q, k, v)


def test_reference_fallback_warns_once_naming_what_is_missing():
    kernels._warn_once.cache_clear()
    q = torch.empty(4, 1, 2, 8, device="meta")  # a device no fused kernel runs on
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert isinstance(kernel_for(q, q, q), ReferenceKernel)
        kernels.kernel_for(q, q, q)
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(messages) == 1
    assert "reference block kernel" in messages[0] and "no fused kernel runs on meta" in messages[0]
    # On CUDA the reason names each missing or unfit kernel.
    reason = choose_kernel(req(dtype=torch.float64, available={"torch_efficient"})).reason
    assert "torch_cuda_efficient takes bfloat16/float16/float32 inputs, not float64" in reason
    assert "flash_attn needs flash-attn 2.x" in reason


# --- MLA head dims at the kernel level (q/k 24, v 16: 192/128 scaled down) ---------------

def one_sequence(sq, sk, causal):
    return KernelCall(((0, sq),), (((0, sk),),), (-1, 0) if causal else (-1, -1))


varlen = KernelCall.back_to_back  # a call of sequences (sq, sk), rows packed in order


@pytest.mark.parametrize("kernel", [ReferenceKernel(), TorchCPUFlashKernel()], ids=lambda k: k.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("causal", [True, False])
def test_mla_head_dims_forward_backward(kernel, dtype, kv_heads, causal):
    gen = torch.Generator().manual_seed(7)
    s, b, h, dqk, dv = 10, 2, 4, 24, 16
    q, k, v, dout = (
        torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
        for shape in [(s, b, h, dqk), (s, b, kv_heads, dqk), (s, b, kv_heads, dv), (s, b, h, dv)]
    )
    scale = dqk**-0.5
    ref = reference_with_grads(*(t.double() for t in (q, k, v, dout)), causal, scale)
    call = one_sequence(s, s, causal)
    out, lse = kernel.forward(q, k, v, call, scale=scale)
    assert out.shape == (s, b, h, dv) and lse.shape == (b, h, s)
    grads = kernel.backward(dout, q, k, v, out, lse, call, scale=scale)
    for got, want in zip((out, *grads), ref):
        assert got.shape == want.shape
        assert relative_error(got, want) <= TOLERANCE[dtype]


class _PaddedReference(EqualHeadDimsKernel, ReferenceKernel):
    """The reference kernel behind the padding wrapper, refusing unequal dims like fused ops."""

    name = "padded_reference"
    head_dim_multiple = 8

    def _attend(self, q, k, v, **kwargs):
        assert q.shape[-1] == k.shape[-1] == v.shape[-1] and q.shape[-1] % 8 == 0
        return super()._attend(q, k, v, **kwargs)

    def _attend_backward(self, dout, q, k, v, out, lse, **kwargs):
        assert len({t.shape[-1] for t in (dout, q, k, v, out)}) == 1
        return super()._attend_backward(dout, q, k, v, out, lse, **kwargs)


@pytest.mark.parametrize("dqk, dv", [(12, 7), (7, 12), (16, 16)])
def test_head_dim_padding_is_exact(dqk, dv):
    gen = torch.Generator().manual_seed(3)
    call = varlen([(9, 9), (4, 7)], (-1, 0))
    q, k = torch.randn(13, 2, 4, dqk, generator=gen, dtype=torch.float64), torch.randn(16, 2, 2, dqk, generator=gen, dtype=torch.float64)
    v, dout = torch.randn(16, 2, 2, dv, generator=gen, dtype=torch.float64), torch.randn(13, 2, 4, dv, generator=gen, dtype=torch.float64)
    ref, padded = ReferenceKernel(), _PaddedReference()
    out, lse = ref.forward(q, k, v, call, scale=0.3)
    pout, plse = padded.forward(q, k, v, call, scale=0.3)
    assert pout.shape == out.shape and torch.allclose(pout, out, rtol=0, atol=1e-13)
    assert torch.allclose(plse, lse, rtol=0, atol=1e-13)
    for got, want in zip(padded.backward(dout, q, k, v, out, lse, call, scale=0.3),
                         ref.backward(dout, q, k, v, out, lse, call, scale=0.3)):
        assert got.shape == want.shape and torch.allclose(got, want, rtol=0, atol=1e-12)


def test_padding_and_lse_row_helpers():
    x = torch.randn(2, 3, 5, 6)
    assert pad_head_dim(x, 6) is x and common_head_dim(192, 128) == 192 and common_head_dim(60, 12, 8) == 64
    padded = pad_head_dim(x, 8)
    assert padded.shape == (2, 3, 5, 8) and padded[..., 6:].abs().sum() == 0 and torch.equal(cut_head_dim(padded, 6), x)
    with pytest.raises(ValueError):
        pad_head_dim(x, 4)
    lse = torch.randn(2, 3, 50)
    rows = pad_lse_rows(lse)  # the memory-efficient op's layout: rows a multiple of 32
    assert rows.shape == (2, 3, 64) and rows.is_contiguous() and torch.equal(trim_lse(rows, 50), lse)
    assert torch.equal(trim_lse(lse.unsqueeze(-1), 50), lse)  # cuDNN's [b, h, sq, 1]


# --- the CUDA adapters' op plumbing, on the meta device (shapes only; no GPU here) ---------

@pytest.mark.parametrize("kernel", [TorchCUDAFlashKernel(), TorchCUDAEfficientKernel(), TorchCUDACudnnKernel()],
                         ids=lambda k: k.name)
@pytest.mark.parametrize("dqk, dv, kv_heads", [(64, 64, 4), (64, 64, 1), (192, 128, 2), (60, 60, 4)])
@pytest.mark.parametrize("window", [(-1, -1), (-1, 0), (16, 0)], ids=str)
def test_cuda_adapters_call_the_ops_with_their_schemas(kernel, dqk, dv, kv_heads, window):
    b, h = 2, 4
    call = varlen([(50, 70), (30, 30)], window)
    meta = lambda *shape: torch.empty(*shape, device="meta", dtype=torch.bfloat16)  # noqa: E731
    q, k, v = meta(80, b, h, dqk), meta(100, b, kv_heads, dqk), meta(100, b, kv_heads, dv)
    out, lse = kernel.forward(q, k, v, call, scale=0.1)
    assert out.shape == (80, b, h, dv) and lse.shape == (b, h, 80) and lse.dtype == torch.float32
    dq, dk, dv_ = kernel.backward(meta(80, b, h, dv), q, k, v, out, lse, call, scale=0.1)
    assert (dq.shape, dk.shape, dv_.shape) == (q.shape, k.shape, v.shape)


def _reference_varlen(q, k, v, cu_q, cu_k, window):
    """The reference kernel on flash-attn's folded ``[total, h, d]`` tensors (batch 1)."""
    cq, ck = cu_q.tolist(), cu_k.tolist()
    call = KernelCall(tuple(zip(cq, cq[1:])), tuple(((a, b),) for a, b in zip(ck, ck[1:])), window)
    return call, [x.unsqueeze(1) for x in (q, k, v)]


# flash-attn builds as their documented API gives them (tests/flash_attn_fakes.py): which one
# the probe keeps, and the adapters against each kept one.
FLASH_BUILDS = [("flash_attn", "2.6.3"), ("flash_attn", "2.8.3"), ("flash_attn_3", "2025-06-30"),
                ("flash_attn_3", "2025-08-29")]


def flash_kernel(monkeypatch, backend, build):
    """``make_kernel(backend)`` bound to the fake ``build`` installed in sys.modules."""
    installed = flash_attn_fakes.install(monkeypatch, **{"fa2" if backend == "flash_attn" else "fa3": build})
    kernel = kernels.make_kernel(backend)
    assert kernel._interface is installed[backend]
    return kernel


@pytest.mark.parametrize("backend, build", FLASH_BUILDS, ids=str)
@pytest.mark.parametrize("dqk, dv", [(24, 16), (16, 16)])
@pytest.mark.parametrize("window", [(-1, 0), (-1, -1), (3, 0), (0, -1), (2, 1)], ids=str)
def test_flash_attn_adapters_against_documented_builds(monkeypatch, backend, build, dqk, dv, window):
    # GQA, MLA padding, batch 2 folded into the rows, unequal sequences; float64 against the
    # independent call reference (flash_rule, autograd).
    kernel = flash_kernel(monkeypatch, backend, build)
    gen = torch.Generator().manual_seed(11)
    call = varlen([(10, 10), (4, 9), (7, 12)], window)
    b, h, kvh = 2, 4, 2
    q, k, v, dout = (torch.randn(shape, generator=gen, dtype=torch.float64)
                     for shape in [(21, b, h, dqk), (31, b, kvh, dqk), (31, b, kvh, dv), (21, b, h, dv)])
    want_out, want_lse, *want = float64_call(q, k, v, dout, call, 0.25)
    out, lse = kernel.forward(q, k, v, call, scale=0.25)
    grads = kernel.backward(dout, q, k, v, out, lse, call, scale=0.25)
    for got, ref_t in zip((out, lse, *grads), (want_out, want_lse, *want)):
        assert got.shape == ref_t.shape and relative_error(got, ref_t) <= 1e-12


def test_flash_attn_adapter_refuses_what_an_unchecked_build_returns(monkeypatch):
    # A defence behind the probe: an old lse layout or no lse stops the call, naming why.
    q = torch.randn(8, 1, 2, 16, dtype=torch.float64)
    call = one_sequence(8, 8, True)
    old = flash_kernel(monkeypatch, "flash_attn", "2.5.9")
    with pytest.raises(RuntimeError, match=re.escape("flash-attn >= 2.6 returns [heads, total_q]")):
        old.forward(q, q, q, call, scale=0.3)
    no_lse = flash_kernel(monkeypatch, "flash_attn_3", "2025-08-01")
    with pytest.raises(RuntimeError, match="returned no log-sum-exp"):
        no_lse.forward(q, q, q, call, scale=0.3)


# --- the build probe: each backend's version and features, checked once per process -----------

H100 = kernels.CudaDevice(capability=(9, 0), sdpa_flash=True, cudnn_version=0)  # sm90, torch's flash op, no cuDNN


@pytest.fixture
def fresh_probe(monkeypatch, caplog):
    """Empty probe caches; yields pytest's log capture. Tests probe :data:`H100`."""
    caches = (kernels._usable_cuda_backends, builds.build_problem, builds._log_once)
    for cache in caches:
        cache.cache_clear()
    caplog.set_level(logging.WARNING, logger=builds.__name__)
    yield caplog
    for cache in caches:
        cache.cache_clear()


def probe_lines(caplog):
    return [r.getMessage() for r in caplog.records if r.name == builds.__name__]


def test_flash_attn_2_older_than_2_6_is_skipped_once_naming_version_and_lse_layout(monkeypatch, fresh_probe):
    flash_attn_fakes.install(monkeypatch, fa2="2.5.9")
    usable = kernels._usable_cuda_backends(H100, 0)
    assert usable == {"torch_flash", "torch_efficient"}  # flash-attn dropped; FA3 not installed: not a candidate
    kernels._usable_cuda_backends.cache_clear()  # a second probe (another device, say) logs nothing new
    assert kernels._usable_cuda_backends(H100, 0) == usable
    [line] = probe_lines(fresh_probe)
    assert "flash-attn 2.5.9" in line and "lse layout" in line and ">= 2.6" in line
    assert choose_kernel(req(available=usable)).name == "torch_cuda_flash"


@pytest.mark.parametrize("version", [None, "unknown"])
def test_flash_attn_2_without_a_version_is_skipped(monkeypatch, fresh_probe, version):
    flash_attn_fakes.install(monkeypatch, fa2="2.8.3")
    sys.modules["flash_attn"].__version__ = version
    assert "flash_attn" not in kernels._usable_cuda_backends(H100, 0)
    [line] = probe_lines(fresh_probe)
    assert "flash-attn" in line and "a version to read" in line


def test_flash_attn_3_build_without_lse_is_skipped_and_auto_falls_back(monkeypatch, fresh_probe):
    # 2025-07-11 .. 08-28: no return_attn_probs parameter, and one trial call returns out only.
    flash_attn_fakes.install(monkeypatch, fa2="2.8.3", fa3="2025-08-01")
    usable = builds.usable_builds({"flash_attn_3", "flash_attn", "torch_flash", "torch_efficient"}, torch.device("cpu"))
    assert usable == {"flash_attn", "torch_flash", "torch_efficient"}
    [line] = probe_lines(fresh_probe)
    assert "flash_attn_3 3.0.0b1" in line and "lse returned" in line and "2025-08-29" in line
    assert choose_kernel(req(available=usable, cap=A100_SM80)).name == "flash_attn"  # the unmeasured GPUs' order
    with pytest.raises(ValueError, match="--startrail-kernel flash_attn_3 .*not usable"):
        choose_kernel(req(available=usable), "flash_attn_3")


@pytest.mark.parametrize("build, trial", [("2025-06-30", True), ("2025-08-29", False)])
def test_good_flash_attn_builds_are_used(monkeypatch, fresh_probe, build, trial):
    # Before 07-11 FA3 always returned (out, lse): a trial call shows it; from 08-29 the
    # signature does (return_attn_probs), and nothing runs.
    installed = flash_attn_fakes.install(monkeypatch, fa2="2.6.3", fa3=build)
    calls = []
    forward = installed["flash_attn_3"].flash_attn_varlen_func
    monkeypatch.setattr(installed["flash_attn_3"], "flash_attn_varlen_func",
                        functools.wraps(forward)(lambda *a, **kw: calls.append(1) or forward(*a, **kw)))
    usable = builds.usable_builds({"flash_attn_3", "flash_attn", "torch_efficient"}, torch.device("cpu"))
    assert usable == {"flash_attn_3", "flash_attn", "torch_efficient"} and not probe_lines(fresh_probe)
    assert len(calls) == trial
    builds.usable_builds({"flash_attn_3"}, torch.device("cpu"))
    assert len(calls) == trial  # checked once
    # Usable, but auto leaves it out on sm90 until a committed GPU table shows it PASS; forced, it runs.
    assert choose_kernel(req(available=usable), "flash_attn_3").name == "flash_attn_3"
    assert "flash_attn_3 is unmeasured on sm90" in choose_kernel(req(available=usable, qk=192, v=128)).reason
    assert kernels.make_kernel("flash_attn_3")._interface is installed["flash_attn_3"]


def test_every_gpu_backend_states_its_minimum_and_features():
    assert set(builds.NEEDS) == set(BACKENDS)
    assert builds.NEEDS["flash_attn"].minimum == (2, 6) and "lse layout" in builds.NEEDS["flash_attn"].features
    assert all(needs.minimum and needs.features for needs in builds.NEEDS.values())
    assert builds.version_tuple("2.6.3.post1") == (2, 6, 3) and builds.version_tuple("3.0.0.b1") == (3, 0, 0)
    assert builds.version_tuple("dev") is None
    # This CPU build of torch passes the torch checks (the flash op's lse layout read from its meta kernel).
    assert all(builds.build_problem(b, "cpu") is None for b in ("torch_flash", "torch_efficient", "torch_cudnn"))


@torch.library.custom_op("startrail_test::fake_flash_backward", mutates_args=("dq",), device_types="cpu")
def _custom_op_backward(dout: torch.Tensor, dq: torch.Tensor, softmax_scale: float, causal: bool,
                        window_size_left: int, rng_state: torch.Tensor | None = None) -> None:
    assert window_size_left == -1 and rng_state is None
    dq.copy_(dout * softmax_scale)


def test_call_by_name_through_a_torch_library_custom_op():
    # flash-attn >= 2.7 wraps _flash_attn_backward in torch.library.custom_op.
    dout, dq = torch.randn(5), torch.empty(5)
    call_by_name(_custom_op_backward, dout=dout, dq=dq, softmax_scale=0.5, causal=True, window_size_left=-1)
    assert torch.equal(dq, dout * 0.5)


def test_call_by_name_refuses_unknown_required_parameters():
    def backward(dout, mystery):
        return dout

    assert call_by_name(lambda dout, deterministic, dropout_p=0.5: (deterministic, dropout_p), dout=1) == (False, 0.0)
    with pytest.raises(TypeError, match="mystery"):
        call_by_name(backward, dout=1)


# --- the flag and its plumbing -------------------------------------------------------------

def test_startrail_kernel_flag():
    parser = add_startrail_args(argparse.ArgumentParser())
    assert parser.parse_args([]).startrail_kernel == "auto"
    assert parser.parse_args(["--startrail-kernel", "torch_cuda_efficient"]).startrail_kernel == "torch_cuda_efficient"
    with pytest.raises(SystemExit):
        parser.parse_args(["--startrail-kernel", "triton"])


def forced_kernel_worker(rank, world_size):
    """A bad kernel name fails in new_startrail_groups, before any group; a forced kernel that
    cannot take the inputs fails in startrail_attn before any communication (U = 2 would start
    with an all-to-all); a forced kernel that fits runs and is exact."""
    messages = []
    try:
        new_startrail_groups(team_size=1, kernel="triton")
    except ValueError as e:
        messages.append(str(e))
    groups = new_startrail_groups(team_size=1, ulysses_size=2, kernel="torch_cuda_flash")
    assert groups.kernel == "torch_cuda_flash"
    gen = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(4, 1, 4, 8, generator=gen) for _ in range(3))
    try:
        startrail_attn(q, k, v, groups)
    except ValueError as e:
        messages.append(str(e))
    nothing_sent = groups.last_forward_stats is None
    forced = new_startrail_groups(team_size=1, kernel="reference")
    out = startrail_attn(q, k, v, forced)
    auto = startrail_attn(q, k, v, new_startrail_groups(team_size=1))
    return messages, nothing_sent, relative_error(out, auto.double())


def test_forced_kernel_errors_on_every_rank_before_communication():
    for messages, nothing_sent, diff in run_ranks(forced_kernel_worker, 4, timeout=120):
        assert len(messages) == 2 and "--startrail-kernel" in messages[0]
        assert "--startrail-kernel torch_cuda_flash" in messages[1] and "runs on cuda tensors" in messages[1]
        assert nothing_sent and diff <= TOLERANCE[torch.float32]


class _EmulatedAtenOps:
    """The three CUDA attention ops emulated in float64 on the CPU, with their conventions:
    flash variable length with flash-attn's window, GQA and ``[total, h, d]`` / lse
    ``[h, total]``; efficient and cuDNN per sequence, no GQA (cuDNN: GQA without a bias), an additive bias for a mask,
    one head dim (cuDNN), lse padded to 32 rows with junk (efficient) or ``[b, h, sq, 1]``
    (cuDNN), and the backward asserting it gets them back that way."""

    ref = ReferenceKernel()

    def _dense(self, q, k, v, bias, causal, scale, equal_dims, gqa=False):
        assert q.shape[1] == k.shape[1] == v.shape[1] or (gqa and k.shape[1] == v.shape[1]
                                                          and q.shape[1] % k.shape[1] == 0), "no GQA here"
        assert q.shape[-1] % 8 == 0 and v.shape[-1] % 8 == 0
        assert not equal_dims or q.shape[-1] == k.shape[-1] == v.shape[-1]
        mask = None if bias is None else bias[0, 0] == 0
        return self.ref._attend(q, k, v, causal=causal, mask=mask, scale=scale)

    def _dense_bwd(self, dout, q, k, v, out, lse, bias, causal, scale):
        mask = None if bias is None else bias[0, 0] == 0
        return self.ref._attend_backward(dout, q, k, v, out, lse, causal=causal, mask=mask, scale=scale)

    @staticmethod
    def _window(is_causal, left, right):
        assert not (is_causal and (left is not None or right is not None))
        return (-1, 0) if is_causal else (left, right)

    def _flash_attention_forward(self, q, k, v, cq, ck, mq, mk, p, is_causal, debug, *, scale,
                                 window_size_left=None, window_size_right=None):
        assert p == 0.0 and q.shape[-1] == v.shape[-1] and q.shape[-1] % 8 == 0
        call, (q4, k4, v4) = _reference_varlen(q, k, v, cq, ck, self._window(is_causal, window_size_left,
                                                                              window_size_right))
        assert (mq, mk) == (call.max_seqlen_q, call.max_seqlen_k)
        out, lse = self.ref.forward(q4, k4, v4, call, scale=scale)
        return out.squeeze(1), lse.squeeze(0), None, None, None

    def _flash_attention_backward(self, dout, q, k, v, out, lse, cq, ck, mq, mk, p, is_causal, seed, offset, *,
                                  scale, window_size_left=None, window_size_right=None):
        assert lse.is_contiguous() and lse.shape == (q.shape[1], q.shape[0])
        call, (q4, k4, v4) = _reference_varlen(q, k, v, cq, ck, self._window(is_causal, window_size_left,
                                                                              window_size_right))
        g = self.ref.backward(dout.unsqueeze(1), q4, k4, v4, out.unsqueeze(1), lse.unsqueeze(0), call, scale=scale)
        return tuple(x.squeeze(1) for x in g)

    def _scaled_dot_product_efficient_attention(self, q, k, v, bias, compute_lse, p, is_causal, *, scale):
        assert compute_lse and p == 0.0
        out, lse = self._dense(q, k, v, bias, is_causal, scale, False)
        padded = torch.full((*lse.shape[:2], -(-lse.shape[2] // 32) * 32), float("nan"), dtype=lse.dtype)
        padded[..., : lse.shape[2]] = lse
        return out, padded, None, None

    def _scaled_dot_product_efficient_attention_backward(self, dout, q, k, v, bias, out, lse, seed, offset, p, mask,
                                                         is_causal, *, scale):
        assert lse.shape[-1] % 32 == 0 and lse.is_contiguous() and list(mask) == [True, True, True, False]
        return (*self._dense_bwd(dout, q, k, v, out, lse[..., : q.shape[2]], bias, is_causal, scale), None)

    @staticmethod
    def _like(x, layout):
        # the op allocates its results in the layout of the input they belong to (PyTorch's
        # alloc_with_matching_layout: out and dQ like q, dK like k, dV like v)
        return torch.empty_like(layout).copy_(x)

    def _scaled_dot_product_cudnn_attention(self, q, k, v, bias, compute_lse, p, is_causal, debug, *, scale):
        assert all(t.stride(-1) == 1 for t in (q, k, v))  # any strides, a dense head dim
        out, lse = self._dense(q, k, v, bias, is_causal, scale, True, gqa=bias is None)  # GQA: aten_doubles
        return self._like(out, q), lse.unsqueeze(-1), None, None, q.shape[2], k.shape[2], None, None, None

    def _scaled_dot_product_cudnn_attention_backward(self, dout, q, k, v, out, lse, seed, offset, bias, cq, ck, mq,
                                                     mk, p, is_causal, *, scale):
        assert lse.dim() == 4 and lse.shape[-1] == 1 and all(t.stride(-1) == 1 for t in (dout, q, k, v, out))
        assert all(x == y for n, x, y in zip(out.shape, out.stride(), dout.stride()) if n > 1), "dO laid out like out"
        grads = self._dense_bwd(dout, q, k, v, out, lse.squeeze(-1), bias, is_causal, scale)
        return tuple(self._like(g, t) for g, t in zip(grads, (q, k, v)))

    def _ragged(self, q, k, v, cq, ck, is_causal):
        """cuDNN's ragged op: ``[total, h, d]`` dense rows, no GQA, top-left causal (taken here only
        on square sequences, where it is flash-attn's bottom-right rule)."""
        assert q.shape[1] == k.shape[1] == v.shape[1], "cuDNN's ragged op takes no GQA"
        assert all(t.is_contiguous() for t in (q, k, v)) and q.shape[-1] == v.shape[-1]
        call, tensors = _reference_varlen(q, k, v, cq, ck, (-1, 0) if is_causal else (-1, -1))
        assert not is_causal or torch.equal(cq.diff(), ck.diff()), "top-left causal on a non-square sequence"
        return call, tensors

    def _cudnn_attention_forward(self, q, k, v, bias, cq, ck, mq, mk, compute_lse, p, is_causal, debug, *, scale):
        assert bias is None and compute_lse and p == 0.0
        call, (q4, k4, v4) = self._ragged(q, k, v, cq, ck, is_causal)
        assert (mq, mk) == (call.max_seqlen_q, call.max_seqlen_k)
        out, lse = self.ref.forward(q4, k4, v4, call, scale=scale)
        return out.squeeze(1), lse.squeeze(0).transpose(0, 1).unsqueeze(-1), cq, ck, mq, mk, None, None, None

    def _cudnn_attention_backward(self, dout, q, k, v, out, lse, seed, offset, bias, cq, ck, mq, mk, p, is_causal, *,
                                  scale):
        assert bias is None and lse.is_contiguous() and lse.shape == (q.shape[0], q.shape[1], 1)
        assert dout.is_contiguous() and out.is_contiguous()
        call, (q4, k4, v4) = self._ragged(q, k, v, cq, ck, is_causal)
        g = self.ref.backward(dout.unsqueeze(1), q4, k4, v4, out.unsqueeze(1), lse.squeeze(-1).transpose(0, 1)
                              .unsqueeze(0), call, scale=scale)
        return tuple(x.squeeze(1) for x in g)


@pytest.mark.parametrize("kernel", CUDA_ADAPTERS, ids=adapter_id)
@pytest.mark.parametrize("dqk, dv", [(24, 16), (20, 20), (12, 20)])
@pytest.mark.parametrize("window", [(-1, 0), (-1, -1), (5, 0), (0, -1)], ids=str)
def test_cuda_adapters_against_emulated_ops(monkeypatch, kernel, dqk, dv, window):
    # GQA, head-dim padding (MLA, and dims not a multiple of 8), the ops' lse layouts and
    # flash-attn's window rule over a variable-length call (sequences of unequal lengths,
    # batch 2), end to end in float64 against the reference; 40 rows is not a multiple of 32.
    from megatron_startrail.kernels import cudnn_varlen, torch_cuda

    monkeypatch.setattr(torch_cuda, "_aten", _EmulatedAtenOps())
    monkeypatch.setattr(cudnn_varlen, "_aten", _EmulatedAtenOps())
    gen = torch.Generator().manual_seed(13)
    call = varlen([(40, 40), (9, 16)], window)
    b, h, kvh = 2, 4, 2
    q, k, v, dout = (torch.randn(shape, generator=gen, dtype=torch.float64)
                     for shape in [(49, b, h, dqk), (56, b, kvh, dqk), (56, b, kvh, dv), (49, b, h, dv)])
    ref = ReferenceKernel()
    want_out, want_lse = ref.forward(q, k, v, call, scale=0.2)
    want = ref.backward(dout, q, k, v, want_out, want_lse, call, scale=0.2)
    out, lse = kernel.forward(q, k, v, call, scale=0.2)
    assert lse.shape == (b, h, 49) and torch.allclose(lse, want_lse, rtol=0, atol=1e-12)
    grads = kernel.backward(dout, q, k, v, out, lse, call, scale=0.2)
    for got, ref_t in zip((out, *grads), (want_out, *want)):
        assert got.shape == ref_t.shape and torch.allclose(got, ref_t, rtol=0, atol=1e-12)


def test_megatron_flag_is_checked_at_start_up(monkeypatch):
    # Through Megatron's own parser: a forced kernel that cannot take the model's attention
    # inputs fails in validate_startrail_args, before any process group exists.
    from tests.megatron.utils import cpu_patches  # noqa: F401, PLC0415 - import shims before megatron.training
    from megatron.training.arguments import parse_args  # noqa: PLC0415

    from megatron_startrail.megatron.arguments import validate_startrail_args  # noqa: PLC0415

    def parse(*extra):
        monkeypatch.setattr("sys.argv", [
            "pretrain_gpt.py", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "8",
            "--seq-length", "256", "--max-position-embeddings", "256", "--micro-batch-size", "1",
            "--global-batch-size", "1", "--train-iters", "1", "--lr", "1e-3", "--attention-dropout", "0",
            "--context-parallel-size", "2", "--context-parallel-algo", "startrail", "--startrail-team-size", "1",
            *extra])
        return parse_args(extra_args_provider=add_startrail_args)

    args = parse()
    assert args.startrail_kernel == "auto"
    validate_startrail_args(args)
    validate_startrail_args(parse("--startrail-kernel", "reference"))
    device = "cuda" if torch.cuda.is_available() else "cpu"
    other = "torch_cpu_flash" if device == "cuda" else "torch_cuda_efficient"
    with pytest.raises(ValueError, match=f"--startrail-kernel {other} .*runs on .* tensors, these are on {device}"):
        validate_startrail_args(parse("--startrail-kernel", other))


def test_deterministic_mode_reaches_the_kernels(monkeypatch):
    """--deterministic-mode: StarTrailConfig.deterministic, set by config_from_args, built into
    the kernel, and passed to flash-attn's forward and backward (PyTorch's own ops follow
    torch.use_deterministic_algorithms, which Megatron's flag sets)."""
    from tests.megatron.utils import cpu_patches  # noqa: F401, PLC0415 - import shims before megatron
    from megatron_startrail.megatron.from_args import config_from_args  # noqa: PLC0415

    args = types.SimpleNamespace(startrail_team_size=1, ulysses_degree_in_cp=1, startrail_backward_rotation="auto",
                                 startrail_transfer="ring", startrail_regather_in_backward=False,
                                 startrail_kernel="auto", deterministic_mode=True,
                                 startrail_recompute_attention=False, startrail_reverse_overlap=True)
    assert config_from_args(args).deterministic is True
    assert kernels.make_kernel("reference", deterministic=True).deterministic is True
    seen = []
    _, interface = flash_attn_fakes.flash_attn_2("2.8.3")
    forward, backward = interface.flash_attn_varlen_func, interface._flash_attn_varlen_backward

    def recording(name, fn):
        @functools.wraps(fn)  # the adapter binds arguments by fn's parameter names
        def wrapper(**kwargs):
            seen.append((name, kwargs["deterministic"]))
            return fn(**kwargs)
        return wrapper

    recording_forward, recording_backward = recording("forward", forward), recording("backward", backward)
    interface.flash_attn_varlen_func, interface._flash_attn_varlen_backward = recording_forward, recording_backward
    kernel = object.__new__(FlashAttnKernel)
    kernel._interface, kernel.deterministic = interface, True
    q, k, v = (torch.randn(6, 1, 2, 8, dtype=torch.float64) for _ in range(3))
    call = one_sequence(6, 6, True)
    out, lse = kernel.forward(q, k, v, call, scale=0.3)
    kernel.backward(torch.ones_like(out), q, k, v, out, lse, call, scale=0.3)
    assert seen == [("forward", True), ("backward", True)]


# --- the device's facts: probed once per index, or told ---------------------------------------

def test_a_cuda_device_is_probed_once_and_can_be_told_instead(monkeypatch, fresh_probe):
    asked = []

    def capability(index=None):
        asked.append(index)
        return (8, 0)

    monkeypatch.setattr(kernels, "_CUDA_DEVICES", {})
    monkeypatch.setattr(torch.cuda, "get_device_capability", capability)
    monkeypatch.setattr(torch.backends.cuda, "is_flash_attention_available", lambda: True)
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: False)
    a100 = kernels.cuda_device(1)
    assert a100 == kernels.CudaDevice((8, 0), True, 0) and kernels.cuda_device(1) is a100
    assert asked == [1]  # once per index and process
    # Told, device 0 is never asked about: the choice follows what it was told.
    kernels.assume_cuda_device(0, H100)
    assert kernels.usable_backends(torch.device("cuda", 0)) == {"torch_flash", "torch_efficient"}
    assert asked == [1]
    kernels.assume_cuda_device(0, H100)  # the same again: fine
    with pytest.raises(ValueError, match="already taken as .*before the first attention call"):
        kernels.assume_cuda_device(1, H100)  # device 1 was probed as an A100
    old_gpu = kernels.CudaDevice((7, 0), False, 0)
    kernels.assume_cuda_device(2, old_gpu)
    assert kernels.usable_backends(torch.device("cuda", 2)) == {"torch_efficient"}
