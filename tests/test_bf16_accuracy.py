"""bf16 StarTrail (C=2) and ring (C=1) stay within 1.5x of single-device bf16 attention's error
against float64, at every length (benchmarks/accuracy/bf16.py at CI sizes: P=8, 1K-4K tokens)."""

import pytest
import torch

from benchmarks.accuracy import bf16 as bench
from tests.attention_cases import local_rows, reference_with_grads, zigzag_ranges
from tests.multiproc import run_ranks

LENGTHS = [1024, 2048, 4096]
BOUND = 1.5


def streaming_reference_worker(rank, world_size, seq, heads, dim):
    full = bench.full_inputs(7, seq, heads, dim)
    ranges = zigzag_ranges(rank, world_size, seq)
    got = bench.reference_on_my_rows(full, ranges, dim**-0.5)
    want = reference_with_grads(*full, True, dim**-0.5)
    return {name: (got[name] - local_rows(w, rank, world_size)).abs().max().item() for name, w in zip(bench.TENSORS, want)}


def test_streaming_float64_reference_is_plain_attention(monkeypatch):
    monkeypatch.setattr(bench, "REF_BLOCK", 24)  # several key blocks per chunk, ragged last block
    for errors in run_ranks(streaming_reference_worker, 4, args=(384, 2, 8), timeout=120):
        assert max(errors.values()) <= 1e-12, errors


@pytest.fixture(scope="module")
def rows():
    return run_ranks(bench.accuracy_worker, 8, args=(LENGTHS, 2, 16, 2, 0), timeout=300)[0]


@pytest.mark.parametrize("method", ["startrail-2", "ring"])
@pytest.mark.parametrize("metric", ["max_rel", "rms_rel"])
def test_bf16_error_within_1_5x_of_single_device(rows, method, metric):
    assert sorted({r["seq"] for r in rows}) == LENGTHS
    for seq, per_tensor in bench.ratios(rows, method, metric).items():
        for tensor, ratio in per_tensor.items():
            assert ratio <= BOUND, (seq, tensor, ratio, rows)


def test_errors_are_bf16_sized_and_not_zero(rows):
    # Every method really ran in bf16 (not above float32 accuracy) and is nowhere near broken.
    for r in rows:
        for tensor, e in r["errors"].items():
            assert 1e-4 < e["rms_rel"] < 3e-2 and e["max_rel"] < 5e-2, (r["seq"], r["method"], tensor, e)


def test_table_lists_every_length_and_method(rows):
    text = bench.table(rows, {"world_size": 8, "heads": 2, "dim": 16})
    for seq in LENGTHS:
        for method in ("ring", "startrail-2", "single-device"):
            assert f"| {seq} | {method} |" in text
    assert torch.isfinite(torch.tensor([e["max_rel"] for r in rows for e in r["errors"].values()])).all()
