"""The one place that creates StarTrail process groups.

Ranks are laid out inside each context-parallel (CP) group of ``CP = U * S`` ranks as::

    CP position c = s * U + u      u: Ulysses rank (0..U-1), s: StarTrail position (0..S-1)

    Ulysses groups   : U consecutive CP positions  {s*U + u : u}     (all-to-all)
    StarTrail groups : stride U across them         {s*U + u : s}     (sub-ring P2P)
    team groups      : C consecutive StarTrail positions inside a StarTrail group

Consecutive CP ranks are usually on one node, so Ulysses all-to-alls and team
collectives stay inside a node while the sub-ring P2P crosses nodes only where it must.
Process-group creation is collective: every rank creates every group of every CP group
in the same order and keeps the ones that contain it (like Megatron's
``initialize_model_parallel``).
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.distributed as dist

from . import nccl_rules
from .comm import CommStats
from .config import StarTrailConfig
from .microbatch import MicroBatchCache
from .topology import StarTrailTopology, check_team_size
from .transport import DEVICE_TYPES, ROLES, Transport, default_device_type, group_backend, transport_for



def plan_cp_group(cp_ranks: list[int], team_size: int, ulysses_size: int) -> dict[str, list[list[int]]]:
    """Pure: the Ulysses, StarTrail and team groups (global ranks) of one CP group."""
    cp_size = len(cp_ranks)
    if ulysses_size < 1 or cp_size % ulysses_size != 0:
        raise ValueError(
            f"ulysses_size={ulysses_size} must divide the context-parallel size {cp_size}"
        )
    st_size = cp_size // ulysses_size
    check_team_size(st_size, team_size)
    topo = StarTrailTopology(st_size, team_size)
    ulysses = [[cp_ranks[s * ulysses_size + u] for u in range(ulysses_size)] for s in range(st_size)]
    startrail = [[cp_ranks[s * ulysses_size + u] for s in range(st_size)] for u in range(ulysses_size)]
    teams = [[st[p] for p in team] for st in startrail for team in topo.teams()]
    return {"ulysses": ulysses, "startrail": startrail, "teams": teams}


@dataclass(eq=False)
class StarTrailGroups:
    """This rank's StarTrail groups and where it sits in them.

    ``last_forward_stats`` / ``last_backward_stats`` hold the communication of the most
    recent attention call made with these groups (set by :func:`startrail_attn`).
    """

    topology: StarTrailTopology  # of the StarTrail group (size S, team size C)
    cp_global_ranks: tuple[int, ...]
    cp_rank: int
    ulysses_size: int
    ulysses_rank: int
    ulysses_group: object | None  # None when U == 1
    startrail_rank: int  # position s in the StarTrail group
    startrail_global_ranks: tuple[int, ...]
    startrail_group: object
    team_group: object | None  # None when C == 1
    # A second group over the same StarTrail ranks (see megatron_startrail.transport): on
    # gloo it carries the transfers to a lower position (their own TCP connection); on NCCL
    # the side channel (initial send, its reverse, gradient accumulators), so that they
    # progress beside the sub-ring's hops instead of queueing behind them.
    startrail_twin_group: object | None = None
    cp_group: object | None = None  # this rank's whole CP group (the packed-document agreement)
    # For each device type the groups' backend carries ({"cpu": ..., "cuda": ...}), the pair
    # (transport of every message of the attention, the same with P2P over the CP group): the
    # attention takes the pair of its tensors' device (:meth:`transports_on`).
    device_transports: dict = field(default_factory=dict, repr=False)
    config: StarTrailConfig = field(default_factory=StarTrailConfig)  # how the attention runs on these groups
    # Per-micro-batch packed-document metadata, shared by every layer (megatron_startrail.documents).
    documents_cache: MicroBatchCache = field(default_factory=MicroBatchCache, repr=False)
    last_forward_stats: CommStats | None = field(default=None, repr=False)
    last_backward_stats: CommStats | None = field(default=None, repr=False)

    @property
    def cp_size(self) -> int:
        return len(self.cp_global_ranks)

    @property
    def team_size(self) -> int:
        return self.topology.team_size

    @property
    def backward_rotation(self) -> str:
        return self.config.backward_rotation

    @property
    def kernel(self) -> str:
        return self.config.kernel

    @property
    def transport(self) -> Transport:
        """The transport of the default device (:func:`~megatron_startrail.transport.default_device_type`):
        for what runs before any tensor exists (the eager initialisation); the attention asks
        :meth:`transports_on` its tensors' device."""
        return self.device_transports[default_device_type()][0]

    @property
    def cp_transport(self) -> Transport:
        return self.device_transports[default_device_type()][1]

    def transports_on(self, device: torch.device) -> tuple[Transport, Transport]:
        """``(transport, cp_transport)`` for tensors on ``device``: chosen by the tensors, not by
        whether this process sees a GPU (a group "cpu:gloo,cuda:nccl" carries CPU tensors on gloo
        and CUDA tensors on NCCL, and torch's fake group stands in for either); ValueError naming
        the backend when the groups' backend carries no ``device`` tensors."""
        pair = self.device_transports.get(torch.device(device).type)
        if pair is None:
            raise ValueError(f"StarTrail's attention got {torch.device(device).type} tensors, but its process "
                             f"groups carry only {', '.join(sorted(self.device_transports))} tensors (backend "
                             f"{dist.get_backend(self.startrail_group)!r}): run the attention on that device, or "
                             f"create the groups with a backend for {torch.device(device).type}")
        return pair

    def __copy__(self) -> StarTrailGroups:
        """A shallow copy: the same process groups (a group handle is shared, never duplicated)."""
        copied = object.__new__(type(self))
        copied.__dict__.update(self.__dict__)
        return copied

    def __reduce__(self):
        raise TypeError(
            "StarTrailGroups holds this process's torch.distributed process groups (communicators of live "
            "connections), which cannot be pickled or sent to another process: build the groups in each process "
            "with new_startrail_groups() or, under Megatron, initialize_startrail() (collective on every rank)"
        )

    def describe(self) -> str:
        t = self.topology
        return (
            f"StarTrail CP={self.cp_size} (Ulysses U={self.ulysses_size} x StarTrail S={t.size}), "
            f"team size C={t.team_size}, {t.num_teams} teams, sub-rings of {t.sub_ring_size}"
        )


