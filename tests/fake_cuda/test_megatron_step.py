"""A Megatron GPT training step at production shapes (hidden 4096, 32 heads in 8 query groups,
ffn 14336, 2 layers, 128K tokens, bf16, distributed optimizer) with StarTrail attention, as one
rank of CP8 C2 and of CP16 C4, on fake CUDA (tests.fake_cuda.megatron_step, one child process).

Asserted: the step finishes with a scalar fp32 loss on the device (its value is meaningless:
nothing is computed), StarTrail runs its GPU path (the torch_cuda_flash kernel, the NCCL
transport), no host sync or mixed-device op comes from the package, and the rank's memory
agrees with its closed form: between steps it holds the parameters, grad buffer and its shard
of the optimizer state (within 1%: Megatron pads its buffers), and at the step's peak at least
that plus the planner's attention peak, and less than an H100's 80 GB.
"""

import json

import pytest

from tests.fake_cuda.build import build_shim, why_not_buildable
from tests.fake_cuda.rank import is_package_frame
from tests.fake_cuda.run import run_fake_cuda

CONFIGS = ((8, 2), (16, 4))
H100_BYTES = 80 * 10**9


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    reason = why_not_buildable()
    if reason:
        pytest.skip(reason)
    shim = build_shim(tmp_path_factory.mktemp("fake_cuda"))
    out = tmp_path_factory.mktemp("megatron_step") / "step.json"
    cps, teams = ([str(c[i]) for c in CONFIGS] for i in (0, 1))
    done = run_fake_cuda(shim, "tests.fake_cuda.megatron_step", "--cp", *cps, "--team", *teams, "--json", str(out),
                         timeout=600)
    assert done.returncode == 0, done.stderr[-6000:]
    return {(r["cp"], r["team"]): r for r in json.loads(out.read_text())["runs"]}


@pytest.mark.parametrize("cp,team", CONFIGS, ids=[f"CP{c}_C{t}" for c, t in CONFIGS])
def test_step_runs_startrails_gpu_path(runs, cp, team):
    r = runs[(cp, team)]
    assert r["update_successful"]
    assert r["loss"] == {"shape": [], "dtype": "torch.float32", "device": "cuda:0"}
    assert r["kernels"] == ["torch_cuda_flash"]
    assert r["transports"] == ["NcclTransport"]
    assert "aten._flash_attention_forward.default" in r["attention_ops"]


@pytest.mark.parametrize("cp,team", CONFIGS, ids=[f"CP{c}_C{t}" for c, t in CONFIGS])
def test_no_host_sync_or_mixed_devices_from_the_package(runs, cp, team):
    r = runs[(cp, team)]
    assert [s for s in r["syncs"] if is_package_frame(s[1])] == []
    assert [m for m in r["mixed"] if is_package_frame(m[2])] == []
    # The stand-in host values went to Megatron's and torch's reads only (rank.DeviceRules).
    assert not [v for v in r["stand_ins"] if is_package_frame(v[2])]


@pytest.mark.parametrize("cp,team", CONFIGS, ids=[f"CP{c}_C{t}" for c, t in CONFIGS])
def test_memory_matches_its_closed_form(runs, cp, team):
    r = runs[(cp, team)]
    static = sum(r["static_closed_form"].values())
    between_steps = r["live_bytes"]["after_step"] - (r["live_bytes"]["with_batch"] - r["live_bytes"]["built"])
    assert static <= between_steps <= 1.01 * static, (between_steps, r["static_closed_form"])
    assert static + r["attention_activation_peak_planner"] <= r["peak_bytes"] < H100_BYTES
