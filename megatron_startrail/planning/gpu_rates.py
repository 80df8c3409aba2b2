"""Measured GPU compute rates the planner prices a rank's attention with.

One H100 80GB HBM3 (sm90, torch 2.11.0+cu130, cuDNN 9.19), code at 9ee7a82, 2026-11-27; the
raw files are committed in ``benchmarks/results/gpu/h100-2026-11-27/`` (issue 50 quotes
them). All bf16, causal, batch 1, fwd+bwd; FLOPs counted as the planner counts them
(:meth:`~megatron_startrail.planning.planner.Workload.attention_flops`, the backward 2.5x
the forward), so a 1 x 16 x 8192 x 128 causal call is 962 GFLOP and the whole 128K
sequence at 16 x 128 is 246.3 TFLOP.

A rank's block loop is priced as the fused kernel's rate on a long call times the block
loop's *efficiency*: (the fused call's time / P) / the rank's time, measured with one rank
on torch's no-op process group (communication returns at once, so the rank's time is its
kernels, merges, copies and per-call Python). The efficiency is a function of the tokens
each rank holds: the H100 runs found it depends on P (the rank's share) and hardly on C
(GQA 32/8, FA2: P8 197-204 ms at C 1 and 2; P16 105-108 ms at C 1, 2 and 4).
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

H100_RUN = "benchmarks/results/gpu/h100-2026-11-27"

# Fused SDPA (default dispatch: cuDNN on sm90) fwd+bwd over the whole 128K sequence,
# MHA 16 x 128: 440.4 ms (its ``README.md``, "also measured") -> 246.3 TFLOP / 0.4404 s.
H100_FUSED_TFLOPS = 559.3

# Per call, 1 x 16 x 8192 x 128 causal, fwd+bwd, 962 GFLOP
# (benchmarks/results/gpu/h100-2026-11-27/timing_rank_transport.md, "Block kernel vs torch SDPA"): cuDNN adapter 2.584 ms, FA2 adapter 3.719 ms, SDPA
# 1.952-1.979 ms. The planner does not use these directly (a rank's calls are what the
# block-loop efficiency below measures); they are the per-call rates for the docs' table.
H100_CALL_TFLOPS = {"torch_cuda_cudnn": 372.3, "torch_cuda_flash": 258.7, "sdpa": 492.9}


@dataclass(frozen=True)
class BlockLoopEfficiency:
    """Measured (tokens per rank, efficiency) points, interpolated linearly in log2(tokens)
    between them and held at the end points outside (no measurement there: see the docs)."""

    kernel: str
    points: tuple[tuple[int, float], ...]
    source: str

    def at(self, tokens_per_rank: float) -> float:
        xs = [math.log2(t) for t, _ in self.points]
        ys = [e for _, e in self.points]
        x = math.log2(max(1.0, tokens_per_rank))
        if x <= xs[0]:
            return ys[0]
        if x >= xs[-1]:
            return ys[-1]
        i = bisect.bisect_right(xs, x)
        f = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
        return ys[i - 1] + f * (ys[i] - ys[i - 1])


# One rank at 128K, MHA 16 x 128, kernel forced (its ``README.md``, "also measured"): the fused
# share is 440.4 / P ms.
H100_BLOCK_LOOP = {
    # cuDNN: P16 C4 45.7 ms (27.5 / 45.7), P8 C2 66.6 ms (55.05 / 66.6).
    "torch_cuda_cudnn": BlockLoopEfficiency("torch_cuda_cudnn", ((8192, 0.602), (16384, 0.827)),
                                            f"{H100_RUN}/README.md: cudnn P16 C4 45.7 ms, P8 C2 66.6 ms"),
    # FA2 (auto's pick at 9ee7a82): P16 C4 58.7 ms, P8 C2 101.9 ms.
    "torch_cuda_flash": BlockLoopEfficiency("torch_cuda_flash", ((8192, 0.469), (16384, 0.540)),
                                            f"{H100_RUN}/README.md: flash P16 C4 58.7 ms, P8 C2 101.9 ms"),
}

# FA2 against FA2's own fused call (``one_rank_gqa.jsonl``, GQA 32/8 x 128, rank 1 of P, rotation
# kv): the fused call (FLASH forced, K/V expanded) 1544.6 ms; P16 C4 106.0 ms (96.54 / 106.0),
# P8 C2 199.3 ms (193.08 / 199.3). The loop costs FA2 little: its loss is the kernel's.
H100_FA2_BLOCK_LOOP_VS_FA2 = BlockLoopEfficiency(
    "torch_cuda_flash", ((8192, 0.911), (16384, 0.969)),
    f"{H100_RUN}/one_rank_gqa.jsonl: B-fused 1544.6 ms, P16 C4 kv 106.0 ms, P8 C2 kv 199.3 ms")
