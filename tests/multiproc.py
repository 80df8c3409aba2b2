"""Run a function on N gloo ranks forked from the test process.

Why fork: on a 2-core machine, starting 16 fresh Python processes that import torch and
megatron takes ~50 s; forking a parent that already imported them takes well under a
second per rank. Why short timeouts: a schedule mismatch between ranks would otherwise
hang a collective for gloo's default 30 minutes; here it fails the test in seconds.

Usage::

    results = run_ranks(worker, world_size=8, args=(...))   # list of per-rank returns

``worker(rank, world_size, *args)`` runs inside an initialized default process group
(backend gloo). Any exception on any rank fails the call with that rank's traceback.
Workers should build their own inputs from a seed. Every forked rank starts with
:func:`single_threaded_after_fork` (the parent runs torch ops of its own; see there).

In NCCL-rules mode (``STARTRAIL_CHECK_NCCL_RULES=1``, which tests/conftest.py sets for the
whole suite) every run that finishes on all ranks is then checked against NCCL's rules
(:mod:`megatron_startrail.nccl_rules`): a violation fails the test like an exception.
"""

from __future__ import annotations

import datetime
import functools
import gc
import math
import multiprocessing as mp
import os
import pickle
import signal
import sys
import tempfile
import time
import traceback
from typing import Any, Callable, Sequence

import torch
import torch._inductor  # noqa: F401 - see below
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from megatron_startrail import nccl_rules

# torch.use_deterministic_algorithms (which many workers call) imports torch._inductor, and
# with it dynamo and sympy: ~800 modules, ~1 s of CPU per rank, 16 ranks on 2 cores. Imported
# once here, before the fork, every rank has them. (Importing starts no thread pool.)

# Collective timeout inside the ranks: a mismatch raises instead of hanging.
PG_TIMEOUT_S = float(os.environ.get("STARTRAIL_TEST_PG_TIMEOUT", "60"))
# run_ranks' deadlines times this: a module run apart at the lowest CPU priority (tests/early.py's
# APART) may wait minutes for the CPU the other tests leave idle.
TIMEOUT_SCALE = float(os.environ.get("STARTRAIL_TEST_TIMEOUT_SCALE", "1"))
# The same timeout in megatron-core's unit (whole minutes, at least 1): the default that
# _megatron_groups_take_the_test_timeout gives Megatron's groups.
MEGATRON_TIMEOUT_MINUTES = max(1, math.ceil(PG_TIMEOUT_S / 60))


def single_threaded_after_fork() -> None:
    """The first call of every rank forked from the pytest process. The parent runs torch ops of
    its own (the float64 references of many tests), and a multi-threaded one starts libgomp's
    OpenMP thread pool; fork copies the pool's bookkeeping but not its threads, so a child's first
    parallel region with more than one thread waits for ever for them. (Seen: all 8 ranks of
    tests/megatron/test_example_failures.py stuck in Megatron's ``torch.zeros`` of the gradient
    buffer, after a ``layer_norm`` in the parent.) One thread per rank starts no pool, and with
    2-16 ranks on 2 cores it is also the fastest."""
    torch.set_num_threads(1)


FORK = mp.get_context("fork")


def start_forked(target: Callable[..., Any], args: Sequence[Any]) -> mp.process.BaseProcess:
    """Fork a daemon process running ``target(*args)``, with the parent's heap frozen for it.

    Why frozen: the pytest process holds millions of objects (torch, megatron, dynamo, every
    test module). A forked child's garbage collections walk them, writing to each object's
    header, which copies the pages of the parent's heap (copy-on-write): CPU and memory per
    rank, 16 ranks on 2 cores. ``gc.freeze()`` moves them to the collector's permanent
    generation, where no child's collection looks; the parent's ``gc.unfreeze()`` right after
    the fork hands them back to its own collector. Measured alone on this 2-core machine, two
    runs each: the 8-rank ``test_dynamic_cp[DP8]`` 23.2 -> 19.5 s (its pytest's user + sys
    64 -> 55 s); the model fuzzer's ten fixed draws 231 -> 229 CPU-s, no change. (Freezing in
    the child instead, as its first step, gave DP8 no gain: 22.9 s.)"""
    process = FORK.Process(target=target, args=tuple(args), daemon=True)
    gc.freeze()
    try:
        process.start()
    finally:
        gc.unfreeze()
    return process


