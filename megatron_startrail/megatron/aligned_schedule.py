"""Hybrid (dynamic) CP schedules whose every sub-sample lands on one of Megatron's groups.

megatron-core 0.19.2's ``BalancedCPScheduler.next_hdp_group`` forms one phase of a global
batch in two steps: a greedy placement of sub-samples on groups of ``gpus_needed`` ranks,
then ``fill_empty_gpus``, which doubles the first smallest group in place (pushing the
groups after it along) until no rank is idle. Neither step keeps a group of ``k`` ranks on
an *aligned* slice (first rank a multiple of ``k``), and those are the only CP groups
Megatron builds (``create_hybrid_dp_cp_groups``) and StarTrail builds on: a CP-8
sub-sample on ranks 6..13 hands ranks 6, 7 the group 0..7 and ranks 8..13 the group
8..15, and the attention never completes (Megatron-LM#7141).

:class:`AlignedCPScheduler` keeps Megatron's placement step (which sub-samples share a
phase and a group: its balance objective) and replaces the fill: from the groups that step
made, at the sizes it made them, :func:`aligned_fill` doubles, while ranks are idle, the
group with the most work per rank that still fits (Megatron's fill doubles the first
smallest one, whatever its work), then :func:`place_aligned` lays the groups out largest
first on consecutive ranks. Power-of-two sizes laid out in non-increasing order are
aligned by construction (every group starts after a sum of sizes no smaller than its own,
hence a multiple of it), so no placement is ever outside Megatron's groups.

The other option, a StarTrail group set for every contiguous slice the scheduler can
choose, was not taken: a rank would hold ``k`` CP groups of each size ``k`` instead of
one (511 at 256 ranks, each with StarTrail's team, twin and sub-ring communicators), and
Megatron itself hands the attention only its aligned group
(``get_hybrid_data_context_parallel_groups``), so its schedule would need patching too.

:func:`install_aligned_scheduler` puts the class where Megatron's data wrapper
(``HybridCPDataLoaderWrapper``) looks the scheduler up; :mod:`.dynamic_cp` calls it when it
builds the StarTrail groups, the step the example and a patched ``pretrain_gpt.py`` share.
"""

from __future__ import annotations

from typing import Callable

from megatron.core.pipeline_parallel.hybrid_cp_schedule import BalancedCPScheduler


def placements(sample_id_groups: list[list[list[int]]]):
    """``(phase, sub-sample, ranks)`` of a schedule (``sample_id_groups[phase][dp_cp_rank]``:
    the sub-samples that rank runs in that phase), ranks ascending."""
    for phase, per_rank in enumerate(sample_id_groups):
        holders: dict[int, list[int]] = {}
        for rank, ids in enumerate(per_rank):
            for sample in ids:
                holders.setdefault(sample, []).append(rank)
        for sample, ranks in holders.items():
            yield phase, sample, ranks


def is_aligned(ranks: list[int]) -> bool:
    """Whether ``ranks`` are one of Megatron's hybrid CP groups: a power of two ``k`` of
    consecutive ranks starting at a multiple of ``k``."""
    k = len(ranks)
    return not k & (k - 1) and ranks == list(range(ranks[0], ranks[0] + k)) and ranks[0] % k == 0


def phase_groups(sample_ids_per_rank: list[list[int]]) -> list[list[int]]:
    """The groups of one phase, as the sub-sample ids each runs (in the order its ranks
    run them), in order of their first rank. Ranks of one group hold the same list."""
    seen: dict[tuple[int, ...], None] = {}
    for ids in sample_ids_per_rank:
        if ids:
            seen.setdefault(tuple(ids), None)
    return [list(ids) for ids in seen]


