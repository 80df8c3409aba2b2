"""The planner's cost model applied to PyTorch's ring attention (benchmarks/testbed/torch_cp_peer.py),
so that its row in the validation table has a prediction too.

PyTorch's schedule (``_templated_ring_attention`` and its backward, load-balanced so every
step attends half of the two chunks' blocks):

* ``allgather`` (its default): one all-gather of K, V over all ``P`` ranks, posted before
  step 0 and waited on at step 1, so it flies during step 0's compute only; the backward
  all-gathers K, V again the same way, and passes the float32 dK, dV accumulator one
  hop per step (posted after step ``i``, waited on after step ``i+1``'s compute, the
  last one after the loop).
* ``alltoall``: K, V move one hop per step like the project's ring (C = 1), posted
  before the step computes, plus the same dK, dV accumulator in the backward.

Two facts of gloo priced here (the project's own model has no use for them):

* gloo's all-gather is a ring that keeps two half-blocks in flight (``gloo/allgather.cc``
  waits for the next-to-last transfer, not the last), so it streams: its bytes at the
  link's rate and one call latency, not a latency per hop.
* Every hop of the ring (``permute_tensor``) is an all-to-all over all ranks with one
  non-empty split; gloo's all-to-all still sends every other rank a message, empty here,
  and the ones to other nodes cross the link: ``EMPTY_MESSAGE_WIRE_BYTES`` each.
"""

from __future__ import annotations

from benchmarks.testbed.testbed_model import ring_streams
from megatron_startrail.planning.cluster import ClusterSpec
from megatron_startrail.planning.planner import BACKWARD_FLOPS_RATIO, Workload, overlapped_steps

# Inter-node bytes on the wire of one empty gloo message (framing, TCP/IP headers, ACKs),
# measured by the rotation probe (536, 540 and 537 bytes on 2 x 4 at 50, 100 and 200 Mbit/s,
# benchmarks/results/rotation_probe.md; 536 on 3 x 4, benchmarks/results/rotation_probe_3x4.md;
# a 4-byte tensor rotated by permute_tensor against the same rotation by P2P, kernel counters).
# The probe was retired once this was written down: `git show 3b4c963:benchmarks/rotation_probe.py`.
EMPTY_MESSAGE_WIRE_BYTES = 537


def empty_messages_crossing(cluster: ClusterSpec, p: int) -> int:
    """Empty messages one ``permute_tensor`` call over ``p`` ranks sends from the busiest
    node to other nodes: each rank sends one to every rank other than itself and its next
    rank (which gets the payload)."""
    crossing: dict[int, int] = {}
    for r in range(p):
        for q in range(p):
            if q not in (r, (r + 1) % p) and cluster.node_of(q) != cluster.node_of(r):
                crossing[cluster.node_of(r)] = crossing.get(cluster.node_of(r), 0) + 1
    return max(crossing.values(), default=0)


def permute_overhead_s(cluster: ClusterSpec, p: int) -> float:
    """Link time of those empty messages at the inter-node rate. They are posted with the
    payload and share its link (the time they add is their bytes: 0.3-1.3 ms a call on
    2 x 4, about what PyTorch's all-to-all ring measured slower than the project's ring)."""
    return empty_messages_crossing(cluster, p) * EMPTY_MESSAGE_WIRE_BYTES / (cluster.inter_node_gbs * 1e9)


def predict_torch_ring(cluster: ClusterSpec, work: Workload, cp_size: int, rotate_method: str) -> float:
    """Predicted forward+backward seconds of PyTorch's ring attention on ``cp_size`` ranks."""
    p = cp_size
    s_local = work.seq_length // p
    kv_bytes = 2 * s_local * work.batch * work.kv_heads * work.head_dim * work.dtype_bytes
    dkv_bytes = 2 * s_local * work.batch * work.kv_heads * work.head_dim * 4  # float32 accumulators
    flops = 4 * work.batch * work.heads * work.seq_length**2 * work.head_dim / p / (2 if work.causal else 1)
    rate = cluster.attention_tflops * 1e12
    step_fwd, step_bwd = flops / rate / p, BACKWARD_FLOPS_RATIO * flops / rate / p

    # PyTorch rotates with an all-to-all over all ranks (permute_tensor), a collective,
    # not a buffered send to one neighbour; still, measured on the emulated cluster it
    # moves at the link's rate like the project's ring (benchmarks/testbed/README.md, planner
    # validation), so it is priced as a streaming ring (testbed_model.ring_streams): the
    # inter-node latency once per phase, with its first transfer. Each call adds its
    # empty messages' bytes.
    streaming = ring_streams(cluster, [list(range(p))])
    phase_latency = cluster.inter_latency_s if streaming else 0.0
    call_overhead = permute_overhead_s(cluster, p)

    def hop(nbytes: float, inter_latency: bool = not streaming) -> float:
        ring = [(r, (r + 1) % p, nbytes) for r in range(p)]
        return cluster.exchange_time(ring, inter_latency)[0] + call_overhead

    kv_hop, dkv_hop = hop(kv_bytes), hop(dkv_bytes)
    if rotate_method == "allgather":
        # gloo's pipelined ring: all the blocks at the link's rate, one call latency.
        ring = [(r, (r + 1) % p, (p - 1) * kv_bytes) for r in range(p)]
        crosses = any(cluster.node_of(r) != cluster.node_of((r + 1) % p) for r in range(p))
        hop_latency = cluster.inter_latency_s if crosses else cluster.intra_latency_s
        gather = cluster.exchange_time(ring, latency=False)[0] + cluster.call_latency(hop_latency, True)
        fwd_flying = [gather] + [0.0] * (p - 1)
        bwd_flying = [gather] + [dkv_hop + phase_latency] + [dkv_hop] * (p - 2)  # dK, dV ring
    elif rotate_method == "alltoall":
        fwd_flying = [kv_hop + phase_latency] + [kv_hop] * (p - 2) + [0.0]
        bwd_flying = [kv_hop + phase_latency] + [kv_hop + dkv_hop] * (p - 2) + [dkv_hop]
    else:
        raise ValueError(f"rotate_method={rotate_method!r}: 'allgather' or 'alltoall'")
    # The last dK, dV hop is waited on after the loop, alone: exposed, with its latency.
    return (overlapped_steps(cluster.overlap, [step_fwd] * p, fwd_flying)
            + overlapped_steps(cluster.overlap, [step_bwd] * p, bwd_flying)
            + hop(dkv_bytes, inter_latency=True))
