"""examples/pretrain_gpt.py end to end (megatron.training's parse_args and pretrain, DDP,
Adam, LR schedule, data loader): CP4 with StarTrail (x TP2 or x PP2) logs the losses of
the same command with --context-parallel-size 1."""

import contextlib
import importlib.util
import io
import math
import os
import re

import pytest

from tests.megatron.utils import cpu_patches  # noqa: F401  (import shims before megatron.training)
from tests.multiproc import run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
_spec = importlib.util.spec_from_file_location("pretrain_gpt", os.path.join(ROOT, "examples", "pretrain_gpt.py"))
pretrain_gpt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pretrain_gpt)  # imported here so that forked ranks inherit it

COMMON = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "8",
    "--seq-length", "256", "--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", "4",
    "--lr", "3e-3", "--lr-warmup-iters", "1", "--seed", "1234", "--log-interval", "1",
]
LOG_LINE = re.compile(r"iteration\s+(\d+)/\s*(\d+) \|.* lm loss: ([0-9.E+-]+) \|.* tokens/s: ([0-9.]+) \|")


def example_worker(rank, world_size, argv):
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        pretrain_gpt.main(argv)
    return [(int(m[1]), int(m[2]), float(m[3]), float(m[4])) for m in LOG_LINE.finditer(out.getvalue())]


def losses(world_size, *flags):
    logged = run_ranks(example_worker, world_size, args=([*COMMON, *flags],), timeout=240)
    lines = logged[-1]  # megatron.training logs on the last rank
    assert [(i, n) for i, n, _, _ in lines] == [(i, 4) for i in range(1, 5)]
    assert all(tokens_per_s > 0 for *_, tokens_per_s in lines)
    return [loss for _, _, loss, _ in lines]


@pytest.mark.parametrize("grid", [
    ["--tensor-model-parallel-size", "2"],
    ["--pipeline-model-parallel-size", "2"],
], ids=["TP2", "PP2"])
def test_startrail_cp4_logs_the_losses_of_cp1(grid):
    startrail = losses(8, *grid, "--context-parallel-size", "4", "--context-parallel-algo", "startrail",
                       "--startrail-team-size", "2")
    reference = losses(2, *grid, "--context-parallel-size", "1")
    assert all(math.isfinite(x) for x in startrail + reference)
    for got, want in zip(startrail, reference):
        assert abs(got - want) <= 2e-6 * want, (startrail, reference)
    assert reference[-1] < reference[0]  # it learns


# DeepSeek-style MLA at toy size: q/k head dim 32 + 16 (RoPE part), v head dim 16.
MLA = ["--multi-latent-attention", "--qk-head-dim", "32", "--qk-pos-emb-head-dim", "16", "--v-head-dim", "16",
       "--kv-lora-rank", "32", "--rope-type", "rope"]  # yarn's RoPE table needs a GPU in megatron-core 0.19.2


def test_mla_startrail_cp4_with_and_without_regathering_logs_the_losses_of_cp1():
    reference = losses(1, *MLA, "--context-parallel-size", "1")
    startrail = ["--context-parallel-size", "4", "--context-parallel-algo", "startrail", "--startrail-team-size", "2"]
    for extra in ([], ["--startrail-regather-in-backward"]):
        got = losses(4, *MLA, *startrail, *extra)
        assert all(math.isfinite(x) for x in got + reference)
        for g, want in zip(got, reference):
            assert abs(g - want) <= 1e-4 * want, (extra, got, reference)
    assert reference[-1] < reference[0]


def test_tokens_per_second_is_read_off_megatrons_line():
    from megatron_startrail.megatron.training_log import with_tokens_per_second

    line = (" [2026-01-01 00:00:00.000000] iteration        5/      30 | consumed samples:           20 |"
            " elapsed time per iteration (ms): 400.0 | learning rate: 1.0E-03 | global batch size:     4 |"
            " lm loss: 4.602513E+00 | loss scale: 1.0 |")
    assert with_tokens_per_second(line, 2048) == line + " tokens/s: 20480.0 |"  # 4 x 2048 / 0.4 s
    assert with_tokens_per_second("done with setup ...", 2048) == "done with setup ..."
