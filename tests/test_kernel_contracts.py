"""The CUDA adapters against the torch ops' contracts (tests/fake_cuda/aten_doubles.py) on the meta
device, and every adapter's host check of its call (kernels/call_check.py). Issue 49: on an
H100 the memory-efficient adapter gave dQ, dK 0.2-2 relative off at batch 2 in half precision
(out's row stride), raised on every mask (the bias's row stride), and a flash call of 8192
rows handed a 16-row tensor crashed the CUDA context."""

import re

import pytest
import torch

from megatron_startrail import kernels
from megatron_startrail.kernels.cudnn_varlen import TorchCUDACudnnVarlenKernel, ragged_fits
from megatron_startrail.kernels.torch_cuda import TorchCUDACudnnKernel, TorchCUDAEfficientKernel, TorchCUDAFlashKernel
from megatron_startrail.layout import KernelCall
from tests import flash_attn_fakes
from tests.fake_cuda.aten_doubles import ContractViolation, OpContracts

aten = torch.ops.aten


def ragged_on() -> TorchCUDACudnnVarlenKernel:
    """The cuDNN varlen adapter with cuDNN's ragged op on (off by default: the H200 gave wrong
    dQ, dK; kernels/cudnn_varlen.py), so its math around the op stays checked."""
    kernel = TorchCUDACudnnVarlenKernel()
    kernel.ragged_op = True
    return kernel


CUDA_ADAPTERS = [TorchCUDAFlashKernel(), TorchCUDAEfficientKernel(), TorchCUDACudnnKernel(),
                 TorchCUDACudnnVarlenKernel(), ragged_on()]


def adapter_id(kernel) -> str:
    return kernel.name + ("+ragged" if getattr(kernel, "ragged_op", False) else "")

# (name, sequences (sq, sk), window): the masks the schedule makes
CALLS = [
    ("full", [(96, 96)], (-1, -1)),
    ("causal square", [(96, 96)], (-1, 0)),
    ("equal sequences, causal", [(40, 40)] * 3, (-1, 0)),
    ("non-square causal", [(40, 100)], (-1, 0)),
    ("window", [(96, 96)], (37, 0)),
    ("band cut edge", [(40, 61)], (0, -1)),
    ("packed documents", [(50, 70), (30, 30)], (-1, 0)),
]


def fused_qkv(rows, b, heads, kv_heads, dqk, dv, dtype, device="meta"):
    """q, k, v as Megatron passes them: views of one fused projection ``[rows, b, kv_heads, group * dqk +
    dqk + dv]`` (strided rows and heads)."""
    group = heads // kv_heads
    qkv = torch.empty(rows, b, kv_heads, group * dqk + dqk + dv, dtype=dtype, device=device)
    q = qkv[..., : group * dqk].unflatten(-1, (group, dqk)).flatten(2, 3)
    return q, qkv[..., group * dqk: (group + 1) * dqk], qkv[..., (group + 1) * dqk:]


def run(kernel, call, b, heads, kv_heads, dqk, dv, dtype, strided):
    tq, tk = call.cu_seqlens_q[-1], call.cu_seqlens_k[-1]
    meta = lambda *shape: torch.empty(*shape, dtype=dtype, device="meta")  # noqa: E731
    if strided and tq == tk:
        q, k, v = fused_qkv(tq, b, heads, kv_heads, dqk, dv, dtype)
    else:
        q, k, v = meta(tq, b, heads, dqk), meta(tk, b, kv_heads, dqk), meta(tk, b, kv_heads, dv)
    dout = meta(b, tq, heads, dv).transpose(0, 1)  # a non-contiguous gradient, as autograd hands one
    with OpContracts() as contracts:
        out, lse = kernel.forward(q, k, v, call, scale=0.1)
        grads = kernel.backward(dout, q, k, v, out, lse, call, scale=0.1)
    assert out.shape == (tq, b, heads, dv) and lse.shape == (b, heads, tq)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    return contracts.checked


@pytest.mark.parametrize("kernel", CUDA_ADAPTERS, ids=adapter_id)
@pytest.mark.parametrize("name, lengths, window", CALLS, ids=[c[0] for c in CALLS])
@pytest.mark.parametrize("b, heads, kv_heads, dqk, dv, strided", [
    (1, 4, 4, 64, 64, True), (2, 4, 2, 64, 64, True), (2, 4, 1, 192, 128, False), (2, 4, 4, 60, 60, False)],
    ids=["b1 fused", "b2 fused GQA", "b2 MLA MQA", "b2 dims 60"])
