"""Pure rank math, checked at many sizes without processes."""

import functools
from collections import Counter

import pytest

from megatron_startrail.topology import StarTrailTopology, valid_team_sizes
from megatron_startrail.transfer import sub_ring_lanes

SIZES = [1, 2, 4, 8, 9, 16, 18, 32, 36, 64, 128, 256, 1024]


def all_topologies():
    for p in SIZES:
        for c in valid_team_sizes(p):
            if (p, c) != (1024, 1):  # the plain ring is checked to P = 256; its 10^6 pairs at 1024 took 8 s
                yield StarTrailTopology(p, c)


@pytest.mark.parametrize("topo", list(all_topologies()), ids=lambda t: f"P{t.size}C{t.team_size}")
def test_every_query_key_team_pair_is_computed_exactly_once(topo):
    # Forward: position r computes its team's queries against the K, V it holds at each
    # step. The C members of a team see disjoint key teams, so over all positions and
    # steps every (query team, key team) pair must be computed exactly once.
    pairs = Counter()
    for pos in range(topo.size):
        for step in range(topo.sub_ring_size):
            pairs[(topo.team_of(pos), topo.kv_team_at_step(pos, step))] += 1
    t = topo.num_teams
    assert pairs == Counter({(qt, kt): 1 for qt in range(t) for kt in range(t)})


@pytest.mark.parametrize("topo", list(all_topologies()), ids=lambda t: f"P{t.size}C{t.team_size}")
def test_backward_rotation_covers_the_same_pairs(topo):
    # Backward with K, V fixed at their step-0 holders and queries rotating.
    pairs = Counter()
    for pos in range(topo.size):
        for step in range(topo.sub_ring_size):
            # The queries pos holds at ``step`` are those its sub-ring lane brought from ``origin``.
            pairs[(topo.team_of(_ring_lane(topo, pos).origin(pos, step)), topo.kv_team_at_step(pos, 0))] += 1
    t = topo.num_teams
    assert pairs == Counter({(qt, kt): 1 for qt in range(t) for kt in range(t)})


@functools.lru_cache(maxsize=None)
def _lanes(size: int, team_size: int) -> list:
    """Every position's lanes, from ``sub_ring_lanes`` once per position (it rebuilds the
    sub-rings on each call: asked per step, P1024 C2 took 8 minutes of the suite)."""
    topo = StarTrailTopology(size, team_size)
    return [sub_ring_lanes(topo, pos, "ring") for pos in range(size)]


def _ring_lane(topo, pos):
    """The sub-ring the schedule runs for ``pos`` (StarTrail's single ring)."""
    (lane,) = _lanes(topo.size, topo.team_size)[pos]
    return lane


@pytest.mark.parametrize("topo", list(all_topologies()), ids=lambda t: f"P{t.size}C{t.team_size}")
def test_initial_send_and_ring_are_consistent(topo):
    p = topo.size
    dst = [topo.init_send_dst(r) for r in range(p)]
    assert sorted(dst) == list(range(p)), "initial send must be a permutation"
    for r in range(p):
        assert topo.init_send_src(dst[r]) == r
        # The K, V delivered initially is the sender's team.
        assert topo.kv_team_at_step(dst[r], 0) == topo.team_of(r)
        lane = _ring_lane(topo, r)
        assert lane.prev(lane.next(r)) == r
        # K, V held at step i+1 is what the previous position of the sub-ring held at step i.
        prev = lane.prev(r)
        for step in range(topo.sub_ring_size - 1):
            assert topo.kv_team_at_step(r, step + 1) == topo.kv_team_at_step(prev, step)
    rings = topo.sub_rings()
    assert sorted(x for ring in rings for x in ring) == list(range(p))
    for ring in rings:
        assert len(ring) == topo.sub_ring_size
        for i, r in enumerate(ring):
            assert _ring_lane(topo, r).next(r) == ring[(i + 1) % len(ring)]
            # A sub-ring stays inside one team group: consecutive teams, same member.
            assert topo.member_of(r) == topo.member_of(ring[0])


def test_paper_algorithms_literal_form():
    # Paper Alg. 2/3 written with (inter-team rank r_t, intra-team rank r_a,
    # d_t = number of teams, d_a = team size), compared with the class.
    for topo in all_topologies():
        c, t_count = topo.team_size, topo.num_teams
        group_size = t_count // c
        for r in range(topo.size):
            rt, ra = r // c, r % c
            target_team = ra * group_size + rt // c
            assert topo.init_send_dst(r) == target_team * c + rt % c
            own_group = rt // group_size
            nxt = (rt + 1) % group_size + group_size * own_group
            lst = (rt - 1) % group_size + group_size * own_group
            assert _ring_lane(topo, r).next(r) == ra + nxt * c
            assert _ring_lane(topo, r).prev(r) == ra + lst * c


def test_known_small_case():
    topo = StarTrailTopology(8, 2)
    assert [topo.init_send_dst(r) for r in range(8)] == [0, 4, 1, 5, 2, 6, 3, 7]
    assert topo.sub_rings() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    ring = StarTrailTopology(8, 1)
    assert ring.sub_rings() == [list(range(8))]
    assert [ring.init_send_dst(r) for r in range(8)] == list(range(8))
    star = StarTrailTopology(16, 4)
    assert star.sub_ring_size == 1 and star.sub_rings() == [[r] for r in range(16)]


@pytest.mark.parametrize("p,c", [(8, 3), (8, 4), (12, 3), (16, 3), (4, 0)])
def test_invalid_team_size_names_the_setting(p, c):
    with pytest.raises(ValueError, match="team_size"):
        StarTrailTopology(p, c)


def test_valid_team_sizes():
    assert valid_team_sizes(16) == [1, 2, 4]
    assert valid_team_sizes(8) == [1, 2]
    assert valid_team_sizes(36) == [1, 2, 3, 6]
