"""The timeline recorder: spans of every blocking collective and P2P wait, by phase."""

import time

import pytest
import torch
import torch.distributed as dist

from megatron_startrail.comm import CommStats, Communicator
from megatron_startrail.transport import transport_for
from megatron_startrail.timeline import PHASES, Timeline, phase_of
from tests.multiproc import run_ranks


def world_transport(world_size):
    """The transport of one StarTrail group of all ranks, made directly on the default group."""
    return transport_for({"startrail": dist.group.WORLD}, tuple(range(world_size)))


def comm_worker(rank, world_size):
    timeline = Timeline()
    transport = world_transport(world_size)
    comm = Communicator(CommStats(), transport, timeline)
    x = torch.randn(3, 2, generator=torch.Generator().manual_seed(rank))
    start = time.perf_counter()
    gathered = comm.all_gather(x, dist.group.WORLD, world_size, op="team_all_gather")
    got = torch.empty_like(x)
    if rank == 0:
        time.sleep(0.2)  # rank 1 waits for rank 0's late send: its wait span must show it
    comm.post([(x, (rank + 1) % world_size)], [(got, (rank - 1) % world_size)], op="init_send").wait()
    comm.reduce_scatter(gathered, dist.group.WORLD, world_size, op="team_reduce_scatter")
    end = time.perf_counter()
    untimed = Communicator(CommStats(), transport)
    untimed.all_gather(x, dist.group.WORLD, world_size, op="team_all_gather")
    return [op for op, _, _ in timeline.spans], timeline.phase_seconds(start, end), end - start


def test_communicator_records_one_span_per_blocking_call():
    for rank, (ops, phases, window) in enumerate(run_ranks(comm_worker, 2)):
        assert ops == ["team_all_gather", "init_send", "team_reduce_scatter"]
        assert set(phases) == set(PHASES) | {"compute"}
        assert sum(phases.values()) == pytest.approx(window)
        if rank == 1:
            assert phases["initial send"] > 0.15
        else:
            assert phases["compute"] > 0.15  # the sleep is not communication


def test_ops_map_to_phases():
    assert phase_of("sub_ring_grad") == "ring wait" and phase_of("team_merge") == "merge"
    assert phase_of("something_new") == "other comm"


def attention_worker(rank, world_size):
    from megatron_startrail import new_startrail_groups, startrail_attn  # noqa: PLC0415

    groups = new_startrail_groups(team_size=2)
    gen = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(8, 1, 2, 4, generator=gen, requires_grad=True) for _ in range(3))
    timeline = Timeline()
    startrail_attn(q, k, v, groups, timeline=timeline).sum().backward()
    return {op for op, _, _ in timeline.spans}


def test_startrail_attn_records_every_phase_forward_and_backward():
    for ops in run_ranks(attention_worker, 8):
        # C = 2 on 8 ranks: team gathers, merge and reduce-scatter, the sub-ring both ways.
        assert {"team_all_gather", "team_merge", "sub_ring", "sub_ring_grad", "team_reduce_scatter"} <= ops


def async_worker(rank, world_size):
    group, ranks = dist.group.WORLD, tuple(range(world_size))
    x = torch.randn(4, 3, generator=torch.Generator().manual_seed(rank))
    sync_stats, async_stats, timeline = CommStats(), CommStats(), Timeline()
    transport = world_transport(world_size)
    sync, started = Communicator(sync_stats, transport), Communicator(async_stats, transport, timeline)
    want = [sync.all_gather(x, group, world_size, op="g"), sync.all_to_all(x, group, world_size, op="a"),
            sync.reduce_scatter(x, group, world_size, op="r")]
    pending = [started.all_gather(x, group, world_size, op="g", wait=False),
               started.all_to_all(x, group, world_size, op="a", wait=False),
               started.reduce_scatter(x, group, world_size, op="r", wait=False)]
    got = [p.wait() for p in pending]
    return all(torch.equal(g, w) for g, w in zip(got, want)), sync_stats.as_dict() == async_stats.as_dict(), \
        [op for op, _, _ in timeline.spans]


def test_started_collectives_give_the_blocking_results_and_counts():
    for same, same_counts, ops in run_ranks(async_worker, 2):
        assert same and same_counts
        assert ops == ["g", "a", "r"]  # one span per wait()
