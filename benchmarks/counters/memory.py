"""Two memory measurements of one attention call, shared by the benchmark and the tests.

``saved_bytes``: the bytes autograd keeps for the backward, read from
``torch.autograd.graph.saved_tensors_hooks`` (every saved tensor passes through the pack
hook; distinct storages are counted once, and storages of the ``exclude`` tensors, the
caller's own inputs, are left out).

``peak_live_bytes``: the peak of live tensor bytes above the level at the start, during
``fn`` (e.g. one forward+backward), on this process. CUDA: the caching allocator's
``max_memory_allocated``. CPU: ``torch.profiler`` with ``profile_memory``
records every allocation and free of the CPU allocator with its size and time (this
process's allocations; gloo's own transport buffers are not tensors and are not seen);
summed in time order, the running sum's maximum is the peak. Both count tensors
(communication buffers are tensors), not the allocator's cached or fragmented memory.
"""

from __future__ import annotations

from typing import Callable

import torch


def _storage_key(t: torch.Tensor) -> tuple[int, int]:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


def saved_bytes(fn: Callable[[], object], exclude: tuple[torch.Tensor, ...] = ()) -> tuple[object, int]:
    """Run ``fn``; return its result and the bytes of distinct storages saved for backward,
    except those of ``exclude``."""
    excluded = {_storage_key(t) for t in exclude}
    seen: set[tuple[int, int]] = set()
    total = 0

    def pack(t):
        nonlocal total
        key = _storage_key(t)
        if key not in seen and key not in excluded:
            seen.add(key)
            total += key[1]
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, total


def peak_live_bytes(fn: Callable[[], object], device: torch.device) -> tuple[object, int]:
    """Run ``fn``; return its result and the peak of live tensor bytes above the start."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        start = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        out = fn()
        torch.cuda.synchronize(device)
        return out, torch.cuda.max_memory_allocated(device) - start
    from torch._C._profiler import _EventType  # noqa: PLC0415
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    # Every allocation (+size) and free (-size) of the CPU allocator, with its time: the
    # raw stream that torch.profiler's own memory timeline is built from (op-level
    # "self memory" would apply a parent op's frees before its children's allocations).
    changes: list[tuple[int, int]] = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        if node.tag == _EventType.Allocation:
            changes.append((node.start_time_ns, node.extra_fields.alloc_size))
        stack.extend(node.children)
    live = peak = 0
    for _, nbytes in sorted(changes):
        live += nbytes
        peak = max(peak, live)
    return out, peak