def test_cuda_adapters_meet_the_op_contracts(kernel, name, lengths, window, b, heads, kv_heads, dqk, dv, strided):
    call = KernelCall.back_to_back(lengths, window)
    dtypes = [torch.bfloat16] + ([torch.float32] if kernel.name == "torch_cuda_efficient" else [])
    if kernel.name.startswith("torch_cuda_cudnn") and dqk > 128:
        pytest.skip("cuDNN: head dims up to 128 (auto's rule)")
    for dtype in dtypes:
        checked = run(kernel, call, b, heads, kv_heads, dqk, dv, dtype, strided)
        assert len(checked) == 2 and min(checked.values()) >= 1, checked
        if kernel.name == "torch_cuda_cudnn_varlen":  # the ragged op where cuDNN's rule is flash-attn's, one launch
            ragged = {"aten._cudnn_attention_forward.default": 1, "aten._cudnn_attention_backward.default": 1}
            assert (checked == ragged) == (kernel.ragged_op and ragged_fits(call)), (name, checked)


class CudnnCalls(OpContracts):
    """The contract doubles, recording the q / dO (``operands[0]``) and k (``operands[1]``) that reach
    cuDNN's fused forward (q, k, v, ...) and backward (dO, q, k, v, ...) ops, in call order."""

    OPS = {aten._scaled_dot_product_cudnn_attention.default: 1,  # the k argument's index
           aten._scaled_dot_product_cudnn_attention_backward.default: 2}

    def __init__(self):
        super().__init__()
        self.first, self.k = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func in self.OPS:
            self.first.append(tuple(args[0].shape))
            self.k.append(tuple(args[self.OPS[func]].shape))
        return super().__torch_dispatch__(func, types, args, kwargs)


def test_cudnn_folds_a_dense_call_into_one_launch():
    # Three equal causal sequences at batch 2: one forward and one backward launch, batch 3 x 2.
    meta = lambda *shape: torch.empty(*shape, dtype=torch.bfloat16, device="meta")  # noqa: E731
    q, k, v = meta(120, 2, 4, 64), meta(120, 2, 4, 64), meta(120, 2, 4, 64)
    call = KernelCall.back_to_back([(40, 40)] * 3, (-1, 0))
    kernel = TorchCUDACudnnKernel()
    with CudnnCalls() as calls:
        out, lse = kernel.forward(q, k, v, call, scale=0.1)
        kernel.backward(meta(120, 2, 4, 64), q, k, v, out, lse, call, scale=0.1)
    assert calls.first == [(6, 4, 40, 64), (6, 4, 40, 64)]


@pytest.mark.parametrize("window, kv_heads_in", [((-1, 0), 2), ((8, 0), 8)], ids=["causal", "window (bias)"])
def test_cudnn_takes_gqa_kv_heads_as_they_are_unless_a_bias_goes_in(window, kv_heads_in):
    # GQA 8/2 on Megatron's fused-QKV views: K/V reach cuDNN's forward and backward at 2 heads
    # (no copies, no dK/dV group sums) where no bias goes in; a window goes in as a bias, and
    # there K/V are expanded to 8 heads (GQA with a bias: unmeasured on a GPU).
    q, k, v = fused_qkv(64, 2, 8, 2, 64, 64, torch.bfloat16)
    dout = torch.empty(2, 64, 8, 64, dtype=torch.bfloat16, device="meta").transpose(0, 1)
    call = KernelCall.back_to_back([(64, 64)], window)
    kernel = TorchCUDACudnnKernel()
    with CudnnCalls() as calls:
        out, lse = kernel.forward(q, k, v, call, scale=0.1)
        grads = kernel.backward(dout, q, k, v, out, lse, call, scale=0.1)
    assert [shape[1] for shape in calls.k] == [kv_heads_in, kv_heads_in]
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]


def test_cudnn_double_refuses_gqa_heads_with_a_bias():
    meta = lambda *shape: torch.empty(*shape, dtype=torch.bfloat16, device="meta")  # noqa: E731
    q, k, v, bias = meta(1, 8, 16, 64), meta(1, 2, 16, 64), meta(1, 2, 16, 64), meta(1, 1, 16, 16)
    with pytest.raises(ContractViolation, match="K/V heads dividing q's only without attn_bias"), OpContracts():
        aten._scaled_dot_product_cudnn_attention(q, k, v, bias, True, 0.0, False, False, scale=0.1)
    with OpContracts():  # the same heads without the bias: the op's contract as the H100 probe ran it
        aten._scaled_dot_product_cudnn_attention(q, k, v, None, True, 0.0, False, False, scale=0.1)


# --- the doubles reject what 9ee7a82's efficient adapter handed the op ---------------------------

