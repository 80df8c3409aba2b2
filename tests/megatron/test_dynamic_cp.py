"""StarTrail inside Megatron's hybrid (dynamic) context parallelism (megatron/dynamic_cp.py).

End to end: examples/pretrain_gpt.py with --hybrid-context-parallel, Megatron's own hybrid
sampler, data wrapper, BalancedCPScheduler and schedule, on samples of 128 tokens packed
with documents of 1 to 119 tokens, with --max-seqlen-per-dp-cp-rank 16, so that a global batch runs sub-samples at CP
sizes 1, 2, 4 and 8, each on StarTrail groups of its size. Seed 1234, that of the other
example tests: megatron-core 0.19.2's own fill places a CP-4 sub-sample of the fourth global
batch on ranks 2..5, which no group of Megatron's can run; the groups install StarTrail's
aligned fill (megatron/aligned_schedule.py), so that batch trains (and
dynamic_cp.schedule_sizes would stop a misplaced one with that message, test below). It logs the per-token losses of
the same command at CP 1 (one rank, Megatron's dense per-document mask), and the first
step's gradients are those of CP 1 too. Also: the groups and team sizes per size, the
schedule check, the flags' refusals (Megatron's own among them).
"""

from __future__ import annotations

import math
import os
import re

import pytest
import torch

from tests.megatron.example import pretrain_gpt, run_example_rank
from tests.megatron.utils import assert_first_step_grads_match, record_first_step_grads
from tests.multiproc import run_ranks

from megatron_startrail.megatron.dynamic_cp import (  # noqa: E402
    dp_cp_rank_lists,
    dynamic_cp_sizes,
    schedule_sizes,
    sub_groups,
)
from megatron_startrail.topology import team_size_for  # noqa: E402

COMMON = ["--num-layers", "1", "--hidden-size", "64", "--num-attention-heads", "8", "--seq-length", "128",
          "--micro-batch-size", "1", "--global-batch-size", "8", "--train-iters", "4", "--lr", "3e-3",
          "--lr-warmup-iters", "1", "--seed", "1234", "--log-interval", "1", "--calculate-per-token-loss"]
DYNAMIC = ["--context-parallel-algo", "startrail", "--dataloader-inter-document-masking", "--hybrid-context-parallel",
           "--rerun-mode", "disabled", "--eval-iters", "0", "--max-seqlen-per-dp-cp-rank", "16"]
LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.* lm loss: ([0-9.E+-]+) \|")
SCHEDULE = re.compile(r"dynamic CP: (.*)")
SIZE = re.compile(r"CP (\d+): (\d+) sub-samples, team size (\d+)")


def test_team_size_per_cp_size_is_the_largest_whose_square_divides_it():
    assert [team_size_for(k, 2) for k in (1, 2, 4, 8, 16)] == [1, 1, 2, 2, 2]
    assert [team_size_for(k, 4) for k in (1, 2, 4, 8, 16, 32)] == [1, 1, 2, 2, 4, 4]
    assert [team_size_for(k, 1) for k in (1, 8)] == [1, 1]
    assert dynamic_cp_sizes(8) == [1, 2, 4, 8]
    for bad in (1, 6, 12):
        with pytest.raises(ValueError, match="power of two"):
            dynamic_cp_sizes(bad)