# Note [communicators]
# --------------------
# Every NCCL communicator costs GPU memory (buffers per peer and channel), so a rank makes
# only the ones the schedule needs beyond Megatron's (one group of each role per CP group):
#
#     role             ranks                      when                 carries
#     cp               the CP group               Megatron's, reused   packed-document check, halo P2P
#     cp_twin          the CP group               gloo only            halo P2P to a lower rank (gloo)
#     startrail        the StarTrail group        U > 1 (else: cp)     sub-ring hops (channel "ring")
#     startrail_twin   the StarTrail group        always               the side channel (NCCL), lower
#                                                                      ranks (gloo); = cp_twin, U = 1
#     team             C consecutive positions    C > 1                team collectives
#     ulysses          U consecutive CP ranks     U > 1                the Ulysses all-to-alls
#
# With Ulysses off the StarTrail group IS the CP group (same ranks, same order), so one
# communicator and one twin serve both. On NCCL the halo exchange posts on the "ring"
# channel only, so the CP group's own twin is made only for gloo, where it gives transfers
# to a lower rank their own TCP connection. Per rank, from Megatron (its CP group reused):
# U = 1 makes the twin and, for C > 1, the team (before: five); U > 1 adds the Ulysses
# group and the StarTrail group with its twin (and the CP twin on gloo) (before: six).
#
# A group the caller already has is not made again either. A caller that holds other
# groups over these ranks hands them over (``existing_groups``: ranks -> its group on this
# rank, None where the rank is not in it, the same keys on every rank); a team or Ulysses
# group -- collectives only, one call at a time -- over the same ranks is that group. Under
# hybrid CP a team is C consecutive ranks of an aligned slice, which is Megatron's aligned
# group of C (megatron/dynamic_cp.py hands over the groups of the smaller sizes): at
# DP x CP = 64 with C <= 8 the teams of sizes 4..64 reuse its groups of 2, 4 and 8 (11
# communicators per rank -> 6; benchmarks/results/scale_replay.md). Sharing a communicator
# orders those operations on one stream; the NCCL replay names a group by its process
# group, so it checks that order across every set that uses it. Group creation stays
# collective: every rank has the same keys, so all skip the same creations.