def _bhsd_of_sequence_major(rows, b, h, d, dtype=torch.bfloat16):
    # [rows, b, h, d] storage viewed [b, h, rows, d]: rows b*h*d apart (9ee7a82's PerSequenceKernel views)
    return torch.empty(rows, b, h, d, dtype=dtype, device="meta").permute(1, 2, 0, 3)


def test_efficient_double_rejects_sequence_major_out_at_batch_2_half():
    b, h, s, d = 2, 4, 100, 64
    q = k = v = _bhsd_of_sequence_major(s, b, h, d)
    out = dout = _bhsd_of_sequence_major(s, b, h, d)
    lse = torch.empty(b, h, 128, device="meta")
    seed = torch.empty((), dtype=torch.int64, device="meta")
    with OpContracts(), pytest.raises(ContractViolation, match=re.escape("reads out's rows 256 (heads x head dim) "
                                                                         "apart, whatever its row stride (here 512)")):
        aten._scaled_dot_product_efficient_attention_backward(dout, q, k, v, None, out, lse, seed, seed, 0.0,
                                                              [True, True, True, False], False, scale=0.1)
    # fp32 computes rowsum(dO * O) on the host, respecting strides: accepted (H100: 2e-6 at batch 2).
    q32, out32 = (_bhsd_of_sequence_major(s, b, h, d, torch.float32) for _ in range(2))
    with OpContracts():
        aten._scaled_dot_product_efficient_attention_backward(out32, q32, q32, q32, None, out32, lse, seed, seed,
                                                              0.0, [True, True, True, False], False, scale=0.1)


def test_efficient_double_rejects_an_expanded_unpadded_mask_bias():
    b, h, sq, sk, d = 2, 4, 1000, 1005, 64
    q = torch.empty(b, sq, h, d, dtype=torch.bfloat16, device="meta").transpose(1, 2)
    k = v = torch.empty(b, sk, h, d, dtype=torch.bfloat16, device="meta").transpose(1, 2)
    bias = torch.empty(sq, sk, dtype=torch.bfloat16, device="meta").expand(b, h, sq, sk)
    with OpContracts(), pytest.raises(ContractViolation, match=re.escape(
            "attn_bias is not correctly aligned (strideM). attn_bias.stride(2) = 1005, and should be a multiple of 8")):
        aten._scaled_dot_product_efficient_attention(q, k, v, bias, True, 0.0, False, scale=0.1)
    padded = torch.empty(sq, 1008, dtype=torch.bfloat16, device="meta").expand(b, h, sq, 1008)[..., :sk]
    with OpContracts():
        aten._scaled_dot_product_efficient_attention(q, k, v, padded, True, 0.0, False, scale=0.1)


# --- every adapter refuses a call its tensors do not hold, before launching ----------------------

def every_adapter(monkeypatch):
    """(kernel, device) for every adapter: the CUDA ones on meta tensors (nothing launches)."""
    flash_attn_fakes.install(monkeypatch, fa2="2.8.3", fa3="2025-08-29")
    return [(kernels.make_kernel("reference"), "cpu"), (kernels.make_kernel("torch_cpu_flash"), "cpu"),
            *((kernels.make_kernel(n), "meta") for n in ("torch_cuda_flash", "torch_cuda_efficient",
                                                          "torch_cuda_cudnn", "flash_attn", "flash_attn_3"))]


def test_a_call_larger_than_its_tensors_raises_in_every_adapter(monkeypatch):
    call = KernelCall.back_to_back([(8192, 8192)], (-1, 0))
    for kernel, device in every_adapter(monkeypatch):
        small = torch.randn(16, 1, 2, 64, dtype=torch.bfloat16).to(device)
        big = torch.randn(8192, 1, 2, 64, dtype=torch.bfloat16).to(device)
        with pytest.raises(ValueError, match=re.escape(f"{kernel.name}: call has 8192 query rows but q holds 16 "
                                                       "rows ([16, 1, 2, 64])")):
            kernel.forward(small, big, big, call, scale=0.1)
        with pytest.raises(ValueError, match="call has 8192 key rows but k holds 16 rows"):
            kernel.forward(big, small, big, call, scale=0.1)
        lse = torch.zeros(1, 2, 8192).to(device)
        with pytest.raises(ValueError, match="call has 8192 query rows but dout holds 16 rows"):
            kernel.backward(small, big, big, big, big, lse, call, scale=0.1)
        with pytest.raises(ValueError, match=re.escape("lse is [1, 2, 16], not [1, 2, 8192]")):
            kernel.backward(big, big, big, big, big, lse[..., :16], call, scale=0.1)


