"""The planner's cost model: what it counts, and the choices it makes."""

import pytest

from megatron_startrail.planner import ClusterSpec, Workload, choose_team_size, plan, predict
from megatron_startrail.topology import valid_team_sizes

WORK = Workload(seq_length=8192, heads=4, kv_heads=4, head_dim=32, batch=1, dtype_bytes=4, causal=True)


def slow_link_cluster(nodes, per_node, **kw):
    return ClusterSpec(nodes=nodes, gpus_per_node=per_node, intra_node_gbs=1.0, inter_node_gbs=50 / 8 / 1000,
                       **{"nics_per_node": 1, "attention_tflops": 0.01, **kw})


def test_inter_node_bytes_are_the_implementations():
    # 2 nodes x 4 ranks, causal fp32, 8192 tokens, 4 heads of 32: the benchmark measured
    # 44 MiB (ring) and 16 MiB (C=2) crossing nodes per forward+backward, both nodes together.
    cluster = slow_link_cluster(2, 4)
    mib = 2**20
    assert predict(cluster, WORK, 8, 1).internode_bytes * 2 == pytest.approx(44 * mib)
    assert predict(cluster, WORK, 8, 2).internode_bytes * 2 == pytest.approx(16 * mib)


def test_slow_inter_node_link_prefers_teams_that_keep_rings_inside_nodes():
    cluster = slow_link_cluster(2, 8)
    ranking = [p.name for p in plan(cluster, WORK, 16, transfers=("ring",))]
    assert ranking.index("startrail-2") < ranking.index("ring")
    assert choose_team_size(cp_size=16, ulysses_size=1, gpus_per_node=8, seq_length=8192, num_heads=4,
                            num_kv_heads=4, head_dim=32, micro_batch_size=1, dtype_bytes=4, cluster=cluster) == 2


def test_fast_links_make_communication_disappear():
    cluster = ClusterSpec(nodes=2, gpus_per_node=8, intra_node_gbs=1e6, inter_node_gbs=1e6, attention_tflops=0.01,
                          intra_latency_s=0, inter_latency_s=0)
    for c in valid_team_sizes(16):
        p = predict(cluster, WORK, 16, c)
        assert p.exposed_comm_s == pytest.approx(0.0, abs=1e-3 * p.compute_s)


def test_multiring_pays_off_only_on_a_full_mesh():
    mesh = slow_link_cluster(8, 1, inter_node_mesh=True)
    switch = slow_link_cluster(8, 1)
    ring, tasp = predict(mesh, WORK, 8, 1, transfer="ring"), predict(mesh, WORK, 8, 1, transfer="multiring")
    assert tasp.time_s < ring.time_s / 2  # 7 links instead of 1
    assert predict(switch, WORK, 8, 1, transfer="multiring").time_s == pytest.approx(
        predict(switch, WORK, 8, 1, transfer="ring").time_s)


def test_choose_team_size_default_cluster_gives_a_valid_size():
    for cp in (4, 8, 16, 32):
        c = choose_team_size(cp_size=cp, ulysses_size=1, gpus_per_node=8, seq_length=131072, num_heads=32,
                             num_kv_heads=8, head_dim=128, micro_batch_size=1, dtype_bytes=2)
        assert c in valid_team_sizes(cp)


def test_overlap_prices_hidden_and_serialised_steps():
    from megatron_startrail.planner import overlapped_steps  # noqa: PLC0415

    assert overlapped_steps(1.0, [3.0, 1.0], [1.0, 2.0]) == pytest.approx(3.0 + 2.0)
    assert overlapped_steps(0.0, [3.0, 1.0], [1.0, 2.0]) == pytest.approx(7.0)
    assert overlapped_steps(0.5, [3.0], [1.0]) == pytest.approx(3.5)
    # Less overlap never makes a configuration faster.
    full, half = slow_link_cluster(2, 4), slow_link_cluster(2, 4, overlap=0.5)
    for c in (1, 2):
        assert predict(half, WORK, 8, c).time_s >= predict(full, WORK, 8, c).time_s


