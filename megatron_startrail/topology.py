"""Pure StarTrail rank math: teams, team groups, sub-rings, the initial send.

No torch.distributed here: everything is a function of positions inside one StarTrail
group, so it can be checked at any size without processes (like Megatron's
``RankGenerator``).

Notation (paper section 3; docs/design.md, "Rank math")::

    P = size      ranks in the StarTrail group
    C = team_size ranks per team; C * C must divide P
    T = P // C    number of teams; team t holds positions t*C .. t*C + C-1
    G = P // C^2  sub-ring length; team group g holds teams g*G .. g*G + G-1

Position r is member ``a = r % C`` of team ``t = r // C``. After the team all-gather
every member holds its team's Q, K, V. The initial send (paper Alg. 2) moves the team's
K, V from member ``a`` to member ``t % C`` of team ``a*G + t // C``, so that member ``m``
of team ``g*G + j`` holds the K, V of team ``j*C + m``. Members with the same ``m`` in
one team group then form a sub-ring (paper Alg. 3) of ``G`` positions at stride ``C``;
after ``G - 1`` steps member ``m`` has seen the K, V of the ``G`` teams ``{j*C + m}``,
1/C of the sequence, and the ``C`` members together have seen all of it.

Picture for P = 8, C = 2 (G = 2): teams (0,1) (2,3) (4,5) (6,7); team groups
{teams 0,1} and {teams 2,3}; sub-rings 0-2, 1-3 (group 0) and 4-6, 5-7 (group 1)::

    team:    0       1      |   2       3
    member:  0   1   0   1  |   0   1   0   1
    pos:     0   1   2   3  |   4   5   6   7
    initial send (pos -> pos): 0->0 1->4 2->1 3->5 4->2 5->6 6->3 7->7
"""

from __future__ import annotations

from dataclasses import dataclass


def check_team_size(size: int, team_size: int, *, flag: str = "team_size") -> None:
    """Raise ValueError unless ``team_size**2`` divides ``size`` (names the setting)."""
    if size < 1:
        raise ValueError(f"StarTrail group size must be >= 1, got {size}")
    if team_size < 1 or size % (team_size * team_size) != 0:
        valid = valid_team_sizes(size)
        raise ValueError(
            f"{flag}={team_size} does not fit a StarTrail group of {size} ranks: "
            f"{flag}^2 must divide {size}; valid values: {valid}"
        )


def valid_team_sizes(size: int) -> list[int]:
    """All C with C*C dividing ``size`` (C = 1 is ring attention)."""
    return [c for c in range(1, size + 1) if c * c <= size and size % (c * c) == 0]


def team_size_for(size: int, team_size: int) -> int:
    """The team size on a StarTrail group of ``size`` ranks under ``--startrail-team-size
    team_size``: the largest ``C <= team_size`` with ``C*C`` dividing ``size`` (1, ring
    attention, where none larger does; hybrid CP's groups of every size)."""
    return max(c for c in valid_team_sizes(size) if c <= team_size)


@dataclass(frozen=True)
class StarTrailTopology:
    """Rank math of one StarTrail group of ``size`` positions and team size ``team_size``."""

    size: int
    team_size: int

    def __post_init__(self) -> None:
        check_team_size(self.size, self.team_size)

    # -- shape of the decomposition ------------------------------------------------
    @property
    def num_teams(self) -> int:  # T
        return self.size // self.team_size

    @property
    def sub_ring_size(self) -> int:  # G
        return self.size // (self.team_size * self.team_size)

    @property
    def one_position_sub_rings(self) -> bool:
        """``G = 1`` with ``C > 1`` (``P = C^2``): nothing circulates, and the backward's
        rotation "q" runs piece by piece (Note [piece-major rotation q] in backward.py)."""
        return self.sub_ring_size == 1 and self.team_size > 1

    def team_of(self, pos: int) -> int:
        return pos // self.team_size

    def member_of(self, pos: int) -> int:
        return pos % self.team_size

    def position(self, team: int, member: int) -> int:
        return team * self.team_size + member

    def team_positions(self, team: int) -> list[int]:
        return [self.position(team, m) for m in range(self.team_size)]

    def teams(self) -> list[list[int]]:
        """Every team's positions, in team order (the team process groups)."""
        return [self.team_positions(t) for t in range(self.num_teams)]

    # -- initial send (paper Alg. 2) -------------------------------------------------
    def init_send_dst(self, pos: int) -> int:
        """Where member ``a`` of team ``t`` sends its team's K, V before the sub-ring loop."""
        c, g = self.team_size, self.sub_ring_size
        t, a = self.team_of(pos), self.member_of(pos)
        return self.position(a * g + t // c, t % c)

    def init_send_src(self, pos: int) -> int:
        """Inverse of :meth:`init_send_dst`: who sends K, V to ``pos``."""
        c, g = self.team_size, self.sub_ring_size
        team, m = self.team_of(pos), self.member_of(pos)
        group, j = divmod(team, g)
        return self.position(j * c + m, group)

    # -- sub-rings (paper Alg. 3) ----------------------------------------------------
    def sub_rings(self) -> list[list[int]]:
        """Every sub-ring's positions, in ring order (next of ring[i] is ring[i+1])."""
        c, g = self.team_size, self.sub_ring_size
        return [
            [self.position(group * g + j, m) for j in range(g)]
            for group in range(c)
            for m in range(c)
        ]

    def kv_team_at_step(self, pos: int, step: int) -> int:
        """Team whose K, V position ``pos`` holds at sub-ring step ``step`` (0 .. G-1).

        Step 0 is what the initial send delivered (team ``j*C + m``); each step the K, V
        move to the next position of the sub-ring, so at step ``i`` position ``pos`` holds what its ``i``-th
        predecessor received initially.
        """
        g = self.sub_ring_size
        j = self.team_of(pos) % g
        return ((j - step) % g) * self.team_size + self.member_of(pos)
