"""The CUDA adapters on fake CUDA tensors against the ops' contracts (child side:
``python -m tests.fake_cuda.kernel_matrix --json OUT``, started by :func:`tests.fake_cuda.run.run_fake_cuda`).

A handful of kernel calls per adapter (torch_cuda_flash, torch_cuda_efficient, torch_cuda_cudnn,
flash-attn 2.8.3's double) as the schedule hands them: batch 1 and 2, q/k/v as views of a fused
QKV projection, GQA, MLA head dims 192/128, and the masks (a window, a band's cut edge, a
non-square causal block), forward and backward, under :func:`~.rank.fake_cuda_rank`'s
:class:`~.aten_doubles.OpContracts` (which here also knows the ``cu_seqlens`` values, so
flash's rows are checked against its tensors). Each case records the contracts it passed or
the violation. Two more: the GPU kit's timing call of 9ee7a82 (permuted ``[1, 16, 8192, 128]``
tensors with a call of 8192 rows), refused by the adapter's host check, and the same call past
that check, refused by the flash op's contract.
"""

from __future__ import annotations

import argparse
import json

import torch

from megatron_startrail import kernels
from megatron_startrail.kernels.torch_cuda import _TorchFlashVarlen
from megatron_startrail.layout import KernelCall
from tests.fake_cuda import flash_attn_double
from tests.fake_cuda.aten_doubles import ContractViolation
from tests.fake_cuda.rank import fake_cuda_rank, leave

# (case, batch, heads, kv heads, d_qk, d_v, sequences (sq, sk), window)
CASES = [
    ("b1 causal", 1, 8, 8, 128, 128, [(256, 256)], (-1, 0)),
    ("b2 causal GQA", 2, 8, 2, 128, 128, [(256, 256)], (-1, 0)),
    ("b2 window", 2, 8, 8, 128, 128, [(256, 256)], (37, 0)),
    ("b2 band cut edge", 2, 8, 2, 128, 128, [(200, 261)], (0, -1)),
    ("b1 non-square causal MLA", 1, 8, 8, 192, 128, [(200, 312)], (-1, 0)),
    ("b2 documents MLA GQA", 2, 8, 2, 192, 128, [(120, 120), (80, 80)], (-1, 0)),
]
ADAPTERS = ("torch_cuda_flash", "torch_cuda_efficient", "torch_cuda_cudnn", "flash_attn")


def fused_views(rows, b, heads, kv_heads, dqk, dv):
    """q, k, v as views of one fused projection ``[rows, b, kv_heads, group * dqk + dqk + dv]`` (Megatron's)."""
    group = heads // kv_heads
    qkv = torch.randn(rows, b, kv_heads, group * dqk + dqk + dv, device="cuda", dtype=torch.bfloat16)
    q = qkv[..., : group * dqk].unflatten(-1, (group, dqk)).flatten(2, 3)
    return q, qkv[..., group * dqk: (group + 1) * dqk], qkv[..., (group + 1) * dqk:]


def run_case(kernel_name, b, heads, kv_heads, dqk, dv, lengths, window) -> str | None:
    """None when forward and backward met every contract, else the violation."""
    call = KernelCall.back_to_back(lengths, window)
    tq, tk = call.cu_seqlens_q[-1], call.cu_seqlens_k[-1]
    if tq == tk:
        q, k, v = fused_views(tq, b, heads, kv_heads, dqk, dv)
    else:
        q, (k, v) = fused_views(tq, b, heads, kv_heads, dqk, dv)[0], fused_views(tk, b, heads, kv_heads, dqk, dv)[1:]
    kernel = kernels.make_kernel(kernel_name)
    try:
        out, lse = kernel.forward(q, k, v, call, scale=0.1)
        dout = torch.randn(b, tq, heads, dv, device="cuda", dtype=torch.bfloat16).transpose(0, 1)
        kernel.backward(dout, q, k, v, out, lse, call, scale=0.1)
    except ContractViolation as e:
        return str(e)
    return None


def kit_timing_call() -> dict:
    """9ee7a82's kit: permuted [1, 16, 8192, 128] views handed with a call of 8192 rows."""
    x = torch.randn(8192, 1, 16, 128, device="cuda", dtype=torch.bfloat16).permute(1, 2, 0, 3)
    call = KernelCall.back_to_back([(8192, 8192)], (-1, 0))
    kernel = kernels.make_kernel("torch_cuda_flash")
    seen = {}
    try:
        kernel.forward(x, x, x, call, scale=0.1)
    except ValueError as e:
        seen["adapter"] = str(e)
    try:  # past the host check: what the op would have been handed
        _TorchFlashVarlen.forward(kernel, x, x, x, call, scale=0.1)
    except ContractViolation as e:
        seen["op"] = str(e)
    return seen


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True)
    args = parser.parse_args(argv)
    flash_attn_double.install()
    results = []
    with fake_cuda_rank(0, 1) as (_, rules):
        for name in ADAPTERS:
            for case, *shape in CASES:
                if name == "torch_cuda_cudnn" and shape[3] > 128:
                    continue  # cuDNN: head dims up to 128 (auto's rule)
                results.append({"kernel": name, "case": case, "violation": run_case(name, *shape)})
        kit = kit_timing_call()
        checked = dict(rules.contracts.checked)
    with open(args.json, "w") as f:
        json.dump({"cases": results, "kit": kit, "checked": checked, "flash_attn_calls": flash_attn_double.calls},
                  f, indent=1)
    leave()


if __name__ == "__main__":
    main()
