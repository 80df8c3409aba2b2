"""Ranks forked from a pytest process: one that has run multi-threaded torch ops of its own, and
whose heap no rank's garbage collector may walk.

libgomp's OpenMP pool does not survive fork: a child's first parallel region with more than
one thread waits for the pool's threads, which exist only in the parent. Every fork site of
the suite starts its ranks with ``tests.multiproc.single_threaded_after_fork``; this checks
that a forked rank runs parallel ops after the parent started its pool.
"""

from __future__ import annotations

import gc

import pytest
import torch

from tests.multiproc import run_ranks


def _parallel_ops(rank, world_size):
    # Both go through at::parallel_for over many rows: a region with the pool's thread count.
    zeros = torch.zeros(20_000_000)
    normed = torch.nn.functional.layer_norm(torch.randn(4096, 64, generator=torch.Generator().manual_seed(rank)),
                                            (64,))
    return float(zeros.sum()), tuple(normed.shape), torch.get_num_threads()


def test_a_forked_rank_runs_parallel_ops_after_the_parent_started_its_thread_pool():
    if torch.get_num_threads() < 2:
        pytest.skip("one intra-op thread here: the parent starts no OpenMP pool to inherit")
    # Rows > 1 with grain size 1: layer_norm's CPU kernel opens a parallel region on every thread.
    x = torch.randn(64, 8, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
    torch.nn.functional.layer_norm(x, (8,))
    results = run_ranks(_parallel_ops, 2, timeout=30)  # a hang here is the bug: no report in 30 s
    assert results == [(0.0, (4096, 64), 1), (0.0, (4096, 64), 1)]


def _collector_state(rank, world_size):
    # What the rank's collector inherited: the parent's objects in its permanent generation, and
    # its generations 0-2 (what a collection walks) holding only what the rank made since.
    return gc.get_freeze_count(), len(gc.get_objects())


def test_a_forked_rank_collects_none_of_the_parents_heap_and_the_parent_keeps_its_own():
    parent_objects = len(gc.get_objects())  # the pytest process: torch, megatron, the test modules
    assert gc.get_freeze_count() == 0
    results = run_ranks(_collector_state, 2, timeout=30)
    for frozen, walked in results:
        assert frozen >= 0.9 * parent_objects, (frozen, parent_objects)
        assert walked < parent_objects // 10, (walked, parent_objects)
    assert gc.get_freeze_count() == 0  # the parent's collector has its objects back
