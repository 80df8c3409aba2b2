"""Every context-parallel type Megatron users pick, priced beside StarTrail on one cluster.

Megatron's ``--cp-comm-type`` (Transformer Engine's context-parallel attention) offers
``p2p`` (ring), ``all_gather``, ``a2a`` (Ulysses) and ``a2a+p2p`` (Ulysses inside a group
of ``--hierarchical-context-parallel-sizes`` ranks, ring across them); recipes now default
to a2a or all-gather. This module prices each on a :class:`ClusterSpec`, forward + backward
of one attention layer, next to StarTrail-C and Ulysses x StarTrail-C:

=================  =========================================================================
``ring``           :func:`~.planner.predict` with C = 1, U = 1 (the schedule's ring)
``all_gather``     K, V all-gathered over the CP group in the forward and again in the
                   backward, dK, dV reduce-scattered (:func:`~megatron_startrail.accounting.
                   allgather_cp_comm`), all three exposed (TE: "KV all-gather ... is
                   exposed"); compute at the block loop's rate for the rank's tokens
``a2a``            Ulysses over the whole CP group (U = CP): q, k, v, out all-to-all'd in the
                   forward, dout, dq, dk, dv in the backward (the bytes of
                   :func:`~megatron_startrail.accounting.expected_comm` with U = CP), then
                   one fused call per rank over the whole sequence: priced at the fused
                   call's measured rate (no block loop)
``a2a+p2p``        :func:`~.planner.predict` with C = 1 and U > 1: all-to-all inside U
                   ranks, the ring over CP / U
``startrail``      :func:`~.planner.predict`, the fastest C > 1 (U = 1)
``a2a+startrail``  :func:`~.planner.predict`, the fastest U > 1 and C > 1
=================  =========================================================================

The Ulysses degree U (the rule stated in ``benchmarks/results/paper_clusters.md``):

- it divides the query heads (every type);
- Megatron's ``a2a`` and ``a2a+p2p`` run Transformer Engine's all-to-all, which asserts
  that the K/V heads divide too (``k.shape[-2] % cp_size == 0``): GQA 32/8 allows U <= 8;
- megatron_startrail's Ulysses replicates K/V heads up to U where U is a multiple of
  the K/V heads (:func:`~megatron_startrail.accounting.ulysses_kv_heads`; the bytes count
  the replicas): GQA 32/8 allows U up to 32 under StarTrail;
- the hybrids keep their all-to-all inside a node (U divides the GPUs per node, as
  Megatron's hierarchical CP is used): the planner prices a Ulysses group as a ring of
  sends, which matches an all-to-all through one switch, not one across NICs. ``a2a``
  alone spans the nodes and is priced by its explicit all-to-all sends
  (:meth:`ClusterSpec.exchange_time`: each rank's own NIC, each node's uplink).

A collective over the whole CP group (``all_gather``) runs as NCCL's rings striped over
every NIC of a node, so its crossing traffic is limited by the node's rate, not by one NIC.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ..accounting import AttentionShape, allgather_cp_comm, expected_comm
from ..topology import valid_team_sizes
from .cluster import ClusterSpec
from .planner import BACKWARD_FLOPS_RATIO, Workload, predict

CP_TYPES = ("ring", "all_gather", "a2a", "a2a+p2p", "startrail", "a2a+startrail")
LABELS = {"ring": "ring (p2p)", "all_gather": "all-gather", "a2a": "Ulysses (a2a)", "a2a+p2p": "a2a+p2p",
          "startrail": "StarTrail-C", "a2a+startrail": "Ulysses x StarTrail-C"}
STARTRAIL_TYPES = ("startrail", "a2a+startrail")


@dataclass(frozen=True)
class CPPrice:
    """One CP type's predicted forward+backward time of one attention layer; ``time_s`` is
    None where the type cannot run this workload (``why_not`` says why)."""

    cp_type: str
    time_s: float | None
    ulysses_size: int = 1
    team_size: int = 1
    why_not: str = ""
    fused_rate_time_s: float | None = None  # all_gather: its compute at the fused call's rate

    @property
    def config(self) -> str:
        parts = ([f"U={self.ulysses_size}"] if self.ulysses_size > 1 and self.cp_type != "a2a" else []) + (
            [f"C={self.team_size}"] if self.team_size > 1 else [])
        return " ".join(parts)


def _shape(work: Workload, cp_size: int) -> AttentionShape:
    return AttentionShape(work.seq_length // cp_size, work.batch, work.heads, work.kv_heads, work.head_dim,
                          work.dtype_bytes, v_head_dim=work.v_head_dim)


def _compute_s(cluster: ClusterSpec, work: Workload, cp_size: int, tokens_per_rank: float) -> float:
    return (1 + BACKWARD_FLOPS_RATIO) * work.attention_flops(cp_size) / cluster.attention_rate(tokens_per_rank)


def ulysses_degrees(work: Workload, cp_size: int, cluster: ClusterSpec, *, replicate_kv: bool) -> list[int]:
    """U > 1 for a hybrid (Ulysses inside a node, U < CP for Megatron's a2a+p2p, any U | CP
    for StarTrail), by the rule in the module's docstring."""
    return [u for u in range(2, cluster.gpus_per_node + 1)
            if cluster.gpus_per_node % u == 0 and cp_size % u == 0 and work.heads % u == 0
            and (work.kv_heads % u == 0 or (replicate_kv and u % work.kv_heads == 0))
            and (replicate_kv or u < cp_size)]


