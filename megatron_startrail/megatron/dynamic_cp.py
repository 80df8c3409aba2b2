"""StarTrail inside Megatron's hybrid (dynamic) context parallelism.

With ``--hybrid-context-parallel`` (megatron-core 0.19.2) the static CP size is 1 and
every sub-sample of a global batch runs on a context-parallel group of its own
power-of-two size ``k`` over the DP x CP ranks (``BalancedCPScheduler``): a 2K-token
document alone, a 128K one across all of them. Megatron builds a group of every size
(``parallel_state.create_hybrid_dp_cp_groups``: aligned, contiguous slices of each DP x CP
rank list) and tells the core attention per call which one runs this sub-sample
(``PackedSeqParams.local_cp_size`` and ``cp_group``). (Not to be confused with the
``HybridModel`` of ``--hybrid-layer-pattern``, :mod:`.hybrid_specs`.)

:func:`initialize_dynamic_startrail` builds StarTrail groups on every one of those groups,
eagerly and collectively (every rank, ascending size: what NCCL needs), each with its
own team size (:func:`team_size_for`); :class:`DynamicCPGroups` holds them, and the core
attention picks the set of this call's size (:meth:`DynamicCPGroups.for_call`). It also
installs :class:`.AlignedCPScheduler` (megatron/aligned_schedule.py), so that Megatron's
scheduler places every sub-sample on one of those groups.
"""

from __future__ import annotations

import dataclasses
import datetime
import functools

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.parallel_state import RankGenerator

from ..config import StarTrailConfig
from ..groups import StarTrailGroups, new_startrail_groups
from ..microbatch import MicroBatchCache
from ..topology import team_size_for
from ..transport import group_backend
from .aligned_schedule import install_aligned_scheduler, is_aligned, placements


def dynamic_cp_sizes(dp_cp_size: int) -> list[int]:
    """The CP sizes Megatron's scheduler may give a sub-sample: 1, 2, 4, ..., DP x CP."""
    if dp_cp_size < 2 or dp_cp_size & (dp_cp_size - 1):
        raise ValueError(
            f"--hybrid-context-parallel needs a power of two of data x context parallel ranks (>= 2), got "
            f"{dp_cp_size}: change --tensor-model-parallel-size or the number of ranks"
        )
    return [1 << i for i in range(dp_cp_size.bit_length())]