def fork_ranks(target: Callable[..., Any], world_size: int,
               args_of: Callable[[int], Sequence[Any]]) -> tuple[list[mp.process.BaseProcess], list[Any]]:
    """Fork one process per rank with :func:`start_forked`, rank ``r`` running
    ``target(*args_of(r), conn)``, where ``conn`` is the writing end of a pipe of its own; return
    the processes and the reading ends, in rank order. (The parent closes its copy of each writing
    end, so a rank that dies without reporting shows as EOF on its reading end.)"""
    procs, conns = [], []
    for rank in range(world_size):
        parent_conn, child_conn = FORK.Pipe(duplex=False)
        procs.append(start_forked(target, (*args_of(rank), child_conn)))
        child_conn.close()
        conns.append(parent_conn)
    return procs, conns


class _OneGlooDevicePerRank(type):
    """Stands in for ``c10d.ProcessGroupGloo`` in a rank (:func:`_gloo_groups_share_one_device`):
    a call makes the real group (the stand-in's ``real``) with the rank's one device (its
    ``device``); ``isinstance`` and other attributes are the real class's."""

    def __call__(cls, store, rank, size, timeout=datetime.timedelta(minutes=30)):
        options = cls.real._Options()
        options._devices = [cls.device]
        options._threads = 2  # what torch gives a group of one device
        options._timeout = timeout
        return cls.real(store, rank, size, options)

    def __instancecheck__(cls, obj):
        return isinstance(obj, cls.real)

    def __getattr__(cls, name):
        return getattr(cls.real, name)


def _gloo_groups_share_one_device() -> None:
    """Every gloo group this rank makes (the world, Megatron's, StarTrail's) on one gloo device.

    Why: torch gives each ``ProcessGroupGloo`` a device of its own, and each device a thread
    (``gloo_tcp_loop``) that wakes from ``epoll_wait`` every 10 ms whether or not anything
    arrived. A Megatron test world has ~30 groups per rank: 30 such threads per rank, 240 in an
    8-rank world on 2 cores. Measured with ``perf`` on the 8-rank attention world, those threads
    took 19% of all CPU samples. A gloo device serves any number of contexts (its listener tells
    their pairs apart), so one per rank changes no group's semantics, only who polls the sockets.
    Measured alone, two runs each: the 8-rank ``test_dynamic_cp[DP8]`` 40.2 -> 36.0 s, its user +
    sys 59.8 -> 50.9 s, voluntary context switches 550k -> 75k. (Each group's timeout is kept: the
    options carry it.)"""
    real = c10d.ProcessGroupGloo
    if type(real) is _OneGlooDevicePerRank:  # already in place in this process
        return
    c10d.ProcessGroupGloo = _OneGlooDevicePerRank("ProcessGroupGloo", (), {
        "real": real, "device": real.create_default_device()})


