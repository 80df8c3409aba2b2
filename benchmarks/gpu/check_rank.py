"""One StarTrail rank at long context in one process (part of gpu_check; docs/design.md, "The test bed").

torch's no-op ("fake") process group lets this process be rank ``r`` of a world of ``P``:
``new_startrail_groups`` and ``startrail_attn`` run unchanged, every collective and P2P
returns at once and moves nothing (the numbers are garbage, the work is real). So the
time measured is one rank's compute and memory traffic of the block loop, and
``torch.cuda.max_memory_allocated`` is one rank's peak. The yardstick is one fused SDPA
forward+backward over the whole sequence divided by ``P``: the block loop's efficiency is
that divided by the rank's time (1.0 = no overhead over a single fused call).

Memory is measured as the fake-CUDA rehearsal counts it (``benchmarks/counters/fake_cuda_memory.py``):
bytes above the caller's q, k, v, dO -- ``kept`` live after the forward, ``forward_peak`` and
``backward_peak`` the most allocated during each -- beside
:func:`megatron_startrail.planning.memory_model.layer_memory_bytes` and the rehearsal's row
(``benchmarks/results/fake_cuda_memory.json``: GQA 32/8 x 128, rank 1) where there is one.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F

from benchmarks import RESULTS
from benchmarks.gpu.check_kernels import DTYPE_NAMES, DTYPES, _timer, generator, randn
from megatron_startrail import new_startrail_groups, startrail_attn
from megatron_startrail.accounting import AttentionShape, choose_backward_rotation
from megatron_startrail.planning.memory_model import layer_memory_bytes

REHEARSAL = Path(RESULTS) / "fake_cuda_memory.json"
NAN = float("nan")


def _synced_allocated(device) -> tuple[int, int]:
    """(allocated now, the most since the last reset) in bytes; NaN on the CPU."""
    if device.type != "cuda":
        return NAN, NAN
    torch.cuda.synchronize(device)
    return torch.cuda.memory_allocated(device), torch.cuda.max_memory_allocated(device)


def _reset_peak(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def fused_sdpa(tokens: int, heads: int, kv_heads: int, head_dim: int, dtype, device, iters: int) -> dict:
    """One ``F.scaled_dot_product_attention`` forward+backward over the whole causal sequence
    (default dispatch; GQA: K/V expanded to the query heads beforehand, outside the time)."""
    gen = generator(device, 2)  # drawn on the device (1M tokens: billions of normals)
    q = randn((1, heads, tokens, head_dim), gen, device, dtype).requires_grad_(True)
    k, v = (randn((1, kv_heads, tokens, head_dim), gen, device, dtype)
            .repeat_interleave(heads // kv_heads, dim=1).requires_grad_(True) for _ in range(2))
    dout = randn((1, heads, tokens, head_dim), gen, device, dtype)

    def step():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.autograd.grad(out, (q, k, v), dout)

    _reset_peak(device)
    ms = _timer(device)(step, iters)
    peak = _synced_allocated(device)[1]
    return {"kind": "fused", "tokens": tokens, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim,
            "dtype": DTYPE_NAMES[dtype], "ms": ms, "peak_mib": peak / 2**20}


@contextlib.contextmanager
def fake_rank(world: int, rank: int):
    """This process as rank ``rank`` of ``world`` on torch's fake process group."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: PLC0415 - test utility

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        yield
    finally:
        dist.destroy_process_group()


def rank_inputs(tokens: int, world: int, heads: int, kv_heads: int, head_dim: int, dtype, device):
    """This rank's ``q [tokens / world, 1, heads, d]``, ``k``, ``v`` (kv_heads) needing grad, and ``dout``."""
    s_local = tokens // world
    gen = generator(device, 3)  # drawn on the device, not on one host core
    q, k, v = (randn((s_local, 1, h, head_dim), gen, device, dtype).requires_grad_(True)
               for h in (heads, kv_heads, kv_heads))
    dout = randn((s_local, 1, heads, head_dim), gen, device, dtype)
    return q, k, v, dout


def layer_step(q, k, v, dout, groups, **kwargs) -> None:
    """One attention layer's forward + backward as a model runs it (the grads freed after)."""
    startrail_attn(q, k, v, groups, **kwargs).backward(dout)
    q.grad = k.grad = v.grad = None


