"""Cost model and planner: which (Ulysses degree U, team size C) to use on a cluster.

The model walks the schedule the implementation runs, with the bytes of
:mod:`megatron_startrail.accounting`'s closed forms and the peers of
:mod:`megatron_startrail.topology`, and prices each phase on a
:class:`~megatron_startrail.planning.cluster.ClusterSpec` (links, latencies, kernel rate, overlap)::

    sub-ring step = max(compute, transfer) + (1 - overlap) * min(compute, transfer)
                    (the next step's data flies while this one computes)
    blocking phase = its transfer time, latencies included: team all-gather, initial send,
                    team merge, Ulysses all-to-alls, the last gradient accumulator
    pipelining    = the initial send lands in C pieces and step 0 attends each as it lands:
                    (C-1)/C of min(send, step 0) hides, each extra piece pays a latency

Compute is the attention's FLOPs (causal: half the blocks) at the cluster's
:meth:`~megatron_startrail.planning.cluster.ClusterSpec.attention_rate` for the rank's tokens
(on the H100 presets measured: :mod:`megatron_startrail.planning.gpu_rates`); the backward
does 2.5x the forward's (flash attention recomputes). The default cluster is the
``h100-nvlink-8x400ib`` preset (:mod:`megatron_startrail.planning.cluster`).

A sliding window (``Workload.window``) makes compute the pairs inside the window, and
where no rank's window reaches past a quarter of the sequence the layer is the halo
exchange (:mod:`megatron_startrail.halo`): its closed-form rows
(:func:`~megatron_startrail.accounting.halo_rows`) in one round each way, blocking, around
the compute; C and U do not change it. With ``Workload.window_skip_freq`` (Megatron's
``--window-attn-skip-freq``) a prediction is the mean over the layers' mix of windowed and
full-attention layers.

    python -m megatron_startrail.planning --nodes 4 --cp-size 32 --seq-length 131072 --heads 32 --head-dim 128
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass

from ..accounting import AttentionShape, backward_p2p_parts, choose_backward_rotation, startrail_rank_elements
from ..accounting import halo_rows
from ..halo import MAX_HALO_SHARE
from ..initial_send import reverse_overlaps
from ..layout import normalize_window
from ..topology import StarTrailTopology, valid_team_sizes
from ..transfer import sub_ring_lanes
from .cluster import DEFAULT_CLUSTER, PRESETS, ClusterSpec, preset
from .memory_model import activation_peak_bytes, kept_per_layer_bytes, memory_fallbacks

BACKWARD_FLOPS_RATIO = 2.5


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
    window: tuple[int, int] | None = None  # sliding window (left, right), -1 unbounded; None: full
    window_skip_freq: int | tuple[int, ...] | None = None  # Megatron's --window-attn-skip-freq

    def attention_flops(self, cp_size: int) -> float:
        """Forward FLOPs of one rank's share of the attention (QK^T and PV); with a window,
        of the pairs inside it (the mean over ranks: the zigzag layout balances them)."""
        v_dim = self.head_dim if self.v_head_dim is None else self.v_head_dim
        if self.window is not None:
            pairs = visible_pairs(self.seq_length, self.window, self.causal)
            return 2 * self.batch * self.heads * pairs * (self.head_dim + v_dim) / cp_size
        flops = 2 * self.batch * self.heads * self.seq_length**2 * (self.head_dim + v_dim) / cp_size
        return flops / 2 if self.causal else flops


def visible_pairs(seq_length: int, window: tuple[int, int], causal: bool) -> int:
    """(query, key) pairs of a sequence with key - query in ``[-left, right]`` (-1 unbounded;
    causal caps ``right`` at 0): the sum over those offsets ``d`` of ``seq_length - |d|``."""
    s, (left, right) = seq_length, window
    lo = -(s - 1) if left < 0 else max(-left, -(s - 1))
    hi = s - 1 if right < 0 else min(right, s - 1)
    if causal:
        hi = min(hi, 0)
    if hi < lo:
        return 0

    def abs_sum(a: int, b: int) -> int:  # sum of |d| for a <= d <= b, both of one sign
        return (abs(a) + abs(b)) * (b - a + 1) // 2

    total_abs = abs_sum(lo, hi) if lo >= 0 or hi <= 0 else abs_sum(lo, 0) + abs_sum(0, hi)
    return (hi - lo + 1) * s - total_abs


def window_layers(layers: int, skip_freq: int | tuple[int, ...] | list[int] | None) -> tuple[int, int]:
    """(windowed, full-attention) among layers 1..``layers`` by Megatron's rule
    (``is_layer_window_attention``): no skip frequency, all windowed; an int ``N``, every
    ``N``-th layer full; a list, 1 for a windowed layer and 0 for a full one."""
    if skip_freq is None:
        return layers, 0
    if isinstance(skip_freq, int):
        windowed = sum(1 for n in range(1, layers + 1) if n % skip_freq != 0)
    else:
        if len(skip_freq) < layers:
            raise ValueError(f"--window-attn-skip-freq lists {len(skip_freq)} layers, fewer than the {layers} priced")
        windowed = sum(1 for x in skip_freq[:layers] if x)
    return windowed, layers - windowed


@dataclass(frozen=True)
class Prediction:
    ulysses_size: int
    team_size: int
    transfer: str
    time_s: float
    compute_s: float
    exposed_comm_s: float
    internode_bytes: float  # the busiest node's, forward + backward
    regather_in_backward: bool = False
    activation_bytes: int = 0  # what the attention layers keep for backward, per rank
    # ... plus, at the peak, one layer's forward or backward buffers (memory_model.py)
    peak_bytes: int = 0
    rotation: str = "auto"  # the backward rotation asked for ("q": streamed, the lowest peak)
    reverse_overlap: bool = True  # False: --startrail-no-reverse-overlap (Note [reverse overlap])

    @property
    def name(self) -> str:
        core = "ring" if self.team_size == 1 and self.transfer == "ring" else (
            "tasp" if self.team_size == 1 else f"startrail-{self.team_size}")
        if self.transfer == "multiring" and self.team_size > 1:
            core += "-multiring"
        if self.regather_in_backward and self.team_size > 1:
            core += "-regather"
        if self.rotation != "auto":
            core += f"-rot{self.rotation}"
        if not self.reverse_overlap:
            core += "-no-reverse-overlap"
        return core if self.ulysses_size == 1 else f"ulysses-{self.ulysses_size}x{core}"


def overlapped_steps(overlap: float, compute: list[float], transfer: list[float]) -> float:
    """Steps that each compute while a transfer flies: the longer of the two, plus the part
    of the shorter one that does not hide (``1 - overlap``)."""
    return sum(max(c, t) + (1.0 - overlap) * min(c, t) for c, t in zip(compute, transfer))


def predict(cluster: ClusterSpec, work: Workload, cp_size: int, team_size: int, ulysses_size: int = 1,
            transfer: str = "ring", regather_in_backward: bool = False, *, halo_exchange: bool = True,
            rotation: str = "auto", reverse_overlap: bool = True) -> Prediction:
    """Predicted forward+backward time of one attention layer on one CP group, and the
    bytes ``work.layers`` such layers keep for backward on one rank. With ``work.window``:
    time, compute and inter-node bytes are the mean per layer over the mix of windowed and
    full layers (:func:`window_layers`), kept bytes their sum; ``halo_exchange=False``
    prices a windowed layer through the schedule, as ``startrail_attn`` runs it then;
    ``reverse_overlap``: the setting of that name (Note [reverse overlap] in initial_send.py)."""
    args = (cp_size, team_size, ulysses_size, transfer, regather_in_backward)
    if work.window is not None and normalize_window(work.window, work.causal) is None:
        work = dataclasses.replace(work, window=None)  # a window that bounds nothing (startrail_attn's rule)
    schedule = dict(rotation=rotation, reverse_overlap=reverse_overlap)
    if work.window is None:
        return _schedule_layer(cluster, work, *args, **schedule)
    windowed, full = window_layers(work.layers, work.window_skip_freq)
    one, parts = dataclasses.replace(work, layers=1), []
    if windowed:
        parts.append((windowed, (halo_exchange and _halo_layer(cluster, one, *args)) or
                      _schedule_layer(cluster, one, *args, **schedule)))
    if full:
        parts.append((full, _schedule_layer(cluster, dataclasses.replace(one, window=None), *args, **schedule)))
    mean = lambda field: sum(n * getattr(p, field) for n, p in parts) / work.layers  # noqa: E731
    kept = sum(n * p.activation_bytes for n, p in parts)
    transient = max(p.peak_bytes - p.activation_bytes for _, p in parts)  # one layer runs at a time
    return Prediction(ulysses_size, team_size, transfer, mean("time_s"), mean("compute_s"), mean("exposed_comm_s"),
                      mean("internode_bytes"), regather_in_backward and team_size > 1, kept, kept + transient,
                      reverse_overlap=reverse_overlap)


def _halo_layer(cluster: ClusterSpec, work: Workload, cp_size: int, team_size: int, ulysses_size: int,
                transfer: str, regather_in_backward: bool) -> Prediction | None:
    """A windowed layer as the halo exchange, or None where it does not run (some rank's
    window reaches past MAX_HALO_SHARE of the sequence): K|V rows in one blocking round,
    the windowed compute, dK|dV back in one round (accumulator dtype)."""
    rows = halo_rows(work.seq_length, cp_size, work.window, work.causal)
    received = max(sum(n for (_, r), n in rows.items() if r == x) for x in range(cp_size))
    if cp_size == 1 or received > MAX_HALO_SHARE * work.seq_length:
        return None
    shape = AttentionShape(work.seq_length // cp_size, work.batch, work.heads, work.kv_heads, work.head_dim,
                           work.dtype_bytes, v_head_dim=work.v_head_dim)
    row = shape.batch * shape.kv_heads * (shape.head_dim + shape.v_dim)  # elements of one K|V row
    fwd = cluster.exchange_time([(owner, to, n * row * shape.dtype_bytes) for (owner, to), n in rows.items()])
    bwd = cluster.exchange_time([(to, owner, n * row * shape.acc_bytes) for (owner, to), n in rows.items()])
    compute = (1 + BACKWARD_FLOPS_RATIO) * work.attention_flops(cp_size) / cluster.attention_rate(
        work.seq_length / cp_size)
    el = startrail_rank_elements(shape, 1)  # before any Ulysses all-to-all
    # Kept for backward: ring attention's (own q, k|v, out, lse) and the received K|V rows.
    kept = (el.q + el.kv + el.out + received * row) * shape.dtype_bytes + el.lse * shape.acc_bytes
    total = fwd[0] + compute + bwd[0]
    # Transient: the gradients of the received rows (accumulator dtype) while they go back.
    transient = received * row * shape.acc_bytes
    return Prediction(ulysses_size, team_size, transfer, total, compute, total - compute, fwd[1] + bwd[1],
                      regather_in_backward and team_size > 1, work.layers * kept, work.layers * kept + transient)


def _ulysses_and_team_phases(cluster, shape, teams, ulysses_groups, c, regather_in_backward, rotation) -> list:
    """The blocking collectives of one layer outside the sub-ring: the Ulysses all-to-alls
    (forward and backward), the team all-gather of q, k|v (again when the backward regathers:
    k|v only with rotation "q", which broadcasts the queries member by member) and the merge
    of out, lse; each ``(seconds, the busiest node's inter-node bytes)``."""
    u = len(ulysses_groups[0])
    e, a = shape.dtype_bytes, shape.acc_bytes
    eq, ekv, eo, el = startrail_rank_elements(shape, u)
    phases = []
    if u > 1:
        phases.append(cluster.collective_time(ulysses_groups, 2 * (u - 1) / u * (eq + eo + ekv) * e, calls=8,
                                              ring=False))
    if c > 1:
        phases.append(cluster.collective_time(teams, (c - 1) * (eq + ekv) * e))
        if regather_in_backward:
            phases.append(cluster.collective_time(teams, (c - 1) * (ekv + (eq if rotation == "kv" else 0)) * e))
        phases.append(cluster.collective_time(teams, (c - 1) * (eo * e + el * a), ring=False))
    return phases


def _with_pieces(total, cluster, c, g, init_send_s, reverse_s, fwd_step_s, bwd_step_s, regather_in_backward,
                 rotation, reverse_hidden: float = 1.0) -> float:
    """``total`` seconds with what the C-piece transfers change: what each piece hides behind the
    step that attends it, the streamed rotation q's extra rounds, one latency per piece message.
    ``reverse_hidden``: the part of the C - 1 reverse pieces that fly while the next one computes
    (Note [reverse overlap] in initial_send.py; piece-major rotation q)."""

    def pipelined(transfer_s: float, step_compute_s: float) -> float:
        """What a transfer cut in C pieces hides behind the step that attends each piece."""
        return cluster.overlap * (c - 1) / c * min(transfer_s, step_compute_s)

    total -= pipelined(init_send_s, fwd_step_s)
    if regather_in_backward:
        total -= pipelined(init_send_s, bwd_step_s)
    if rotation == "q":  # dK, dV go back piece by piece during the last step (or pass, piece-major)
        total -= reverse_hidden * pipelined(reverse_s, bwd_step_s)
        # Note [streamed rotation q]: C passes of the sub-ring, one member's rows each: the
        # same bytes, C times the sequential rounds (each one latency more).
        total += (c - 1) * (g if g > 1 else 0) * cluster.inter_latency_s
    # Each piece is its own message: the initial send, the reverse send, [the regathered
    # initial send], step 0's hop forward and, with rotation "kv", backward.
    cut_transfers = 2 + regather_in_backward + (g > 1) + (g > 1 and rotation == "kv")
    return total + (c - 1) * cut_transfers * cluster.inter_latency_s


def _schedule_layer(cluster: ClusterSpec, work: Workload, cp_size: int, team_size: int, ulysses_size: int = 1,
                    transfer: str = "ring", regather_in_backward: bool = False, *,
                    rotation: str = "auto", reverse_overlap: bool = True) -> Prediction:
    """One layer through the StarTrail schedule (compute from :meth:`Workload.attention_flops`,
    windowed with ``work.window``: the window skips blocks, never transfers; the model
    spreads its compute evenly over the steps)."""
    u, c = ulysses_size, team_size
    topo = StarTrailTopology(cp_size // u, c)
    g, positions = topo.sub_ring_size, range(cp_size // u)
    shape = AttentionShape(work.seq_length // cp_size, work.batch, work.heads, work.kv_heads, work.head_dim,
                           work.dtype_bytes, v_head_dim=work.v_head_dim)
    e, a = shape.dtype_bytes, shape.acc_bytes
    eq, ekv, eo, el = startrail_rank_elements(shape, u)
    cp_rank = lambda pos, uly=0: pos * u + uly  # noqa: E731 - StarTrail position -> CP rank
    rate = cluster.attention_rate(work.seq_length * u / cp_size)  # a StarTrail rank's tokens, after Ulysses
    compute_fwd = work.attention_flops(cp_size) / rate
    compute_bwd = BACKWARD_FLOPS_RATIO * compute_fwd
    phases = []  # blocking phases: (seconds, the busiest node's inter-node bytes)

    teams = [[cp_rank(p, x) for p in team] for x in range(u) for team in topo.teams()]
    if rotation == "auto":
        rotation = choose_backward_rotation(shape, u, c)
    phases += _ulysses_and_team_phases(cluster, shape, teams, [[cp_rank(p, x) for x in range(u)] for p in positions],
                                       c, regather_in_backward, rotation)

    def initial_send(nbytes: float) -> tuple[float, float]:
        return cluster.exchange_time([(cp_rank(p, x), cp_rank(topo.init_send_dst(p), x), nbytes)
                                      for p in positions for x in range(u)])

    init_fwd = [initial_send(c * ekv * e) for _ in range(1 + regather_in_backward)]
    phases += init_fwd
    # Sub-ring steps: one lane per ring of the transfer (multi-ring: the sub-ring's
    # Hamiltonian cycles), each carrying its share of the step's bytes to its next rank.
    lanes = {p: sub_ring_lanes(topo, p, transfer) for p in positions}
    payload_bwd, accumulator_bwd = backward_p2p_parts(shape, u, c)[rotation]
    rings = {tuple(cp_rank(p, x) for p in lane.order) for p in positions for x in range(u) for lane in lanes[p]}
    once = g > 1 and cluster.latency_once_per_phase(rings)

    def ring_round(nbytes: float, latency: bool = not once) -> tuple[float, float]:
        return cluster.exchange_time([(cp_rank(p, x), cp_rank(lane.next(p), x), nbytes / len(lanes[p]))
                                      for p in positions for x in range(u) for lane in lanes[p]], latency)

    # What flies while step i computes (schedule.rotate). Forward: the next K, V (steps
    # 0..G-2). Backward: the next payload (0..G-2) and the accumulator posted after the
    # previous step (1..G-1); the last accumulator is waited on after the last step.
    fwd_flying = [ring_round(c * ekv * e) for _ in range(g - 1)] + [(0.0, 0.0)]
    bwd_flying = [ring_round(payload_bwd * (i < g - 1) + accumulator_bwd * (i > 0)) for i in range(g)]
    total = 0.0
    for flying, compute in ((fwd_flying, compute_fwd), (bwd_flying, compute_bwd)):
        # A ring paying its latency once per phase pays it with its first transfer.
        transfers = [t + (cluster.inter_latency_s if once and i == 0 else 0.0) for i, (t, _) in enumerate(flying)]
        total += overlapped_steps(cluster.overlap, [compute / g] * g, transfers)
        phases += [(0.0, b) for _, b in flying]
    if g > 1:
        phases.append(ring_round(accumulator_bwd, latency=True))
    # Backward team phases: all-gather dO|out, lse; dK, dV go back along the reverse
    # initial send while dQ is reduce-scattered in the team; then dK, dV are.
    reverse = initial_send(c * ekv * a)
    if c > 1:
        query_side = (2 * eo + (eq if rotation == "q" else 0)) * e + el * a  # [q,] dO, out, lse
        # Note [piece-major rotation q]: with one position per sub-ring, once per piece of K, V.
        per_piece = c if rotation == "q" and topo.one_position_sub_rings else 1
        phases.append(cluster.collective_time(teams, per_piece * (c - 1) * query_side))
        dq = cluster.collective_time(teams, per_piece * (c - 1) * eq * a)
        phases.append((max(reverse[0], dq[0]), reverse[1] + dq[1]))
        phases.append(cluster.collective_time(teams, (c - 1) * ekv * a))
    else:
        phases.append(reverse)
    total += sum(t for t, _ in phases)
    hidden = 1.0  # Note [reverse overlap]: the reverse pieces that fly while the next one computes
    if rotation == "q" and topo.one_position_sub_rings and c > 1:
        flies = reverse_overlaps(c, ekv * e, ekv * a, regathered=regather_in_backward, overlap=reverse_overlap)
        hidden = sum(flies) / (c - 1)
    total = _with_pieces(total, cluster, c, g, init_fwd[0][0], reverse[0], compute_fwd / g, compute_bwd / g,
                         regather_in_backward, rotation, hidden)
    compute = compute_fwd + compute_bwd
    kept = work.layers * kept_per_layer_bytes(shape, ulysses_size=u, team_size=c,
                                              regather_in_backward=regather_in_backward, rotation=rotation)
    peak = activation_peak_bytes(shape, layers=work.layers, cp_size=cp_size, team_size=c, ulysses_size=u,
                                 regather_in_backward=regather_in_backward, rotation=rotation,
                                 reverse_overlap=reverse_overlap)
    return Prediction(u, c, transfer, total, compute, max(0.0, total - compute), sum(b for _, b in phases),
                      regather_in_backward and c > 1, kept, peak, reverse_overlap=reverse_overlap)


def _fitting(cluster, work, cp_size, c, u, transfer, memory_limit_bytes,
             rotations=("auto", "q")) -> Prediction | None:
    """The prediction for (U, C, transfer) within the memory limit: as it is if that fits,
    else with the backward rotation "q" (streamed: a lower peak, the same bytes), else that
    without the reverse sends' overlap (sub-rings of one position: Note [reverse overlap]), else
    regathering (ring attention keeps the same either way), else those together; else None."""
    for regather, rotation, overlap in memory_fallbacks(cp_size // u, c, rotations,
                                                        (False, True) if c > 1 else (False,)):
        pred = dataclasses.replace(predict(cluster, work, cp_size, c, u, transfer, regather, rotation=rotation,
                                           reverse_overlap=overlap), rotation=rotation)
        if memory_limit_bytes is None or pred.peak_bytes <= memory_limit_bytes:
            return pred
    return None


def plan(cluster: ClusterSpec, work: Workload, cp_size: int, *, transfers=("ring", "multiring"),
         memory_limit_bytes: int | None = None) -> list[Prediction]:
    """Every valid (U, C, transfer) within ``memory_limit_bytes`` (per rank, the peak of
    ``work.layers`` attention layers' kept tensors plus one layer's forward or backward
    buffers; regathering where only that fits it), fastest first."""
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


def choose_plan(*, cp_size: int, ulysses_size: int, gpus_per_node: int, seq_length: int, num_heads: int,
                num_kv_heads: int, head_dim: int, micro_batch_size: int, dtype_bytes: int,
                cluster: ClusterSpec | None = None, v_head_dim: int | None = None, layers: int = 1,
                memory_limit_bytes: int | None = None, window_size: tuple[int, int] | None = None,
                window_skip_freq: int | tuple[int, ...] | None = None, backward_rotation: str = "auto") -> Prediction:
    """The fastest (team size, backward rotation, regathering) for this CP size and Ulysses
    degree whose ``layers`` attention layers peak at most ``memory_limit_bytes`` per rank
    (what they keep for backward plus one layer's transient buffers); ``window_size`` /
    ``window_skip_freq``: Megatron's sliding windows over those layers. With
    ``backward_rotation`` "auto" the streamed rotation "q" is taken where only it fits;
    "q" or "kv" are kept as given.

    Without ``cluster``: the ``DEFAULT_CLUSTER`` preset with ``gpus_per_node`` CP ranks per
    node. Raises ValueError when nothing fits."""
    if cluster is None:
        cluster = preset(DEFAULT_CLUSTER, max(1, -(-cp_size // gpus_per_node)), gpus_per_node=gpus_per_node)
    work = Workload(seq_length, num_heads, num_kv_heads, head_dim, micro_batch_size, dtype_bytes,
                    v_head_dim=v_head_dim, layers=layers, window=None if window_size is None else tuple(window_size),
                    window_skip_freq=window_skip_freq if isinstance(window_skip_freq, (int, type(None)))
                    else tuple(window_skip_freq))
    found = [pred for c in valid_team_sizes(cp_size // ulysses_size)
             if (pred := _fitting(cluster, work, cp_size, c, ulysses_size, "ring", memory_limit_bytes,
                                  ("auto", "q") if backward_rotation == "auto" else (backward_rotation,)))
             is not None]
    if not found:
        least = predict(cluster, work, cp_size, 1, ulysses_size).peak_bytes
        raise ValueError(
            f"no StarTrail team size keeps the attention's activations within "
            f"--startrail-memory-limit-gb {memory_limit_bytes / 1e9:g}: even ring attention peaks at "
            f"{least / 1e9:.3g} GB per rank ({layers} layers); raise the limit or --context-parallel-size")
    return min(found, key=lambda p: p.time_s)


# Flags that override the preset's fields: flag, field, type, factor to the field's unit, help.
CLUSTER_FLAGS = [
    ("--gpus-per-node", "gpus_per_node", int, 1, "GPUs per node"),
    ("--intra-node-gbs", "intra_node_gbs", float, 1, "GB/s per GPU per direction"),
    ("--inter-node-gbps", "inter_node_gbs", float, 1 / 8, "Gbit/s per node, all NICs together"),
    ("--nics-per-node", "nics_per_node", int, 1, "NICs per node"),
    ("--attention-tflops", "attention_tflops", float, 1, "attention kernel TFLOP/s per GPU on one long fused call (the "
     "preset's measured block-loop efficiency applies on top)"),
    ("--overlap", "overlap", float, 1, "fraction of a sub-ring step's transfer hidden behind its compute"),
]


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m megatron_startrail.planning", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cluster", choices=PRESETS, default=DEFAULT_CLUSTER, help="hardware preset (default: %(default)s)")
    p.add_argument("--nodes", type=int, required=True)
    for flag, _, kind, _, text in CLUSTER_FLAGS:  # give effective rates: what the transport delivers
        p.add_argument(flag, type=kind, help=f"{text} (default: the preset's)")
    p.add_argument("--cp-size", type=int, required=True)
    p.add_argument("--tp-size", type=int, default=1)
    p.add_argument("--seq-length", type=int, required=True)
    p.add_argument("--heads", type=int, required=True, help="attention heads (before TP)")
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--dtype-bytes", type=int, default=2)
    p.add_argument("--v-head-dim", type=int, default=None, help="V head dim (MLA); default: --head-dim")
    p.add_argument("--num-layers", type=int, default=1,
                   help="attention layers (for the memory limit and the mix of windowed and full layers)")
    p.add_argument("--window-size", type=_window_flag, default=None, metavar="LEFT,RIGHT",
                   help="sliding window, flash-attn's meaning (-1 unbounded), as Megatron's --window-size")
    p.add_argument("--window-attn-skip-freq", type=_skip_flag, default=None, metavar="N|1,1,0,...",
                   help="Megatron's: every N-th layer full attention, or 1 (windowed) / 0 (full) per layer")
    p.add_argument("--memory-limit-gb", type=float, default=None,
                   help="leave out configurations whose attention activations exceed this, per rank")
    p.add_argument("--no-causal", action="store_true")
    return p


def _window_flag(text: str) -> tuple[int, int]:
    try:
        left, right = (int(x) for x in text.strip("()").split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--window-size takes LEFT,RIGHT (e.g. 4096,0), got {text!r}") from None
    return left, right


def _skip_flag(text: str) -> int | tuple[int, ...]:
    try:
        return int(text) if "," not in text else tuple(int(x) for x in text.strip("[]()").split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--window-attn-skip-freq takes N or 1,1,0,... got {text!r}") from None


def cluster_from_args(args: argparse.Namespace) -> ClusterSpec:
    given = {field: getattr(args, flag[2:].replace("-", "_")) for flag, field, *_ in CLUSTER_FLAGS}
    factor = {field: f for _, field, _, f, _ in CLUSTER_FLAGS}
    return preset(args.cluster, args.nodes, cp_stride=args.tp_size,
                  **{k: v * factor[k] for k, v in given.items() if v is not None})


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    cluster = cluster_from_args(args)
    work = Workload(args.seq_length, args.heads // args.tp_size, (args.kv_heads or args.heads) // args.tp_size,
                    args.head_dim, args.batch, args.dtype_bytes, not args.no_causal, args.v_head_dim, args.num_layers,
                    args.window_size, args.window_attn_skip_freq)
    limit = None if args.memory_limit_gb is None else int(args.memory_limit_gb * 1e9)
    if work.window is not None:
        windowed, _ = window_layers(work.layers, work.window_skip_freq)
        halo = _halo_layer(cluster, dataclasses.replace(work, layers=1), args.cp_size, 1, 1, "ring", False)
        how = "by the halo exchange" if halo else "through the schedule (the window reaches too far for the halo)"
        print(f"window {work.window[0]},{work.window[1]}: {windowed} of {work.layers} layers windowed, {how}; "
              "times are per layer, averaged over the layers")
    print(f"{'configuration':36} {'time ms':>9} {'compute ms':>11} {'exposed comm ms':>16} "
          f"{'inter-node MiB/node':>20} {'kept for bwd GB/rank':>21} {'peak GB/rank':>13}")
    preds = plan(cluster, work, args.cp_size, memory_limit_bytes=limit)
    if not preds:
        print(f"no configuration keeps the attention's activations of {args.num_layers} layers within "
              f"--memory-limit-gb {args.memory_limit_gb:g} per rank")
    for pred in preds:
        print(f"{pred.name:36} {pred.time_s * 1e3:9.2f} {pred.compute_s * 1e3:11.2f} "
              f"{pred.exposed_comm_s * 1e3:16.2f} {pred.internode_bytes / 2**20:20.1f} "
              f"{pred.activation_bytes / 1e9:21.3f} {pred.peak_bytes / 1e9:13.3f}")


if __name__ == "__main__":
    main()
