"""Several CP groups in one world, and bad settings failing fast on every rank."""

import torch
import torch.distributed as dist

from megatron_startrail import new_startrail_groups, startrail_attn
from megatron_startrail.groups import plan_cp_group
from tests.attention_cases import TOLERANCE, full_inputs, local_rows, reference_with_grads, relative_error
from tests.multiproc import run_ranks


def test_plan_cp_group_layout():
    plan = plan_cp_group([10, 11, 12, 13, 14, 15, 16, 17], team_size=2, ulysses_size=2)
    assert plan["ulysses"] == [[10, 11], [12, 13], [14, 15], [16, 17]]
    assert plan["startrail"] == [[10, 12, 14, 16], [11, 13, 15, 17]]
    assert plan["teams"] == [[10, 12], [14, 16], [11, 13], [15, 17]]


def multi_group_worker(rank, world_size, cp_groups, team_size, ulysses_size):
    groups = new_startrail_groups(cp_groups, team_size=team_size, ulysses_size=ulysses_size)
    index = next(i for i, g in enumerate(cp_groups) if rank in g)
    cp = len(cp_groups[index])
    assert groups.cp_global_ranks == tuple(cp_groups[index])
    # Each CP group attends over its own sequence (different seed per group).
    full = full_inputs(100 + index, 2 * cp * 2, 1, 4, 2, 8, torch.float32)
    ref = reference_with_grads(*full, True, 8**-0.5)
    q, k, v, dout = (local_rows(t, groups.cp_rank, cp).float() for t in full)
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    out = startrail_attn(q, k, v, groups, causal=True)
    out.backward(dout)
    errors = [relative_error(g, local_rows(r, groups.cp_rank, cp)) for g, r in zip((out, q.grad, k.grad, v.grad), ref)]
    # P2P stays inside this rank's CP group.
    peers = set(groups.last_forward_stats.p2p_bytes_sent_to) | set(groups.last_backward_stats.p2p_bytes_sent_to)
    # A twin group over the same ranks (on gloo: transfers to a lower position go through it).
    twin = groups.startrail_twin_group
    assert twin is not None and twin is not groups.startrail_group
    assert dist.get_process_group_ranks(twin) == dist.get_process_group_ranks(groups.startrail_group)
    return max(errors), peers <= set(cp_groups[index])


def test_each_backend_routes_transfers_to_its_twin_group_by_its_own_rule():
    """gloo: by direction (a transfer to a lower position gets its own TCP connection);
    NCCL: by channel (the side channel on its own communicator, beside the sub-ring's hops)."""
    from megatron_startrail.transport import GlooTransport, NcclTransport  # noqa: PLC0415

    groups = {"startrail": "main group", "startrail_twin": "twin group"}
    gloo, nccl = (cls.__new__(cls) for cls in (GlooTransport, NcclTransport))
    for transport in (gloo, nccl):
        transport.groups, transport.p2p_roles = groups, ("startrail", "startrail_twin")
    for channel in ("ring", "side"):
        assert gloo.p2p_group(0, 2, channel) == "main group"
        assert gloo.p2p_group(2, 0, channel) == "twin group"
    for src, dst in ((0, 2), (2, 0)):
        assert nccl.p2p_group(src, dst, "ring") == "main group"
        assert nccl.p2p_group(src, dst, "side") == "twin group"
    gloo.groups = {"startrail": "main group", "startrail_twin": None}  # no twin: one group for all
    assert gloo.p2p_group(2, 0, "ring") == "main group"


def test_megatron_style_strided_cp_groups():
    # TP=2 x CP=4 in Megatron's order: CP groups are [0,2,4,6] and [1,3,5,7].
    cp_groups = [[0, 2, 4, 6], [1, 3, 5, 7]]
    for err, peers_ok in run_ranks(multi_group_worker, 8, args=(cp_groups, 2, 1)):
        assert err <= TOLERANCE[torch.float32] and peers_ok


def test_four_cp_groups_with_ulysses():
    cp_groups = [[i, i + 4, i + 8, i + 12] for i in range(4)]  # CP=4 = U2 x S2 each
    for err, peers_ok in run_ranks(multi_group_worker, 16, args=(cp_groups, 1, 2)):
        assert err <= TOLERANCE[torch.float32] and peers_ok