def test_rings_that_forward_node_local_messages_stream():
    from megatron_startrail.planner import ring_streams  # noqa: PLC0415

    cluster = slow_link_cluster(2, 4)
    assert ring_streams(cluster, [list(range(8))])  # ring attention: 3 -> 4 and 7 -> 0 forward 2's, 6's
    assert not ring_streams(cluster, [[0, 1, 2, 3]])  # no hop crosses: each forwards what just came
    assert not ring_streams(cluster, [[0, 4]])  # a pair exchange: each forwards what just crossed
    # With a pair exchange beside it, each node's link carries two ranks' hops (3's and
    # 0's from node 0): one's wait is the other's transfer (see below); with a NIC per
    # two ranks each NIC carries one, and the pair exchange makes the rings lock-step.
    assert ring_streams(cluster, [list(range(8)), [0, 4]])
    assert not ring_streams(slow_link_cluster(2, 4, nics_per_node=2), [list(range(8)), [0, 4]])
    # StarTrail-2's sub-ring on 4 x 4, positions 0, 2, 4, 6: spans nodes 0, 0, 1, 1 and streams.
    assert ring_streams(slow_link_cluster(4, 4), [[0, 2, 4, 6]])


def test_lock_step_rings_that_share_a_link_stream():
    from megatron_startrail.planner import ring_streams  # noqa: PLC0415

    # Ulysses-2 x ring on 4 nodes x 2 ranks: two rings, every hop crosses; each node's
    # link carries both ranks' hops, so one ring's wait is the other's transfer.
    rings = [[0, 2, 4, 6], [1, 3, 5, 7]]
    assert ring_streams(slow_link_cluster(4, 2), rings)
    assert not ring_streams(slow_link_cluster(4, 2), rings[:1])  # alone on its link: lock-step
    assert not ring_streams(slow_link_cluster(4, 2, nics_per_node=2), rings)  # a NIC for each
    # Every hop of one ring crosses, but two of its ranks send over each node's link.
    assert ring_streams(slow_link_cluster(2, 4), [[0, 4, 1, 5]])
    # A full mesh: each node pair's link is its own. Both rings' hops from node 0 to 1
    # share link 0 -> 1 (and so on round the nodes): they stream; a second ring that
    # crosses on other links leaves each of its senders alone on its link: lock-step.
    mesh = slow_link_cluster(4, 2, inter_node_mesh=True)
    assert ring_streams(mesh, rings)
    assert not ring_streams(mesh, [[0, 2, 4, 6], [1, 5, 3, 7]])
    # Mixed: ring attention's 3 -> 4 is alone on link 1 -> 2 but forwards 2's message,
    # and the pair exchanges' senders share their links: streams. One pair exchange
    # alone on link 1 -> 0 (2 forwards what 0 just sent across): lock-step.
    assert ring_streams(mesh, [list(range(8)), [0, 2], [1, 3]])
    assert not ring_streams(mesh, [list(range(8)), [0, 2]])


def test_ulysses_ring_sharing_a_link_pays_the_latency_once_per_phase():
    # Ulysses-2 x ring on 4 x 2, link-bound: 5 ms more inter-node latency costs the two
    # phases' first transfers and the last dK, dV (three), as ring attention does; with a
    # NIC per rank its rings are lock-step and pay it every hop (3 forward, 3 + 1 backward,
    # the last dK, dV).
    def extra(**kw):
        fast, slow = (slow_link_cluster(4, 2, inter_latency_s=lat, **kw) for lat in (0.0, 5e-3))
        return predict(slow, WORK, 8, 1, 2).time_s - predict(fast, WORK, 8, 1, 2).time_s

    assert extra() == pytest.approx(3 * 5e-3)
    assert extra(nics_per_node=2) >= 8 * 5e-3 - 1e-12


def test_a_streaming_ring_pays_the_inter_node_latency_once_per_phase():
    # Link-bound ring attention on 2 x 4 (a step's transfer far above the latency):
    # raising the inter-node latency from 0 to 5 ms adds three latencies (the two
    # phases' first messages and the last dK, dV, waited on alone), not one per step.
    fast, slow = slow_link_cluster(2, 4, inter_latency_s=0.0), slow_link_cluster(2, 4, inter_latency_s=5e-3)
    assert predict(slow, WORK, 8, 1).time_s - predict(fast, WORK, 8, 1).time_s == pytest.approx(3 * 5e-3)
    # Ulysses 4 x ring (a ring of two per rank pair: lock-step) with a NIC per rank, so no
    # ring shares a link: one latency per step and per transfer.
    fast, slow = (slow_link_cluster(2, 4, inter_latency_s=lat, nics_per_node=4) for lat in (0.0, 5e-3))
    steps_u4 = 1 + 2 + 1  # forward, backward steps, the last dK, dV
    assert predict(slow, WORK, 8, 1, 4).time_s - predict(fast, WORK, 8, 1, 4).time_s >= steps_u4 * 5e-3


