"""StarTrail inside a plain-PyTorch DiT block (no attention mask), checked against no CP.

    torchrun --nproc-per-node 8 examples/dit_startrail.py --team-size 2
    torchrun --nproc-per-node 8 examples/dit_startrail.py --team-size 2 --ulysses-size 2

A DiT block (Peebles & Xie): adaLN-Zero modulation from a conditioning vector, full
self-attention over the patch tokens, an MLP. The token sequence is split across the
context-parallel ranks in Megatron's layout (chunks r and 2*CP-1-r of 2*CP chunks) and
the attention is ``startrail_attn(..., causal=False)``; everything else is per token.
Every rank also runs the same block on the whole sequence without context parallelism
and compares the output and the parameter gradients (summed over the CP group, as a
data-parallel all-reduce would); it prints PASS or FAIL and exits non-zero on failure.
"""

from __future__ import annotations

import argparse
import datetime
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from megatron_startrail import new_startrail_groups, startrail_attn
from megatron_startrail.layout import zigzag_chunks


def modulate(x, shift, scale):
    return x * (1 + scale) + shift


class DiTBlock(nn.Module):
    """``x [s, b, hidden]``, ``cond [b, hidden]`` -> ``[s, b, hidden]``."""

    def __init__(self, hidden: int, heads: int, mlp_ratio: float = 4.0):
        super().__init__()
        self.heads = heads
        self.norm1 = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.norm2 = nn.LayerNorm(hidden, elementwise_affine=False, eps=1e-6)
        self.mlp = nn.Sequential(nn.Linear(hidden, int(hidden * mlp_ratio)), nn.GELU(approximate="tanh"),
                                 nn.Linear(int(hidden * mlp_ratio), hidden))
        self.adaLN = nn.Sequential(nn.SiLU(), nn.Linear(hidden, 6 * hidden))

    def attention(self, x, groups):
        s, b, hidden = x.shape
        q, k, v = self.qkv(x).view(s, b, 3, self.heads, hidden // self.heads).unbind(2)  # [s, b, np, hn]
        if groups is None:  # the whole sequence on this rank
            out = F.scaled_dot_product_attention(*(t.permute(1, 2, 0, 3) for t in (q, k, v))).permute(2, 0, 1, 3)
        else:
            out = startrail_attn(q, k, v, groups, causal=False)
        return self.proj(out.reshape(s, b, hidden))

    def forward(self, x, cond, groups=None):
        shift1, scale1, gate1, shift2, scale2, gate2 = self.adaLN(cond).unsqueeze(0).chunk(6, dim=-1)
        x = x + gate1 * self.attention(modulate(self.norm1(x), shift1, scale1), groups)
        return x + gate2 * self.mlp(modulate(self.norm2(x), shift2, scale2))


def local_rows(x, cp_rank, cp_size):
    chunk = x.shape[0] // (2 * cp_size)
    return torch.cat([x[c * chunk : (c + 1) * chunk] for c in zigzag_chunks(cp_rank, cp_size)])


def check(rank: int, world_size: int, team_size: int, ulysses_size: int = 1, tokens: int = 256, hidden: int = 64,
          heads: int = 4, batch: int = 2, seed: int = 0) -> dict[str, float]:
    """Run the block with and without CP on this rank; return max relative errors."""
    groups = new_startrail_groups(team_size=team_size, ulysses_size=ulysses_size)
    torch.manual_seed(seed)  # same weights and inputs on every rank
    block = DiTBlock(hidden, heads).double()
    nn.init.normal_(block.adaLN[1].weight, std=0.02)  # adaLN-Zero would start as identity
    x = torch.randn(tokens, batch, hidden, dtype=torch.float64)
    cond = torch.randn(batch, hidden, dtype=torch.float64)
    grad = torch.randn(tokens, batch, hidden, dtype=torch.float64)

    ref = block(x, cond)
    ref.backward(grad)
    ref_grads = {n: p.grad.clone() for n, p in block.named_parameters()}
    block.zero_grad()

    out = block(local_rows(x, rank, world_size), cond, groups)
    out.backward(local_rows(grad, rank, world_size))
    errors = {"output": ((out - local_rows(ref, rank, world_size)).abs().max() / ref.abs().max()).item()}
    for name, p in block.named_parameters():
        g = p.grad.clone()
        dist.all_reduce(g)  # every rank saw part of the tokens
        errors[name] = ((g - ref_grads[name]).abs().max() / ref_grads[name].abs().max().clamp_min(1e-30)).item()
    return errors


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--team-size", type=int, default=2)
    p.add_argument("--ulysses-size", type=int, default=1)
    p.add_argument("--tokens", type=int, default=256)
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--tolerance", type=float, default=1e-10)
    args = p.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    errors = check(rank, world, args.team_size, args.ulysses_size, args.tokens, args.hidden, args.heads)
    worst = torch.tensor([max(errors.values())], dtype=torch.float64)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    ok = worst.item() <= args.tolerance
    if rank == 0:
        print(f"{'PASS' if ok else 'FAIL'}: DiT block, CP={world} (U={args.ulysses_size}, C={args.team_size}), "
              f"{args.tokens} tokens, float64: max relative error {worst.item():.2e} "
              f"(output and every parameter gradient; tolerance {args.tolerance:.0e})")
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
