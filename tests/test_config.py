"""StarTrailConfig: one frozen object for every StarTrail setting, checked when made."""

import dataclasses
import os
import subprocess
import sys

import pytest

from megatron_startrail.config import StarTrailConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.parametrize("field, value, flag", [
    ("team_size", 0, "--startrail-team-size"),
    ("ulysses_size", 0, "--ulysses-degree-in-cp"),
    ("backward_rotation", "dq", "--startrail-backward-rotation"),
    ("transfer", "tree", "--startrail-transfer"),
    ("kernel", "triton", "--startrail-kernel"),
])
def test_a_bad_setting_names_its_flag(field, value, flag):
    with pytest.raises(ValueError, match=flag):
        StarTrailConfig(**{field: value})


def test_it_is_frozen_and_compares_by_value():
    config = StarTrailConfig(team_size=2, transfer="multiring", regather_in_backward=True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.team_size = 4
    assert config == StarTrailConfig(2, 1, "auto", "multiring", True, "auto")
    assert hash(config) == hash(StarTrailConfig(2, 1, "auto", "multiring", True, "auto"))
    with pytest.raises(ValueError, match="regather_in_backward.*--startrail-regather-in-backward"):
        StarTrailConfig(regather_in_backward="yes")


def test_the_runtime_does_not_import_the_planning_tools():
    """Planner, cluster presets and memory model are apart from the runtime: importing the
    attention, its groups and Megatron's core attention leaves ``megatron_startrail.planning``
    unloaded (Megatron's argument validation imports it only for ``auto`` or a memory limit)."""
    code = ("import sys; import megatron_startrail, megatron_startrail.attention, megatron_startrail.backward, "
            "megatron_startrail.groups, megatron_startrail.megatron.arguments; "
            "print(sorted(m for m in sys.modules if m.startswith('megatron_startrail.planning')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120,
                         cwd=ROOT, env=dict(os.environ, PYTHONPATH=ROOT)).stdout
    assert out.strip() == "[]", out