def test_compute_hides_a_streaming_ring_latency():
    # Compute-bound (fast link, slow kernel): the phases' latencies hide behind compute
    # as they do in a lock-step ring; at most the last dK, dV, waited on alone, shows.
    kw = dict(intra_node_gbs=1.0, inter_node_gbs=10.0, nics_per_node=1, attention_tflops=1e-4)
    fast = ClusterSpec(2, 4, inter_latency_s=0.0, **kw)
    slow = ClusterSpec(2, 4, inter_latency_s=1e-3, **kw)
    assert 0 <= predict(slow, WORK, 8, 1).time_s - predict(fast, WORK, 8, 1).time_s <= 1e-3 + 1e-12


def test_pytorch_ring_model_streams_like_the_projects_ring():
    from benchmarks.peer_models import permute_overhead_s, predict_torch_ring  # noqa: PLC0415

    # Link-bound: K, V forward and K, V + dK, dV backward each pay the latency once, and
    # the last dK, dV once more -- the same three as the project's ring.
    fast, slow = slow_link_cluster(2, 4, inter_latency_s=0.0), slow_link_cluster(2, 4, inter_latency_s=5e-3)
    extra = predict_torch_ring(slow, WORK, 8, "alltoall") - predict_torch_ring(fast, WORK, 8, "alltoall")
    assert extra == pytest.approx(3 * 5e-3)
    # Same bytes and schedule shape as the project's ring, plus the empty messages of
    # each of its 3P - 2 all-to-all calls (K, V: P - 1 forward, P - 1 backward; dK, dV: P).
    calls = 3 * 8 - 2
    assert predict_torch_ring(slow, WORK, 8, "alltoall") == pytest.approx(
        predict(slow, WORK, 8, 1).time_s + calls * permute_overhead_s(slow, 8), rel=1e-6)
    # One rank per node: every hop crosses, lock-step, a latency per hop.
    mesh_fast, mesh_slow = slow_link_cluster(8, 1, inter_latency_s=0.0), slow_link_cluster(8, 1, inter_latency_s=5e-3)
    hops = 7 + 1 + 6 + 1 + 1  # forward K, V; backward K, V, K, V + dK, dV, dK, dV; the last dK, dV
    extra = predict_torch_ring(mesh_slow, WORK, 8, "alltoall") - predict_torch_ring(mesh_fast, WORK, 8, "alltoall")
    assert extra >= hops * 5e-3 - 1e-9


def test_pytorch_all_gather_streams_as_gloo_pipelines_it():
    from benchmarks.peer_models import predict_torch_ring  # noqa: PLC0415

    # gloo's all-gather keeps two half-blocks in flight: a latency per call, not per hop.
    # Link-bound on 2 x 4: the forward's and the backward's all-gathers, the dK, dV
    # ring's phase and its last hop -- four latencies, whatever P is.
    fast, slow = slow_link_cluster(2, 4, inter_latency_s=0.0), slow_link_cluster(2, 4, inter_latency_s=5e-3)
    extra = predict_torch_ring(slow, WORK, 8, "allgather") - predict_torch_ring(fast, WORK, 8, "allgather")
    assert extra == pytest.approx(4 * 5e-3)


def test_empty_messages_of_a_permute_are_counted_per_node():
    from benchmarks.peer_models import EMPTY_MESSAGE_WIRE_BYTES, empty_messages_crossing, permute_overhead_s  # noqa: PLC0415

    # 2 x 4: each of a node's 4 ranks sends to the other node's 4, less the one payload
    # (rank 3 -> 4): 15; the probe divides its measured bytes by the same count.
    for nodes, per_node, messages in ((2, 4, 15), (3, 4, 31), (4, 2, 11)):
        cluster = slow_link_cluster(nodes, per_node)
        assert empty_messages_crossing(cluster, nodes * per_node) == messages
        assert permute_overhead_s(cluster, nodes * per_node) == pytest.approx(
            messages * EMPTY_MESSAGE_WIRE_BYTES / (cluster.inter_node_gbs * 1e9))
    assert permute_overhead_s(slow_link_cluster(1, 8), 8) == 0.0  # one node: nothing crosses


