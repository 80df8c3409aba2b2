"""examples/pretrain_gpt.py under bad flags and a dying rank.

- A misconfiguration reachable from Megatron flags raises the same ValueError, naming the flag,
  on every rank before torch.distributed is even initialized (so no rank can be left waiting).
- A rank killed in the middle of a training step makes every other rank exit with an error
  within --distributed-timeout-minutes (gloo notices the closed connections at once).
- From the command line, a bad flag (argparse's or the validation's) is one error line and exit
  status 2 on each rank; under torchrun the line comes once, from rank 0.

Ranks are forked from the test process (which imported Megatron) without a process group:
the example initializes it itself from RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT.
"""

from __future__ import annotations

import contextlib
import io
import os
import runpy
import signal
import socket
import subprocess
import sys
import time

import pytest
import torch.distributed as dist

from megatron_startrail.megatron import rank_output
from tests.megatron.example import ROOT, pretrain_gpt
from tests.multiproc import fork_ranks, single_threaded_after_fork


COMMON = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "8",
    "--seq-length", "256", "--micro-batch-size", "1", "--global-batch-size", "2",
    "--lr", "3e-3", "--seed", "1234", "--log-interval", "1",
    "--context-parallel-size", "4", "--context-parallel-algo", "startrail",
]


def _example_rank(rank, world, argv, env, victim_step, conn):
    """Run the example as rank ``rank``; report how it ended and when."""
    single_threaded_after_fork()  # before any torch op (the parent ran some: see there)
    os.environ.update(env, RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world))
    if victim_step is not None:  # this rank dies (SIGKILL) inside its victim_step-th forward step
        calls = {"n": 0}
        forward_step = pretrain_gpt.forward_step

        def dying_forward_step(data_iterator, model):
            calls["n"] += 1
            if calls["n"] == victim_step:
                conn.send(("killed", "", True, time.monotonic()))  # the time of death, for the parent
                os.kill(os.getpid(), signal.SIGKILL)
            return forward_step(data_iterator, model)

        pretrain_gpt.forward_step = dying_forward_step
    try:
        with contextlib.redirect_stdout(io.StringIO()):
            pretrain_gpt.main(argv)
        outcome = ("finished", "")
    except BaseException as e:  # noqa: BLE001 - the outcome under test
        outcome = (type(e).__name__, str(e))
    conn.send((*outcome, dist.is_initialized(), time.monotonic()))
    conn.close()
    os._exit(0)


def run_example(world, argv, env=None, victim=None, victim_step=None, timeout=120.0):
    """Fork ``world`` ranks of the example; return {rank: (kind, message, pg_initialized, end_time)}
    for every rank that reported within ``timeout`` (the victim reports "killed" as it dies)."""
    procs, conns = fork_ranks(_example_rank, world,
                              lambda rank: (rank, world, argv, env or {}, victim_step if rank == victim else None))
    deadline, reports = time.monotonic() + timeout, {}
    try:
        for rank in range(world):
            if conns[rank].poll(max(deadline - time.monotonic(), 0)):
                reports[rank] = conns[rank].recv()
    finally:
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
            p.join()
    return reports, procs


@pytest.mark.parametrize("flags, error, message", [
    (["--startrail-team-size", "4"], "ValueError", "--startrail-team-size 4 does not fit a StarTrail group of"),
    (["--ulysses-degree-in-cp", "3"], "ValueError", "--ulysses-degree-in-cp 3 must divide --context-parallel-size 4"),
    (["--ulysses-degree-in-cp", "4", "--num-attention-heads", "6", "--hidden-size", "48"], "ValueError",
     "--ulysses-degree-in-cp 4 must divide the attention heads of a tensor-parallel rank: --num-attention-heads 6"),
    # Megatron's own validate_args catches this one first, with its own message.
    (["--seq-length", "252"], "AssertionError", "seq-length should be a multiple of 2 * context-parallel-size"),
    # With what Megatron's own hybrid CP checks ask for: StarTrail's refusal, not Megatron's
    # "data iterator is not wrapped with RerunDataIterator" at the first step.
    (["--hybrid-context-parallel", "--calculate-per-token-loss", "--max-seqlen-per-dp-cp-rank", "64"], "ValueError",
     "--hybrid-context-parallel runs with --context-parallel-size 1"),
], ids=["team-size", "ulysses-cp", "ulysses-heads", "seq-length", "hybrid-cp"])
def test_bad_flags_fail_on_every_rank_before_any_communication(flags, error, message):
    # CP 4 on 4 ranks. No MASTER_ADDR: a rank that got as far as init_process_group would fail
    # differently, and none has a process group when it raises.
    reports, _ = run_example(4, [*COMMON, "--train-iters", "2", *flags], timeout=90)
    assert sorted(reports) == list(range(4)), reports
    assert {r[:3] for r in reports.values()} == {(error, reports[0][1], False)}, reports
    assert message in reports[0][1], reports[0][1]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_killed_rank_makes_every_other_rank_fail_within_the_timeout():
    timeout_minutes = 1
    argv = [*COMMON, "--tensor-model-parallel-size", "2", "--startrail-team-size", "2", "--train-iters", "50",
            "--distributed-timeout-minutes", str(timeout_minutes)]
    env = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port())}
    victim = 5
    # Rank 5 dies in the forward of its second step (each step has 2 microbatches: 3rd call).
    reports, procs = run_example(8, argv, env, victim=victim, victim_step=3, timeout=240)
    assert procs[victim].exitcode == -signal.SIGKILL
    assert sorted(reports) == list(range(8)), reports
    killed_at = reports.pop(victim)[3]
    for rank, (kind, message, initialized, end) in reports.items():
        assert initialized and kind not in ("finished", "killed"), (rank, kind, message)
        assert end - killed_at <= 60 * timeout_minutes, (rank, kind, message, end - killed_at)



