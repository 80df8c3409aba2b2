"""Two memory measurements of one attention call, shared by the benchmark and the tests.

``saved_bytes``: the bytes autograd keeps for the backward, read from
``torch.autograd.graph.saved_tensors_hooks`` (every saved tensor passes through the pack
hook; distinct storages are counted once, and storages of the ``exclude`` tensors, the
caller's own inputs, are left out).

``peak_live_bytes``: the peak of live tensor bytes above the level at the start, during
``fn`` (e.g. one forward+backward), on this process. CUDA: the caching allocator's
``max_memory_allocated``. CPU: ``torch.profiler``'s memory accounting (every allocation
and free of the CPU allocator, attributed to the op that made it), summed in op start
order; the running sum's maximum is the peak. A temporary allocated and freed inside one
op (no child op) is not seen, so the CPU figure is a lower bound by at most one op's
scratch. Both count tensors (communication buffers are tensors), not the allocator's
cached or fragmented memory.
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
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    # An op's self memory is what it allocated (less what it freed) outside its child
    # ops; "[memory]" events are frees (and allocations) outside any op.
    live = peak = 0
    for e in sorted(prof.events(), key=lambda e: e.time_range.start):
        live += e.self_cpu_memory_usage
        peak = max(peak, live)
    return out, peak
