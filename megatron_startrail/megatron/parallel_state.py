"""StarTrail groups inside Megatron's parallel-state grid.

Call :func:`initialize_startrail` once, on every rank, right after
``parallel_state.initialize_model_parallel``. Megatron orders ranks ``tp-cp-ep-dp-pp``;
a CP group is the set of ranks sharing TP, DP and PP coordinates, and StarTrail's
teams, sub-rings and Ulysses groups are built inside every one of them, so StarTrail
composes with tensor, pipeline and data parallelism.

Like Megatron's own ``initialize_model_parallel``: first pure rank math
(:func:`context_parallel_groups`, Megatron's ``RankGenerator``), then one collective
pass that creates every group on every rank in the same order.
"""

from __future__ import annotations

import datetime
import functools

import torch.distributed as dist
from megatron.core import parallel_state
from megatron.core.parallel_state import RankGenerator

from ..groups import StarTrailGroups, new_startrail_groups
from ..transport import group_backend

DEFAULT_ORDER = "tp-cp-ep-dp-pp"


def context_parallel_groups(
    world_size: int, tp: int = 1, pp: int = 1, cp: int = 1, order: str = DEFAULT_ORDER
) -> list[list[int]]:
    """Pure: every CP group of the dense grid (global ranks in CP-rank order).

    The same lists ``initialize_model_parallel`` builds for these sizes and order.
    """
    if world_size % (tp * pp * cp) != 0:
        raise ValueError(
            f"world size {world_size} is not divisible by tensor ({tp}) x pipeline ({pp}) x "
            f"context ({cp}) parallel sizes"
        )
    dp = world_size // (tp * pp * cp)
    return RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=cp, order=order).get_ranks("cp")


def initialize_startrail(
    team_size: int | None = None,
    ulysses_size: int = 1,
    *,
    order: str = DEFAULT_ORDER,
    timeout: datetime.timedelta | None = None,
    nccl_comm_cfgs: dict | None = None,
    **options,
) -> StarTrailGroups:
    """Build the StarTrail groups of every CP group; collective, once per process.

    ``order`` must be the one given to ``initialize_model_parallel`` (Megatron's default,
    or ``tp-cp-ep-pp-dp`` with ``--use-tp-pp-dp-mapping``). Groups are made the way
    Megatron makes its own: ``parallel_state.create_group`` with ``timeout`` (pass
    ``--distributed-timeout-minutes`` as a ``timedelta``), a group description
    (``STARTRAIL_<ROLE>``) and, on NCCL, the ``"cp"`` entry of ``nccl_comm_cfgs`` (the
    parsed ``--nccl-communicator-config-path``) as ``pg_options``. ``options`` go to
    :func:`megatron_startrail.new_startrail_groups` (``backward_rotation``, ``kernel``,
    ``transfer``, ``regather_in_backward``, or all settings at once as ``config``).
    """
    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError("call parallel_state.initialize_model_parallel before initialize_startrail")
    cp_groups = context_parallel_groups(
        dist.get_world_size(),
        tp=parallel_state.get_tensor_model_parallel_world_size(),
        pp=parallel_state.get_pipeline_model_parallel_world_size(),
        cp=parallel_state.get_context_parallel_world_size(),
        order=order,
    )
    # The data layout comes from get_batch_on_this_cp_rank, which uses Megatron's CP group:
    # refuse to build StarTrail groups that would disagree with it.
    mine = list(parallel_state.get_context_parallel_global_ranks())
    if mine not in cp_groups:
        raise ValueError(
            f"Megatron's CP group of rank {dist.get_rank()} is {mine}, not one of the CP groups of "
            f"order {order!r}: pass the order given to initialize_model_parallel"
        )
    pg_options = None
    if group_backend() == "nccl":  # StarTrail's groups live inside the CP groups: their NCCL settings
        pg_options = parallel_state.get_nccl_options("cp", nccl_comm_cfgs or {})
    create_group = functools.partial(parallel_state.create_group, pg_options=pg_options)
    # Megatron's CP group is reused (and, with Ulysses off, is the StarTrail group): Note [communicators].
    groups = new_startrail_groups(cp_groups, team_size=team_size, ulysses_size=ulysses_size, timeout=timeout,
                                  create_group=create_group, cp_group=parallel_state.get_context_parallel_group(),
                                  **options)
    assert groups.cp_rank == parallel_state.get_context_parallel_rank()
    return groups
