"""Cost model and planner: which (Ulysses degree U, team size C) to use on a cluster.

The model walks the schedule the implementation runs, with the bytes it really sends
(:mod:`megatron_startrail.accounting`'s per-step forms) and the peers the rank math
gives (:mod:`megatron_startrail.topology`), and prices every step on the cluster::

    step time    = max(compute, transfer) + (1 - overlap) * min(compute, transfer) + latency
                   for a sub-ring step whose transfer flies while it computes (a ring
                   that streams over the inter-node links, :func:`ring_streams`, pays
                   the crossing latency once per phase instead); a blocking
                   collective or wait costs its transfer time + latency
    link time    = bytes over a rank's intra-node link / intra bandwidth, or
                   a node's bytes to other nodes / the node's inter-node bandwidth
                   (and one rank's / its own NIC's share); on gloo, a round in which
                   a rank pair sends both ways moves at the (lower) duplex rate
    attention    = team all-gather + initial send + sub-ring steps (overlapped with
                   compute) + team merge, forward and backward, + Ulysses all-to-alls,
                   less what the pipelined initial send hides behind step 0 (its C
                   pieces each attended as it lands) and, with the backward rotation
                   "q", what the reverse send hides behind the last step

Bandwidths are *effective* rates (what the transport delivers, measured per cluster:
benchmarks/calibration.py on the emulated cluster, NCCL-test figures for the paper's
clusters) and ``overlap`` is how much of a step's transfer really hides behind its
compute on that cluster (1: perfectly; 0: they serialise), measured the same way.

Compute is the attention's FLOPs (causal: half the blocks) at ``attention_tflops``
per GPU; the backward does 2.5x the forward's FLOPs (flash-attention recomputes).

    python -m megatron_startrail.planner --nodes 4 --gpus-per-node 8 --inter-node-gbps 100 \
        --seq-length 131072 --heads 32 --head-dim 128 --cp-size 32
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from .accounting import (
    AttentionShape,
    backward_p2p_parts,
    choose_backward_rotation,
    kept_for_backward_bytes,
    startrail_rank_elements,
)
from .topology import StarTrailTopology, valid_team_sizes
from .transfer import sub_ring_lanes

BACKWARD_FLOPS_RATIO = 2.5


@dataclass(frozen=True)
class ClusterSpec:
    """Topology and speeds. Bandwidths in GB/s per direction; latency in seconds."""

    nodes: int
    gpus_per_node: int
    intra_node_gbs: float = 300.0  # per GPU (NVLink-class)
    inter_node_gbs: float = 50.0  # per node, all NICs together
    nics_per_node: int = 8
    intra_latency_s: float = 5e-6
    inter_latency_s: float = 20e-6
    # Rate (GB/s per node) of a round in which some pair of ranks on two nodes sends both
    # ways: gloo carries both directions on one TCP connection, which moves less than two
    # one-way connections (benchmarks/calibration.py). None: inter_node_gbs (NCCL, RDMA).
    inter_node_duplex_gbs: float | None = None
    # A collective call's latency when it exceeds a P2P step's (None: the same).
    collective_latency_s: float | None = None
    attention_tflops: float = 150.0  # effective, per GPU
    # Fraction of min(compute, transfer) of an overlapped step that is hidden.
    overlap: float = 1.0
    # Full meshes: every pair has its own link. Inside a node (xGMI-style) a GPU's
    # bandwidth is split over its gpus_per_node - 1 links; between nodes inter_node_gbs
    # is then the rate of each node pair's link. Otherwise: a switch (NVSwitch, a NIC).
    intra_node_mesh: bool = False
    inter_node_mesh: bool = False
    # CP rank c sits on global rank c * cp_stride (Megatron's order tp-cp-...: stride = TP).
    cp_stride: int = 1

    def node_of(self, cp_rank: int) -> int:
        return (cp_rank * self.cp_stride) // self.gpus_per_node


@dataclass(frozen=True)
class Workload:
    seq_length: int
    heads: int  # per rank, after tensor parallelism
    kv_heads: int
    head_dim: int
    batch: int = 1
    dtype_bytes: int = 2
    causal: bool = True
    v_head_dim: int | None = None  # None: head_dim (Multi-Latent Attention: its own)
    layers: int = 1  # attention layers whose activations are alive at once (memory only)


@dataclass(frozen=True)
class Prediction:
    ulysses_size: int
    team_size: int
    transfer: str
    time_s: float
    compute_s: float
    exposed_comm_s: float
    internode_bytes: float  # per node, forward + backward
    regather_in_backward: bool = False
    activation_bytes: int = 0  # what the attention layers keep for backward, per rank

    @property
    def name(self) -> str:
        core = "ring" if self.team_size == 1 and self.transfer == "ring" else (
            "tasp" if self.team_size == 1 else f"startrail-{self.team_size}")
        if self.transfer == "multiring" and self.team_size > 1:
            core += "-multiring"
        if self.regather_in_backward and self.team_size > 1:
            core += "-regather"
        return core if self.ulysses_size == 1 else f"ulysses-{self.ulysses_size}x{core}"


def _exchange_time(cluster: ClusterSpec, sends: list[tuple[int, int, float]],
                   inter_latency: bool = True) -> tuple[float, float]:
    """Time of one round of concurrent sends ``(src cp rank, dst cp rank, bytes)``, and the
    largest number of bytes one node sent to other nodes in it. ``inter_latency=False``:
    the inter-node sends cost their bytes' time only (a streaming ring's, :func:`ring_streams`)."""
    intra: dict = {}
    inter_link: dict = {}
    inter_node: dict[int, float] = {}
    inter_rank: dict[int, float] = {}
    inter_pairs: set[tuple[int, int]] = set()  # (src, dst) rank pairs crossing nodes
    for src, dst, nbytes in sends:
        if src == dst or nbytes == 0:
            continue
        a, b = cluster.node_of(src), cluster.node_of(dst)
        if a == b:
            key = (src, dst) if cluster.intra_node_mesh else src
            intra[key] = intra.get(key, 0.0) + nbytes
        else:
            inter_link[(a, b)] = inter_link.get((a, b), 0.0) + nbytes
            inter_node[a] = inter_node.get(a, 0.0) + nbytes
            inter_rank[src] = inter_rank.get(src, 0.0) + nbytes
            inter_pairs.add((src, dst))
    t = 0.0
    if intra:
        links = max(1, cluster.gpus_per_node - 1) if cluster.intra_node_mesh else 1
        t = max(t, max(intra.values()) * links / (cluster.intra_node_gbs * 1e9) + cluster.intra_latency_s)
    if inter_link:
        duplex = cluster.inter_node_duplex_gbs is not None and any(
            (dst, src) in inter_pairs for src, dst in inter_pairs)
        rate = (cluster.inter_node_duplex_gbs if duplex else cluster.inter_node_gbs) * 1e9
        latency = cluster.inter_latency_s if inter_latency else 0.0
        if cluster.inter_node_mesh:
            t = max(t, max(inter_link.values()) / rate + latency)
        else:
            t = max(t, max(inter_node.values()) / rate + latency,
                    max(inter_rank.values()) / (rate / cluster.nics_per_node) + latency)
    return t, max(inter_node.values(), default=0.0)


def ring_streams(cluster: ClusterSpec, rings: Iterable[Sequence[int]]) -> bool:
    """Whether rings' steps stream over the inter-node links: some hop crosses nodes, and
    either every rank that sends to another node forwards what it received from a rank of
    its own node, or every inter-node link carries the crossing hops of two ranks or more.

    Forwarding node-local messages: such a rank sends step i+1's message once its
    node-local predecessor's has landed, not the message that crossed in step i, so
    (sends buffered by the transport) the link carries message after message without a
    gap. Ring attention over nodes of several ranks streams that way (one hop per node
    boundary, the others local).

    Several senders per link: a rank that forwards what just crossed (every hop of
    Ulysses-2 x ring on one rank pair per node crosses) waits a latency before its next
    send, but the link it shares with other ranks' rings carries their queued messages
    meanwhile: a FIFO link serves whole messages in turn, so one flow's gap is another's
    transfer (measured: Ulysses-2 x ring on 4 nodes x 2 ranks ran at the link's rate,
    benchmarks/README.md). A NIC of its own per rank (``nics_per_node``) shares nothing.

    Either way the crossing hop's latency is paid beside the transfer, once per phase,
    while node-local hops still pay theirs every step. (Once per phase holds while a
    crossing transfer outlasts the latency; in latency-bound rounds the chain through the
    node boundaries pays more.) Otherwise -- one ring forwarding what just crossed, alone
    on its link (a pair exchange between two nodes of one rank each) -- lock-step: a
    latency after every message."""
    node = cluster.node_of
    crossing = [(ring, i) for ring in rings for i in range(len(ring))
                if node(ring[i]) != node(ring[(i + 1) % len(ring)])]
    if not crossing:
        return False
    # Ranks sending over each inter-node link: per node pair on a mesh, else per node,
    # where each of the node's NICs must carry two of them (ranks spread evenly).
    def link(ring, i):
        return (node(ring[i]), node(ring[(i + 1) % len(ring)])) if cluster.inter_node_mesh else node(ring[i])

    senders: dict = {}
    for ring, i in crossing:
        senders.setdefault(link(ring, i), set()).add(ring[i])
    flows_needed = 2 if cluster.inter_node_mesh else 2 * cluster.nics_per_node
    # Every crossing sender either forwards a node-local message or shares its link.
    return all(node(ring[i - 1]) == node(ring[i]) or len(senders[link(ring, i)]) >= flows_needed
               for ring, i in crossing)


def overlapped_steps(overlap: float, compute: list[float], transfer: list[float]) -> float:
    """Time of steps that each compute while a transfer flies: the longer of the two, plus
    the part of the shorter one that does not hide (``1 - overlap``)."""
    return sum(max(c, t) + (1.0 - overlap) * min(c, t) for c, t in zip(compute, transfer))


def _collective_time(cluster: ClusterSpec, groups: list[list[int]], bytes_per_rank: float,
                     calls: int = 1, ring: bool = True) -> tuple[float, float]:
    """A bandwidth-optimal collective moving ``bytes_per_rank`` per rank within each group,
    issued as ``calls`` collectives one after another (collectives in flight together
    count as one call: their bytes add up in ``bytes_per_rank``).

    ``ring``: an all-gather / reduce-scatter, which the libraries run as a ring of
    ``n - 1`` sequential hops (gloo; NCCL's ring algorithm): the call pays a collective
    call's latency, every further hop a P2P step's. Otherwise an all-to-all: every pair
    exchanges at once, one call latency. Bandwidth is
    priced as a ring over the group's members in either case."""
    sends = []
    for g in groups:
        if len(g) > 1:
            for i, r in enumerate(g):
                sends.append((r, g[(i + 1) % len(g)], bytes_per_rank))
    t, inter = _exchange_time(cluster, sends)
    if not sends:
        return t, inter
    crosses = any(cluster.node_of(a) != cluster.node_of(b) for a, b, _ in sends)
    hop_latency = cluster.inter_latency_s if crosses else cluster.intra_latency_s
    if ring or cluster.collective_latency_s is None:
        call_latency = max(hop_latency, cluster.collective_latency_s or 0.0)
    else:
        # An all-to-all (Ulysses', the merge's) costs what a tiny all-to-all measured per
        # call, not a ring step's latency: Ulysses-2 x ring came out +3-6% in every run
        # priced that way. (Priced so while gloo serialised pair exchanges, Ulysses-2 x
        # StarTrail-2 went to -18%; with each direction on its own connection it does not.)
        call_latency = cluster.collective_latency_s
    hops = max(len(g) for g in groups) - 1 if ring else 1
    # Each call: its own start (a collective call's latency), then hop after hop; the
    # exchange above already counted one hop's latency.
    return t + calls * (call_latency + (hops - 1) * hop_latency) - hop_latency, inter


def _shape(work: Workload, cp_size: int) -> AttentionShape:
    return AttentionShape(work.seq_length // cp_size, work.batch, work.heads, work.kv_heads, work.head_dim,
                          work.dtype_bytes, v_head_dim=work.v_head_dim)


def predict(cluster: ClusterSpec, work: Workload, cp_size: int, team_size: int, ulysses_size: int = 1,
            transfer: str = "ring", regather_in_backward: bool = False) -> Prediction:
    """Predicted forward+backward time of one attention layer on one CP group, and the
    bytes ``work.layers`` such layers keep for backward on one rank."""
    u, c = ulysses_size, team_size
    s_size = cp_size // u
    topo = StarTrailTopology(s_size, c)
    g = topo.sub_ring_size
    shape = _shape(work, cp_size)
    e, a = shape.dtype_bytes, shape.acc_bytes
    eq, ekv, eo, el = startrail_rank_elements(shape, u)  # one StarTrail rank's Q, K+V, out, lse elements
    cp_rank = lambda pos, uly=0: pos * u + uly  # noqa: E731 - StarTrail position -> CP rank
    positions = range(s_size)

    # Compute: a rank's share of the attention FLOPs, spread over the G sub-ring steps.
    flops_fwd = 2 * work.batch * work.heads * work.seq_length**2 * (work.head_dim + shape.v_dim) / cp_size
    if work.causal:
        flops_fwd /= 2
    rate = cluster.attention_tflops * 1e12
    compute_fwd, compute_bwd = flops_fwd / rate, BACKWARD_FLOPS_RATIO * flops_fwd / rate
    total, inter_bytes = 0.0, 0.0

    def add(t_and_bytes):
        nonlocal total, inter_bytes
        total += t_and_bytes[0]
        inter_bytes += t_and_bytes[1]

    all_uly = [[cp_rank(p, x) for x in range(u)] for p in positions]
    teams = [[cp_rank(p, x) for p in team] for x in range(u) for team in topo.teams()]
    # Ulysses all-to-alls: q, k, v in and the output back, each way (fwd and bwd).
    if u > 1:
        uly_bytes = (u - 1) / u * (eq + eo + ekv) * e
        add(_collective_time(cluster, all_uly, 2 * uly_bytes, calls=8, ring=False))  # q, k, v, out; both ways
    # Forward: team all-gather of q and k|v (in flight together); merge all-to-alls of
    # out and lse (together).
    if c > 1:
        for _ in range(2 if regather_in_backward else 1):  # the backward may gather again
            add(_collective_time(cluster, teams, (c - 1) * (eq + ekv) * e))
        add(_collective_time(cluster, teams, (c - 1) * (eo * e + el * a), ring=False))
    # Initial send (forward K, V; the K, V again when the backward regathers). Its
    # reverse (dK, dV in the accumulator dtype) is priced with the backward's team phases.
    def initial_send(nbytes: float) -> tuple[float, float]:
        return _exchange_time(cluster, [(cp_rank(p, x), cp_rank(topo.init_send_dst(p), x), nbytes)
                                        for p in positions for x in range(u)])

    init_fwd = initial_send(c * ekv * e)
    add(init_fwd)
    if regather_in_backward:
        add(init_fwd)
    # Sub-ring steps, overlapped with the compute of the step they feed.
    # One lane per ring of the transfer (multi-ring: the sub-ring's Hamiltonian cycles),
    # each carrying its share of the step's bytes to its own next rank.
    lanes = {p: sub_ring_lanes(topo, p, transfer) for p in positions}
    rotation = choose_backward_rotation(shape, u, c)
    payload_bwd, accumulator_bwd = backward_p2p_parts(shape, u, c)[rotation]

    rings = {tuple(cp_rank(p, x) for p in lane.order) for p in positions for x in range(u) for lane in lanes[p]}
    streaming = g > 1 and ring_streams(cluster, rings)
    # A streaming ring pays the inter-node latency once per phase: with its first transfer,
    # where compute can still hide it.
    phase_latency = cluster.inter_latency_s if streaming else 0.0

    def ring_round(nbytes: float, inter_latency: bool = not streaming) -> tuple[float, float]:
        return _exchange_time(cluster, [
            (cp_rank(p, x), cp_rank(lane.next(p), x), nbytes / len(lanes[p]))
            for p in positions for x in range(u) for lane in lanes[p]
        ], inter_latency)

    # What flies while step i computes (schedule.rotate). Forward: the next K, V, steps
    # 0..G-2. Backward: the next payload (steps 0..G-2) and the accumulator posted after
    # the previous step (steps 1..G-1); the last accumulator is waited on after the last
    # step, exposed.
    kv_round = ring_round(c * ekv * e)
    fwd_flying = [kv_round] * (g - 1) + [(0.0, 0.0)]
    bwd_flying = [ring_round(payload_bwd * (i < g - 1) + accumulator_bwd * (i > 0)) for i in range(g)]
    for flying, compute in ((fwd_flying, compute_fwd), (bwd_flying, compute_bwd)):
        transfers = [t + (phase_latency if i == 0 else 0.0) for i, (t, _) in enumerate(flying)]
        total += overlapped_steps(cluster.overlap, [compute / g] * g, transfers)
        inter_bytes += sum(b for _, b in flying)
    if g > 1:
        add(ring_round(accumulator_bwd, inter_latency=True))  # waited on alone
    # Backward: all-gather dO|out and lse (together); dK, dV travel back along the
    # reverse initial send while dQ is reduce-scattered in the team; then dK, dV are.
    reverse = initial_send(c * ekv * a)
    if c > 1:
        add(_collective_time(cluster, teams, (c - 1) * (2 * eo * e + el * a)))
        dq_rs = _collective_time(cluster, teams, (c - 1) * eq * a)
        add((max(reverse[0], dq_rs[0]), reverse[1] + dq_rs[1]))
        add(_collective_time(cluster, teams, (c - 1) * ekv * a))
    else:
        add(reverse)
    # Pipelining (schedule.rotate's pieces): the initial send lands in C pieces and step 0
    # attends to each as it lands, so of the send's time T and step 0's compute S only
    # max(T + S/C, T/C + S) is exposed, i.e. (C-1)/C x min(T, S) hides (as much as the
    # cluster overlaps). The same in the backward when it regathers, and for the reverse
    # send behind the last step's compute with rotation "q" (each piece goes back once
    # the last step has computed it).
    # Each piece is its own message, so every transfer cut in pieces (the initial send,
    # step 0's hop, the reverse send) pays C - 1 more latencies: on a cluster whose
    # latency is large next to step 0's compute (the CPU emulation) pipelining costs time.
    def pipelined(transfer_s: float, step_compute_s: float) -> float:
        return cluster.overlap * (c - 1) / c * min(transfer_s, step_compute_s)

    total -= pipelined(init_fwd[0], compute_fwd / g)
    if regather_in_backward:
        total -= pipelined(init_fwd[0], compute_bwd / g)
    if rotation == "q":
        total -= pipelined(reverse[0], compute_bwd / g)
    # forward: initial send, step 0's hop; backward: reverse send, [initial send again],
    # step 0's hop of K, V (rotation "kv")
    cut_transfers = 2 + regather_in_backward + (g > 1) + (g > 1 and rotation == "kv")
    total += (c - 1) * cut_transfers * cluster.inter_latency_s
    compute = compute_fwd + compute_bwd
    kept = work.layers * kept_for_backward_bytes(shape, ulysses_size=u, team_size=c,
                                                 regather_in_backward=regather_in_backward)
    return Prediction(u, c, transfer, total, compute, max(0.0, total - compute), inter_bytes,
                      regather_in_backward and c > 1, kept)


def _fitting(cluster, work, cp_size, c, u, transfer, memory_limit_bytes) -> Prediction | None:
    """The prediction for (U, C, transfer) that fits the memory limit: without regathering
    if that fits, else with it (ring attention keeps the same either way), else None."""
    pred = predict(cluster, work, cp_size, c, u, transfer)
    if memory_limit_bytes is None or pred.activation_bytes <= memory_limit_bytes:
        return pred
    if c > 1:
        pred = predict(cluster, work, cp_size, c, u, transfer, regather_in_backward=True)
        if pred.activation_bytes <= memory_limit_bytes:
            return pred
    return None


def plan(cluster: ClusterSpec, work: Workload, cp_size: int, *, transfers=("ring", "multiring"),
         memory_limit_bytes: int | None = None) -> list[Prediction]:
    """Every valid (U, C, transfer), fastest first.

    With ``memory_limit_bytes`` (per rank, for what ``work.layers`` attention layers keep
    for backward), configurations over it are left out, and StarTrail is planned with
    regathering in the backward where only that makes it fit."""
    out = []
    for u in range(1, cp_size + 1):
        if cp_size % u or work.heads % u or (work.kv_heads % u and u % work.kv_heads):
            continue
        for c in valid_team_sizes(cp_size // u):
            for transfer in transfers:
                if transfer == "multiring" and StarTrailTopology(cp_size // u, c).sub_ring_size < 3:
                    continue  # one or two ranks per sub-ring: the same as the single ring
                pred = _fitting(cluster, work, cp_size, c, u, transfer, memory_limit_bytes)
                if pred is not None:
                    out.append(pred)
    return sorted(out, key=lambda p: p.time_s)


def choose_team_size(**kwargs) -> int:
    """The team size of :func:`choose_plan` (same keywords)."""
    return choose_plan(**kwargs).team_size


def choose_plan(*, cp_size: int, ulysses_size: int, gpus_per_node: int, seq_length: int, num_heads: int,
                num_kv_heads: int, head_dim: int, micro_batch_size: int, dtype_bytes: int,
                cluster: ClusterSpec | None = None, v_head_dim: int | None = None, layers: int = 1,
                memory_limit_bytes: int | None = None) -> Prediction:
    """The (team size, regathering) the planner predicts fastest for this CP size and
    Ulysses degree, among those whose ``layers`` attention layers keep at most
    ``memory_limit_bytes`` per rank for backward (no limit: all).

    Without ``cluster``: ``gpus_per_node`` GPUs per node with NVLink-class links inside
    and 8 x 400 Gbit/s (InfiniBand) between nodes; the ranking depends on the ratio of
    the two far more than on their absolute values. Raises ValueError when nothing fits.
    """
    if cluster is None:
        nodes = max(1, -(-cp_size // gpus_per_node))
        cluster = ClusterSpec(nodes=nodes, gpus_per_node=gpus_per_node)
    work = Workload(seq_length, num_heads, num_kv_heads, head_dim, micro_batch_size, dtype_bytes,
                    v_head_dim=v_head_dim, layers=layers)
    found = [
        pred for c in valid_team_sizes(cp_size // ulysses_size)
        if (pred := _fitting(cluster, work, cp_size, c, ulysses_size, "ring", memory_limit_bytes)) is not None
    ]
    if not found:
        least = predict(cluster, work, cp_size, 1, ulysses_size).activation_bytes
        raise ValueError(
            f"no StarTrail team size keeps the attention's activations within "
            f"--startrail-memory-limit-gb {memory_limit_bytes / 1e9:g}: even ring attention keeps "
            f"{least / 1e9:.3g} GB per rank ({layers} layers); raise the limit or --context-parallel-size"
        )
    return min(found, key=lambda p: p.time_s)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, required=True)
    p.add_argument("--gpus-per-node", type=int, required=True)
    p.add_argument("--intra-node-gbs", type=float, default=300.0, help="GB/s per GPU per direction")
    p.add_argument("--inter-node-gbps", type=float, default=3200.0,
                   help="effective Gbit/s per node, all NICs (what NCCL delivers, not the line rate)")
    p.add_argument("--nics-per-node", type=int, default=8)
    p.add_argument("--attention-tflops", type=float, default=150.0)
    p.add_argument("--overlap", type=float, default=1.0,
                   help="fraction of a sub-ring step's transfer hidden behind its compute (measure it: "
                        "benchmarks/calibration.py does on the emulated cluster)")
    p.add_argument("--cp-size", type=int, required=True)
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--seq-length", type=int, required=True)
    p.add_argument("--heads", type=int, required=True, help="attention heads (before TP)")
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype-bytes", type=int, default=2)
    p.add_argument("--v-head-dim", type=int, default=None, help="V head dim (MLA); default: --head-dim")
    p.add_argument("--num-layers", type=int, default=1, help="attention layers (for the memory limit)")
    p.add_argument("--memory-limit-gb", type=float, default=None,
                   help="leave out configurations whose attention activations exceed this, per rank")
    p.add_argument("--no-causal", action="store_true")
    args = p.parse_args()
    cluster = ClusterSpec(args.nodes, args.gpus_per_node, args.intra_node_gbs, args.inter_node_gbps / 8,
                          args.nics_per_node, attention_tflops=args.attention_tflops, overlap=args.overlap,
                          cp_stride=args.tp_size)
    work = Workload(args.seq_length, args.heads // args.tp_size, (args.kv_heads or args.heads) // args.tp_size,
                    args.head_dim, args.batch, args.dtype_bytes, not args.no_causal, args.v_head_dim, args.num_layers)
    limit = None if args.memory_limit_gb is None else int(args.memory_limit_gb * 1e9)
    print(f"{'configuration':36} {'time ms':>9} {'compute ms':>11} {'exposed comm ms':>16} "
          f"{'inter-node MiB/node':>20} {'kept for bwd GB/rank':>21}")
    preds = plan(cluster, work, args.cp_size, memory_limit_bytes=limit)
    if not preds:
        print(f"no configuration keeps the attention's activations of {args.num_layers} layers within "
              f"--memory-limit-gb {args.memory_limit_gb:g} per rank")
    for pred in preds:
        print(f"{pred.name:36} {pred.time_s * 1e3:9.2f} {pred.compute_s * 1e3:11.2f} "
              f"{pred.exposed_comm_s * 1e3:16.2f} {pred.internode_bytes / 2**20:20.1f} "
              f"{pred.activation_bytes / 1e9:21.3f}")


if __name__ == "__main__":
    main()

