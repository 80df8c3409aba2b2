"""The planner's hardware description: a cluster's links, kernel rate and overlap, how a
round of transfers costs on it, and named presets.

Bandwidths are *effective* GB/s per direction (what the transport delivers, not the line
rate); ``overlap`` is the fraction of the shorter of a step's compute and transfer that
hides behind the longer one (1: perfectly; 0: they serialise). A round of concurrent
sends costs, per link, ``latency + bytes / bandwidth``; the slowest link sets the round.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .gpu_rates import H100_BLOCK_LOOP, H100_FA2_BLOCK_LOOP_VS_FA2, H100_FUSED_TFLOPS, BlockLoopEfficiency

# Assumed fractions of line rate that NCCL delivers (no cluster here to measure them):
# NVLink and InfiniBand (RDMA) run close to line rate; 100 GbE through NCCL's TCP sockets
# (no RDMA) far below it. GPU_OVERLAP: NCCL's kernels take SMs and memory bandwidth from
# the attention kernel they overlap with. The second table of benchmarks/planner/paper_clusters.py
# shows how the predicted winners move with the last two.
NVLINK_EFFICIENCY, IB_EFFICIENCY, TCP_ETHERNET_EFFICIENCY, GPU_OVERLAP = 0.9, 0.9, 0.5, 0.7
# The A100's FA2 rate has no measurement here: an assumption (the A100 presets' kernel).
A100_FA2_TFLOPS = 170.0


@dataclass(frozen=True)
class ClusterSpec:
    """Topology and speeds. The defaults are the default preset, ``DEFAULT_CLUSTER`` =
    "h100-nvlink-8x400ib": H100 SXM, 8 per node on NVLink 4 (450 GB/s per GPU), 8 x 400 Gbit/s
    InfiniBand per node (400 GB/s), both at 90 % of line rate; overlap 0.7; attention priced
    as measured on one H100 (:mod:`.gpu_rates`): the fused cuDNN call's 559 TFLOP/s times
    the cuDNN block loop's efficiency at the rank's tokens."""

    nodes: int
    gpus_per_node: int = 8
    intra_node_gbs: float = 450 * NVLINK_EFFICIENCY  # per GPU
    inter_node_gbs: float = 400 * IB_EFFICIENCY  # per node, all NICs together
    nics_per_node: int = 8  # one rank's transfers to other nodes use its NIC: 1/nics of the node's rate
    intra_latency_s: float = 5e-6  # per transfer inside a node
    inter_latency_s: float = 20e-6  # per transfer between nodes
    # The attention kernel's rate on one long fused call, per GPU, forward and backward alike;
    # a rank's block loop runs at ``block_loop.at(tokens per rank)`` of it (None: all of it).
    attention_tflops: float = H100_FUSED_TFLOPS
    block_loop: BlockLoopEfficiency | None = H100_BLOCK_LOOP["torch_cuda_cudnn"]
    overlap: float = GPU_OVERLAP
    # Full meshes: every pair has its own link. Inside a node (xGMI-style) a GPU's
    # bandwidth is split over its gpus_per_node - 1 links; between nodes inter_node_gbs
    # is then the rate of each node pair's link. Otherwise: a switch (NVSwitch, a NIC).
    intra_node_mesh: bool = False
    inter_node_mesh: bool = False
    # CP rank c sits on global rank c * cp_stride (Megatron's order tp-cp-...: stride = TP).
    cp_stride: int = 1

    def attention_rate(self, tokens_per_rank: float) -> float:
        """FLOP/s of one rank's attention (kernels, merges, copies, per-call work) when it
        holds ``tokens_per_rank`` tokens."""
        efficiency = self.block_loop.at(tokens_per_rank) if self.block_loop is not None else 1.0
        return self.attention_tflops * 1e12 * efficiency

    def node_of(self, cp_rank: int) -> int:
        return (cp_rank * self.cp_stride) // self.gpus_per_node

    def exchange_time(self, sends: Iterable[tuple[int, int, float]], latency: bool = True) -> tuple[float, float]:
        """Time of one round of concurrent sends ``(src cp rank, dst cp rank, bytes)``, and
        the most bytes one node sent to other nodes in it. ``latency=False``: the transfers
        between nodes cost their bytes only (a ring whose latency is paid once per phase,
        :meth:`latency_once_per_phase`)."""
        intra: dict = {}
        inter_link: dict = {}
        inter_node: dict[int, float] = {}
        inter_rank: dict[int, float] = {}
        for src, dst, nbytes in sends:
            if src == dst or nbytes == 0:
                continue
            a, b = self.node_of(src), self.node_of(dst)
            if a == b:
                key = (src, dst) if self.intra_node_mesh else src
                intra[key] = intra.get(key, 0.0) + nbytes
            else:
                inter_link[(a, b)] = inter_link.get((a, b), 0.0) + nbytes
                inter_node[a] = inter_node.get(a, 0.0) + nbytes
                inter_rank[src] = inter_rank.get(src, 0.0) + nbytes
        t = 0.0
        if intra:
            links = max(1, self.gpus_per_node - 1) if self.intra_node_mesh else 1
            t = max(intra.values()) * links / (self.intra_node_gbs * 1e9) + self.intra_latency_s
        if inter_link:
            rate, lat = self.inter_node_gbs * 1e9, self.inter_latency_s if latency else 0.0
            if self.inter_node_mesh:
                t = max(t, max(inter_link.values()) / rate + lat)
            else:  # the node's uplink, and one rank's NIC
                t = max(t, max(inter_node.values()) / rate + lat,
                        max(inter_rank.values()) / (rate / self.nics_per_node) + lat)
        return t, max(inter_node.values(), default=0.0)

    def collective_time(self, groups: list[list[int]], bytes_per_rank: float, calls: int = 1,
                        ring: bool = True) -> tuple[float, float]:
        """``calls`` collectives one after another, moving ``bytes_per_rank`` per rank in each
        group in all (collectives in flight together count as one call). Bandwidth: a ring
        over the group's members. ``ring``: an all-gather / reduce-scatter, run as ``n - 1``
        hops, each paying a transfer's latency; otherwise an all-to-all, one latency."""
        sends = [(r, g[(i + 1) % len(g)], bytes_per_rank) for g in groups if len(g) > 1 for i, r in enumerate(g)]
        t, inter = self.exchange_time(sends)
        if not sends:
            return t, inter
        crosses = any(self.node_of(a) != self.node_of(b) for a, b, _ in sends)
        hop = self.inter_latency_s if crosses else self.intra_latency_s
        hops = max(len(g) for g in groups) - 1 if ring else 1
        # The exchange above already counted one hop's latency.
        return t + calls * (self.call_latency(hop, ring) + (hops - 1) * hop) - hop, inter

    def call_latency(self, hop_latency_s: float, ring: bool) -> float:
        """The latency of a collective call's first hop: a transfer's."""
        return hop_latency_s

    def latency_once_per_phase(self, rings: Iterable[Sequence[int]]) -> bool:
        """Whether these rings' crossing hops pay their latency once per phase rather than
        every step: no (a step's message is forwarded once it has landed)."""
        return False


