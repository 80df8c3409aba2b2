"""Metadata computed once per micro-batch and reused by every layer.

Packed documents give every attention layer of a micro-batch the same ``cu_seqlens``
tensors (Megatron: one ``PackedSeqParams`` shared by the layers). What StarTrail derives
from them -- the document segments after the cross-rank agreement (one host sync, one
small collective) and the RoPE positions of the sample layout -- depends on nothing else,
so it is computed by the first layer and looked up by the others. Keys are the tensors'
identities: an entry lives while its tensors do (weak references), and a recycled ``id``
of a dead tensor never matches. Contract: ``cu_seqlens`` tensors are not modified in place
once a layer has seen them (Megatron builds new ones for every micro-batch).

The kernel calls' metadata on the device (``cu_seqlens`` and gather indices of every call
of every step, :class:`~megatron_startrail.layout.KernelCall`) is per micro-batch as well:
:func:`device_calls` makes it in ONE host-to-device copy (non-blocking, from pinned memory
on CUDA) for all the layers of a micro-batch, and keeps it on the micro-batch's
:class:`~megatron_startrail.layout.Documents` object, so it goes when the micro-batch does
(Note [device metadata]).
"""

from __future__ import annotations

import functools
import weakref
from collections import OrderedDict
from typing import Callable, Hashable, Sequence

import torch

from .device_copy import pack_on_device
from .layout import docs_of, plan_calls, rank_runs, segments_of_runs


class MicroBatchCache:
    """A small LRU of ``kind, tensors, extra -> value``; ``capacity`` covers the micro-batches
    in flight on one pipeline stage (interleaved schedules alternate several). An entry goes
    as soon as one of its tensors does (its micro-batch is over): what it holds -- the
    micro-batch's Documents, and through them their device metadata -- lives no longer."""

    def __init__(self, capacity: int = 16) -> None:
        self.capacity = capacity
        self._entries: OrderedDict = OrderedDict()  # key -> (weak refs of the tensors, value)
        self.computed = 0  # how many values were computed (tests count them)

    def __getstate__(self) -> dict:
        # Pickled (or deep-copied) empty: its entries live as long as this process's tensors do
        # (weak references), which another process or a copy does not hold.
        return {"capacity": self.capacity, "computed": self.computed}

    def __setstate__(self, state: dict) -> None:
        self.__init__(state["capacity"])
        self.computed = state["computed"]

    def get(self, kind: str, tensors: Sequence[torch.Tensor | None], extra: Hashable, make: Callable):
        key = (kind, tuple(None if t is None else id(t) for t in tensors), extra)
        hit = self._entries.get(key)
        if hit is not None and all((r is None and t is None) or (r is not None and r() is t)
                                   for r, t in zip(hit[0], tensors)):
            self._entries.move_to_end(key)
            return hit[1]
        value = make()  # may raise: nothing is cached then
        self.computed += 1
        drop = functools.partial(_drop_entry, weakref.ref(self._entries), key)
        refs = tuple(None if t is None else weakref.ref(t, drop) for t in tensors)
        self._entries[key] = (refs, value)
        self._entries.move_to_end(key)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)
        return value


def _drop_entry(entries_ref, key, dead_ref) -> None:
    """A tensor of entry ``key`` died: drop the entry, if it is still the one that tensor made."""
    entries = entries_ref()
    hit = None if entries is None else entries.get(key)
    if hit is not None and any(r is dead_ref for r in hit[0]):
        del entries[key]


# Note [device metadata]
# ----------------------
# A kernel call reads its ``cu_seqlens`` (int32) and, where its rows are not one run, its
# gather indices (int64) on the device. ``torch.tensor(list, device="cuda")`` would make each
# one with a blocking copy (pageable memory) that waits for the stream: a host sync per call
# tensor, 8 (sample layout) to 31 (document layout) a micro-batch at P = 8, C = 2, 16K tokens
# of 64 packed documents (tests/megatron/test_host_syncs.py). Instead every
# call of every step of a micro-batch is planned before its first step, and their metadata goes
# to the device in one buffer:
#
#     host (pinned on CUDA)   [ int64 indices, as int32 pairs | int32 cu_seqlens ]
#     device                  the same, one non-blocking copy; every call reads views of it
#
# Which calls: the planner is asked for the same rows in every micro-batch (Note [rows of CP
# ranks] in layout.py), so the requests a step makes that find their calls missing are kept
# (as runs of CP ranks' rows, :data:`_REQUESTS`) and planned again with each new micro-batch's
# documents. The first micro-batch of a run (or of a new sequence length) learns them: there,
# each step whose calls are missing makes one copy of its own. A request that cannot be written
# as runs (segments that do not know their documents) is served the same way every time.
#
# Where: on the Documents object (``docs.__dict__``, per device and batch size), which lives
# while the micro-batch does -- held by the per-micro-batch cache until its ``cu_seqlens``
# tensors go, and by the autograd graph until its backward is done. A dense run's Documents
# is one object per shape on the groups (an entry of their MicroBatchCache without tensors), so
# its metadata is made once, and goes with the groups.

