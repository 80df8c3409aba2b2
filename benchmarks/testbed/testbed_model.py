"""The test bed's preset: the planner's cluster built from a calibration
(benchmarks/testbed/calibration.py), with what gloo and the emulated links do that a GPU cluster's
transport does not.

The package's model (megatron_startrail/planning/cluster.py) prices a round of transfers as
latency + bytes / bandwidth per link and every sub-ring step's latency. On the test bed
(gloo over TCP, nodes as network namespaces, links shaped with ``tc``, latencies of
milliseconds) three things differ, each found by a probe or a validation run
(benchmarks/testbed/README.md, "Planner vs measurement"):

* **Duplex rate.** A round in which some rank pair on two nodes sends both ways moves at
  the calibrated both-ways rate (``inter_node_duplex_gbs``; gloo used to carry both
  directions of a pair on one TCP connection, which moved 1-15 % less).
* **Collective calls.** A collective call costs what a tiny all-to-all measured per call
  (``collective_latency_s``), more than a P2P step on gloo; an all-to-all costs just that
  (priced at a P2P step's latency, Ulysses-2 x ring came out +3-6 % in every run).
* **Streaming rings** (:func:`ring_streams`): gloo buffers sends, so some rings pay the
  crossing latency once per phase instead of every step.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from megatron_startrail.planning.cluster import ClusterSpec


def ring_streams(cluster: ClusterSpec, rings: Iterable[Sequence[int]]) -> bool:
    """Whether rings' steps stream over the inter-node links: some hop crosses nodes, and
    every rank that sends to another node either forwards what it received from a rank of
    its own node, or shares its inter-node link with another rank's crossing hops.

    Forwarding node-local messages: such a rank sends step i+1's message once its
    node-local predecessor's has landed, not the message that crossed in step i, so
    (sends buffered by the transport) the link carries message after message without a
    gap. Ring attention over nodes of several ranks streams that way.

    Several senders per link: a rank that forwards what just crossed (every hop of
    Ulysses-2 x ring on one rank pair per node crosses) waits a latency before its next
    send, but the link it shares with other ranks' rings carries their queued messages
    meanwhile: a FIFO link serves whole messages in turn, so one flow's gap is another's
    transfer (measured: Ulysses-2 x ring on 4 nodes x 2 ranks ran at the link's rate).
    A NIC of its own per rank (``nics_per_node``) shares nothing.

    Either way the crossing hop's latency is paid beside the transfer, once per phase.
    Otherwise -- one ring forwarding what just crossed, alone on its link (a pair exchange
    between two nodes of one rank each) -- lock-step: a latency after every message."""
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
    return all(node(ring[i - 1]) == node(ring[i]) or len(senders[link(ring, i)]) >= flows_needed
               for ring, i in crossing)


@dataclass(frozen=True)
class TestBedCluster(ClusterSpec):
    """A :class:`ClusterSpec` priced as gloo on the emulated links (module docstring)."""

    __test__ = False  # not a pytest class
    inter_node_duplex_gbs: float | None = None  # None: inter_node_gbs
    collective_latency_s: float | None = None  # None: a transfer's latency

    def exchange_time(self, sends, latency=True):
        sends = list(sends)
        crossing = {(a, b) for a, b, n in sends if n and a != b and self.node_of(a) != self.node_of(b)}
        if self.inter_node_duplex_gbs is not None and any((b, a) in crossing for a, b in crossing):
            slower = dataclasses.replace(self, inter_node_gbs=self.inter_node_duplex_gbs, inter_node_duplex_gbs=None)
            return slower.exchange_time(sends, latency)
        return super().exchange_time(sends, latency)

    def call_latency(self, hop_latency_s, ring):
        if self.collective_latency_s is None:
            return hop_latency_s
        return max(hop_latency_s, self.collective_latency_s) if ring else self.collective_latency_s

    def latency_once_per_phase(self, rings):
        return ring_streams(self, rings)


def testbed_cluster(calibration: dict, nodes: int, ranks_per_node: int, rate_mbit: float,
                    full_mesh: bool = False, gloo_rules: bool = True) -> ClusterSpec:
    """The planner's view of an emulated cluster, from what its ranks measured on it
    before any attention ran (benchmarks/testbed/calibration.py): effective inter- and intra-node
    rates, step latency (the same inside and between nodes: process scheduling as much as
    the network), a collective call's latency, the kernel's rate under contention, overlap.
    One shaped link per node (``nics_per_node=1``). ``gloo_rules=False``: the package's
    model on the same figures, to show what the rules above are worth."""
    latency = calibration["step_latency_s"]
    spec = TestBedCluster(
        nodes=nodes, gpus_per_node=ranks_per_node,
        intra_node_gbs=calibration.get("intra_node_gbs", 1.0),
        inter_node_gbs=calibration.get("inter_node_gbs", rate_mbit / 8 / 1000), nics_per_node=1,
        intra_latency_s=latency, inter_latency_s=latency, attention_tflops=calibration["attention_tflops"],
        block_loop=None,  # the calibration measured the rate of the block loop itself
        overlap=calibration.get("overlap", 1.0), inter_node_mesh=full_mesh,
        inter_node_duplex_gbs=calibration.get("inter_node_duplex_gbs"),
        collective_latency_s=calibration.get("collective_latency_s"),
    )
    return spec if gloo_rules else ClusterSpec(**{f: getattr(spec, f) for f in ClusterSpec.__dataclass_fields__})
