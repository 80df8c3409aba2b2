"""StarTrailConfig: one frozen object for every StarTrail setting, checked when made."""

import dataclasses

import pytest

from megatron_startrail.config import StarTrailConfig


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
    with pytest.raises(ValueError, match="serial_reverse_send.*--startrail-serial-reverse-send"):
        StarTrailConfig(serial_reverse_send=1)