def error_worker(rank, world_size):
    """Every bad setting raises ValueError on every rank, and no rank is left waiting."""
    messages = {}

    def expect(name, fn):
        try:
            fn()
        except ValueError as e:
            messages[name] = str(e)

    expect("team_size", lambda: new_startrail_groups(team_size=3))
    expect("ulysses_size", lambda: new_startrail_groups(team_size=1, ulysses_size=3))
    expect("cp_ranks", lambda: new_startrail_groups([[0, 1], [2]], team_size=1))
    groups = new_startrail_groups(team_size=2, ulysses_size=2)  # 8 = U2 x S4, C=2
    x = lambda *shape, dtype=torch.float32: torch.randn(*shape, dtype=dtype)
    expect("odd_seq", lambda: startrail_attn(x(3, 1, 4, 8), x(3, 1, 4, 8), x(3, 1, 4, 8), groups))
    expect("heads_u", lambda: startrail_attn(x(4, 1, 3, 8), x(4, 1, 3, 8), x(4, 1, 3, 8), groups))
    expect("kv_heads_u", lambda: startrail_attn(x(4, 1, 6, 8), x(4, 1, 3, 8), x(4, 1, 3, 8), groups))
    expect("dtype", lambda: startrail_attn(x(4, 1, 4, 8), x(4, 1, 4, 8, dtype=torch.float16), x(4, 1, 4, 8), groups))
    expect("shape", lambda: startrail_attn(x(4, 1, 4, 8), x(4, 2, 4, 8), x(4, 2, 4, 8), groups))
    expect("kv_shape", lambda: startrail_attn(x(4, 1, 4, 8), x(4, 1, 4, 8), x(4, 1, 2, 8), groups))
    expect("rank", lambda: startrail_attn(x(4, 4, 8), x(4, 4, 8), x(4, 4, 8), groups))
    expect("gqa", lambda: startrail_attn(x(4, 1, 4, 8), x(4, 1, 3, 8), x(4, 1, 3, 8), groups))
    # Nothing is pending: a collective right after still lines up on every rank.
    dist.barrier()
    return messages


def test_bad_settings_raise_value_error_naming_the_setting():
    results = run_ranks(error_worker, 8, timeout=120)
    assert all(r == results[0] for r in results)
    msgs = results[0]
    assert set(msgs) == {
        "team_size", "ulysses_size", "cp_ranks", "odd_seq", "heads_u", "kv_heads_u",
        "dtype", "shape", "kv_shape", "rank", "gqa",
    }, msgs
    assert "team_size=3" in msgs["team_size"] and "valid values: [1, 2]" in msgs["team_size"]
    assert "ulysses_size=3" in msgs["ulysses_size"]
    assert "--seq-length" in msgs["odd_seq"] and "2 * context-parallel size = 16" in msgs["odd_seq"]
    assert "--ulysses-degree-in-cp" in msgs["heads_u"]
    assert "--ulysses-degree-in-cp" in msgs["kv_heads_u"]
    assert "dtype" in msgs["dtype"]


def communicators_worker(rank, world_size):
    """How many groups holding this rank new_startrail_groups makes (each is an NCCL
    communicator on a GPU), with and without an existing CP group to reuse, and a run on it."""
    counts = {}
    for ulysses, team, reuse in ((1, 1, False), (1, 2, False), (1, 2, True), (2, 2, False), (2, 2, True)):
        made = []

        def create_group(ranks, *, timeout, group_desc, made=made):
            pg = dist.new_group(ranks, timeout=timeout, group_desc=group_desc)
            if rank in ranks:
                made.append(group_desc)
            return pg

        groups = new_startrail_groups(team_size=team, ulysses_size=ulysses, create_group=create_group,
                                      cp_group=dist.group.WORLD if reuse else None)
        q, k, v = (torch.randn(8, 1, 4, 8, requires_grad=True) for _ in range(3))
        startrail_attn(q, k, v, groups).sum().backward()  # the harness replays it under NCCL's rules
        shared = groups.startrail_group is groups.cp_group
        counts[ulysses, team, reuse] = (sorted(made), shared)
    return counts


def test_startrail_makes_only_the_communicators_it_needs():
    """Note [communicators]: with Ulysses off the StarTrail group is the CP group (Megatron's,
    when given) and its twin the CP group's twin; before, five groups per rank (startrail, its
    twin, team, cp, cp twin), six with Ulysses."""
    for counts in run_ranks(communicators_worker, 8):
        assert counts[1, 1, False] == (["STARTRAIL_CP", "STARTRAIL_STARTRAIL_TWIN"], True)
        assert counts[1, 2, False] == (["STARTRAIL_CP", "STARTRAIL_STARTRAIL_TWIN", "STARTRAIL_TEAM"], True)
        assert counts[1, 2, True] == (["STARTRAIL_STARTRAIL_TWIN", "STARTRAIL_TEAM"], True)
        # Ulysses: its group, the StarTrail group and twin, the team; the CP twin on gloo only.
        assert counts[2, 2, True] == (["STARTRAIL_CP_TWIN", "STARTRAIL_STARTRAIL", "STARTRAIL_STARTRAIL_TWIN",
                                       "STARTRAIL_TEAM", "STARTRAIL_ULYSSES"], False)
        assert len(counts[2, 2, False][0]) == 6
