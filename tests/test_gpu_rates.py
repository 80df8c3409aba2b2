"""The planner's GPU rates (megatron_startrail/planning/gpu_rates.py) are the committed H100
run's figures: recomputed here from the raw files in benchmarks/results/gpu/h100-2026-11-27/."""

import json
import os
import re

import pytest

from megatron_startrail.planning.cluster import DEFAULT_CLUSTER, preset
from megatron_startrail.planning.gpu_rates import (H100_BLOCK_LOOP, H100_CALL_TFLOPS, H100_FA2_BLOCK_LOOP_VS_FA2,
                                                   H100_FUSED_TFLOPS)
from megatron_startrail.planning.planner import Workload

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RUN = os.path.join(ROOT, "benchmarks", "results", "gpu", "h100-2026-11-27")


def _read(name):
    with open(os.path.join(RUN, name), encoding="utf-8") as f:
        return f.read()


def _flops(tokens, heads=16):  # fwd + 2.5x bwd, causal, head dims 128 / 128, as the planner counts
    return 3.5 * Workload(tokens, heads=heads, kv_heads=heads, head_dim=128).attention_flops(1)


def test_rates_are_the_committed_measurements():
    readme = _read("README.md")
    ms = {}  # "cudnn P8 C2 66.6 ms, P16 C4 45.7 ms; flash P8 C2 ..."
    for tag, p8, p16 in re.findall(r"(cudnn|flash) P8 C2 ([\d.]+) ms,\s+P16 C4 ([\d.]+) ms", readme):
        ms[f"{tag} P8 C2"], ms[f"{tag} P16 C4"] = float(p8), float(p16)
    fused_ms = float(re.search(r"whole sequence ([\d.]+) ms", readme).group(1))
    assert H100_FUSED_TFLOPS == pytest.approx(_flops(131072) / fused_ms / 1e9, rel=1e-3)
    for kernel, tag in (("torch_cuda_cudnn", "cudnn"), ("torch_cuda_flash", "flash")):
        points = dict(H100_BLOCK_LOOP[kernel].points)
        assert points[16384] == pytest.approx(fused_ms / 8 / ms[f"{tag} P8 C2"], abs=1e-3)
        assert points[8192] == pytest.approx(fused_ms / 16 / ms[f"{tag} P16 C4"], abs=1e-3)
    with open(os.path.join(ROOT, "benchmarks/results/gpu/h100-2026-11-27/timing_rank_transport.md"),
              encoding="utf-8") as f:
        timing = f.read()
    row = {m[0]: float(m[1]) for m in re.findall(r"\| (torch_cuda_\w+) \| bf16 \| 128, 128 \| causal \| \S+ \| ([\d.]+) \|",
                                                 timing)}
    assert set(row) == {"torch_cuda_flash", "torch_cuda_cudnn"}, row
    for kernel, kernel_ms in row.items():
        assert H100_CALL_TFLOPS[kernel] == pytest.approx(_flops(8192) / kernel_ms / 1e9, rel=1e-3)
    rows = [json.loads(line) for line in _read("one_rank_gqa.jsonl").splitlines()]
    fused = next(r["ms"] for r in rows if r["part"] == "B-fused")
    assert set(ms) == {"cudnn P8 C2", "cudnn P16 C4", "flash P8 C2", "flash P16 C4"}
    rank = {r["world"]: r["ms"] for r in rows if r["part"] == "B" and r["rotation"] == "kv" and not r["regather"]
            and r["window"] is None and not r["docs"] and not r["sinks"] and r["team"] in (2, 4)
            and (r["world"], r["team"]) in ((8, 2), (16, 4))}
    points = dict(H100_FA2_BLOCK_LOOP_VS_FA2.points)
    assert points[16384] == pytest.approx(fused / 8 / rank[8], abs=1e-3)
    assert points[8192] == pytest.approx(fused / 16 / rank[16], abs=1e-3)


def test_the_h100_preset_prices_a_rank_as_measured():
    cluster = preset(DEFAULT_CLUSTER, 2)
    share_s = _flops(131072) / 8 / cluster.attention_rate(16384)
    assert share_s * 1e3 == pytest.approx(66.6, rel=2e-3)  # the cuDNN rank at P8 C2
    assert cluster.attention_rate(4096) == cluster.attention_rate(8192) < cluster.attention_rate(12000) \
        < cluster.attention_rate(16384) == cluster.attention_rate(1 << 20)
