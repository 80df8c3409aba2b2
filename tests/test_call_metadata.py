"""The kernel calls' metadata on the device (Note [device metadata] in
megatron_startrail/microbatch.py, Note [rows of CP ranks] in layout.py), on the CPU.

What the GPU counts look like (one copy per micro-batch, no sync) is checked on the meta
device by tests/megatron/test_host_syncs.py; here: the rows a step asks for survive the
round trip through CP ranks' runs, the buffer's views hold what the calls say, one micro-batch
makes one buffer, and what hangs on a micro-batch goes with it.
"""

import gc
import weakref

import pytest
import torch

from megatron_startrail import microbatch
from megatron_startrail.layout import (KernelCall, cp_rank_segments, docs_of, documents_from_cu_seqlens, plan_calls,
                                       rank_runs, rows_of_cp_ranks, segment_rows, segments_of_runs, split_segments)
from megatron_startrail.device_copy import pack_on_device
from megatron_startrail.microbatch import BoundCall, MicroBatchCache, device_calls
from tests.packed_cases import make_documents

CP, CHUNK = 4, 12


def documents(layout: str, seed: int):
    cu, padded = make_documents(CP, CHUNK, layout, seed)
    local = (padded if padded is not None else cu)[-1].item() // CP
    docs = documents_from_cu_seqlens(tuple(cu.tolist()), None if padded is None else tuple(padded.tolist()), CP, local)
    assert not isinstance(docs, str), docs
    return docs


def requests(docs):
    """Rows the way the schedule makes them: a team's sequence, lane parts, pieces, one rank."""
    team = rows_of_cp_ranks(docs, (1, 2))
    n = sum(b - a for _, a, b in team) // 2
    yield team, team
    yield team, split_segments(rows_of_cp_ranks(docs, (3, 0)), 3)[1]
    yield segment_rows(team, n, 2 * n), segment_rows(split_segments(rows_of_cp_ranks(docs, (0, 3)), 2)[0], 1, n)
    yield cp_rank_segments(docs, 2), cp_rank_segments(docs, 1)


@pytest.mark.parametrize("layout", ["sample", "document"])
def test_rows_survive_the_round_trip_through_cp_ranks(layout):
    docs = documents(layout, 0)
    for q_segments, k_segments in requests(docs):
        for segments in (q_segments, k_segments):
            assert docs_of(segments) is docs  # the layout functions pass the documents on
            runs = rank_runs(docs, segments)
            assert all(0 <= r < CP and 0 <= a < b for r, a, b in runs)
            assert segments_of_runs(docs, runs) == segments
        # The same runs under other documents are the same rows of the same CP ranks.
        other = documents(layout, 1)
        again = segments_of_runs(other, rank_runs(docs, q_segments))
        assert rank_runs(other, again) == rank_runs(docs, q_segments)


def test_one_buffer_holds_every_call_as_it_says():
    call = KernelCall(((0, 3), (5, 9)), (((2, 4), (7, 8)), ((0, 6),)), (-1, 0))
    items = [(call, "q_index", 1), (call, "k_index", 1), (call, "cu_seqlens_q", 2), (call, "cu_seqlens_k", 1)]
    views = pack_on_device(items, "cpu")
    assert views[(call, "q_index", 1)].tolist() == [0, 1, 2, 5, 6, 7, 8]
    assert views[(call, "k_index", 1)].tolist() == [2, 3, 7, 0, 1, 2, 3, 4, 5]
    assert views[(call, "cu_seqlens_q", 2)].tolist() == [0, 3, 7, 10, 14]  # two samples folded
    assert views[(call, "cu_seqlens_k", 1)].tolist() == [0, 3, 9]
    assert {v.dtype for what, v in ((i[1], views[i]) for i in items) if what.startswith("cu_")} == {torch.int32}
    assert views[(call, "q_index", 1)].dtype == torch.int64
    assert len({v.untyped_storage().data_ptr() for v in views.values()}) == 1  # one copy made them all
    assert call.tensor("k_index", "cpu").tolist() == [2, 3, 7, 0, 1, 2, 3, 4, 5]  # a call on its own
    assert "_tensors" not in call.__dict__  # and it keeps nothing


@pytest.mark.parametrize("layout", ["sample", "document"])
def test_a_micro_batch_makes_one_buffer_for_every_step(layout):
    microbatch._REQUESTS.clear()
    first, second = documents(layout, 0), documents(layout, 1)
    for docs in (first, second):
        for q_segments, k_segments in requests(docs):
            calls = device_calls(q_segments, k_segments, True, None, None, "cpu", 1)
            assert [c.call for c in calls] == list(plan_calls(q_segments, k_segments, True))
            for c in calls:
                assert isinstance(c, BoundCall) and c.causal == c.call.causal
                assert c.tensor("cu_seqlens_k", "cpu").tolist() == list(c.call.cu_seqlens_k)
                if c.k_slice is None:
                    assert c.tensor("k_index", "cpu").tolist() == list(c.call.k_index)
    (learned,) = first.__dict__["_device_calls"].values()
    (replayed,) = second.__dict__["_device_calls"].values()
    assert learned.copies == sum(1 for q, k in requests(first) if plan_calls(q, k, True))  # one per new request
    assert replayed.copies == 1  # every step's calls, before the first


def test_rows_without_documents_get_plain_calls():
    docs = documents("sample", 0)
    q, k = (tuple(s) for s in next(requests(docs)))  # plain tuples: no documents known
    calls = device_calls(q, k, True, None, None, "cpu", 1)
    assert calls and all(isinstance(c, KernelCall) for c in calls)


def test_micro_batch_cache_entries_go_with_their_tensors():
    cache = MicroBatchCache()
    cu = torch.tensor([0, 4, 8])
    value = cache.get("documents", (cu, None), 1, lambda: documents("sample", 0))
    alive = weakref.ref(value)
    assert cache.get("documents", (cu, None), 1, lambda: None) is value
    del value, cu
    gc.collect()
    assert alive() is None and not cache._entries
