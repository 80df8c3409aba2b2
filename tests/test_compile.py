"""torch.compile around a function that calls ``startrail_attn``.

- The compiled function equals the eager one, output and every input's gradient within 1e-12
  in float64, at P = 2 (C = 1) and P = 4 (C = 1, 2), dense and packed documents (both layouts),
  backends ``eager`` and ``aot_eager``, and ``inductor`` on one small case where a C++ compiler
  is present (gcc on CI). The attention is a graph break (Note [graph break at the attention] in
  megatron_startrail/compile_boundary.py): dynamo compiles a graph before it and one after it.
  On 3a17b64 dynamo traced into the attention and one rank raised
  ``InternalTorchDynamoError: RecursionError`` (``microbatch.BoundCall.__getattr__``) while the
  other went on into the next collective.
- An exception raised inside the attention on one rank (a planted kernel step) leaves no rank
  blocked: the raising rank reports its error; every other rank a RuntimeError naming the
  StarTrail communication it was waiting in or posting, and gloo's cause, within the
  process-group timeout, whether the raising rank's process exits (a crashed job) or stays
  alive (its error caught).
"""

from __future__ import annotations

import datetime
import os
import re
import shutil
import time

import pytest
import torch

from megatron_startrail import blocks, new_startrail_groups, nccl_rules, startrail_attn
from tests.attention_cases import full_inputs, local_rows
from tests.multiproc import run_ranks
from tests.packed_cases import held_positions, make_documents

CHUNK, BATCH, HEADS, KV_HEADS, DIM, TOLERANCE = 3, 1, 4, 2, 8, 1e-12
HAS_CXX = shutil.which(os.environ.get("CXX", "g++")) is not None


def _documents(layout, cp):
    """(cu_seqlens, cu_seqlens_padded) for a packed layout; (None, None) for dense."""
    return (None, None) if layout == "dense" else make_documents(cp, CHUNK, layout, seed=cp)


