"""Measure StarTrail's per-rank communication next to the closed forms and the paper's eq. 1-3.

    torchrun --nproc-per-node 16 examples/comm_volume.py --seq-length 4096 --team-sizes 1 2 4

Every rank runs one forward+backward for each team size and reports its counters; rank 0
prints, per team size, the measured P2P and collective bytes (min/max over ranks), the
closed form of megatron_startrail.accounting for the busiest rank, and the paper's
eq. 1 (ring), eq. 2 (collective) and eq. 3 (sub-ring P2P) in the same units.
"""

from __future__ import annotations

import argparse
import datetime

import torch
import torch.distributed as dist

from megatron_startrail import new_startrail_groups, startrail_attn, valid_team_sizes
from megatron_startrail.accounting import AttentionShape, choose_backward_rotation, expected_comm, paper_forward_bytes
from megatron_startrail.layout import zigzag_chunks

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def parse_args():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seq-length", type=int, default=4096)
    p.add_argument("--micro-batch-size", type=int, default=1)
    p.add_argument("--num-attention-heads", type=int, default=8)
    p.add_argument("--num-query-groups", type=int, default=None, help="K/V heads (default: MHA)")
    p.add_argument("--kv-channels", type=int, default=64, help="head dim")
    p.add_argument("--team-sizes", type=int, nargs="+", default=None)
    p.add_argument("--dtype", choices=DTYPES, default="bf16")
    return p.parse_args()


def mib(x: float) -> str:
    return f"{x / 2**20:8.2f}"


def main():
    args = parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.set_num_threads(1)
    dtype = DTYPES[args.dtype]
    heads, kv_heads = args.num_attention_heads, args.num_query_groups or args.num_attention_heads
    s_local = args.seq_length // world
    gen = torch.Generator().manual_seed(rank)
    q = torch.randn(s_local, args.micro_batch_size, heads, args.kv_channels, generator=gen).to(dtype)
    k = torch.randn(s_local, args.micro_batch_size, kv_heads, args.kv_channels, generator=gen).to(dtype)
    v = torch.randn_like(k)
    shape = AttentionShape(s_local, args.micro_batch_size, heads, kv_heads, args.kv_channels, q.element_size())
    assert zigzag_chunks(rank, world)  # Megatron layout: this rank holds chunks (r, 2P-1-r)

    rows = []
    for c in args.team_sizes or valid_team_sizes(world):
        groups = new_startrail_groups(team_size=c)
        qq, kk, vv = (t.clone().requires_grad_(True) for t in (q, k, v))
        startrail_attn(qq, kk, vv, groups, causal=True).sum().backward()
        mine = {
            phase: stats.as_dict()
            for phase, stats in (("forward", groups.last_forward_stats), ("backward", groups.last_backward_stats))
        }
        closed = expected_comm(shape, cp_size=world, team_size=c, startrail_rank=groups.startrail_rank,
                               rotation=groups.backward_rotation)
        gathered = [None] * world
        dist.all_gather_object(gathered, (mine, closed, choose_backward_rotation(shape, 1, c)))
        rows.append((c, gathered))

    if rank == 0:
        paper = {c: paper_forward_bytes(shape, cp_size=world, team_size=c) for c, _ in rows}
        print(f"P={world} seq={args.seq_length} b={args.micro_batch_size} heads={heads} kv_heads={kv_heads} "
              f"head_dim={args.kv_channels} {args.dtype}; MiB per rank, min..max over ranks")
        print(f"{'C':>2} {'phase':8} {'P2P sent':>19} {'closed form':>12} {'paper P2P':>10} "
              f"{'collective':>19} {'closed form':>12} {'paper coll':>10} {'steps':>6}")
        for c, gathered in rows:
            for phase in ("forward", "backward"):
                p2p = [g[0][phase]["p2p_bytes_sent"] for g in gathered]
                coll = [g[0][phase]["collective_bytes_sent"] for g in gathered]
                steps = max(g[0][phase]["p2p_steps"] for g in gathered)
                cf_p2p = max(g[1][phase]["p2p_bytes_sent"] for g in gathered)
                cf_coll = max(g[1][phase]["collective_bytes_sent"] for g in gathered)
                if phase == "forward":
                    pp = paper[c]["ring_p2p"] if c == 1 else paper[c]["sub_ring_p2p"]
                    paper_p2p, paper_coll = mib(pp), mib(paper[c]["collective"])
                else:
                    paper_p2p = paper_coll = "       -"
                print(f"{c:>2} {phase:8} {mib(min(p2p))}..{mib(max(p2p))} {mib(cf_p2p):>12} {paper_p2p:>10} "
                      f"{mib(min(coll))}..{mib(max(coll))} {mib(cf_coll):>12} {paper_coll:>10} {steps:>6}")
            print(f"   backward rotation (auto): {gathered[0][2]}")
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