def _checked_cp_ranks(cp_ranks, cp_group) -> list[list[int]]:
    """``cp_ranks`` as lists of ints (``None``: one CP group of the whole world), or ValueError
    (before any group exists) when they do not partition the world into equal groups or
    ``cp_group`` is not this rank's."""
    world_size, rank = dist.get_world_size(), dist.get_rank()
    cp_ranks = [list(range(world_size))] if cp_ranks is None else [list(map(int, g)) for g in cp_ranks]
    if sorted(r for g in cp_ranks for r in g) != list(range(world_size)):
        raise ValueError(f"cp_ranks must list every rank of the world ({world_size}) exactly once, got {cp_ranks}")
    if len({len(g) for g in cp_ranks}) != 1:
        raise ValueError(f"all context-parallel groups must have the same size, got {cp_ranks}")
    my_cp = next(g for g in cp_ranks if rank in g)
    if cp_group is not None and list(dist.get_process_group_ranks(cp_group)) != my_cp:
        raise ValueError(f"cp_group holds ranks {dist.get_process_group_ranks(cp_group)}, but this rank's CP "
                         f"group is {my_cp}: pass the context-parallel group these CP ranks describe")
    return cp_ranks


def _create_groups(plans, cp_ranks, ulysses_size, team_size, timeout, create_group, cp_group,
                   existing_groups: dict) -> dict:
    """Every group of every CP group, role by role in one order on every rank (collective);
    returns this rank's group of each role (Note [communicators])."""
    rank = dist.get_rank()
    gloo = group_backend() == "gloo"

    def create(rank_lists: list[list[int]], role: str) -> object | None:
        mine = None
        for ranks in rank_lists:
            if role in ("team", "ulysses") and tuple(ranks) in existing_groups:
                pg = existing_groups[tuple(ranks)]
            else:
                pg = create_group(ranks, timeout=timeout, group_desc=f"STARTRAIL_{role.upper()}")
            if rank in ranks:
                mine = pg
        return mine

    mine: dict[str, object | None] = dict.fromkeys(ROLES)
    for plan, cp in zip(plans, cp_ranks):
        built = {"cp": create([cp], "cp") if cp_group is None else (cp_group if rank in cp else None)}
        built["ulysses"] = create(plan["ulysses"], "ulysses") if ulysses_size > 1 else None
        if ulysses_size == 1:  # the StarTrail group is the CP group
            built["startrail"] = built["cp"]
            built["startrail_twin"] = built["cp_twin"] = create([cp], "startrail_twin")
        else:
            built["startrail"] = create(plan["startrail"], "startrail")
            built["startrail_twin"] = create(plan["startrail"], "startrail_twin")
            built["cp_twin"] = create([cp], "cp_twin") if gloo else None
        built["team"] = create(plan["teams"], "team") if team_size > 1 else None
        if rank in cp:
            mine = built
    return mine


def torch_new_group(ranks: list[int], *, timeout, group_desc: str):
    """torch's group creation; Megatron passes its own ``parallel_state.create_group``."""
    return dist.new_group(ranks, timeout=timeout, group_desc=group_desc)


