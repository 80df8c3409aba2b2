"""``scripts/gpu_session.sh --cpu-selfcheck``: every part of the GPU session at toy sizes on the
CPU, each in its own process as on a GPU (the GPT step on the rehearsal's fake CUDA), so the
script cannot rot between the lent GPUs; and the session's budget against the lease."""

import argparse
import json
import os
import re
import sys

import pytest
import torch

from benchmarks.gpu import check as gpu_check
from benchmarks.gpu import session as gpu_session
from benchmarks.gpu import session_probes as gpu_session_probes
from tests import early
from tests.fake_cuda.build import why_not_buildable

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FILE_LIMIT = 8  # the device tool brings back at most 8 files from $OUT
LEASE_COMMAND_S = 480  # issue 50: at most 8 minutes on an H100


def _selfcheck_parts() -> list[str]:
    parts = list(gpu_session.ORDER)
    if why_not_buildable() is not None:  # the GPT part's self-check runs on fake CUDA
        parts.remove("gpt")
    return parts


@early.recipe("gpu-session-selfcheck", __file__, tests=("test_session_selfcheck_runs_every_part",))
def start_selfcheck(directory):
    """The script's CPU self-check, started with the session (tests/early.py), its files in ``directory/out``."""
    # The script runs $PYTHON (else python3 from PATH): this test's own interpreter, venv or not.
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHON=sys.executable)
    (directory / "out").mkdir(parents=True)
    return early.Process(["bash", "scripts/gpu_session.sh", "--cpu-selfcheck", "--out", str(directory / "out"),
                          "--parts", ",".join(_selfcheck_parts())], env, directory)


def test_session_selfcheck_runs_every_part():
    parts = _selfcheck_parts()
    selfcheck = early.started("gpu-session-selfcheck")
    code, log = selfcheck.finish(timeout=3600)
    assert code == 0, log[-6000:]
    tmp_path = selfcheck.directory / "out"
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["gpu_check.json", "gpu_check.md", "gpu_session.json", "gpu_session.log", "gpu_session.md"]
    assert len(files) <= FILE_LIMIT
    data = json.loads((tmp_path / "gpu_session.json").read_text())["parts"]
    kit = json.loads((tmp_path / "gpu_check.json").read_text())["parts"]
    assert {n: p["status"] for n, p in {**data, **kit}.items()} == {n: "ok" for n in parts}
    assert [r["status"] for r in kit["accuracy"]["rows"]].count("PASS") == 48  # 2 CPU kernels x 24
    assert {(r["kernel"], r["causal"]) for r in kit["timing"]["rows"]} == {("torch_cpu_flash", True),
                                                                           ("torch_cpu_flash", False)}
    assert [r["against"] for r in kit["timing"]["rows"] if "documents" in r["shape"]] == ["reference"]
    ranks = [r for n in ("rank-128k", "rank-1m") for r in data[n]["rows"] if r["kind"] == "rank"]
    assert {(r["tokens"], r["world"], r["team"], r["heads"], r["kv_heads"]) for r in ranks} == {
        (t, 4, c, h, hkv) for t in (256, 512) for c in (1, 2) for h, hkv in ((2, 2), (4, 2))}
    assert all(r["model"]["backward_peak"] > 0 and r["rank_ms"] > 0 for r in ranks)
    million = [r for r in data["rank-1m"]["rows"] if r["kind"] == "rank"]
    assert million[0]["kv_heads"] < million[0]["heads"] and million[-1]["kv_heads"] == million[-1]["heads"]
    profile = data["profile"]["rows"]
    assert profile[-1]["name"] == "(all)" and profile[-1]["count"] > 100
    assert any("flash_attention" in r["name"] for r in profile[:-1])
    assert [(r["layout"], r["syncs"]) for r in data["syncdebug"]["rows"]] == [
        ("dense", 0), ("documents", 0), ("window", 0)]
    text = (tmp_path / "gpu_session.md").read_text()
    assert "(extrapolated from 256)" in text and "| transport of the backend | ok |" in text
    if "gpt" in parts:
        first, gpt = data["gpt"]["rows"]
        assert (gpt["cp"], gpt["team"], gpt["kernels"], gpt["transports"]) == (4, 2, ["torch_cuda_flash"],
                                                                                ["NcclTransport"])
        assert gpt["update_successful"] and gpt["peak_bytes"] > gpt["live_bytes"]["with_batch"] > 0
        # the second configuration started with nothing of the first alive (weak references to its parameters)
        assert (first["team"], first["previous_params_alive"], gpt["previous_params_alive"]) == (1, 0, 0)


