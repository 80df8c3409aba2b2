"""The test bed's refinement of the planner (benchmarks/testbed/testbed_model.py, peer_models.py):
its rules, each on the case it was written for. How well they predict is checked against
the committed runs in tests/test_planner.py."""

import json
import os

import pytest

from benchmarks.testbed import testbed_model
from benchmarks.testbed.peer_models import EMPTY_MESSAGE_WIRE_BYTES, empty_messages_crossing, permute_overhead_s
from benchmarks.testbed.testbed_model import TestBedCluster, ring_streams
from megatron_startrail.planning.cluster import ClusterSpec

RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "results")


def slow_link_cluster(nodes, per_node, **kw):
    return TestBedCluster(nodes=nodes, gpus_per_node=per_node, **{"intra_node_gbs": 1.0,
                          "inter_node_gbs": 50 / 8 / 1000, "nics_per_node": 1, "attention_tflops": 0.01, **kw})


def test_rings_that_forward_node_local_messages_stream():
    cluster = slow_link_cluster(2, 4)
    assert ring_streams(cluster, [list(range(8))])  # ring attention: 3 -> 4 and 7 -> 0 forward 2's, 6's
    assert not ring_streams(cluster, [[0, 1, 2, 3]])  # no hop crosses: each forwards what just came
    assert not ring_streams(cluster, [[0, 4]])  # a pair exchange: each forwards what just crossed
    # With a pair exchange beside it, each node's link carries two ranks' hops (3's and
    # 0's from node 0): one's wait is the other's transfer; with a NIC per two ranks each
    # NIC carries one, and the pair exchange makes the rings lock-step.
    assert ring_streams(cluster, [list(range(8)), [0, 4]])
    assert not ring_streams(slow_link_cluster(2, 4, nics_per_node=2), [list(range(8)), [0, 4]])
    # StarTrail-2's sub-ring on 4 x 4, positions 0, 2, 4, 6: spans nodes 0, 0, 1, 1 and streams.
    assert ring_streams(slow_link_cluster(4, 4), [[0, 2, 4, 6]])


def test_lock_step_rings_that_share_a_link_stream():
    # Ulysses-2 x ring on 4 nodes x 2 ranks: two rings, every hop crosses; each node's
    # link carries both ranks' hops, so one ring's wait is the other's transfer.
    rings = [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert ring_streams(slow_link_cluster(4, 2), rings)
    assert not ring_streams(slow_link_cluster(4, 2), rings[:1])  # alone on its link: lock-step
    assert not ring_streams(slow_link_cluster(4, 2, nics_per_node=2), rings)  # a NIC for each
    # A full mesh: each node pair's link is its own. A second ring that crosses on other
    # links leaves each of its senders alone on its link: lock-step.
    mesh = slow_link_cluster(4, 2, inter_node_mesh=True)
    assert ring_streams(mesh, rings)
    assert not ring_streams(mesh, [[0, 2, 4, 6], [1, 5, 3, 7]])
    assert ring_streams(mesh, [list(range(8)), [0, 2], [1, 3]])
    assert not ring_streams(mesh, [list(range(8)), [0, 2]])


def test_rounds_where_a_rank_pair_sends_both_ways_use_the_duplex_rate():
    one_way_gbs, duplex_gbs, nbytes = 50 / 8 / 1000, 25 / 8 / 1000, 1e6
    cluster = slow_link_cluster(2, 4, inter_node_duplex_gbs=duplex_gbs, inter_latency_s=0.0)
    one_way = [(0, 4, nbytes), (5, 1, nbytes)]  # the two directions on different rank pairs
    both_ways = [(0, 4, nbytes), (4, 0, nbytes)]  # one rank pair, both directions
    assert cluster.exchange_time(one_way)[0] == pytest.approx(nbytes / (one_way_gbs * 1e9))
    assert cluster.exchange_time(both_ways)[0] == pytest.approx(nbytes / (duplex_gbs * 1e9))
    # The package's model (NCCL, RDMA) has one rate for both.
    plain = ClusterSpec(2, 4, inter_node_gbs=one_way_gbs, nics_per_node=1, inter_latency_s=0.0)
    assert plain.exchange_time(both_ways) == plain.exchange_time(one_way) == cluster.exchange_time(one_way)


def test_collective_calls_cost_the_calibrated_call_latency():
    hop, call = 3e-3, 1e-3
    cluster = slow_link_cluster(1, 4, intra_latency_s=hop, collective_latency_s=call)
    assert cluster.call_latency(hop, ring=False) == call  # an all-to-all: what a tiny one measured
    assert cluster.call_latency(hop, ring=True) == hop  # a ring's first hop is still a hop
    assert slow_link_cluster(1, 4).call_latency(hop, ring=False) == hop  # nothing measured: a hop


def test_testbed_preset_is_built_from_a_committed_calibration():
    run = json.load(open(os.path.join(RESULTS, "validation_4x4.json")))
    cal = run["results"][0]["calibration"]
    cluster = testbed_model.testbed_cluster(cal, 4, 4, 100)
    assert (cluster.inter_node_gbs, cluster.inter_node_duplex_gbs, cluster.intra_node_gbs) == (
        cal["inter_node_gbs"], cal["inter_node_duplex_gbs"], cal["intra_node_gbs"])
    assert cluster.inter_latency_s == cluster.intra_latency_s == cal["step_latency_s"]
    assert (cluster.attention_tflops, cluster.overlap, cluster.collective_latency_s) == (
        cal["attention_tflops"], cal["overlap"], cal["collective_latency_s"])


def test_empty_messages_of_a_permute_are_counted_per_node():
    # 2 x 4: each of a node's 4 ranks sends to the other node's 4, less the one payload
    # (rank 3 -> 4): 15; the probe divides its measured bytes by the same count.
    for nodes, per_node, messages in ((2, 4, 15), (3, 4, 31), (4, 2, 11)):
        cluster = slow_link_cluster(nodes, per_node)
        assert empty_messages_crossing(cluster, nodes * per_node) == messages
        assert permute_overhead_s(cluster, nodes * per_node) == pytest.approx(
            messages * EMPTY_MESSAGE_WIRE_BYTES / (cluster.inter_node_gbs * 1e9))
    assert permute_overhead_s(slow_link_cluster(1, 8), 8) == 0.0  # one node: nothing crosses