def price_all_gather(cluster: ClusterSpec, work: Workload, cp_size: int) -> CPPrice:
    """Megatron's ``all_gather``: three exposed collectives over the CP group (the bytes of
    :func:`allgather_cp_comm`; K and V, dK and dV each one call), then the compute."""
    comm = allgather_cp_comm(_shape(work, cp_size), cp_size=cp_size)
    striped = dataclasses.replace(cluster, nics_per_node=1)  # NCCL's rings over every NIC of a node
    group = [list(range(cp_size))]
    gather, _ = striped.collective_time(group, comm["forward"]["collective_bytes_sent"], calls=2)
    # The backward's two collectives (gather K, V; reduce-scatter dK, dV) move the same bytes.
    comm_s = 3 * gather
    assert comm["backward"]["collective_bytes_sent"] == 2 * comm["forward"]["collective_bytes_sent"]
    tokens = work.seq_length / cp_size
    fused = dataclasses.replace(cluster, block_loop=None)
    return CPPrice("all_gather", comm_s + _compute_s(cluster, work, cp_size, tokens),
                   fused_rate_time_s=comm_s + _compute_s(fused, work, cp_size, tokens))


def price_ulysses(cluster: ClusterSpec, work: Workload, cp_size: int) -> CPPrice:
    """Megatron's ``a2a`` (U = CP), or why it cannot run: eight all-to-alls (four each way)
    over the CP group, priced as explicit sends, and one fused call per rank."""
    if work.heads % cp_size or work.kv_heads % cp_size:
        return CPPrice("a2a", None, cp_size, why_not=f"heads {work.heads}/{work.kv_heads} not divisible by CP {cp_size}")
    shape = _shape(work, cp_size)
    sent = expected_comm(shape, cp_size=cp_size, team_size=1, ulysses_size=cp_size)
    assert sent["forward"]["p2p_bytes_sent"] == 0 and sent["backward"] == sent["forward"]
    piece = sent["forward"]["collective_bytes_sent"] / (cp_size - 1)  # to each peer, q, k, v, out together
    one_way, _ = cluster.exchange_time([(r, s, piece) for r in range(cp_size) for s in range(cp_size) if r != s])
    crosses = cluster.node_of(0) != cluster.node_of(cp_size - 1)
    hop = cluster.inter_latency_s if crosses else cluster.intra_latency_s
    comm_s = 2 * (one_way + 3 * hop)  # four calls each way; the exchange counted one latency
    fused = dataclasses.replace(cluster, block_loop=None)
    return CPPrice("a2a", comm_s + _compute_s(fused, work, cp_size, work.seq_length), cp_size)


def _fastest(cp_type: str, preds, why_not: str) -> CPPrice:
    if not preds:
        return CPPrice(cp_type, None, why_not=why_not)
    best = min(preds, key=lambda p: p.time_s)
    return CPPrice(cp_type, best.time_s, best.ulysses_size, best.team_size)


def price_cp_types(cluster: ClusterSpec, work: Workload, cp_size: int) -> dict[str, CPPrice]:
    """Every type of :data:`CP_TYPES` on one CP group of ``cp_size`` ranks (no window)."""
    teams = [c for c in valid_team_sizes(cp_size) if c > 1]
    return {
        "ring": _fastest("ring", [predict(cluster, work, cp_size, 1)], ""),
        "all_gather": price_all_gather(cluster, work, cp_size),
        "a2a": price_ulysses(cluster, work, cp_size),
        "a2a+p2p": _fastest("a2a+p2p", [predict(cluster, work, cp_size, 1, u) for u in
                                        ulysses_degrees(work, cp_size, cluster, replicate_kv=False)],
                            "no Ulysses degree inside a node divides the heads"),
        "startrail": _fastest("startrail", [predict(cluster, work, cp_size, c) for c in teams],
                              f"no C > 1 with C^2 dividing {cp_size}"),
        "a2a+startrail": _fastest("a2a+startrail", [
            predict(cluster, work, cp_size, c, u) for u in ulysses_degrees(work, cp_size, cluster, replicate_kv=True)
            for c in valid_team_sizes(cp_size // u) if c > 1], "no U x C fits"),
    }


def winner(prices: dict[str, CPPrice]) -> str:
    """The fastest type that can run."""
    return min((p for p in prices.values() if p.time_s is not None), key=lambda p: p.time_s).cp_type
