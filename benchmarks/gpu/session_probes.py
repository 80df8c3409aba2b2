"""Two looks inside one StarTrail rank (parts of ``benchmarks/gpu/session.py``; child side).

Both run rank 1 of P on torch's fake process group (:func:`benchmarks.gpu.check_rank.fake_rank`:
communication returns at once, so this is one rank's compute):

- ``profile_part``: one forward + backward after a warm-up under ``torch.profiler``: the top
  kernels by device time, with their launch counts, and the totals (issue 50: where the time
  outside the attention kernel goes). On the CPU self-check: the top ops by CPU time.
- ``sync_part``: micro-batches of one layer, dense, packed documents (a fresh device
  ``cu_seqlens`` per micro-batch, made before, as a data loader does) and a sliding window;
  after the first micro-batch ``torch.cuda.set_sync_debug_mode("warn")``, and every warning
  that names a synchronizing operation is counted, with its frame. On the CPU self-check the
  ops that would synchronize a GPU (``tests.fake_cuda.rank.SYNCING``) are counted instead.
"""

from __future__ import annotations

import contextlib
import warnings

import torch
from torch.autograd import DeviceType
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.gpu.check_kernels import DTYPES, _timer
from benchmarks.gpu.check_rank import fake_rank, layer_step, rank_inputs
from megatron_startrail import new_startrail_groups

SYNC_WARNING = "called a synchronizing"  # torch's sync debug mode: "called a synchronizing CUDA operation"


def _device_us(event) -> float:
    # torch >= 2.4 names it self_device_time_total; older builds self_cuda_time_total
    return getattr(event, "self_device_time_total", None) or getattr(event, "self_cuda_time_total", 0.0)


def profile_rank(world: int, team: int, tokens: int, heads: int, kv_heads: int, head_dim: int, dtype, device,
                 top: int) -> list[dict]:
    """Rows ``{"name", "count", "self_ms", "avg_us", "share"}`` of the ``top`` kernels (ops on the
    CPU) by self time in one profiled step, then one ``{"name": "(all)"...}`` row of the totals."""
    from torch.profiler import ProfilerActivity, profile  # noqa: PLC0415

    cuda = device.type == "cuda"
    with fake_rank(world, 1):
        groups = new_startrail_groups(team_size=team)
        q, k, v, dout = rank_inputs(tokens, world, heads, kv_heads, head_dim, dtype, device)
        step_ms = _timer(device)(lambda: layer_step(q, k, v, dout, groups, causal=True), 1)  # warm, then timed
        with profile(activities=[ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda) as prof:
            layer_step(q, k, v, dout, groups, causal=True)
            if cuda:
                torch.cuda.synchronize(device)
    # On a GPU the kernels' own events (a CPU op's self device time would count its kernels again)
    averages = [e for e in prof.key_averages() if not cuda or getattr(e, "device_type", None) != DeviceType.CPU]
    events = [(e, _device_us(e) if cuda else e.self_cpu_time_total) for e in averages]
    events = sorted(((e, t) for e, t in events if t > 0), key=lambda et: -et[1])
    total = sum(t for _, t in events)
    rows = [{"name": e.key[:120], "count": e.count, "self_ms": t / 1e3, "avg_us": t / e.count,
             "share": t / total} for e, t in events[:top]]
    return rows + [{"name": "(all)", "count": sum(e.count for e, _ in events), "self_ms": total / 1e3,
                    "avg_us": float("nan"), "share": 1.0, "step_ms": step_ms, "distinct": len(events),
                    "what": "kernels" if cuda else "CPU ops", "world": world, "team": team, "tokens": tokens,
                    "heads": heads, "kv_heads": kv_heads}]


def profile_part(items, tokens: int, world: int, team: int, heads: int, kv_heads: int, head_dim: int, dtype: str,
                 device: str, top: int = 25) -> None:
    items.run([(world, team)], lambda c: profile_rank(c[0], c[1], tokens, heads, kv_heads, head_dim, DTYPES[dtype],
                                                       torch.device(device), top),
              lambda c: f"profile one rank P={c[0]} C={c[1]} {tokens} tokens")


class HostSyncOps(TorchDispatchMode):
    """The CPU's stand-in for sync debug mode: every op that would make a GPU's host wait."""

    def __init__(self, found: list) -> None:
        super().__init__()
        self.found = found

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from tests.fake_cuda.rank import SYNCING, package_frame  # noqa: PLC0415

        if func in SYNCING:
            self.found.append(f"{func} at {package_frame()}")
        return func(*args, **(kwargs or {}))


@contextlib.contextmanager
def synchronizations(device, found: list):
    """Appends to ``found`` each synchronizing operation inside (on CUDA: sync debug mode's
    warnings, with the innermost frame outside torch)."""
    if device.type != "cuda":
        with HostSyncOps(found):
            yield
        return
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(0)
    found += [f"{w.message!s:.80} at {w.filename}:{w.lineno}" for w in caught if SYNC_WARNING in str(w.message)]


def layout_kwargs(layout: str, tokens: int, world: int, device, micro_batches: int) -> list[dict]:
    """``startrail_attn`` keywords per micro-batch: ``documents`` gets 4 documents
    (10/30/20/40% of the sequence) as a fresh int32 ``cu_seqlens`` on the device each time, made
    here, before any is timed (a loader's work); ``window`` a (tokens / 32, 0) band."""
    if layout == "dense":
        return [{}] * micro_batches
    if layout == "window":
        return [{"window_size": (max(tokens // 32, 1), 0)}] * micro_batches
    cuts = [0] + [tokens * f // 10 for f in (1, 4, 6)] + [tokens]
    return [{"cu_seqlens": torch.tensor(cuts, dtype=torch.int32).to(device)} for _ in range(micro_batches)]


def count_syncs(layout: str, world: int, team: int, tokens: int, heads: int, kv_heads: int, head_dim: int, dtype,
                device, micro_batches: int) -> dict:
    found = []
    with fake_rank(world, 1):
        groups = new_startrail_groups(team_size=team)
        q, k, v, dout = rank_inputs(tokens, world, heads, kv_heads, head_dim, dtype, device)
        per_batch = layout_kwargs(layout, tokens, world, device, micro_batches)
        layer_step(q, k, v, dout, groups, causal=True, **per_batch[0])  # the first micro-batch: not counted
        with synchronizations(device, found):
            for kwargs in per_batch[1:]:
                layer_step(q, k, v, dout, groups, causal=True, **kwargs)
    return {"layout": layout, "world": world, "team": team, "tokens": tokens, "heads": heads, "kv_heads": kv_heads,
            "micro_batches_counted": micro_batches - 1, "syncs": len(found), "found": found[:10],
            "how": "torch.cuda.set_sync_debug_mode('warn')" if device.type == "cuda" else "SYNCING ops (CPU)"}


def sync_part(items, tokens: int, world: int, team: int, heads: int, kv_heads: int, head_dim: int, dtype: str,
              device: str, micro_batches: int = 3, layouts: tuple = ("dense", "documents", "window")) -> None:
    dev, dt = torch.device(device), DTYPES[dtype]
    items.run(list(layouts), lambda layout: [count_syncs(layout, world, team, tokens, heads, kv_heads, head_dim,
                                                         dt, dev, micro_batches)],
              lambda layout: f"sync debug {layout} P={world} C={team} {tokens} tokens")

