"""Faulty parts for the GPU kits' tests (child side: the kits start them as they start their own
parts, through ``benchmarks.gpu.check_parts``, so the process per part is exercised as on a GPU)."""

from __future__ import annotations

import os
import time

from benchmarks.gpu import check_kernels as gpu_check_kernels
from benchmarks.gpu import check_parts as gpu_check_parts


def permuted_timing_part(items, **kwargs) -> None:
    """The kit's timing part, the block kernel handed SDPA's ``[1, heads, seq, d]`` views instead
    of its ``[seq, 1, heads, d]`` tensors: what 9ee7a82's ``time_kernel`` did by reading q, k, v,
    dout late in its closure (it crashed an H100, and passed on a CPU where slicing clamps)."""
    inputs = gpu_check_kernels.timing_inputs

    def permuted(*args):
        block, sdpa = inputs(*args)
        return tuple(t.detach() for t in sdpa), sdpa

    gpu_check_kernels.timing_inputs = permuted
    gpu_check_kernels.timing_part(items, **kwargs)


def faulty_part(items, fault: str, at: int, count: int) -> None:
    """``count`` items; item ``at`` ends the process as a CUDA fault does (``fault="die"``: no
    row, no cleanup), never returns (``"hang"``: a hung kernel), or raises and leaves the device
    unusable (``"lose"``: the runner sees its context lost and ends the process)."""
    if fault == "lose":
        gpu_check_parts.device_lost = lambda: True

    def run(i):
        if i == at:
            if fault == "lose":
                raise RuntimeError("CUDA error: an illegal memory access was encountered (pretend)")
            os._exit(134) if fault == "die" else time.sleep(3600)
        return [{"item": i}]

    items.run(range(count), run, lambda i: f"item {i}")


def raising_part(items, count: int) -> None:
    """``count`` items; odd ones raise (the device stays usable: the part goes on)."""

    def run(i):
        if i % 2:
            raise RuntimeError(f"CUDA out of memory (pretend) at {i}")
        return [{"item": i}]

    items.run(range(count), run, lambda i: f"item {i}")


def grouped_fault_part(items, bad: int, good: int) -> None:
    """``bad`` items of group ``bad`` that each end the process as a CUDA fault does, then ``good``
    items of group ``good``: a kernel that kills the device on every case, before a sound one."""

    def run(item):
        if item[0] == "bad":
            os._exit(134)
        return [{"item": item[1]}]

    work = [("bad", i) for i in range(bad)] + [("good", i) for i in range(good)]
    items.run(work, run, lambda item: f"{item[0]} {item[1]}", group=lambda item: item[0])
