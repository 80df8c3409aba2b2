"""A rank that dies (SIGKILL) or stops answering in the middle of StarTrail attention makes
every other rank raise within the process-group timeout instead of hanging.

The StarTrail groups take the timeout they are given (Megatron's
``--distributed-timeout-minutes``, which ``initialize_startrail`` passes); torch would
otherwise give each new group a 30-minute default, and a stuck peer would hold the job for
half an hour.
"""

from __future__ import annotations

import datetime
import os
import signal
import tempfile
import time
import traceback

import pytest
import torch
import torch.distributed as dist

from megatron_startrail import new_startrail_groups, startrail_attn
from tests.multiproc import fork_ranks, single_threaded_after_fork

WORLD, VICTIM = 4, 2
PG_TIMEOUT_S = 6.0


def _attention_step(groups, seed):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(16, 1, 2, 8, generator=gen).requires_grad_(True) for _ in range(3))
    startrail_attn(q, k, v, groups, causal=True).sum().backward()


def _rank(rank, init_file, mode, conn):
    """Two good steps; then the victim dies or hangs while the others start a third."""
    single_threaded_after_fork()
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))
    groups = new_startrail_groups(team_size=2, timeout=datetime.timedelta(seconds=PG_TIMEOUT_S))  # 2 teams of 2
    timeouts = [g._get_backend(torch.device("cpu")).options._timeout.total_seconds()
                for g in (groups.startrail_group, groups.team_group)]
    for step in range(2):
        _attention_step(groups, step)
    dist.barrier()
    if rank == VICTIM:
        if mode == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        time.sleep(3600)  # "hang": alive, but never joins the next step
    start = time.monotonic()
    try:
        for step in range(2, 5):
            _attention_step(groups, step)
        outcome = ("finished", "")
    except Exception as e:  # noqa: BLE001 - the outcome under test
        outcome = (type(e).__name__, f"{e}\n{traceback.format_exc()}")
    conn.send((rank, *outcome, time.monotonic() - start, timeouts))
    conn.close()
    os._exit(0)


@pytest.mark.parametrize("mode", ["kill", "hang"])
def test_survivors_fail_within_the_process_group_timeout(mode):
    with tempfile.TemporaryDirectory() as tmp:
        procs, conns = fork_ranks(_rank, WORLD, lambda rank: (rank, os.path.join(tmp, "pg"), mode))
        # Setup and two steps take a few seconds; the third must fail within the timeout (+ slack
        # for a loaded 2-core machine), never after torch's 30-minute default.
        deadline = time.monotonic() + 60 + 3 * PG_TIMEOUT_S
        reports = {}
        try:
            for rank in (r for r in range(WORLD) if r != VICTIM):
                left = deadline - time.monotonic()
                assert conns[rank].poll(max(left, 0)), f"rank {rank} still running ({mode} of rank {VICTIM})"
                got_rank, *report = conns[rank].recv()
                reports[got_rank] = report
        finally:
            for p in procs:
                if p.is_alive():
                    os.kill(p.pid, signal.SIGKILL)
                p.join()
    assert sorted(reports) == [r for r in range(WORLD) if r != VICTIM]
    for rank, (kind, message, elapsed, timeouts) in reports.items():
        assert timeouts == [PG_TIMEOUT_S, PG_TIMEOUT_S], timeouts  # the groups took the default group's timeout
        assert kind == "RuntimeError", (rank, kind, message)  # gloo's error, not a hang or a silent finish
        assert elapsed <= 2 * PG_TIMEOUT_S + 10, (rank, elapsed, message)
    if mode == "hang":
        # Some rank waited on the stuck peer until the timeout, and said so.
        assert any("timed out" in m.lower() or "timeout" in m.lower() for _, m, _, _ in reports.values()), reports
