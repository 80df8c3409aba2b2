"""Every hybrid CP schedule lands on Megatron's aligned groups (megatron/aligned_schedule.py),
and the offline simulator of benchmarks/dynamic_cp/schedules.py, reduced for CI."""

from __future__ import annotations

import types

import pytest

from megatron_startrail.megatron import cpu_patches

cpu_patches.install_import_shims()  # megatron.core without triton on a CPU

from megatron.core.datasets import data_schedule  # noqa: E402
from megatron.core.pipeline_parallel.hybrid_cp_schedule import BalancedCPScheduler  # noqa: E402

from benchmarks.dynamic_cp.schedules import simulate  # noqa: E402
from megatron_startrail.megatron import dynamic_cp  # noqa: E402
from megatron_startrail.megatron.aligned_schedule import (  # noqa: E402
    AlignedCPScheduler,
    aligned_fill,
    install_aligned_scheduler,
    is_aligned,
    place_aligned,
    placements,
)

# A global batch (16 ranks, --max-seqlen-per-dp-cp-rank 4096, log-uniform documents) on which
# megatron-core 0.19.2's scheduler puts a CP-8 sub-sample on ranks 6..13 (its third phase).
KNOWN = [26267, 26100, 20023, 11679, 9844, 8349, 7330, 6135, 5945, 4629, 2712, 2708, 1283, 392, 351, 254]


def schedule(cls, lengths, ranks=16, max_seqlen=4096):
    return cls(max_seqlen, types.SimpleNamespace(size=lambda: ranks)).get_groups_and_subsamples(
        list(enumerate(lengths)), None)[1]


def test_the_fill_doubles_the_busiest_group_that_fits_and_lays_groups_out_aligned():
    # 8 ranks, groups of 2, 1, 1 (4 idle): the heaviest per rank grows first while it fits.
    assert aligned_fill([8.0, 1.0, 6.0], [2, 1, 1], 8) == [4, 2, 2]
    assert aligned_fill([1.0, 1.0], [1, 1], 2) == [1, 1]
    with pytest.raises(ValueError, match="cannot be laid out"):
        aligned_fill([1.0, 1.0], [4, 8], 8)
    # Largest first, ties in order: every group starts at a multiple of its size.
    sizes = [1, 8, 2, 1, 4]
    firsts = place_aligned(sizes)
    assert firsts == [14, 0, 12, 15, 8]
    assert all(is_aligned(list(range(f, f + k))) for f, k in zip(firsts, sizes))
    assert not is_aligned([2, 3, 4, 5]) and not is_aligned([0, 1, 2]) and is_aligned([4, 5, 6, 7])


def test_megatrons_scheduler_misplaces_the_known_batch_and_the_aligned_one_does_not():
    megatron, aligned = schedule(BalancedCPScheduler, KNOWN), schedule(AlignedCPScheduler, KNOWN)
    bad = [(phase, ranks) for phase, _, ranks in placements(megatron) if not is_aligned(ranks)]
    assert bad == [(2, list(range(6, 14)))]
    with pytest.raises(RuntimeError, match=r"ranks \[6, 7, 8, 9, 10, 11, 12, 13\], not one of Megatron's aligned"):
        dynamic_cp.schedule_sizes(megatron)
    assert all(is_aligned(ranks) for _, _, ranks in placements(aligned))
    # Only where (and on how many ranks) a group runs changes: the same sub-samples per phase.
    assert [{s for ids in phase for s in ids} for phase in aligned] == \
        [{s for ids in phase for s in ids} for phase in megatron]
    assert all(ids for phase in aligned for ids in phase)  # no rank idle
    assert sum(dynamic_cp.schedule_sizes(aligned).values()) == len(KNOWN)


@pytest.mark.parametrize("setting", [(16, 4096, "log-uniform"), (64, 4096, "chat+code")])
def test_reduced_simulation_every_batch_runs_with_the_aligned_fill(setting):
    result = simulate(setting, 200)
    assert result["errors"] == 0 and result["fixed"].unrunnable == 0, result
    # The aligned fill keeps Megatron's balance (it may only improve on it, a little).
    assert result["fixed"].balance <= result["unfixed"].balance * 1.01, result


def test_the_simulators_unfixed_schedule_is_megatrons_own():
    # The simulator reads Megatron's phases inside AlignedCPScheduler; they are what
    # BalancedCPScheduler alone returns (its fill moves no sub-sample across phases).
    from benchmarks.dynamic_cp.schedules import DISTRIBUTIONS, global_batch  # noqa: PLC0415
    import random  # noqa: PLC0415

    class Recording(AlignedCPScheduler):
        def realign(self, ids, seqlen, total):
            self.seen.append([list(x) for x in ids])
            return super().realign(ids, seqlen, total)

    rng = random.Random(7)
    for lengths in [KNOWN] + [global_batch(rng, DISTRIBUTIONS["log-normal"][1], 16, 4096) for _ in range(20)]:
        sched = Recording(4096, types.SimpleNamespace(size=lambda: 16))
        sched.seen = []
        sched.get_groups_and_subsamples(list(enumerate(lengths)), None)
        assert sched.seen == schedule(BalancedCPScheduler, lengths)


def test_building_the_groups_installs_the_aligned_scheduler_where_megatrons_wrapper_finds_it(monkeypatch):
    # initialize_dynamic_startrail (reached by startrail_spec_from_args: the example's and the
    # patched pretrain_gpt.py's one way in) calls install_dynamic_cp_schedule.
    from megatron.core.pipeline_parallel import schedules  # noqa: PLC0415

    monkeypatch.setattr(data_schedule, "BalancedCPScheduler", BalancedCPScheduler)
    monkeypatch.setattr(schedules, "hybrid_context_parallel_forward_backward",
                        schedules.hybrid_context_parallel_forward_backward)
    dynamic_cp.install_dynamic_cp_schedule({1: 1, 2: 1})
    assert data_schedule.BalancedCPScheduler is AlignedCPScheduler
    assert schedules.hybrid_context_parallel_forward_backward._startrail_checked
    install_aligned_scheduler()  # idempotent
    assert data_schedule.BalancedCPScheduler is AlignedCPScheduler
    import inspect  # noqa: PLC0415

    assert "install_dynamic_cp_schedule(" in inspect.getsource(dynamic_cp.initialize_dynamic_startrail)