def _megatron_groups_take_the_test_timeout() -> None:
    """Give the groups of megatron-core's ``initialize_model_parallel`` the test's timeout.

    Megatron passes every group it makes an explicit ``timeout`` (its ``distributed_timeout_minutes``,
    default 30), so ``c10d.default_pg_timeout`` does not reach them: a rank left waiting in a
    Megatron collective (TP, CP, DP groups) would hang for 30 minutes, where the world and
    StarTrail's own groups give up after :data:`PG_TIMEOUT_S`. Here the default becomes the test's
    (:data:`MEGATRON_TIMEOUT_MINUTES`); a caller that passes its own (the example's
    ``--distributed-timeout-minutes``) keeps it. Done in the rank, on the module the parent
    imported (Megatron's tests call it as ``parallel_state.initialize_model_parallel``)."""
    parallel_state = sys.modules.get("megatron.core.parallel_state")
    if parallel_state is None:  # a test without Megatron
        return
    megatrons = parallel_state.initialize_model_parallel

    @functools.wraps(megatrons)
    def initialize_model_parallel(*args, distributed_timeout_minutes=MEGATRON_TIMEOUT_MINUTES, **kwargs):
        return megatrons(*args, distributed_timeout_minutes=distributed_timeout_minutes, **kwargs)

    parallel_state.initialize_model_parallel = initialize_model_parallel


def _child(fn, rank, world_size, init_file, args, kwargs, conn):
    result: Any
    try:
        single_threaded_after_fork()
        _gloo_groups_share_one_device()
        dist.init_process_group(
            "gloo",
            init_method=f"file://{init_file}",
            rank=rank,
            world_size=world_size,
            timeout=datetime.timedelta(seconds=PG_TIMEOUT_S),
        )
        # Groups made without a timeout (torch's default: 30 minutes) get the test's.
        c10d.default_pg_timeout = datetime.timedelta(seconds=PG_TIMEOUT_S)
        _megatron_groups_take_the_test_timeout()
        nccl_rules.take_audits(), nccl_rules.take_program()  # none inherited from the parent: this run's only
        value = fn(rank, world_size, *args, **kwargs)
        if nccl_rules.enabled():  # every rank finished: check the run against NCCL's rules
            nccl_rules.verify_across_ranks()
        result = ("ok", value)
    except BaseException:  # noqa: BLE001 - report everything to the parent
        result = ("error", traceback.format_exc())
    try:
        conn.send_bytes(pickle.dumps(result))
    except Exception:  # unpicklable return value
        conn.send_bytes(pickle.dumps(("error", traceback.format_exc())))
    conn.close()
    # Skip destroy_process_group: a rank that failed would block in it waiting for peers.
    os._exit(0)


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    args: Sequence[Any] = (),
    kwargs: dict | None = None,
    timeout: float = 240.0,
) -> list[Any]:
    """Fork ``world_size`` ranks running ``fn``; return their results in rank order."""
    kwargs = kwargs or {}
    with tempfile.TemporaryDirectory() as tmp:
        init_file = os.path.join(tmp, "pg_init")
        procs, conns = fork_ranks(_child, world_size, lambda rank: (fn, rank, world_size, init_file, tuple(args), kwargs))

        timeout *= TIMEOUT_SCALE
        deadline = time.monotonic() + timeout
        results: list[Any] = [None] * world_size
        errors: list[str] = []
        pending = set(range(world_size))
        while pending and time.monotonic() < deadline:
            for rank in sorted(pending):
                conn = conns[rank]
                if conn.poll(0.05):
                    try:
                        status, value = pickle.loads(conn.recv_bytes())
                    except EOFError:
                        status, value = "error", "rank died without reporting"
                    pending.discard(rank)
                    if status == "ok":
                        results[rank] = value
                    else:
                        errors.append(f"--- rank {rank} ---\n{value}")
                elif not procs[rank].is_alive() and not conn.poll(0):
                    pending.discard(rank)
                    errors.append(f"--- rank {rank} --- exited with code {procs[rank].exitcode}")
            if errors:
                # One failure is enough; the others would only wait for their timeout.
                break
        for p in procs:
            if p.is_alive():
                os.kill(p.pid, signal.SIGKILL)
            p.join()
        if pending and not errors:
            errors.append(f"timed out after {timeout:.0f}s; ranks still running: {sorted(pending)}")
        if errors:
            raise AssertionError("distributed run failed\n" + "\n".join(errors))
        return results