def test_rounds_where_a_rank_pair_sends_both_ways_use_the_duplex_rate():
    from megatron_startrail.planner import _exchange_time  # noqa: PLC0415

    cluster = slow_link_cluster(2, 4, inter_node_duplex_gbs=25 / 8 / 1000, inter_latency_s=0.0)
    nbytes = 1e6
    one_way = [(0, 4, nbytes), (5, 1, nbytes)]  # the two directions on different rank pairs
    both_ways = [(0, 4, nbytes), (4, 0, nbytes)]  # one rank pair, both directions
    assert _exchange_time(cluster, one_way)[0] == pytest.approx(nbytes / (50e6 / 8))
    assert _exchange_time(cluster, both_ways)[0] == pytest.approx(nbytes / (25e6 / 8))
    # Without a duplex figure (NCCL, RDMA): one rate for both.
    plain = slow_link_cluster(2, 4, inter_latency_s=0.0)
    assert _exchange_time(plain, both_ways)[0] == pytest.approx(_exchange_time(plain, one_way)[0])
    # Ulysses 4 x ring on 2 nodes is a ring of two: every hop goes both ways on one pair;
    # ring attention's hops never do.
    assert predict(cluster, WORK, 8, 1, 4).time_s > predict(plain, WORK, 8, 1, 4).time_s
    assert predict(cluster, WORK, 8, 1).time_s == pytest.approx(predict(plain, WORK, 8, 1).time_s)


def test_memory_limit_leaves_out_configurations_or_makes_them_regather():
    from megatron_startrail.accounting import AttentionShape, kept_for_backward_bytes  # noqa: PLC0415

    cluster = slow_link_cluster(2, 8)
    shape = AttentionShape(8192 // 16, 1, 4, 4, 32, 4)
    ring = kept_for_backward_bytes(shape, ulysses_size=1, team_size=1, regather_in_backward=False)
    st2 = kept_for_backward_bytes(shape, ulysses_size=1, team_size=2, regather_in_backward=False)
    assert st2 > ring == kept_for_backward_bytes(shape, ulysses_size=1, team_size=2, regather_in_backward=True)
    free = {(p.ulysses_size, p.name) for p in plan(cluster, WORK, 16, transfers=("ring",))}
    # Room for ring attention's activations only: StarTrail stays, regathering in the backward.
    tight = plan(cluster, WORK, 16, transfers=("ring",), memory_limit_bytes=ring)
    assert {(p.ulysses_size, p.name.replace("-regather", "")) for p in tight} == free
    assert all(p.activation_bytes <= ring for p in tight)
    assert [p.regather_in_backward for p in tight if p.ulysses_size == 1 and p.team_size == 2] == [True]
    # Regathering costs time: the same configuration without it is faster when memory allows.
    loose = {(p.ulysses_size, p.team_size): p.time_s for p in plan(cluster, WORK, 16, transfers=("ring",))}
    assert all(p.time_s > loose[p.ulysses_size, p.team_size] for p in tight if p.regather_in_backward)
    # Below ring attention's activations nothing fits; auto says which flag to change.
    assert plan(cluster, WORK, 16, memory_limit_bytes=ring - 1) == []
    with pytest.raises(ValueError, match="--startrail-memory-limit-gb"):
        choose_team_size(cp_size=16, ulysses_size=1, gpus_per_node=8, seq_length=8192, num_heads=4, num_kv_heads=4,
                         head_dim=32, micro_batch_size=1, dtype_bytes=4, cluster=cluster, memory_limit_bytes=ring - 1)


def test_mla_head_dims_are_priced_separately():
    cluster = slow_link_cluster(2, 4)
    mla = Workload(seq_length=8192, heads=4, kv_heads=4, head_dim=48, batch=1, dtype_bytes=4, v_head_dim=16)
    same = Workload(seq_length=8192, heads=4, kv_heads=4, head_dim=32, batch=1, dtype_bytes=4)
    # K + V of 48 + 16 per head move as many bytes as 32 + 32; the ring attention P2P is K and V only.
    assert predict(cluster, mla, 8, 1).internode_bytes == pytest.approx(predict(cluster, same, 8, 1).internode_bytes)
