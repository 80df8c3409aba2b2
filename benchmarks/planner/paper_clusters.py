"""The planner on the StarTrail paper's clusters (Table 1, Figure 7): which of ring,
StarTrail-2 and StarTrail-4 it predicts fastest, per cluster and workload.

    python -m benchmarks.planner.paper_clusters            # prints the Markdown tables
    python -m benchmarks.planner.paper_clusters --h100     # 2-16 H100 nodes, 128K-1M tokens
    python -m benchmarks.planner.paper_clusters --cp-types # the same, every Megatron CP type beside StarTrail

Nothing here is measured on these clusters (we have none of them); the links are public
figures with stated efficiencies, and the clusters are the package's presets
(megatron_startrail/planning/cluster.py). The compute is measured on one H100
(megatron_startrail/planning/gpu_rates.py): the H100 presets price a rank's attention at the
fused cuDNN call's 559 TFLOP/s times the cuDNN block loop's efficiency at the rank's tokens
(0.60 at 8K, 0.83 at 16K); the A100 presets at an assumed 170 TFLOP/s FA2 times FA2's
block-loop efficiency against its own fused call, measured on the H100 (0.91, 0.97). The second table shows the winner for overlap 1.0 / 0.7 / 0.5 and
Ethernet at 100 % / 50 % of line rate, the two assumptions it depends on most.

Every run uses 32 GPUs (Figure 7), context parallel size 32, batch 1, bf16, causal for
GPT and unmasked for DiT. Attention cost depends only on the hidden size (heads x head
dim), so GPT-3B and GPT-7B (both 4096 wide) share a row. The paper reports training
throughput of the whole model, so its speed-ups include the layers' other work (QKV,
output and MLP GEMMs: ``24 h^2`` FLOPs per token forward), which StarTrail does not
change: the "layer" column adds that work at the same rate to both sides.
"""

from __future__ import annotations

import argparse
import dataclasses

from megatron_startrail.planning.cluster import GPU_OVERLAP, TCP_ETHERNET_EFFICIENCY, ClusterSpec, preset
from megatron_startrail.planning.cp_types import CP_TYPES, LABELS, STARTRAIL_TYPES, price_cp_types
from megatron_startrail.planning.cp_types import winner as cp_winner
from megatron_startrail.planning.planner import BACKWARD_FLOPS_RATIO, Workload, predict

ETHERNET_LINE_GBS = 12.5  # 100 Gbit/s
CLUSTERS = {  # label: preset
    "H100 8 GPU/node, 8x400Gbps IB": "h100-nvlink-8x400ib",
    **{f"A100 {n} GPU/node, 100Gbps Eth": f"a100-{n}gpu-100gbe" for n in (16, 8, 4)},
}
WORKLOADS = {  # name: (workload, hidden size)
    "GPT-3B/7B, 128K": (Workload(131072, heads=32, kv_heads=32, head_dim=128, causal=True), 4096),
    "GPT-3B/7B, 512K": (Workload(524288, heads=32, kv_heads=32, head_dim=128, causal=True), 4096),
    "DiT-1B, 512K": (Workload(524288, heads=24, kv_heads=24, head_dim=64, causal=False), 1536),
}
GPUS = 32
TEAMS = (1, 2, 4)


def other_layer_work_s(cluster: ClusterSpec, work: Workload, hidden: int) -> float:
    """Forward+backward time of a layer's GEMMs on one GPU's tokens (same on every side)."""
    flops = 24 * hidden**2 * work.seq_length / GPUS * work.batch * (1 + BACKWARD_FLOPS_RATIO)
    return flops / (cluster.attention_tflops * 1e12)


