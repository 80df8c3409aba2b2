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

import torch

import torch.distributed as dist

from .comm import CommStats
from .kernels.selection import KERNELS
from .layout import startrail_position_chunks
from .topology import StarTrailTopology, check_team_size

BACKWARD_ROTATIONS = ("auto", "q", "kv")


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
    # A second group over the same StarTrail ranks, carrying the P2P transfers to a lower
    # position (gloo only, else None): gloo runs both directions of a rank pair on one TCP
    # connection, and there a single message each way -- a pair exchange -- serialises
    # (benchmarks/burst_probe.py: 3.4 MB/s on one connection, 6.4 on two, at 50 Mbit/s).
    startrail_reverse_group: object | None = None
    backward_rotation: str = "auto"
    kernel: str = "auto"
    last_forward_stats: CommStats | None = field(default=None, repr=False)
    last_backward_stats: CommStats | None = field(default=None, repr=False)

    @property
    def cp_size(self) -> int:
        return len(self.cp_global_ranks)

    @property
    def team_size(self) -> int:
        return self.topology.team_size

    def position_chunks(self, position: int) -> tuple[int, ...]:
        """Global chunk indices StarTrail position ``position`` holds (after Ulysses)."""
        return startrail_position_chunks(position, self.ulysses_size, self.cp_size)

    def describe(self) -> str:
        t = self.topology
        return (
            f"StarTrail CP={self.cp_size} (Ulysses U={self.ulysses_size} x StarTrail S={t.size}), "
            f"team size C={t.team_size}, {t.num_teams} teams, sub-rings of {t.sub_ring_size}"
        )


def default_group_timeout() -> datetime.timedelta | None:
    """The default process group's timeout (what ``init_process_group`` was given), or None
    (torch's default for new groups) where the backend does not expose it."""
    world = dist.group.WORLD
    for device in (torch.device("cpu"), torch.device("cuda")):
        try:
            return world._get_backend(device).options._timeout
        except (AttributeError, RuntimeError):
            continue
    return None


def new_startrail_groups(
    cp_ranks: list[list[int]] | None = None,
    *,
    team_size: int,
    ulysses_size: int = 1,
    backward_rotation: str = "auto",
    kernel: str = "auto",
    timeout: datetime.timedelta | None = None,
) -> StarTrailGroups:
    """Create the StarTrail groups of every CP group; collective on every rank.

    ``cp_ranks`` lists every CP group's global ranks (each rank in exactly one); ``None``
    means one CP group made of all ranks of the default process group. All validation
    happens before the first ``new_group`` call, so a bad setting raises on every rank
    instead of leaving some ranks waiting.

    ``timeout`` bounds every collective and P2P on these groups (a dead or stuck peer makes
    the others raise after it); ``None`` takes the default process group's timeout, i.e.
    Megatron's ``--distributed-timeout-minutes``, where torch would give a new group its
    own 30-minute default.
    """
    if not dist.is_initialized():
        raise RuntimeError("new_startrail_groups needs torch.distributed to be initialized")
    world_size, rank = dist.get_world_size(), dist.get_rank()
    if cp_ranks is None:
        cp_ranks = [list(range(world_size))]
    cp_ranks = [list(map(int, g)) for g in cp_ranks]
    flat = sorted(r for g in cp_ranks for r in g)
    if flat != list(range(world_size)):
        raise ValueError(
            f"cp_ranks must list every rank of the world ({world_size}) exactly once, got {cp_ranks}"
        )
    if len({len(g) for g in cp_ranks}) != 1:
        raise ValueError(f"all context-parallel groups must have the same size, got {cp_ranks}")
    if backward_rotation not in BACKWARD_ROTATIONS:
        raise ValueError(f"backward_rotation={backward_rotation!r} is not one of {BACKWARD_ROTATIONS}")
    if kernel not in KERNELS:
        raise ValueError(f"kernel={kernel!r} (--startrail-kernel) is not one of {KERNELS}")
    plans = [plan_cp_group(g, team_size, ulysses_size) for g in cp_ranks]
    if timeout is None:
        timeout = default_group_timeout()

    def create(rank_lists: list[list[int]]) -> object | None:
        mine = None
        for ranks in rank_lists:
            pg = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                mine = pg
        return mine

    # NCCL runs the two directions of a pair on their own channels; gloo needs a second group.
    split_directions = dist.get_backend() == "gloo"
    ulysses_group = startrail_group = team_group = reverse_group = None
    for plan in plans:
        if ulysses_size > 1:
            ulysses_group = create(plan["ulysses"]) or ulysses_group
        startrail_group = create(plan["startrail"]) or startrail_group
        if split_directions:
            reverse_group = create(plan["startrail"]) or reverse_group
        if team_size > 1:
            team_group = create(plan["teams"]) or team_group

    my_cp = next(g for g in cp_ranks if rank in g)
    cp_rank = my_cp.index(rank)
    st_rank, u_rank = divmod(cp_rank, ulysses_size)
    st_ranks = tuple(my_cp[s * ulysses_size + u_rank] for s in range(len(my_cp) // ulysses_size))
    return StarTrailGroups(
        topology=StarTrailTopology(len(st_ranks), team_size),
        cp_global_ranks=tuple(my_cp),
        cp_rank=cp_rank,
        ulysses_size=ulysses_size,
        ulysses_rank=u_rank,
        ulysses_group=ulysses_group,
        startrail_rank=st_rank,
        startrail_global_ranks=st_ranks,
        startrail_group=startrail_group,
        team_group=team_group,
        startrail_reverse_group=reverse_group,
        backward_rotation=backward_rotation,
        kernel=kernel,
    )
