"""The GPU validation kit's CPU self-check: argument parsing, tables, and the kit's three
parts run at toy sizes on the CPU kernels (in a subprocess: it initializes torch's fake
process group, which must not leak into this test process)."""

import os
import subprocess
import sys

import pytest
import torch

from benchmarks import gpu_check, gpu_check_kernels
from benchmarks.gpu_check_kernels import AccuracyRow, Case, check_case
from megatron_startrail.kernels import RULES, ReferenceKernel

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_argument_parsing():
    args = gpu_check.parse_args(["--cpu-selfcheck", "--dims", "16/8,32", "--rank-configs", "8x2,16x4",
                                 "--dtypes", "fp32,bf16", "--kernels", "reference"])
    assert args.device == torch.device("cpu") and args.dims == [(16, 8), (32, 32)]
    assert args.rank_configs == [(8, 2), (16, 4)] and args.dtypes == [torch.float32, torch.bfloat16]
    assert args.kernels == ["reference"] and args.block_seq == 40 and args.iters == 1
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):  # the GPU defaults need a GPU
            gpu_check.parse_args([])


def test_tables_have_one_cell_per_column():
    case = Case("reference", torch.bfloat16, (24, 16), (-1, 0), (8, 2))
    rows = [AccuracyRow(case, "PASS", {"out": 1e-3, "lse": 2e-6, "dq": 1e-3, "dk": 1e-3, "dv": 1e-3}, ""),
            AccuracyRow(case, "SKIP", {}, "flash_attn needs flash-attn 2.x")]
    table = gpu_check.accuracy_table(rows)
    assert all(line.count("|") == table[0].count("|") for line in table)
    assert "| PASS | 1.0e-03 | 2.0e-06 |" in table[2] and table[3].endswith("flash_attn needs flash-attn 2.x |")


def test_a_wrong_kernel_is_a_failed_row(monkeypatch):
    class Wrong(ReferenceKernel):
        def backward(self, *args, **kwargs):
            dq, dk, dv = super().backward(*args, **kwargs)
            return dq * 1.1, dk, dv

    monkeypatch.setattr(gpu_check_kernels, "make_kernel", lambda name: Wrong())
    row = check_case(Case("reference", torch.float32, (16, 16), (37, 0), (4, 2)), 20, torch.device("cpu"), frozenset())
    assert row.status == "FAIL" and row.errors["dq"] > 0.05 and row.errors["out"] < 1e-6


def test_cpu_selfcheck_runs_every_part(tmp_path):
    out = tmp_path / "gpu_check.md"
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu_check", "--cpu-selfcheck", "--out", str(out), "--dtypes", "fp32,bf16"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = out.read_text()
    statuses = (" | PASS | ", " | SKIP | ", " | FAIL | ")
    rows = [line.split(" | ") for line in text.splitlines() if any(s in line for s in statuses)]
    assert rows and not any(r[5] == "FAIL" for r in rows)
    # 2 dtypes x 2 head dims x 4 window classes x 2 head layouts per kernel: the CPU kernels pass all,
    # every CUDA kernel is listed as skipped with the reason.
    for rule in RULES:
        mine = [r for r in rows if r[0] == f"| {rule.name}"]
        assert len(mine) == 32
        if rule.device_type == "cuda":
            assert all(r[5] == "SKIP" and "runs on cuda tensors" in r[-1] for r in mine)
        else:
            assert all(r[5] == "PASS" for r in mine)
    assert "| torch_cpu_flash | fp32 | 24, 16 | causal | 1x2x128x24/16 |" in text  # timing vs SDPA
    for p, c in ((4, 1), (4, 2)):
        assert f"| {p} | {c} | 256 | 64 | 2 x 16 | fp32 | torch_cpu_flash |" in text  # one-rank run
    assert "Efficiency at C = 2:" in text
    for check in ("transport of the backend", "self exchange"):  # part 4, on gloo here
        assert f"| {check} | ok |" in text


def test_a_part_that_raises_is_reported_and_fails_the_run(monkeypatch, tmp_path):
    def boom(*args, **kwargs):
        raise RuntimeError("CUDA out of memory (pretend)")

    monkeypatch.setattr(gpu_check, "time_kernel", boom)
    out = tmp_path / "gpu_check.md"
    status = gpu_check.main(["--cpu-selfcheck", "--skip-rank", "--dtypes", "fp32", "--kernels", "torch_cpu_flash",
                             "--dims", "16/16", "--out", str(out)])
    text = out.read_text()
    assert status == 1 and "## Errors" in text and "RuntimeError: CUDA out of memory (pretend)" in text
    assert text.count(" | PASS | ") == 8  # the accuracy rows still ran: 4 window classes x 2 head layouts
