"""Windowed models and the planner: Megatron's own layer rule, and --startrail-team-size auto
handing the planner the window flags."""

import types

import pytest

from tests.megatron.utils import cpu_patches  # noqa: F401  (import shims before megatron)

from megatron.core.transformer.utils import is_layer_window_attention  # noqa: E402
from megatron.training.arguments import parse_args  # noqa: E402

from megatron_startrail.megatron.arguments import add_startrail_args, validate_startrail_args  # noqa: E402
from megatron_startrail.planning.planner import window_layers  # noqa: E402
from tests.megatron.test_arguments import BASE  # noqa: E402


@pytest.mark.parametrize("layers", [1, 4, 7, 12])
@pytest.mark.parametrize("freq", [None, 1, 2, 3, 4, (1, 1, 1, 0) * 3, (0, 1) * 6])
def test_window_layers_follow_megatrons_rule(layers, freq):
    rule = list(freq) if isinstance(freq, tuple) else freq
    windowed = sum(is_layer_window_attention((8, 0), rule, n) for n in range(1, layers + 1))
    assert window_layers(layers, freq) == (windowed, layers - windowed)


@pytest.mark.parametrize("skip, want", [(None, {"window_size": (64, 0), "window_skip_freq": None}),
                                        ("2", {"window_size": (64, 0), "window_skip_freq": 2}),
                                        ("[1,0,1,1]", {"window_size": (64, 0), "window_skip_freq": [1, 0, 1, 1]})])
def test_auto_team_size_hands_the_planner_the_window_flags(monkeypatch, skip, want):
    asked = {}

    def spy(**inputs):
        asked.update(inputs)
        return types.SimpleNamespace(team_size=2, regather_in_backward=False, rotation="auto", reverse_overlap=True)

    monkeypatch.setattr("megatron_startrail.planning.planner.choose_plan", spy)
    extra = ["--window-attn-skip-freq", skip] if skip else []
    monkeypatch.setattr("sys.argv", ["pretrain_gpt.py", *BASE, "--num-layers", "4", "--context-parallel-size", "8",
                                     "--context-parallel-algo", "startrail", "--window-size", "64,0", *extra])
    args = parse_args(extra_args_provider=add_startrail_args)
    validate_startrail_args(args)
    assert {k: asked[k] for k in want} == want
    assert args.startrail_team_size == 2


@pytest.mark.parametrize("skip", ["2", "[1,0]"])
def test_auto_team_size_prices_a_windowed_model(monkeypatch, skip):
    # The real planner, 2 layers: the first windowed by a halo-sized window (the same halo
    # layer for every team size), the second full; so the choice is the full model's.
    flags = [*BASE, "--context-parallel-size", "8", "--context-parallel-algo", "startrail",
             "--seq-length", "4096", "--max-position-embeddings", "4096"]
    chosen = []
    for window in ([], ["--window-size", "16,0", "--window-attn-skip-freq", skip]):
        monkeypatch.setattr("sys.argv", ["pretrain_gpt.py", *flags, *window])
        args = parse_args(extra_args_provider=add_startrail_args)
        validate_startrail_args(args)
        chosen.append(args.startrail_team_size)
    assert chosen[0] == chosen[1] in (1, 2)