def dp_cp_rank_lists(world_size: int, tp: int, order: str) -> list[list[int]]:
    """Pure: Megatron's DP x CP rank lists (pipeline parallelism is 1 with hybrid CP, and
    the static CP size 1), the lists ``create_hybrid_dp_cp_groups`` cuts into groups."""
    return RankGenerator(tp=tp, ep=1, dp=world_size // tp, pp=1, cp=1, order=order).get_ranks("dp-cp")


def sub_groups(rank_lists: list[list[int]], size: int) -> list[list[int]]:
    """Every CP group of ``size`` ranks: aligned contiguous slices of each DP x CP list
    (Megatron's rule in ``create_hybrid_dp_cp_groups``)."""
    return [ranks[i:i + size] for ranks in rank_lists for i in range(0, len(ranks), size)]


@dataclasses.dataclass
class DynamicCPGroups:
    """This rank's StarTrail groups for every CP size of hybrid CP (``by_size[k]``)."""

    by_size: dict[int, StarTrailGroups]
    config: StarTrailConfig  # the flags' settings; each size's team size is its own
    # Per-micro-batch metadata (documents, RoPE positions), shared by every size's groups:
    # what PackedRopeSelfAttention finds through the core attention.
    documents_cache: MicroBatchCache = dataclasses.field(default_factory=MicroBatchCache, repr=False)

    def for_call(self, local_cp_size: int, cp_group) -> StarTrailGroups:
        """The groups of one sub-sample's CP size; ``cp_group`` is Megatron's group for it
        (``PackedSeqParams.cp_group``, None for size 1), checked to be the one they were
        built in: a group they were not built for would pair the wrong ranks."""
        groups = self.by_size.get(int(local_cp_size))
        if groups is None:
            raise ValueError(
                f"local_cp_size={local_cp_size}: StarTrail groups exist for CP sizes {sorted(self.by_size)} "
                "(those of --hybrid-context-parallel over this run's data x context parallel ranks)"
            )
        if local_cp_size > 1 and cp_group is not None and cp_group is not groups.cp_group and tuple(
                dist.get_process_group_ranks(cp_group)) != groups.cp_global_ranks:
            raise ValueError(
                f"PackedSeqParams.cp_group holds ranks {dist.get_process_group_ranks(cp_group)}, but StarTrail's "
                f"CP-{local_cp_size} group here is {list(groups.cp_global_ranks)}: a sub-sample must run on one of "
                "Megatron's aligned hybrid groups (parallel_state.get_hybrid_data_context_parallel_groups)"
            )
        return groups

    def describe(self) -> str:
        sizes = ", ".join(f"CP {k}: team size {g.team_size}" for k, g in sorted(self.by_size.items()))
        return f"hybrid CP, StarTrail groups per CP size ({sizes})"


def initialize_dynamic_startrail(config: StarTrailConfig, *, order: str, team_sizes: dict[int, int] | None = None,
                                 timeout: datetime.timedelta | None = None,
                                 nccl_comm_cfgs: dict | None = None,
                                 reuse_megatron_groups: bool = True) -> DynamicCPGroups:
    """Build the StarTrail groups of every hybrid CP group; collective, once, right after
    ``initialize_model_parallel(hybrid_context_parallel=True)``. ``team_sizes[k]`` (the
    planner's per size, with ``--startrail-team-size auto``) or :func:`team_size_for`.
    ``reuse_megatron_groups``: a team or Ulysses group over the ranks of one of Megatron's
    smaller hybrid groups is that group (Note [communicators]; False: made anew, to count
    what the reuse saves)."""
    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError("call parallel_state.initialize_model_parallel before initialize_dynamic_startrail")
    if parallel_state.get_context_parallel_world_size() != 1 or \
            parallel_state.get_pipeline_model_parallel_world_size() != 1:
        raise ValueError("--hybrid-context-parallel runs with --context-parallel-size 1 and no pipeline parallelism")
    rank_lists = dp_cp_rank_lists(dist.get_world_size(), parallel_state.get_tensor_model_parallel_world_size(),
                                  order)
    pg_options = parallel_state.get_nccl_options("dp_cp", nccl_comm_cfgs or {}) \
        if group_backend() == "nccl" else None
    create_group = functools.partial(parallel_state.create_group, pg_options=pg_options)
    result = DynamicCPGroups({}, config)
    megatron_groups: dict = {}  # Megatron's groups of the sizes done: ranks -> this rank's (None: not in it)
    for k in dynamic_cp_sizes(len(rank_lists[0])):
        # Megatron's own group of this size is reused (Note [communicators] in groups.py);
        # size 1 is its static CP group of one rank.
        cp_group = parallel_state.get_context_parallel_group() if k == 1 else \
            parallel_state.get_hybrid_data_context_parallel_groups(group_size=k)
        team = (team_sizes or {}).get(k) or team_size_for(k, config.team_size)
        cp_ranks = sub_groups(rank_lists, k)
        groups = new_startrail_groups(cp_ranks, config=dataclasses.replace(config, team_size=team), timeout=timeout,
                                      create_group=create_group, cp_group=cp_group,
                                      existing_groups=megatron_groups if reuse_megatron_groups else None)
        rank = dist.get_rank()
        megatron_groups.update((tuple(ranks), cp_group if rank in ranks else None) for ranks in cp_ranks)
        groups.documents_cache = result.documents_cache
        result.by_size[k] = groups
    install_dynamic_cp_schedule({k: g.team_size for k, g in result.by_size.items()})
    return result


def schedule_sizes(sample_id_groups: list[list[list[int]]]) -> dict[int, int]:
    """``{CP size: sub-samples}`` of one global batch's schedule (``BalancedCPScheduler``:
    ``sample_id_groups[phase][dp_cp_rank]`` lists the sub-samples that rank runs in that
    phase), after checking that every sub-sample's ranks are one of Megatron's aligned
    groups. megatron-core 0.19.2's own fill can place a CP-4 sub-sample on ranks 2..5;
    Megatron would then hand ranks 2, 3 the group 0..3 and ranks 4, 5 the group 4..7, and
    the attention's collectives would never complete. :class:`.AlignedCPScheduler` (installed
    with the groups) never does; should another scheduler, every tensor-parallel rank 0
    computes the same schedule and raises here, before the attention runs, and the other
    tensor-parallel ranks raise with it (``_agree_over_tensor_parallel_ranks``)."""
    sizes: dict[int, int] = {}
    for phase, sample, ranks in placements(sample_id_groups):
        k = len(ranks)
        if not is_aligned(ranks):
            raise RuntimeError(
                f"hybrid CP schedule, phase {phase}: sub-sample {sample} is on data x context parallel ranks "
                f"{ranks}, not one of Megatron's aligned groups of {k} (a placement its groups cannot run: is "
                "megatron.core.datasets.data_schedule.BalancedCPScheduler StarTrail's AlignedCPScheduler?)"
            )
        sizes[k] = sizes.get(k, 0) + 1
    return dict(sorted(sizes.items()))


_logged_team_sizes: dict[int, int] = {}  # what the schedule log prints: the last groups built


def install_dynamic_cp_schedule(team_sizes: dict[int, int]) -> None:
    """Make every hybrid CP schedule runnable on the groups built (Megatron's data wrapper
    schedules with :class:`.AlignedCPScheduler`), check each global batch's schedule
    (:func:`schedule_sizes`) on every rank before Megatron runs it and print, on global rank 0
    once per iteration, how many sub-samples run at each CP size and the team size each uses:
    wraps ``schedules.hybrid_context_parallel_forward_backward`` (idempotent). Called by
    :func:`initialize_dynamic_startrail`, so the example and a patched ``pretrain_gpt.py``
    get it from the layer spec, before ``pretrain`` trains."""
    install_aligned_scheduler()
    _logged_team_sizes.clear()
    _logged_team_sizes.update(team_sizes)
    _install_checked_schedule()


def _agree_over_tensor_parallel_ranks(refusal: RuntimeError | None) -> None:
    """Raise on every rank of this tensor-parallel group if tensor-parallel rank 0 refused the
    schedule (only it reads the data): the others would otherwise wait in Megatron's
    broadcast of the schedule until the process-group timeout. One all-reduce of one flag
    per global batch, outside the model (Megatron's own schedule syncs there too)."""
    group = parallel_state.get_tensor_model_parallel_group()
    if group is None or dist.get_world_size(group) == 1:
        if refusal is not None:
            raise refusal
        return
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else "cpu"
    refused = torch.tensor([int(refusal is not None)], dtype=torch.int32, device=device)
    dist.all_reduce(refused, op=dist.ReduceOp.MAX, group=group)
    if refusal is not None:
        raise refusal
    if refused.item():
        raise RuntimeError(
            "hybrid CP schedule refused on tensor-parallel rank 0 of this rank's tensor-parallel group (global "
            f"rank {dist.get_global_rank(group, 0)}; its error names the sub-sample and ranks)")


def _install_checked_schedule() -> None:
    """Wrap ``schedules.hybrid_context_parallel_forward_backward`` (idempotent): tensor-parallel
    rank 0 takes the global batch from the data iterator, checks its schedule once
    (:func:`schedule_sizes`; global rank 0 logs the sizes) and hands it on unchanged; the
    verdict is agreed over the tensor-parallel group."""
    from megatron.core.pipeline_parallel import schedules  # noqa: PLC0415

    megatron_schedule = schedules.hybrid_context_parallel_forward_backward
    if getattr(megatron_schedule, "_startrail_checked", False):
        return

    def checked_schedule(forward_step_func, data_iterator, *args):
        refusal = None
        if parallel_state.get_tensor_model_parallel_rank() == 0:
            data = next(data_iterator)  # (samples, sample_id_groups): one global batch
            try:
                sizes = schedule_sizes(data[1])
            except RuntimeError as error:
                refusal = error
            else:
                if dist.get_rank() == 0:
                    print(" dynamic CP: " + " | ".join(
                        f"CP {k}: {n} sub-samples, team size {_logged_team_sizes.get(k, 1)}"
                        for k, n in sizes.items()), flush=True)
            data_iterator = iter([data])
        _agree_over_tensor_parallel_ranks(refusal)
        return megatron_schedule(forward_step_func, data_iterator, *args)

    checked_schedule._startrail_checked = True
    schedules.hybrid_context_parallel_forward_backward = checked_schedule


# The example's name for it (it installs before the groups are built; a second call only
# refreshes the team sizes logged).
log_dynamic_cp_schedule = install_dynamic_cp_schedule
