"""One StarTrail rank at long context in one process (part of gpu_check; docs/design.md, "The test bed").

torch's no-op ("fake") process group lets this process be rank ``r`` of a world of ``P``:
``new_startrail_groups`` and ``startrail_attn`` run unchanged, every collective and P2P
returns at once and moves nothing (the numbers are garbage, the work is real). So the
time measured is one rank's compute and memory traffic of the block loop, and
``torch.cuda.max_memory_allocated`` is one rank's peak. The yardstick is one fused SDPA
forward+backward over the whole sequence divided by ``P``: the block loop's efficiency is
that divided by the rank's time (1.0 = no overhead over a single fused call).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F

from megatron_startrail import new_startrail_groups, startrail_attn


@dataclass
class RankRow:
    world: int
    team: int
    tokens: int
    heads: int
    head_dim: int
    dtype: torch.dtype
    kernel: str
    rank_ms: float
    rank_peak_mib: float


@dataclass
class FusedRow:
    tokens: int
    ms: float
    peak_mib: float


def _peak_mib(device) -> float:
    return torch.cuda.max_memory_allocated(device) / 2**20 if device.type == "cuda" else float("nan")


def _reset_peak(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)


def fused_sdpa(tokens: int, heads: int, head_dim: int, dtype, device, timer, iters: int) -> FusedRow:
    """One ``F.scaled_dot_product_attention`` forward+backward over the whole causal sequence."""
    gen = torch.Generator(device="cpu").manual_seed(2)
    q, k, v = (torch.randn(1, heads, tokens, head_dim, generator=gen).to(device, dtype).requires_grad_(True)
               for _ in range(3))
    dout = torch.randn(1, heads, tokens, head_dim, generator=gen).to(device, dtype)

    def step():
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        torch.autograd.grad(out, (q, k, v), dout)

    _reset_peak(device)
    ms = timer(step, iters)
    row = FusedRow(tokens, ms, _peak_mib(device))
    del q, k, v, dout
    return row


def one_rank(world: int, team: int, tokens: int, heads: int, head_dim: int, dtype, device, timer, iters: int,
             kernel: str = "auto", rank: int = 0) -> RankRow:
    """Rank ``rank`` of a StarTrail group of ``world`` ranks with team size ``team``, causal,
    batch 1: its ``[tokens / world, 1, heads, head_dim]`` share, forward + backward."""
    from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: PLC0415 - test utility

    if dist.is_initialized():
        dist.destroy_process_group()
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    try:
        groups = new_startrail_groups(team_size=team, kernel=kernel)
        s_local = tokens // world
        gen = torch.Generator(device="cpu").manual_seed(3)
        q, k, v = (torch.randn(s_local, 1, heads, head_dim, generator=gen).to(device, dtype).requires_grad_(True)
                   for _ in range(3))
        dout = torch.randn(s_local, 1, heads, head_dim, generator=gen).to(device, dtype)

        def step():
            out = startrail_attn(q, k, v, groups, causal=True)
            torch.autograd.grad(out, (q, k, v), dout)

        _reset_peak(device)
        ms = timer(step, iters)
        from megatron_startrail.kernels import check_kernel  # noqa: PLC0415

        used = check_kernel(kernel, q, k, v).name
        return RankRow(world, team, tokens, heads, head_dim, dtype, used, ms, _peak_mib(device))
    finally:
        dist.destroy_process_group()
