"""The block loop's predicted efficiency on an H100, before a GPU measures it (issue 55 item 5).

One rank of P at 128K tokens, batch 1, causal, bf16, forward + backward, on auto's sm90 path
(the cuDNN adapter for a dense bf16 layer of head dim 128). The prediction is the rank's time
as two parts that the committed figures give:

- the kernels: the rank's attention FLOPs (the planner's count, the backward 2.5x the forward)
  at SDPA's measured per-call rates on the H100 (``1 x 16 x 8192 x 128``: causal 1.952 ms =
  493 TFLOP/s, full 3.230 ms = 596 TFLOP/s;
  ``benchmarks/results/gpu/h100-2026-11-27/timing_rank_transport.md``): the rank's two
  diagonal chunk blocks causal, the rest full (the zigzag layout: chunks ``r`` and ``2P-1-r``);
- the bytes moved outside the kernels (``benchmarks/results/layer_traffic.json``: the schedule's
  and the adapter's, on the landed code) at the H100's HBM3 bandwidth, 3.35 TB/s: the data
  sheet's figure, not a measurement (the one assumed input; the GPU session measures the rest).

Efficiency = the fused call's share (the whole sequence's FLOPs at the fused SDPA's measured
559 TFLOP/s, over P) / the predicted rank time, as ``benchmarks/gpu/check.py`` measures it.
Launch overhead and Python are left out (the kernels are long enough to hide them at 128K);
what the prediction misses of the measurement is theirs and the bandwidth's.

    python -m benchmarks.gpu.block_loop_prediction   # writes benchmarks/results/block_loop_prediction.md and .json
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass
from pathlib import Path

from megatron_startrail.planning.gpu_rates import H100_FUSED_TFLOPS

ROOT = Path(__file__).resolve().parents[2]
TRAFFIC = ROOT / "benchmarks" / "results" / "layer_traffic.json"
OUT = ROOT / "benchmarks/results/block_loop_prediction.md"
TOKENS = 131072
HEAD_DIM = 128
CALL_GFLOP_CAUSAL = 962.0  # 1 x 16 x 8192 x 128 causal fwd+bwd, as gpu_rates counts it
# SDPA (cuDNN) per call on the H100, 1 x 16 x 8192 x 128 (benchmarks/results/gpu/h100-2026-11-27/timing_rank_transport.md)
SDPA_CALL_MS = {"causal": 1.952, "full": 3.230}
SDPA_CALL_TFLOPS = {"causal": CALL_GFLOP_CAUSAL / SDPA_CALL_MS["causal"],
                    "full": 2 * CALL_GFLOP_CAUSAL / SDPA_CALL_MS["full"]}
H100_HBM_TBPS = 3.35  # H100 SXM5 80GB data sheet: an assumption until a GPU session measures copies
# The cases on auto's sm90 path: (P, C, heads, kv heads) -> the layer_traffic case it reads.
CASES = [(8, 2, 16, 16), (16, 4, 16, 16), (8, 2, 32, 8), (16, 4, 32, 8)]
AUTO_SM90_KERNEL = "torch_cuda_cudnn"


def attention_tflop(tokens: int, heads: int, causal: bool = True) -> float:
    """fwd+bwd TFLOP of one ``tokens`` x ``tokens`` attention at ``heads`` x 128 (the backward 2.5x)."""
    forward = 2 * heads * tokens**2 * (HEAD_DIM + HEAD_DIM) / (2 if causal else 1)
    return 3.5 * forward / 1e12


@dataclass
class Prediction:
    world: int
    team: int
    heads: int
    kv_heads: int
    kernel: str
    case: str
    rank_tflop: float
    kernel_ms: float
    outside_bytes: float
    bytes_ms: float
    predicted_ms: float
    fused_share_ms: float
    predicted_efficiency: float


def traffic_row(rows: list[dict], world: int, team: int, heads: int, kv_heads: int, kernel: str) -> dict:
    found = [r for r in rows if (r["world"], r["team"], r["heads"], r["kv_heads"], r["kernel"])
             == (world, team, heads, kv_heads, kernel) and "dense" in r["case"]]
    if len(found) != 1:
        raise ValueError(f"layer_traffic.json has {len(found)} dense rows of P{world} C{team} {heads}/{kv_heads} "
                         f"{kernel}: regenerate it (python -m benchmarks.counters.layer_traffic)")
    return found[0]


def predict(world: int, team: int, heads: int, kv_heads: int, rows: list[dict],
            kernel: str = AUTO_SM90_KERNEL) -> Prediction:
    row = traffic_row(rows, world, team, heads, kv_heads, kernel)
    whole = attention_tflop(TOKENS, heads)
    chunk = TOKENS // (2 * world)
    causal = 2 * attention_tflop(chunk, heads)  # the rank's two diagonal chunk blocks
    rank = whole / world
    kernel_ms = causal / SDPA_CALL_TFLOPS["causal"] * 1e3 + (rank - causal) / SDPA_CALL_TFLOPS["full"] * 1e3
    outside = row["schedule_bytes"] + row["adapter_bytes"]
    bytes_ms = outside / (H100_HBM_TBPS * 1e12) * 1e3
    share = whole / H100_FUSED_TFLOPS * 1e3 / world
    predicted = kernel_ms + bytes_ms
    return Prediction(world, team, heads, kv_heads, kernel, row["case"], rank, kernel_ms, outside, bytes_ms,
                      predicted, share, share / predicted)


def predictions(rows: list[dict] | None = None) -> list[Prediction]:
    rows = json.loads(TRAFFIC.read_text()) if rows is None else rows
    return [predict(*case, rows) for case in CASES]


def table(preds: list[Prediction]) -> list[str]:
    out = ["| P | C | heads q/kv x 128 | kernel | rank TFLOP | kernels ms | bytes outside GB | bytes ms | "
           "predicted rank ms | fused share ms | predicted efficiency |", "|" + "---|" * 11]
    return out + [f"| {p.world} | {p.team} | {p.heads}/{p.kv_heads} | {p.kernel} | {p.rank_tflop:.2f} | "
                  f"{p.kernel_ms:.1f} | {p.outside_bytes / 1e9:.2f} | {p.bytes_ms:.1f} | {p.predicted_ms:.1f} | "
                  f"{p.fused_share_ms:.1f} | {p.predicted_efficiency:.2f} |" for p in preds]


def markdown(preds: list[Prediction]) -> str:
    lines = ["# The block loop's predicted efficiency on an H100 (auto's sm90 path)", "",
             "`python -m benchmarks.gpu.block_loop_prediction` (the model in its docstring). One rank at 128K, batch 1, "
             "causal, bf16, fwd+bwd. Kernels: the rank's FLOPs at SDPA's per-call rates measured on the H100 "
             f"(causal {SDPA_CALL_TFLOPS['causal']:.0f}, full {SDPA_CALL_TFLOPS['full']:.0f} TFLOP/s, "
             "`benchmarks/results/gpu/h100-2026-11-27/timing_rank_transport.md`); "
             "bytes: the schedule's and the adapter's from `layer_traffic.json` at the data sheet's "
             f"{H100_HBM_TBPS} TB/s (assumed); fused share: the whole sequence at the measured "
             f"{H100_FUSED_TFLOPS} TFLOP/s over P. The planner prices the block loop with the measured efficiency of "
             "9ee7a82 (0.83 at P8 C2, 0.60 at P16 C4, cuDNN, MHA; `planning/gpu_rates.py`); the GPU session "
             "(`scripts/gpu_session.sh`) prints these predictions beside what it measures.", ""]
    return "\n".join(lines + table(preds)) + "\n"


def lookup(preds: list[dict], world: int, team: int, heads: int, kv_heads: int) -> dict | None:
    return next((p for p in preds if (p["world"], p["team"], p["heads"], p["kv_heads"])
                 == (world, team, heads, kv_heads)), None)


def committed() -> list[dict]:
    """The committed predictions (the GPU session reads them; empty when none are committed)."""
    path = OUT.with_suffix(".json")
    return json.loads(path.read_text()) if path.exists() else []


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", type=Path, default=OUT, help="the markdown table's path; its .json beside it")
    p.add_argument("--no-write", action="store_true", help="print the table only")
    args = p.parse_args(argv)
    preds = predictions()
    if not args.no_write:
        args.out.write_text(markdown(preds))
        args.out.with_suffix(".json").write_text(json.dumps([asdict(p) for p in preds], indent=1) + "\n")
    print("\n".join(table(preds)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