PRESETS: dict[str, dict] = {
    "h100-nvlink-8x400ib": {},  # the defaults of ClusterSpec
    # The StarTrail paper's A100 40GB clusters (Table 1; Google Cloud): NVLink 3 (300 GB/s)
    # inside, one 100 Gbit/s Ethernet link (12.5 GB/s) per node; FA2 at an assumed 170
    # TFLOP/s bf16, its block loop at the efficiency FA2's measured on the H100 against its
    # own fused call (.gpu_rates).
    **{f"a100-{n}gpu-100gbe": dict(gpus_per_node=n, intra_node_gbs=300 * NVLINK_EFFICIENCY,
                                   inter_node_gbs=12.5 * TCP_ETHERNET_EFFICIENCY, nics_per_node=1,
                                   attention_tflops=A100_FA2_TFLOPS, block_loop=H100_FA2_BLOCK_LOOP_VS_FA2)
       for n in (16, 8, 4)},
    # H100 nodes with one 400 Gbit/s NIC each (50 GB/s per node), the kernel as the default's.
    "h100-nvlink-1x400ib": dict(inter_node_gbs=50 * IB_EFFICIENCY, nics_per_node=1),
}
DEFAULT_CLUSTER = "h100-nvlink-8x400ib"


def preset(name: str, nodes: int, **overrides) -> ClusterSpec:
    """The named preset with ``nodes`` nodes, any field overridden."""
    if name not in PRESETS:
        raise ValueError(f"unknown cluster preset {name!r}; presets: {', '.join(PRESETS)}")
    return dataclasses.replace(ClusterSpec(nodes, **PRESETS[name]), **overrides)
