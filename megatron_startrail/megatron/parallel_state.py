"""StarTrail groups inside Megatron's parallel-state grid.

Call :func:`initialize_startrail` once, on every rank, right after
``parallel_state.initialize_model_parallel``. Megatron orders ranks ``tp-cp-ep-dp-pp``;
a CP group is the set of ranks sharing TP, DP and PP coordinates, and StarTrail's
teams, sub-rings and Ulysses groups are built inside every one of them, so StarTrail
composes with tensor, pipeline and data parallelism.
"""

from __future__ import annotations

import torch.distributed as dist
from megatron.core import parallel_state

from ..groups import StarTrailGroups, new_startrail_groups


def all_cp_groups() -> list[list[int]]:
    """Every CP group of the grid (global ranks in CP-rank order), the same list on every rank.

    Collected from the groups Megatron built rather than recomputed, so it follows
    whatever order and sizes ``initialize_model_parallel`` was given.
    """
    mine = list(parallel_state.get_context_parallel_global_ranks())
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine)
    return [list(g) for g in sorted({tuple(g) for g in gathered})]


def initialize_startrail(team_size: int, ulysses_size: int = 1, **options) -> StarTrailGroups:
    """Build the StarTrail groups of every CP group; collective, once per process."""
    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError("call parallel_state.initialize_model_parallel before initialize_startrail")
    groups = new_startrail_groups(all_cp_groups(), team_size=team_size, ulysses_size=ulysses_size, **options)
    # The data layout comes from get_batch_on_this_cp_rank, which uses Megatron's CP rank.
    assert groups.cp_rank == parallel_state.get_context_parallel_rank()
    return groups