def _inputs(layout, rank, cp):
    """This rank's q, k, v, dout ``[s_local, b, h, d]`` and a weight ``[h, d]`` the function
    multiplies q with (a parameter on each side of the graph break)."""
    cu, padded = _documents(layout, cp)
    seq = 2 * cp * CHUNK if cu is None else int((cu if padded is None else padded)[-1])
    full = full_inputs(cp, seq, BATCH, HEADS, KV_HEADS, DIM, torch.float64)
    rows = held_positions(rank, cp, cu, padded) if cu is not None else None
    local = [local_rows(t, rank, cp) if rows is None else t[rows] for t in full]
    weight = torch.randn(HEADS, DIM, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    return local, weight, cu, padded


def _function(cu, padded):
    def attend(q, k, v, weight, groups):
        out = startrail_attn(q * weight, k.sin(), v, groups, causal=True, cu_seqlens=cu, cu_seqlens_padded=padded)
        return (out * weight).tanh()

    return attend


def _forward_backward(fn, local, weight, groups):
    """(output, grads of q, k, v, weight) of ``fn``, fresh leaves each call."""
    q, k, v, dout = (t.clone() for t in local)
    leaves = [t.requires_grad_(True) for t in (q, k, v, weight.clone())]
    out = fn(*leaves, groups)
    out.backward(dout)
    return [out.detach()] + [t.grad for t in leaves]


def compile_worker(rank, world_size, cases):
    """Per (team size, layout, backend): the worst relative error of compiled against eager over
    the output and the four gradients, and the compile counter's graphs and ops."""
    from torch._dynamo.testing import CompileCounterWithBackend  # noqa: PLC0415

    report = {}
    groups = {}
    for team, layout, backend in cases:
        if team not in groups:
            groups[team] = new_startrail_groups(team_size=team)
        local, weight, cu, padded = _inputs(layout, rank, world_size)
        fn = _function(cu, padded)
        torch._dynamo.reset()
        counter = CompileCounterWithBackend(backend)
        want = _forward_backward(fn, local, weight, groups[team])
        got = _forward_backward(torch.compile(fn, backend=counter), local, weight, groups[team])
        error = max(((g - w).abs().max() / w.abs().max()).item() for g, w in zip(got, want))
        report[(team, layout, backend)] = (error, counter.frame_count, counter.op_count)
    return report


# (team size C, documents, backend) per world: every layout and backend at P = 2 and at P = 4
# C = 2, not the full product (each case compiles anew).
CASES = {
    2: [(1, "dense", "eager"), (1, "sample", "aot_eager"), (1, "document", "eager")]
       + [(1, "dense", "inductor")] * HAS_CXX,  # one small case: inductor's C++ build is the slow part
    4: [(1, "document", "aot_eager"), (2, "dense", "eager"), (2, "sample", "aot_eager"), (2, "document", "aot_eager")],
}


@pytest.mark.parametrize("world_size", list(CASES))
def test_compiled_function_equals_eager(world_size):
    cases = CASES[world_size]
    reports = run_ranks(compile_worker, world_size, args=(cases,), timeout=600)
    for rank, report in enumerate(reports):
        assert list(report) == cases
        for case, (error, graphs, ops) in report.items():
            assert error <= TOLERANCE, f"rank {rank} {case}: relative error {error:.2e}"
            # The graph break: one graph before the attention and one after it, each with ops.
            assert graphs >= 2 and ops >= 4, (rank, case, graphs, ops)


# -- an exception inside the attention on one rank ------------------------------------------

RAISER, FAIL_TIMEOUT_S = 1, 5.0
# gloo's words (torch 2.13's third_party/gloo/gloo/transport/tcp) for a peer whose process is gone,
# and for this rank's own timeout.
GLOO_PEER_GONE = ("Connection reset by peer", "Connection closed by peer")
GLOO_TIMED_OUT = ("Timed out waiting", "Application timeout caused pair closure")


def _planted_step(*args, **kwargs):
    raise ValueError("planted: a kernel step raising on one rank")


def failure_worker(rank, world_size, raiser_stays):
    """One good compiled step, then rank RAISER raises inside its first kernel step; returns
    (error type, message, seconds from the step's start to the error) on every rank."""
    from torch._dynamo.testing import CompileCounter  # noqa: PLC0415

    os.environ[nccl_rules.ENV] = "0"  # the run is broken on purpose: no cross-rank audit after it
    # The compiling step runs on groups with the run's timeout (ranks compile at their own pace);
    # the failing one on groups with a short timeout, through the same graphs.
    warm = new_startrail_groups(team_size=2)
    short = new_startrail_groups(team_size=2, timeout=datetime.timedelta(seconds=FAIL_TIMEOUT_S))
    local, weight, _, _ = _inputs("dense", rank, world_size)
    counter = CompileCounter()
    fn = torch.compile(_function(None, None), backend=counter)
    _forward_backward(fn, local, weight, warm)  # compiled and run once on every rank: all good
    graphs = counter.frame_count
    if rank == RAISER:
        blocks.forward_step = _planted_step  # attention.py calls blocks.forward_step (this forked rank only)
    start = time.monotonic()
    try:
        _forward_backward(fn, local, weight, short)
        return "finished", "", time.monotonic() - start
    except Exception as error:  # noqa: BLE001 - the outcome under test
        outcome = type(error).__name__, str(error), time.monotonic() - start
    assert counter.frame_count == graphs  # the groups are no guard: nothing was compiled in the failing step
    if rank == RAISER and raiser_stays:
        time.sleep(3 * FAIL_TIMEOUT_S)  # alive, its error caught: the others must not wait for it
    return outcome


@pytest.mark.parametrize("raiser_stays", [False, True], ids=["raiser-exits", "raiser-stays"])
def test_an_exception_on_one_rank_leaves_no_rank_blocked(raiser_stays):
    reports = run_ranks(failure_worker, 4, args=(raiser_stays,), timeout=180)
    for rank, (kind, message, elapsed) in enumerate(reports):
        print(f"rank {rank}: {kind} after {elapsed:.1f}s: {message[:300]}")  # with -s: what every rank reports
        if rank == RAISER:
            assert kind == "ValueError" and "planted" in message, (rank, kind, message)
            continue
        assert kind == "RuntimeError", (rank, kind, message)
        # The StarTrail operation it was in, met waiting or already posting (gloo raises in isend once
        # it has seen the connection close: which one a rank meets is timing), then gloo's cause.
        assert re.match(r"StarTrail (?!communication )\w+ failed on this rank, (waiting for a peer|posting a "
                        r"transfer) \(a peer that raised or died", message), (rank, message)
        # The raiser's process gone: gloo's read failed (ECONNRESET) or read end-of-file, by timing.
        # Alive: this rank's own timeout, or a connection closed by a peer that timed out first.
        causes = GLOO_PEER_GONE + (() if not raiser_stays else GLOO_TIMED_OUT)
        assert any(cause in message for cause in causes), (rank, message)
        assert elapsed <= FAIL_TIMEOUT_S + 10, (rank, elapsed, message)  # the group's timeout, never 30 minutes
    if raiser_stays:  # no process died: some rank waited out its timeout, and said so
        assert any(cause in message for _, message, _ in reports for cause in GLOO_TIMED_OUT), reports
