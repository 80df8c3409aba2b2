"""Tests made from mutants of the attention core that the rest of the fast suite let through
(scripts/mutation_check.py: single-line mutations of the shapes real bugs take; each test
here names the mutation it catches).

Each test fails on its mutant and passes on the code as it is.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_startrail import new_startrail_groups
from megatron_startrail.comm import CommStats, Communicator
from tests.multiproc import run_ranks


def strided_comm_worker(rank, world_size):
    """P = 4, C = 2. Every collective and P2P op of the Communicator handed a strided view (a
    transpose: what a batch-first producer or a permuted partial result is): each moves the
    view's values, and (NCCL-rules mode) nothing non-contiguous reaches the transport."""
    groups = new_startrail_groups(team_size=2)
    comm = Communicator(CommStats(), groups.transport)
    team, c = groups.team_group, groups.team_size
    member = groups.topology.member_of(groups.startrail_rank)

    def view(seed: float):  # [6, 4], values seed + 0..23 in row-major order of the view, strided
        base = torch.arange(24, dtype=torch.float64).reshape(6, 4) + seed
        return base.t().contiguous().t()

    got = {}
    x = view(100 * rank)
    assert not x.is_contiguous()
    got["all_gather"] = comm.all_gather(x, team, c, op="all_gather")
    got["reduce_scatter"] = comm.reduce_scatter(view(100 * rank), team, c, op="reduce_scatter")
    pair = torch.stack([view(100 * rank), view(100 * rank + 50)], dim=2).permute(2, 0, 1)  # [2, 6, 4]
    assert not pair.is_contiguous()
    got["all_to_all"] = comm.all_to_all(pair, team, c, op="all_to_all")
    got["broadcast"] = comm.broadcast(view(100 * rank), team, c, src=0, mine=member == 0, op="broadcast")
    reduced = comm.reduce(view(100 * rank), team, c, dst=0, mine=member == 0, op="reduce")
    got["reduce"] = reduced if member == 0 else None
    peer = groups.startrail_rank ^ 1
    landing = torch.empty(6, 4, dtype=torch.float64)
    comm.post([(view(100 * rank), peer)], [(landing, peer)], op="p2p").wait()
    got["p2p"] = landing
    dist.barrier()
    return member, got


def test_every_collective_and_p2p_op_moves_the_values_of_a_strided_view():
    """Mutants: comm.py's ``post`` / ``all_gather`` (and the other collectives) without their
    ``.contiguous()``. Since rotation q makes its side dense before any send, no attention run
    of the suite hands ``post`` a strided tensor: this checks the Communicator itself."""
    results = run_ranks(strided_comm_worker, 4)

    def view(seed):
        return torch.arange(24, dtype=torch.float64).reshape(6, 4) + seed

    for rank, (member, got) in enumerate(results):
        team = [rank - member + m for m in range(2)]
        torch.testing.assert_close(got["all_gather"], torch.cat([view(100 * r) for r in team]), rtol=0, atol=0)
        total = sum(view(100 * r) for r in team)
        torch.testing.assert_close(got["reduce_scatter"], total[3 * member: 3 * member + 3], rtol=0, atol=0)
        want = torch.stack([view(100 * r + 50 * member) for r in team])  # slice ``member`` of each source
        torch.testing.assert_close(got["all_to_all"], want, rtol=0, atol=0)
        torch.testing.assert_close(got["broadcast"], view(100 * team[0]), rtol=0, atol=0)
        if member == 0:
            torch.testing.assert_close(got["reduce"], total, rtol=0, atol=0)
        torch.testing.assert_close(got["p2p"], view(100 * (rank ^ 1)), rtol=0, atol=0)

