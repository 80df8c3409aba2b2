"""The planner on the StarTrail paper's clusters (Table 1, Figure 7): which of ring,
StarTrail-2 and StarTrail-4 it predicts fastest, per cluster and workload.

    python benchmarks/paper_clusters.py            # prints the Markdown table

Cluster speeds are public figures, not measurements: H100 SXM (NVLink 4: 450 GB/s per
direction per GPU; 8 x 400 Gbit/s InfiniBand per node = 400 GB/s), A100 40GB (NVLink 3:
300 GB/s per direction; one 100 Gbit/s Ethernet link per node = 12.5 GB/s). Effective
attention rates (bf16, FlashAttention-2): 350 TFLOP/s on H100, 170 TFLOP/s on A100.
Every run uses 32 GPUs (Figure 7), context parallel size 32, batch 1, bf16, causal for
GPT and unmasked for DiT. Attention cost depends only on the hidden size (heads x head
dim), so GPT-3B and GPT-7B (both 4096 wide) share a row.
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megatron_startrail.planner import ClusterSpec, Workload, predict  # noqa: E402

CLUSTERS = {
    "H100 8 GPU/node, 8x400Gbps IB": dict(gpus_per_node=8, intra_node_gbs=450, inter_node_gbs=400, nics_per_node=8,
                                          attention_tflops=350),
    "A100 16 GPU/node, 100Gbps Eth": dict(gpus_per_node=16, intra_node_gbs=300, inter_node_gbs=12.5,
                                          nics_per_node=1, attention_tflops=170),
    "A100 8 GPU/node, 100Gbps Eth": dict(gpus_per_node=8, intra_node_gbs=300, inter_node_gbs=12.5, nics_per_node=1,
                                         attention_tflops=170),
    "A100 4 GPU/node, 100Gbps Eth": dict(gpus_per_node=4, intra_node_gbs=300, inter_node_gbs=12.5, nics_per_node=1,
                                         attention_tflops=170),
}
WORKLOADS = {
    "GPT-3B/7B, 128K": Workload(131072, heads=32, kv_heads=32, head_dim=128, causal=True),
    "GPT-3B/7B, 512K": Workload(524288, heads=32, kv_heads=32, head_dim=128, causal=True),
    "DiT-1B, 512K": Workload(524288, heads=24, kv_heads=24, head_dim=64, causal=False),
}
GPUS = 32


def rows():
    for cname, c in CLUSTERS.items():
        cluster = ClusterSpec(nodes=GPUS // c["gpus_per_node"], **c)
        for wname, work in WORKLOADS.items():
            preds = {team: predict(cluster, work, GPUS, team) for team in (1, 2, 4)}
            best = min(preds, key=lambda t: preds[t].time_s)
            yield cname, wname, preds, best


def main() -> None:
    print("| cluster (32 GPUs) | workload | ring ms | StarTrail-2 ms | StarTrail-4 ms | predicted winner | "
          "predicted speedup over ring |")
    print("|---|---|---|---|---|---|---|")
    for cname, wname, preds, best in rows():
        name = "ring" if best == 1 else f"StarTrail-{best}"
        t = {k: v.time_s * 1e3 for k, v in preds.items()}
        print(f"| {cname} | {wname} | {t[1]:.1f} | {t[2]:.1f} | {t[4]:.1f} | {name} | {t[1] / t[best]:.2f}x |")


if __name__ == "__main__":
    main()