EXAMPLE = os.path.join(ROOT, "examples", "pretrain_gpt.py")
# A bad flag of each kind: one argparse rejects, one the flag validation rejects.
BAD_FLAGS = {
    "argparse": (["--context-parallel-algo", "ringg"], "argument --context-parallel-algo: invalid choice: 'ringg'"),
    "validation": (["--context-parallel-size", "2", "--startrail-team-size", "2"],
                   "--startrail-team-size 2 does not fit a StarTrail group of 2 ranks"),
}


def _example_as_main(rank, argv, conn):
    """Run examples/pretrain_gpt.py as ``__main__`` (its command-line entry, which a user's
    ``python`` or ``torchrun`` runs) as rank ``rank`` of 2; report its exit code and output."""
    single_threaded_after_fork()
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2", LOCAL_WORLD_SIZE="2")  # as torchrun's
    rank_output.OTHER_RANKS_GRACE_S = 0.0  # no launcher here to stop rank 1 during its wait
    sys.argv = [EXAMPLE, *argv]
    stderr, stdout = io.StringIO(), io.StringIO()
    code: object = "returned"
    try:
        with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(stdout):
            runpy.run_path(EXAMPLE, run_name="__main__")
    except SystemExit as e:
        code = e.code
    except BaseException as e:  # noqa: BLE001 - the outcome under test
        code = f"{type(e).__name__}: {e}"
    conn.send((code, stderr.getvalue() + stdout.getvalue()))
    conn.close()
    os._exit(0)


@pytest.mark.parametrize("kind", sorted(BAD_FLAGS))
def test_a_bad_flag_is_one_error_line_and_exit_status_2_from_the_command_line(kind):
    # Both kinds go through the example's entry (rank_output.bad_flags_reported_once): one line,
    # exit status 2, no usage dump (argparse's, about 700 lines) and no traceback; rank 0 says it
    # plainly, another rank (here with no grace: no launcher stops it) names itself.
    flags, error = BAD_FLAGS[kind]
    procs, conns = fork_ranks(_example_as_main, 2, lambda rank: (rank, [*COMMON, "--train-iters", "2", *flags]))
    try:
        reports = [conn.recv() if conn.poll(120) else ("no report", "") for conn in conns]
    finally:
        for p in procs:
            p.join(10)
    for rank, (code, out) in enumerate(reports):
        lines = [line for line in out.splitlines() if error in line]
        prog = "pretrain_gpt.py" if rank == 0 else "pretrain_gpt.py [rank 1]"
        assert code == 2 and len(lines) == 1 and lines[0].startswith(f"{prog}: error: "), (rank, code, out[-3000:])
        assert "usage:" not in out and "Traceback" not in out, (rank, out[-3000:])


def test_a_bad_flag_prints_one_error_line_from_rank_0_under_torchrun():
    # The command a user runs, on 2 ranks: both hit the same bad flag, but its line comes out
    # once, from rank 0: the launcher stops rank 1 during its wait. (How each kind of bad flag
    # becomes that line is the test above; the launcher's part is the same for both.)
    flags, error = BAD_FLAGS["argparse"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", EXAMPLE,
           *COMMON, "--train-iters", "2", *flags]
    env = dict(os.environ, OMP_NUM_THREADS="1", MASTER_PORT=str(_free_port()))
    res = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env, cwd=ROOT)
    out = res.stdout + res.stderr
    assert res.returncode != 0, out[-3000:]
    lines = [line for line in out.splitlines() if error in line]
    assert len(lines) == 1 and lines[0].startswith("pretrain_gpt.py: error: "), out[-3000:]
    assert "usage:" not in out and f'{EXAMPLE}", line' not in out, out[-3000:]