def new_startrail_groups(
    cp_ranks: list[list[int]] | None = None,
    *,
    team_size: int | None = None,
    ulysses_size: int = 1,
    backward_rotation: str = "auto",
    kernel: str = "auto",
    transfer: str = "ring",
    regather_in_backward: bool = False,
    reverse_overlap: bool = True,
    config: StarTrailConfig | None = None,
    timeout: datetime.timedelta | None = None,
    create_group: Callable = torch_new_group,
    eager_init: bool = True,
    cp_group=None,
    existing_groups: dict | None = None,
) -> StarTrailGroups:
    """Create the StarTrail groups of every CP group; collective on every rank.

    The settings are one :class:`~megatron_startrail.config.StarTrailConfig`: ``config``, or
    built from ``team_size``, ``ulysses_size``, ``backward_rotation``, ``kernel``,
    ``transfer``, ``regather_in_backward`` and ``reverse_overlap`` (not both). It travels with the groups
    (``StarTrailGroups.config``) to every attention call made with them.

    ``cp_ranks`` lists every CP group's global ranks (each rank in exactly one); ``None``
    means one CP group made of all ranks of the default process group. All validation
    happens before the first group is created, so a bad setting raises on every rank
    instead of leaving some ranks waiting.

    ``timeout`` bounds every collective and P2P on these groups (a dead or stuck peer makes
    the others raise after it); ``None`` is torch's default for new groups. Megatron runs
    pass ``--distributed-timeout-minutes`` (``initialize_startrail`` does).
    ``create_group(ranks, timeout=, group_desc=)`` makes one group (Megatron:
    ``parallel_state.create_group`` with its NCCL options). ``eager_init`` runs one
    collective on every group before its first P2P, as NCCL requires (switch it off only
    to show what the NCCL-rules mode catches).

    ``cp_group``: this rank's existing process group over its CP ranks (Megatron's
    ``parallel_state.get_context_parallel_group()``), used instead of a new one -- and, with
    Ulysses off, as the StarTrail group too, whose ranks are the same (Note [communicators]).
    Pass it on every rank or on none (group creation is collective).

    ``existing_groups``: other groups the caller holds, ``{tuple(ranks): this rank's group,
    or None where it is not in it}``, the same keys on every rank; a team or Ulysses group
    over the same ranks is taken from it instead of made (Note [communicators]).
    """
    if not dist.is_initialized():
        raise RuntimeError("new_startrail_groups needs torch.distributed to be initialized")
    rank = dist.get_rank()
    cp_ranks = _checked_cp_ranks(cp_ranks, cp_group)
    if config is None:
        if team_size is None:
            raise ValueError("new_startrail_groups needs team_size (or a StarTrailConfig as config=)")
        config = StarTrailConfig(team_size, ulysses_size, backward_rotation, transfer, regather_in_backward,
                                 reverse_overlap=reverse_overlap, kernel=kernel)
    elif team_size is not None and team_size != config.team_size or ulysses_size not in (1, config.ulysses_size):
        raise ValueError(f"pass the settings either as config={config} or as keywords, not both")
    team_size, ulysses_size = config.team_size, config.ulysses_size
    plans = [plan_cp_group(g, team_size, ulysses_size) for g in cp_ranks]

    mine = _create_groups(plans, cp_ranks, ulysses_size, team_size, timeout, create_group, cp_group,
                          existing_groups or {})
    groups = _groups_of_this_rank(mine, next(g for g in cp_ranks if rank in g), config)
    if eager_init:
        groups.transport.initialize()
    return groups


def _groups_of_this_rank(mine: dict, my_cp: list[int], config: StarTrailConfig) -> StarTrailGroups:
    """This rank's :class:`StarTrailGroups`: where it sits, its groups of each role, and the
    transport over them (checking NCCL's rules in that mode)."""
    rank, ulysses_size = dist.get_rank(), config.ulysses_size
    cp_rank = my_cp.index(rank)
    st_rank, u_rank = divmod(cp_rank, ulysses_size)
    st_ranks = tuple(my_cp[s * ulysses_size + u_rank] for s in range(len(my_cp) // ulysses_size))
    audit = None
    if nccl_rules.enabled():
        nccl_rules.record_megatron_grad_reduce()  # Megatron's own communication in the replay, when it runs here
        audit = nccl_rules.RuleAudit({role: tuple(dist.get_process_group_ranks(g))
                                      for role, g in mine.items() if g is not None},
                                      groups={role: mine[role] for role in ROLES})  # names: the transport's order
    device_transports = {}
    for device_type in DEVICE_TYPES:
        try:
            transport = transport_for(mine, st_ranks, audit, device_type)
        except ValueError:  # a mixed backend string without this device
            continue
        # P2P between CP ranks (halo exchange) over the same groups and audit
        device_transports[device_type] = (transport, transport.on(("cp", "cp_twin"), tuple(my_cp)))
    return StarTrailGroups(
        topology=StarTrailTopology(len(st_ranks), config.team_size),
        cp_global_ranks=tuple(my_cp),
        cp_rank=cp_rank,
        ulysses_size=ulysses_size,
        ulysses_rank=u_rank,
        ulysses_group=mine["ulysses"],
        startrail_rank=st_rank,
        startrail_global_ranks=st_ranks,
        startrail_group=mine["startrail"],
        team_group=mine["team"],
        startrail_twin_group=mine["startrail_twin"],
        cp_group=mine["cp"],
        device_transports=device_transports,
        documents_cache=MicroBatchCache(),
        config=config,
    )