_REQUESTS_PER_SHAPE = 1024  # distinct (q rows, k rows, mask) requests kept per (CP size, tokens)
_SHAPES = 64  # (CP size, tokens) kept: runs whose sequence length varies (SFT) learn each anew
_REQUESTS: OrderedDict[tuple[int, int], OrderedDict] = OrderedDict()


def _items(calls, batch: int):
    """What the calls read on the device: ``cu_seqlens`` always (the variable-length kernels),
    gather indices where a side's rows are not one run (:func:`megatron_startrail.blocks`)."""
    for call in calls:
        yield call, "cu_seqlens_q", batch
        yield call, "cu_seqlens_k", batch
        if call.q_slice is None:
            yield call, "q_index", 1
        if call.k_slice is None:
            yield call, "k_index", 1


class BoundCall:
    """A :class:`~megatron_startrail.layout.KernelCall` with its micro-batch's device metadata:
    ``tensor(what, device, batch)`` is a view of the one buffer; everything else is the call's."""

    __slots__ = ("call", "_views", "_device")

    def __init__(self, call, views: dict, device: torch.device) -> None:
        self.call, self._views, self._device = call, views, device

    def __getattr__(self, name):
        # Only names the slots do not answer come here. An object made without ``__init__``
        # (``__new__`` by copy.copy, pickle, torch.compile's object builder) has no ``call`` yet:
        # reading ``self.call`` would come back here without end; it has no such attribute.
        try:
            call = object.__getattribute__(self, "call")
        except AttributeError:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}") from None
        return getattr(call, name)

    def tensor(self, what: str, device, batch: int = 1) -> torch.Tensor:
        key = (self.call, what, batch if what.startswith("cu_") else 1)
        if torch.device(device) == self._device and key in self._views:
            return self._views[key]
        return self.call.tensor(what, device, batch)  # another device or batch: made anew


class DeviceCalls:
    """The device metadata of one micro-batch on one device for one batch size (Note [device
    metadata]): ``views`` maps ``(call, what, batch)`` to a view of a buffer made in one copy."""

    def __init__(self, docs, device: torch.device, batch: int) -> None:
        self.device, self.batch, self.views = device, batch, {}
        self.copies = 0  # buffers made (tests count them)
        calls = []
        for q_runs, k_runs, causal, window, max_rows, whole_key_runs in list(_requests(docs)):
            calls += plan_calls(segments_of_runs(docs, q_runs), segments_of_runs(docs, k_runs), causal, window,
                                max_rows, whole_key_runs)
        self.add(calls)

    def add(self, calls) -> None:
        """Make the metadata of the calls not here yet, in one copy."""
        items = [i for i in _items(calls, self.batch) if i not in self.views]
        if items:
            self.views.update(pack_on_device(items, self.device))
            self.copies += 1

    def has(self, call) -> bool:
        return (call, "cu_seqlens_q", self.batch) in self.views


def _requests(docs) -> OrderedDict:
    """The requests kept for documents of this CP size and length (Note [device metadata])."""
    shape = (docs.cp_size, (docs.cu_seqlens_padded or docs.cu_seqlens)[-1])
    requests = _REQUESTS.setdefault(shape, OrderedDict())
    _REQUESTS.move_to_end(shape)
    while len(_REQUESTS) > _SHAPES:
        _REQUESTS.popitem(last=False)
    return requests


def _remember(docs, q_segments, k_segments, causal, window, max_rows, whole_key_runs) -> None:
    """Keep a step's request as runs of CP ranks' rows, for the next micro-batches."""
    requests = _requests(docs)
    requests[(rank_runs(docs, q_segments), rank_runs(docs, k_segments), causal, window, max_rows,
              whole_key_runs)] = None
    while len(requests) > _REQUESTS_PER_SHAPE:
        requests.popitem(last=False)


def device_calls(q_segments, k_segments, causal: bool, window, max_rows, device, batch: int,
                 whole_key_runs: bool = False) -> list:
    """The kernel calls of one step (:func:`~megatron_startrail.layout.plan_calls`), bound to their
    micro-batch's device metadata (Note [device metadata]); plain calls where the segments do not
    know their documents (each call then makes its tensors when asked)."""
    calls = plan_calls(q_segments, k_segments, causal, window, max_rows, whole_key_runs)
    docs = docs_of(q_segments, k_segments)
    if docs is None or not calls:
        return list(calls)
    device = torch.device(device)
    per_docs = docs.__dict__.setdefault("_device_calls", {})  # dies with the Documents object
    metadata = per_docs.get((device, batch))
    if metadata is None:
        metadata = per_docs[(device, batch)] = DeviceCalls(docs, device, batch)
    missing = [call for call in calls if not metadata.has(call)]
    if missing:  # a request not seen before: remembered for the next micro-batches, served now
        # Only rows the layout functions made (both sides know their documents) are the same
        # rows in every micro-batch; the halo's own concatenation depends on the documents.
        if docs_of(q_segments) is docs and docs_of(k_segments) is docs:
            _remember(docs, q_segments, k_segments, causal, window, max_rows, whole_key_runs)
        metadata.add(missing)
    return [BoundCall(call, metadata.views, device) for call in calls]