def measured_step(q, k, v, dout, groups, device) -> dict:
    """One forward + backward with the rehearsal's three memory figures (bytes above the
    inputs) and its time from CUDA events (synchronized between the phases)."""
    base = _synced_allocated(device)[0]
    _reset_peak(device)
    timer = _timer(device)
    holder = {}

    def forward_backward():
        out = startrail_attn(q, k, v, groups, causal=True)
        now, peak = _synced_allocated(device)
        holder.update(kept=now - base, forward_peak=peak - base)
        _reset_peak(device)
        out.backward(dout)
        holder["backward_peak"] = _synced_allocated(device)[1] - base
        q.grad = k.grad = v.grad = None

    ms = timer(forward_backward, 1, warm=False)
    return {**holder, "measured_step_ms": ms}


def one_rank(world: int, team: int, tokens: int, heads: int, kv_heads: int, head_dim: int, dtype, device,
             iters: int, kernel: str = "auto", rank: int = 1, warmup: bool = True) -> dict:
    """Rank ``rank`` of a StarTrail group of ``world`` ranks with team size ``team``, causal,
    batch 1: its ``[tokens / world, 1, heads, head_dim]`` share, forward + backward. ``iters``
    timed steps after the measured one (none: the measured step's time is the answer)."""
    with fake_rank(world, rank):
        groups = new_startrail_groups(team_size=team, kernel=kernel)
        q, k, v, dout = rank_inputs(tokens, world, heads, kv_heads, head_dim, dtype, device)
        if warmup:
            layer_step(q, k, v, dout, groups, causal=True)  # the groups' caches, the kernel's plans
        row = measured_step(q, k, v, dout, groups, device)
        if iters:
            row["rank_ms"] = _timer(device)(lambda: layer_step(q, k, v, dout, groups, causal=True), iters)
        else:
            row["rank_ms"] = row["measured_step_ms"]
        from megatron_startrail.kernels import check_kernel  # noqa: PLC0415

        used = check_kernel(kernel, q, k, v).name
    shape = AttentionShape(tokens // world, 1, heads, kv_heads, head_dim, dtype.itemsize)
    rotation = choose_backward_rotation(shape, 1, team)
    model = layer_memory_bytes(shape, cp_size=world, team_size=team, startrail_rank=rank, rotation=rotation)
    return {"kind": "rank", "world": world, "team": team, "tokens": tokens, "heads": heads, "kv_heads": kv_heads,
            "head_dim": head_dim, "dtype": DTYPE_NAMES[dtype], "kernel": used, "rank": rank, "rotation": rotation,
            "iters": iters, "warmup": warmup, **row, "model": model,
            "rehearsal": rehearsal_row(tokens, world, team, rank, rotation, heads, kv_heads, head_dim, dtype)}


def rehearsal_row(tokens, world, team, rank, rotation, heads, kv_heads, head_dim, dtype) -> dict | None:
    """The fake-CUDA rehearsal's kept / forward / backward bytes of this configuration, if it ran it."""
    from benchmarks.counters.fake_cuda_memory import DIM, HEADS, KV_HEADS  # noqa: PLC0415

    if (heads, kv_heads, head_dim, dtype) != (HEADS, KV_HEADS, DIM, torch.bfloat16) or not REHEARSAL.exists():
        return None
    for r in json.loads(REHEARSAL.read_text()):
        if (r["tokens"], r["world"], r["team"], r["rank"], r["rotation"], r["regather"], r["window"], r["sinks"]) \
                == (tokens, world, team, rank, rotation, False, None, False):
            return {key: r[key] for key in ("kept", "forward_peak", "backward_peak")}
    return None


def rank_part(items, tokens: int, configs: list[list[int]], layouts: list[list[int]], head_dim: int, dtype: str,
              device: str, iters: int, warmup: bool = True, fused: bool = True, kernel: str = "auto") -> None:
    """One part (child side): for each ``[heads, kv_heads]`` of ``layouts``, the fused call over
    the whole sequence (if ``fused``), then one rank of each ``[P, C]``; each an item."""
    dev, dt = torch.device(device), DTYPES[dtype]
    work = [("fused", h, hkv) for h, hkv in layouts if fused]
    work += [("rank", h, hkv, p, c) for h, hkv in layouts for p, c in configs]

    def run(item):
        if item[0] == "fused":
            return [fused_sdpa(tokens, item[1], item[2], head_dim, dt, dev, max(iters, 1))]
        _, h, hkv, p, c = item
        return [one_rank(p, c, tokens, h, hkv, head_dim, dt, dev, iters, kernel, warmup=warmup)]

    def what(item):
        run_of = "fused SDPA" if item[0] == "fused" else f"one rank P={item[3]} C={item[4]}"
        return f"{tokens} tokens {item[1]}/{item[2]}x{head_dim} {run_of}"

    items.run(work, run, what)