def test_a_call_that_does_not_rise_or_mismatches_heads_is_refused(monkeypatch):
    falling = KernelCall(((0, 10), (10, 5)), (((0, 10),), ((10, 20),)), (-1, -1))
    x = torch.randn(10, 1, 2, 16)
    for kernel, device in every_adapter(monkeypatch):
        t = x.to(device)
        with pytest.raises(ValueError, match=r"cu_seqlens_q \(0, 10, 5\) does not rise from 0"):
            kernel.forward(t, t, t, falling, scale=0.1)
        call = KernelCall.back_to_back([(10, 10)])
        with pytest.raises(ValueError, match="need one head count that divides q's 2"):
            kernel.forward(t, torch.randn(10, 1, 3, 16).to(device), torch.randn(10, 1, 3, 16).to(device), call,
                           scale=0.1)


# --- folding equal sequences into the batch is exact (the math, on the CPU) ----------------------

@pytest.mark.parametrize("window", [(-1, 0), (-1, -1), (5, 0), (0, -1)], ids=str)
@pytest.mark.parametrize("lengths", [[(12, 12)] * 3, [(9, 16)] * 2, [(10, 10)]], ids=["3 square", "2 non-square", "1"])
def test_folded_sequences_are_exact(monkeypatch, lengths, window):
    # The CPU kernels and the CUDA adapters on float64 emulations of their ops, batch 2, GQA, MLA
    # dims: a dense call in one launch gives the float64 reference call's
    # out, lse and gradients (sequence by sequence, autograd, nothing of the kernels).
    from megatron_startrail.kernels import cudnn_varlen, torch_cuda
    from tests.test_kernel_selection import _EmulatedAtenOps
    from tests.test_kernels_and_merge import float64_call

    monkeypatch.setattr(torch_cuda, "_aten", _EmulatedAtenOps())
    monkeypatch.setattr(cudnn_varlen, "_aten", _EmulatedAtenOps())
    gen = torch.Generator().manual_seed(7)
    call = KernelCall.back_to_back(lengths, window)
    tq, tk, b, h, kvh = call.cu_seqlens_q[-1], call.cu_seqlens_k[-1], 2, 4, 2
    q, k, v, dout = (torch.randn(shape, generator=gen, dtype=torch.float64)
                     for shape in [(tq, b, h, 24), (tk, b, kvh, 24), (tk, b, kvh, 16), (tq, b, h, 16)])
    want = float64_call(q, k, v, dout, call, 0.3)
    for kernel in [kernels.make_kernel("reference"), kernels.make_kernel("torch_cpu_flash"), *CUDA_ADAPTERS]:
        out, lse = kernel.forward(q, k, v, call, scale=0.3)
        grads = kernel.backward(dout, q, k, v, out, lse, call, scale=0.3)
        for got, ref in zip((out, lse, *grads), want):
            assert got.shape == ref.shape and torch.allclose(got, ref, rtol=0, atol=1e-12), kernel.name


def test_ragged_cudnn_double_refuses_what_pytorchs_source_rules_out():
    """cuDNN's ragged op (the double, from PyTorch's sources): K/V at their own head count (no GQA on
    this path), strided rows, or an lse not laid out as the forward returned it are refused."""
    meta = lambda *shape, dtype=torch.bfloat16: torch.empty(*shape, dtype=dtype, device="meta")  # noqa: E731
    cu = torch.zeros(3, dtype=torch.int32, device="meta")
    q, k = meta(96, 4, 64), meta(96, 2, 64)
    with OpContracts(), pytest.raises(ContractViolation, match="one head count"):
        aten._cudnn_attention_forward(q, k, k, None, cu, cu, 64, 64, True, 0.0, True, False, scale=0.1)
    strided = meta(96, 8, 64)[:, ::2]
    with OpContracts(), pytest.raises(ContractViolation, match="dense rows"):
        aten._cudnn_attention_forward(strided, q, q, None, cu, cu, 64, 64, True, 0.0, True, False, scale=0.1)
    with OpContracts():
        out, lse = aten._cudnn_attention_forward(q, q, q, None, cu, cu, 64, 64, True, 0.0, True, False, scale=0.1)[:2]
    assert out.shape == (96, 4, 64) and lse.shape == (96, 4, 1) and lse.dtype == torch.float32
    with OpContracts(), pytest.raises(ContractViolation, match=r"logsumexp \[4, 96\]"):
        aten._cudnn_attention_backward(q, q, q, q, out, lse.squeeze(-1).t().contiguous(), cu, cu, None, cu, cu, 64, 64,
                                       0.0, True, scale=0.1)