def test_groups_of_every_size_are_megatrons_aligned_slices():
    # Megatron's rule (create_hybrid_dp_cp_groups): contiguous, aligned slices of every DP x CP list.
    assert sub_groups(dp_cp_rank_lists(8, 1, "tp-cp-ep-dp-pp"), 4) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    lists = dp_cp_rank_lists(8, 2, "tp-cp-ep-dp-pp")
    assert lists == [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert sub_groups(lists, 2) == [[0, 2], [4, 6], [1, 3], [5, 7]]
    assert sub_groups(lists, 1) == [[r] for r in (0, 2, 4, 6, 1, 3, 5, 7)]


def test_the_schedule_is_counted_per_cp_size_and_a_misaligned_group_is_refused():
    # sample_id_groups[phase][dp_cp_rank]: ids that rank runs in that phase.
    aligned = [[[0], [0], [0], [0], [1], [1], [2], [3]], [[4], [4], [5], [5], [6], [6], [6], [6]]]
    assert schedule_sizes(aligned) == {1: 2, 2: 3, 4: 2}
    # megatron-core 0.19.2's scheduler can put a CP-4 sub-sample on ranks 2..5: two different groups.
    misaligned = [[[0], [0], [1], [1], [1], [1], [2], [2]]]
    with pytest.raises(RuntimeError, match=r"ranks \[2, 3, 4, 5\], not one of Megatron's aligned groups of 4"):
        schedule_sizes(misaligned)


def example_with_grads(rank, world_size, argv):
    recorded = record_first_step_grads()
    log = run_example_rank(rank, world_size, argv)
    return log, recorded.get("grads")


def losses_of(log):
    return [float(m[2]) for m in LOSS.finditer(log)]


@pytest.fixture(scope="module")
def documents(tmp_path_factory):
    make = pretrain_gpt.make_indexed_dataset
    prefix = str(tmp_path_factory.mktemp("dynamic_cp") / "docs")
    make.write_indexed_dataset(make.short_documents(), prefix)
    lengths = [len(d) for d in make.short_documents()]
    assert min(lengths) == 1 and max(lengths) >= 100  # two orders of magnitude
    return ["--data-path", prefix, "--split", "100,0,0"]


def run_against_cp1(documents, tp, ranks, team, extra=()):
    """The example with dynamic CP and StarTrail, and at CP 1: the same per-token losses (4
    iterations) and first-step gradients. Returns rank 0's log and each iteration's
    schedule, ``{CP size: (sub-samples, team size)}``."""
    grid = ["--tensor-model-parallel-size", str(tp), "--max-seqlen-per-dp-cp-rank", str(16 * tp), *extra]
    dynamic = run_ranks(example_with_grads, ranks, args=([*COMMON, *documents, *DYNAMIC, *grid,
                                                          "--startrail-team-size", team],), timeout=400)
    reference = run_ranks(example_with_grads, tp, args=([*COMMON, *documents, *grid, "--reset-attention-mask",
                                                         "--reset-position-ids"],), timeout=400)
    got, want = losses_of(dynamic[-1][0]), losses_of(reference[-1][0])
    assert len(got) == len(want) == 4 and all(math.isfinite(x) for x in got + want), (got, want)
    for g, w in zip(got, want):
        assert abs(g - w) <= 1e-5 * abs(w), (got, want)
    # Every parameter's gradient of the first step, on global rank 0 (TP rank 0 in both runs).
    assert_first_step_grads_match(dynamic[0][1], reference[0][1], f"dynamic CP TP{tp} C={team}")  # issue 36
    # Rank 0 logs each iteration's schedule: sub-samples per CP size and each size's team size.
    schedules = [dict((int(k), (int(n), int(c))) for k, n, c in SIZE.findall(line))
                 for line in SCHEDULE.findall(dynamic[0][0])]
    assert len(schedules) == 4, dynamic[0][0][-3000:]
    return dynamic[0][0], schedules


# TP2 x DP4: 4 data-parallel ranks, 32 tokens each, so that a 119-token document fits on CP 4.
@pytest.mark.parametrize("tp, ranks, sizes", [(1, 8, {1, 2, 4, 8}), (2, 8, {1, 2, 4})], ids=["DP8", "TP2xDP4"])
def test_dynamic_cp_with_startrail_gives_the_losses_and_gradients_of_cp1(documents, tp, ranks, sizes):
    _, schedules = run_against_cp1(documents, tp, ranks, "2")
    seen = set().union(*schedules)
    assert seen == sizes, schedules
    assert all(c == team_size_for(k, 2) for s in schedules for k, (_, c) in s.items()), schedules


def refusing_worker(rank, world_size, argv):
    """The example, with the third global batch's schedule refused on tensor-parallel rank 0 as
    an unrunnable placement is (``schedule_sizes`` raising); returns the error this rank saw."""
    from megatron_startrail.megatron import dynamic_cp  # noqa: PLC0415

    checked, batches = dynamic_cp.schedule_sizes, []

    def refusing(sample_id_groups):
        if not any(b is sample_id_groups for b in batches):
            batches.append(sample_id_groups)
        if batches[2:3] and batches[2] is sample_id_groups:
            raise RuntimeError("hybrid CP schedule, phase 0: sub-sample 5 is on data x context parallel ranks "
                               "[2, 3, 4, 5], not one of Megatron's aligned groups of 4")
        return checked(sample_id_groups)

    dynamic_cp.schedule_sizes = refusing
    try:
        run_example_rank(rank, world_size, argv)
    except RuntimeError as error:
        return str(error)
    return None


def test_a_refused_schedule_stops_every_tensor_parallel_rank_with_its_reason(documents):
    # Only tensor-parallel rank 0 reads the data and checks the schedule; the other TP ranks
    # would wait in Megatron's broadcast of the schedule until the process-group timeout.
    grid = ["--tensor-model-parallel-size", "2", "--max-seqlen-per-dp-cp-rank", "64", "--startrail-team-size", "2"]
    errors = run_ranks(refusing_worker, 4, args=([*COMMON, *documents, *DYNAMIC, *grid],), timeout=120)
    assert all(e is not None and "hybrid CP schedule" in e for e in errors), errors
    assert sum("not one of Megatron's aligned groups" in e for e in errors) == 2, errors  # TP rank 0 of each DP rank
    assert sum("refused on tensor-parallel rank 0" in e for e in errors) == 2, errors


def test_auto_team_size_with_dynamic_cp_trains_as_cp1(documents):
    # --startrail-team-size auto: the planner's team size for every CP size (arguments.py),
    # each size's groups built with it, the losses and gradients of CP 1.
    log, schedules = run_against_cp1(documents, 1, 8, "auto")
    described = re.search(r"hybrid CP, StarTrail groups per CP size \((.*?)\), team sizes by the planner", log)
    assert described, log[-3000:]
    planned = {int(k): int(c) for k, c in re.findall(r"CP (\d+): team size (\d+)", described[1])}
    assert sorted(planned) == [1, 2, 4, 8], planned
    assert all(c == planned[k] for s in schedules for k, (_, c) in s.items()), (planned, schedules)
    assert set().union(*schedules) == {1, 2, 4, 8}, schedules


def test_auto_team_size_logs_the_planners_choice_per_cp_size(monkeypatch):
    from tests.megatron.test_arguments import parse  # noqa: PLC0415

    from megatron_startrail.megatron.arguments import validate_startrail_args  # noqa: PLC0415
    from megatron_startrail.planning import planner  # noqa: PLC0415

    monkeypatch.setenv("WORLD_SIZE", "16")
    asked = []

    def spy(**inputs):
        asked.append((inputs["cp_size"], inputs["seq_length"]))
        return type("Plan", (), {"team_size": 2 if inputs["cp_size"] >= 8 else 1})()

    monkeypatch.setattr(planner, "choose_plan", spy)
    args = parse(monkeypatch, *DYNAMIC, "--calculate-per-token-loss", "--max-seqlen-per-dp-cp-rank", "16")
    args.world_size = 16
    validate_startrail_args(args)
    # Each size is planned for the longest sub-sample it can get: k x 16 tokens, at most --seq-length 256.
    assert asked == [(2, 32), (4, 64), (8, 128), (16, 256)]
    assert args.startrail_dynamic_team_sizes == {1: 1, 2: 1, 4: 1, 8: 2, 16: 2}


@pytest.mark.parametrize("extra, message", [
    (["--context-parallel-size", "2"], "--context-parallel-size 1"),
    (["--ulysses-degree-in-cp", "2"], "--ulysses-degree-in-cp"),
    (["--rerun-mode", "validate_results"], "--rerun-mode disabled"),
    (["--eval-iters", "2"], "--eval-iters 0"),
    (["--startrail-memory-limit-gb", "10"], "--startrail-memory-limit-gb"),
    (["--context-parallel-algo", "tasp", "--startrail-team-size", "2"], "tasp is StarTrail with --startrail-team-size 1"),
    (["--mtp-num-layers", "1"], "--mtp-num-layers with --hybrid-context-parallel"),
    # 8 ranks x 16 tokens < 256: a one-document sample fits no CP group (Megatron's scheduler
    # stopped with "There should be at least one group existing, cannot reditribute").
    (["--seq-length", "256", "--max-seqlen-per-dp-cp-rank", "16"], "--seq-length 256 is more than DP x CP (8 ranks) "
     "x --max-seqlen-per-dp-cp-rank 16 = 128 tokens"),
])
def test_what_dynamic_cp_with_startrail_cannot_run_is_refused_with_its_flag(monkeypatch, extra, message):
    from tests.megatron.test_arguments import parse  # noqa: PLC0415

    from megatron_startrail.megatron.arguments import validate_startrail_args  # noqa: PLC0415

    args = parse(monkeypatch, *DYNAMIC, "--calculate-per-token-loss", *extra)
    args.world_size = 8
    with pytest.raises(ValueError, match=re.escape(message)):
        validate_startrail_args(args)


@pytest.mark.parametrize("extra, error, message", [
    (["--pipeline-model-parallel-size", "2"], AssertionError,
     "Hybrid context parallelism not supported with pipeline parallelism"),
    (["--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor"], AssertionError, "Hybrid context parallelism not supported with Megatron FSDP"),
    # megatron-core 0.19.2 deletes args.enable_cuda_graph (deprecated for --cuda-graph-impl local)
    # before its hybrid check reads it: the run stops there, in Megatron's code.
    (["--enable-cuda-graph"], AttributeError, "enable_cuda_graph"),
    # Megatron's hybrid check does not look at --cuda-graph-impl; StarTrail's refusal names it.
    (["--cuda-graph-impl", "local"], ValueError, "--cuda-graph-impl local"),
])
def test_megatrons_own_refusals_still_come_first_with_megatrons_message(monkeypatch, extra, error, message):
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.delenv("CUDA_DEVICE_MAX_CONNECTIONS", raising=False)  # FSDP's own check, before the hybrid one
    with pytest.raises(error, match=re.escape(message)):
        # two layers: pipeline parallelism 2 needs a layer per stage
        pretrain_gpt.parse_command_line([*COMMON, "--num-layers", "2", "--data-path", "unused", *DYNAMIC, *extra])


def test_a_call_runs_on_the_groups_of_its_cp_size_and_a_foreign_group_is_an_error(monkeypatch):
    import types  # noqa: PLC0415

    from megatron_startrail.megatron import dynamic_cp  # noqa: PLC0415
    from megatron_startrail.megatron.core_attention import StarTrailCoreAttention  # noqa: PLC0415

    built = {k: types.SimpleNamespace(cp_group=f"group-{k}", cp_global_ranks=tuple(range(k))) for k in (1, 2, 4)}
    groups = dynamic_cp.DynamicCPGroups(built, config=None)
    monkeypatch.setattr(dynamic_cp.dist, "get_process_group_ranks", lambda g: [4, 5, 6, 7] if g == "other" else [])
    layer = types.SimpleNamespace(startrail_groups=groups, cp_group=None)
    params = types.SimpleNamespace(local_cp_size=4, cp_group=built[4].cp_group)  # Megatron's group object
    assert StarTrailCoreAttention._groups_for(layer, params) == (built[4], "group-4")
    params = types.SimpleNamespace(local_cp_size=1, cp_group=None)
    assert StarTrailCoreAttention._groups_for(layer, params) == (built[1], "group-1")
    with pytest.raises(ValueError, match=r"cp_group holds ranks \[4, 5, 6, 7\], but StarTrail's CP-4 group"):
        StarTrailCoreAttention._groups_for(layer, types.SimpleNamespace(local_cp_size=4, cp_group="other"))
    with pytest.raises(ValueError, match=r"local_cp_size=8: StarTrail groups exist for CP sizes \[1, 2, 4\]"):
        StarTrailCoreAttention._groups_for(layer, types.SimpleNamespace(local_cp_size=8, cp_group=None))
    with pytest.raises(ValueError, match="needs PackedSeqParams.local_cp_size"):
        StarTrailCoreAttention._groups_for(layer, None)
    # Groups of the fixed CP group take no local_cp_size: built without --hybrid-context-parallel.
    fixed = types.SimpleNamespace(startrail_groups=built[4], cp_group="cp")
    with pytest.raises(ValueError, match="build them with --hybrid-context-parallel"):
        StarTrailCoreAttention._groups_for(fixed, types.SimpleNamespace(local_cp_size=2, cp_group="group-2"))
    assert StarTrailCoreAttention._groups_for(fixed, None) == (built[4], "cp")