def rows(overrides: dict | None = None):
    for cname, name in CLUSTERS.items():
        cluster = preset(name, GPUS // preset(name, 1).gpus_per_node)
        if overrides:
            cluster = dataclasses.replace(cluster, **overrides(cluster))
        for wname, (work, hidden) in WORKLOADS.items():
            preds = {team: predict(cluster, work, GPUS, team) for team in TEAMS}
            best = min(preds, key=lambda t: preds[t].time_s)
            yield cname, wname, cluster, work, hidden, preds, best


def winner(best: int) -> str:
    return "ring" if best == 1 else f"StarTrail-{best}"


H100_NODES = (2, 4, 8, 16)
H100_TOKENS = (131072, 262144, 524288, 1048576)
H100_LINKS = {"1x400Gbps IB": "h100-nvlink-1x400ib", "8x400Gbps IB": "h100-nvlink-8x400ib"}


def h100_rows():
    """GPT-3B/7B attention (32 x 128, causal) on 2-16 H100 nodes, every GPU one CP rank."""
    for lname, name in H100_LINKS.items():
        for nodes in H100_NODES:
            cluster = preset(name, nodes)
            cp = nodes * cluster.gpus_per_node
            for tokens in H100_TOKENS:
                work = Workload(tokens, heads=32, kv_heads=32, head_dim=128, causal=True)
                preds = {team: predict(cluster, work, cp, team) for team in TEAMS}
                best = min(preds, key=lambda t: preds[t].time_s)
                yield lname, nodes, cp, tokens, cluster, preds, best


def h100_table() -> None:
    print("| links | nodes (GPUs) | tokens | tokens/rank | block-loop efficiency | ring ms | StarTrail-2 ms | "
          "StarTrail-4 ms | predicted winner | attention speed-up over ring |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for lname, nodes, cp, tokens, cluster, preds, best in h100_rows():
        t = {k: v.time_s * 1e3 for k, v in preds.items()}
        eff = cluster.block_loop.at(tokens / cp)
        print(f"| {lname} | {nodes} ({cp}) | {tokens // 1024}K | {tokens // cp} | {eff:.2f} | {t[1]:.1f} | "
              f"{t[2]:.1f} | {t[4]:.1f} | {winner(best)} | {t[1] / t[best]:.2f}x |")


H100_HEADS = {"MHA 32 x 128": 32, "GQA 32/8 x 128": 8}  # name: K/V heads (32 query heads)


def cp_type_rows():
    """Every CP type of :mod:`megatron_startrail.planning.cp_types` on the H100 presets."""
    for lname, name in H100_LINKS.items():
        for hname, kv_heads in H100_HEADS.items():
            for nodes in H100_NODES:
                cluster = preset(name, nodes)
                cp = nodes * cluster.gpus_per_node
                for tokens in H100_TOKENS:
                    work = Workload(tokens, heads=32, kv_heads=kv_heads, head_dim=128, causal=True)
                    yield lname, hname, nodes, cp, tokens, price_cp_types(cluster, work, cp)


def cp_type_cell(price) -> str:
    if price.time_s is None:
        return "n/a"
    cell = f"{price.time_s * 1e3:.1f}"
    if price.fused_rate_time_s is not None:
        cell += f" ({price.fused_rate_time_s * 1e3:.1f})"
    return cell + (f" {price.config}" if price.config else "")


def cp_types_tables() -> None:
    """One table per preset and head layout: ms per CP type, the winner, StarTrail's best
    against it."""
    current = None
    for lname, hname, nodes, cp, tokens, prices in cp_type_rows():
        if (lname, hname) != current:
            current = (lname, hname)
            print(f"\n### {lname}, {hname}\n")
            print("| nodes (GPUs) | tokens | " + " | ".join(LABELS[t] + " ms" for t in CP_TYPES)
                  + " | winner | best StarTrail / winner |")
            print("|---|---|" + "---|" * len(CP_TYPES) + "---|---|")
        win = cp_winner(prices)
        star = min((prices[t] for t in STARTRAIL_TYPES if prices[t].time_s is not None), key=lambda p: p.time_s)
        verdict = LABELS[win] if win in STARTRAIL_TYPES else f"**{LABELS[win]}** (not StarTrail)"
        print(f"| {nodes} ({cp}) | {tokens // 1024}K | " + " | ".join(cp_type_cell(prices[t]) for t in CP_TYPES)
              + f" | {verdict} | {star.time_s / prices[win].time_s:.2f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--h100", action="store_true", help="2-16 H100 nodes at 128K-1M tokens instead of the paper's clusters")
    parser.add_argument("--cp-types", action="store_true",
                        help="the H100 presets with every Megatron CP type (p2p, all_gather, a2a, a2a+p2p) beside StarTrail")
    args = parser.parse_args()
    if args.h100:
        h100_table()
        return
    if args.cp_types:
        cp_types_tables()
        return
    print("| cluster (32 GPUs) | workload | ring ms | StarTrail-2 ms | StarTrail-4 ms | predicted winner | "
          "attention speed-up over ring | layer speed-up over ring |")
    print("|---|---|---|---|---|---|---|---|")
    for cname, wname, cluster, work, hidden, preds, best in rows():
        t = {k: v.time_s * 1e3 for k, v in preds.items()}
        other = 1e3 * other_layer_work_s(cluster, work, hidden)
        print(f"| {cname} | {wname} | {t[1]:.1f} | {t[2]:.1f} | {t[4]:.1f} | {winner(best)} | "
              f"{t[1] / t[best]:.2f}x | {(t[1] + other) / (t[best] + other):.2f}x |")
    print()
    settings = [(ov, eth) for ov in (1.0, GPU_OVERLAP, 0.5) for eth in (1.0, TCP_ETHERNET_EFFICIENCY)]
    print("| cluster | workload | " + " | ".join(f"overlap {ov:g}, Eth {eth:.0%}" for ov, eth in settings) + " |")
    print("|---|---|" + "---|" * len(settings))
    winners: dict = {}
    for ov, eth in settings:
        def change(cluster, ov=ov, eth=eth):
            rate = cluster.inter_node_gbs if cluster.nics_per_node > 1 else ETHERNET_LINE_GBS * eth
            return {"overlap": ov, "inter_node_gbs": rate}

        for cname, wname, _, _, _, preds, best in rows(change):
            winners.setdefault((cname, wname), []).append(
                f"{winner(best)} {preds[1].time_s / preds[best].time_s:.2f}x")
    for (cname, wname), cells in winners.items():
        print(f"| {cname} | {wname} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
