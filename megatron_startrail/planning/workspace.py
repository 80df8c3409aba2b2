"""What a block kernel allocates for itself inside one call (its workspace): buffers it frees
before it returns, beside the outputs it hands back. Read from the kernels' sources (below) and
checked against one H100's peaks (tests/test_memory_model.py, issue 50's table): the backward's
fp32 dQ accumulator and row sums, and FlashAttention-2's GQA gradients at the query heads, are
what the H100 held above the modelled buffers (388 MiB a call at P8, 128K tokens, GQA 32/8).

One call takes ``rows_q`` query rows against ``rows_k`` key rows in ``sequences`` runs (the
batch folded into the rows, one run per sequence), ``heads`` query and ``kv_heads`` K/V heads
of one head dim ``dim`` (the kernels that need one head dim pad V to it), inputs of
``dtype_bytes``. Bytes per call, by kernel::

    kernel                 forward                      backward
    torch_cuda_flash,      0                            dQ accumulator fp32 (rows_q + 128 seqs) x h x round(d, 32)
    flash_attn (FA2,                                    (64 above d = 128) + softmax_d fp32 h x (rows_q + 128 seqs)
    mha_varlen_bwd)                                     + [GQA] dK, dV at h heads: 2 rows_k x h x d (input dtype),
                                                        summed into the hkv-head outputs after the kernel
    flash_attn_3           0                            dQ accumulator fp32 and two fp32 row vectors (dsoftmax sum,
                                                        lse in log2) over round(rows_q + 128 seqs, 128) rows
                                                        + [GQA] dK, dV accumulators fp32 at hkv heads
    torch_cuda_cudnn       0                            dQ accumulator fp32 h x rows_q x d + softmax sum fp32
                                                        h x rows_q (cuDNN >= 9: no dP workspace)
    torch_cuda_efficient   [d > 128] out accumulator    grad-Q accumulator fp32 over 64-row, 64-column tiles
                           fp32 rows_q x h x d          + delta fp32 h x rows_q (torch's)
    torch_cpu_flash,       not modelled (the CPU heap harness, benchmarks/counters/peak_memory.py, bounds them)
    reference

The per-sequence adapters (cuDNN, efficient) run a call's runs one at a time, so the largest
run's workspace is live, not the sum: the model's calls are one run each, where they agree.
"""

from __future__ import annotations

from dataclasses import dataclass


def _round(x: int, m: int) -> int:
    return -(-x // m) * m


@dataclass(frozen=True)
class KernelCallShape:
    """One kernel call's sizes (module docstring); ``dim``: the head dim the kernel runs at."""

    rows_q: int
    rows_k: int
    heads: int
    kv_heads: int
    dim: int
    dtype_bytes: int
    sequences: int = 1


def _fa2_backward(s: KernelCallShape) -> int:
    rows = s.rows_q + 128 * s.sequences  # each run's dQ rows start 128 apart (flash_api.cpp, mha_varlen_bwd)
    dq_accum = rows * s.heads * _round(s.dim, 32 if s.dim <= 128 else 64) * 4
    softmax_d = s.heads * rows * 4
    expanded = 2 * s.rows_k * s.heads * s.dim * s.dtype_bytes if s.kv_heads != s.heads else 0
    return dq_accum + softmax_d + expanded


def _fa3_backward(s: KernelCallShape) -> int:
    rows = _round(s.rows_q + 128 * s.sequences, 128)
    dim = _round(s.dim, 32 if s.dim <= 128 else 64)
    accum_kv = 2 * s.kv_heads * _round(s.rows_k + 128 * s.sequences, 128) * dim * 4 if s.kv_heads != s.heads else 0
    return s.heads * rows * (dim + 2) * 4 + accum_kv


def _cudnn_backward(s: KernelCallShape) -> int:
    return s.heads * s.rows_q * (s.dim + 1) * 4


def _efficient_backward(s: KernelCallShape) -> int:
    return s.heads * _round(s.rows_q, 64) * _round(s.dim, 64) * 4 + s.heads * s.rows_q * 4


def _efficient_forward(s: KernelCallShape) -> int:
    # The output stays in registers up to one 128-key block of head dim, else an fp32 copy.
    return s.rows_q * s.heads * s.dim * 4 if s.dim > 128 and s.dtype_bytes < 4 else 0


_BACKWARD = {"torch_cuda_flash": _fa2_backward, "flash_attn": _fa2_backward, "flash_attn_3": _fa3_backward,
             "torch_cuda_cudnn": _cudnn_backward, "torch_cuda_efficient": _efficient_backward}
_FORWARD = {"torch_cuda_efficient": _efficient_forward}
MODELLED = frozenset(_BACKWARD)


def backward_workspace_bytes(kernel: str, call: KernelCallShape) -> int:
    """Bytes ``kernel``'s backward allocates for itself in one call (0: not modelled)."""
    return _BACKWARD[kernel](call) if kernel in _BACKWARD else 0


def forward_workspace_bytes(kernel: str, call: KernelCallShape) -> int:
    """Bytes ``kernel``'s forward allocates for itself in one call (0: none, or not modelled)."""
    return _FORWARD[kernel](call) if kernel in _FORWARD else 0
