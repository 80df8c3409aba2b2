"""Metadata computed once per micro-batch and reused by every layer.

Packed documents give every attention layer of a micro-batch the same ``cu_seqlens``
tensors (Megatron: one ``PackedSeqParams`` shared by the layers). What StarTrail derives
from them -- the document segments after the cross-rank agreement (one host sync, one
small collective) and the RoPE positions of the sample layout -- depends on nothing else,
so it is computed by the first layer and looked up by the others. Keys are the tensors'
identities: an entry lives while its tensors do (weak references), and a recycled ``id``
of a dead tensor never matches. Contract: ``cu_seqlens`` tensors are not modified in place
once a layer has seen them (Megatron builds new ones for every micro-batch).
"""

from __future__ import annotations

import weakref
from collections import OrderedDict
from typing import Callable, Hashable, Sequence

import torch


class MicroBatchCache:
    """A small LRU of ``kind, tensors, extra -> value``; ``capacity`` covers the micro-batches
    in flight on one pipeline stage (interleaved schedules alternate several)."""

    def __init__(self, capacity: int = 16) -> None:
        self.capacity = capacity
        self._entries: OrderedDict = OrderedDict()  # key -> (weak refs of the tensors, value)
        self.computed = 0  # how many values were computed (tests count them)

    def get(self, kind: str, tensors: Sequence[torch.Tensor | None], extra: Hashable, make: Callable):
        key = (kind, tuple(None if t is None else id(t) for t in tensors), extra)
        hit = self._entries.get(key)
        if hit is not None and all((r is None and t is None) or (r is not None and r() is t)
                                   for r, t in zip(hit[0], tensors)):
            self._entries.move_to_end(key)
            return hit[1]
        value = make()  # may raise: nothing is cached then
        self.computed += 1
        self._entries[key] = (tuple(None if t is None else weakref.ref(t) for t in tensors), value)
        self._entries.move_to_end(key)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)
        return value