def aligned_fill(work: list[float], sizes: list[int], total: int) -> list[int]:
    """Group sizes (powers of two) grown until they use all ``total`` ranks. ``work[i]``:
    group ``i``'s whole work, split evenly over its ranks. Each step doubles the group with
    the most work per rank among those no larger than the idle ranks; one always fits,
    since the idle ranks are a multiple of the smallest size (every size and ``total`` are
    powers of two no smaller than it)."""
    sizes = list(sizes)
    idle = total - sum(sizes)
    if idle < 0 or any(k & (k - 1) for k in sizes):
        raise ValueError(f"groups of {sizes} ranks cannot be laid out on {total} ranks")
    while idle and sizes:
        fits = [i for i, k in enumerate(sizes) if k <= idle]
        grow = max(fits, key=lambda i: (work[i] / sizes[i], -i))  # ties: the earliest, Megatron's order
        idle -= sizes[grow]
        sizes[grow] *= 2
    return sizes


def place_aligned(sizes: list[int]) -> list[int]:
    """First rank of each group: largest first (ties in their order), consecutively."""
    first, start = [0] * len(sizes), 0
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        first[i], start = start, start + sizes[i]
    return first


def realign_phase(sample_ids_per_rank: list[list[int]], seqlen: dict[int, int], gpus_needed: Callable[[int], int],
                  workload: Callable[[int, int], float], total: int):
    """One phase re-laid out on aligned groups: ``(micro_batches, exec_times,
    sample_ids_per_gpu)`` as ``next_hdp_group`` returns them. Each group restarts at the size
    Megatron's placement gave it (``gpus_needed`` of its sub-samples: they all share it),
    before Megatron's fill grew it."""
    groups = phase_groups(sample_ids_per_rank)
    needed = [max(gpus_needed(seqlen[s]) for s in ids) for ids in groups]
    work = [sum(workload(seqlen[s], 1) for s in ids) for ids in groups]  # rank-seconds, whatever the size
    sizes = aligned_fill(work, needed, total)
    micro_batches, exec_times, ids_per_rank = [[] for _ in range(total)], [0.0] * total, [[] for _ in range(total)]
    for ids, k, start in zip(groups, sizes, place_aligned(sizes)):
        for r in range(start, start + k):
            micro_batches[r] = [seqlen[s] for s in ids]
            exec_times[r] = sum(workload(seqlen[s], k) for s in ids)
            ids_per_rank[r] = list(ids)
    return micro_batches, exec_times, ids_per_rank


class AlignedCPScheduler(BalancedCPScheduler):
    """Megatron's scheduler with the fill of :func:`realign_phase` (module docstring)."""

    def next_hdp_group(self, sample_seqlens, compute_estimator, total_gpus, *args, **kwargs):
        seqlen = dict(sample_seqlens)
        micro_batches, leftovers, exec_times, ids = super().next_hdp_group(
            sample_seqlens, compute_estimator, total_gpus, *args, **kwargs)
        # Megatron's fill changes neither which sub-samples run in this phase nor the
        # leftovers: only where, and on how many ranks, each group runs.
        micro_batches, exec_times, ids = self.realign(ids, seqlen, total_gpus)
        return micro_batches, leftovers, exec_times, ids

    def realign(self, sample_ids_per_rank, seqlen, total_gpus):
        """``(micro_batches, exec_times, sample_ids_per_gpu)`` of the phase on aligned groups;
        a method so that the schedule simulator can see Megatron's own phase first."""
        return realign_phase(sample_ids_per_rank, seqlen, self.gpus_needed, self.get_total_workload, total_gpus)


def install_aligned_scheduler() -> None:
    """Make Megatron's hybrid CP data wrapper schedule with :class:`AlignedCPScheduler`
    (``HybridCPDataLoaderWrapper.__init__`` looks the class up in its module; idempotent)."""
    from megatron.core.datasets import data_schedule  # noqa: PLC0415

    if not issubclass(data_schedule.BalancedCPScheduler, AlignedCPScheduler):
        data_schedule.BalancedCPScheduler = AlignedCPScheduler