def test_the_sync_counter_sees_a_host_read(monkeypatch):
    """The CPU's stand-in for sync debug mode counts an ``.item()`` planted in the layer, once per
    micro-batch after the first: it is not blind."""
    step = gpu_session_probes.layer_step

    def reading(q, *args, **kwargs):
        step(q, *args, **kwargs)
        q.sum().item()

    monkeypatch.setattr(gpu_session_probes, "layer_step", reading)
    row = gpu_session_probes.count_syncs("dense", 4, 2, 64, 2, 1, 8, torch.float32, torch.device("cpu"), 3)
    assert row["syncs"] == 2 and "_local_scalar_dense" in row["found"][0]


def test_rank_table_compares_memory_and_extrapolates_the_fused_call():
    fused = {"kind": "fused", "tokens": 131072, "heads": 32, "kv_heads": 8, "head_dim": 128, "dtype": "bf16",
             "ms": 1600.0, "peak_mib": 1.0}
    model = {"kept": 2**30, "forward_peak": 2 * 2**30, "backward_peak": 4 * 2**30}
    rank = {"kind": "rank", "tokens": 1048576, "world": 8, "team": 2, "heads": 32, "kv_heads": 8, "head_dim": 128,
            "dtype": "bf16", "kernel": "torch_cuda_flash", "rotation": "kv", "rank_ms": 16000.0, "model": model,
            "rehearsal": dict(model), "kept": 2**30, "forward_peak": 2 * 2**30, "backward_peak": 5 * 2**30}
    (line,) = gpu_check.rank_table([fused, rank])[2:]
    # 1600 ms x 64 / 8 = 12800 ms: efficiency 0.80; the backward peak 1.25x the model
    assert "| 12800.00 (extrapolated from 128K) | 0.80 |" in line and line.endswith("| 5.000 (4.000, 4.000) | 1.25 |")


def test_a_gpt_configuration_refuses_to_start_on_the_last_ones_model():
    """The check before each GPT configuration (weak references to the last model's parameters)
    fails while Megatron's wiring holds the last model (the config's ``no_sync_func``, a bound
    method of the DDP model, whose modules hold the config), and passes once
    ``megatron_step.release`` has cut it, as ``step_facts`` does after its step."""
    from benchmarks.gpu.session_gpt import Configurations
    from tests.fake_cuda import megatron_step

    class Model(torch.nn.Module):
        def __init__(self, config):
            super().__init__()
            self.config, self.layer = config, torch.nn.Linear(4, 4)

        def no_sync(self):
            return None

    cpu = torch.device("cpu")
    config = argparse.Namespace()
    model = Model(config)
    config.no_sync_func, config.grad_scale_func = model.no_sync, model.no_sync  # what build() wires
    configurations = Configurations()
    configurations.watch(model)
    del model
    with pytest.raises(RuntimeError, match=r"still held \(2 of its 2 parameters alive"):
        configurations.before_next(cpu)
    megatron_step.release(config)
    assert configurations.before_next(cpu)["previous_params_alive"] == 0


def test_efficiency_verdict_per_length():
    """A warmed 128K row and an unwarmed 1M row get one verdict each, not one minimum."""
    def rank(tokens, ms, warm):
        return {"kind": "rank", "tokens": tokens, "world": 8, "team": 2, "heads": 16, "kv_heads": 16,
                "head_dim": 128, "dtype": "bf16", "rank_ms": ms, "warmup": warm}
    fused = {"kind": "fused", "tokens": 131072, "heads": 16, "kv_heads": 16, "head_dim": 128, "dtype": "bf16",
             "ms": 800.0}
    lines = gpu_check.efficiency_at_c2([fused, rank(131072, 100.0, True), rank(1048576, 12800.0, False)])
    assert lines[1:] == ["Efficiency at C = 2, 128K tokens: 1.00 (target 0.90: met).",
                         "Efficiency at C = 2, 1024K tokens: 0.50 (target 0.90: NOT met) (one unwarmed step each, "
                         "the fused call extrapolated)."]


def test_session_fits_the_lease_and_docs_give_its_budget():
    """Each part's limit and the whole budget (under 8 minutes) are in docs/gpus.md as the code
    has them, and the device tool's command written there is under its 2,000 characters."""
    assert set(gpu_session.TIMEOUT_S) == set(gpu_session.ORDER)
    assert gpu_session.BUDGET_S <= LEASE_COMMAND_S
    docs = open(os.path.join(ROOT, "docs/gpus.md")).read()
    for name, seconds in gpu_session.TIMEOUT_S.items():
        assert re.search(rf"\| `{name}` \| {seconds} \|", docs), name
    assert f"--budget-s` {gpu_session.BUDGET_S}" in docs or f"{gpu_session.BUDGET_S} s in all" in docs
    command = re.search(r"command: `([^`]+)`", docs).group(1)
    assert len(command) < 2000 and "scripts/gpu_session.sh" in command
    assert re.search(r"carry: `\[\"\.whl\"\]`", docs) and re.search(r"timeout_s: `(\d+)`", docs)
    with pytest.raises(SystemExit):
        if not torch.cuda.is_available():
            gpu_session.parse_args([])  # the full session needs a GPU
        else:
            raise SystemExit
