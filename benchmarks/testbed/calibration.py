"""The planner's inputs, measured on the emulated cluster by the benchmark ranks themselves.

Run by every rank (benchmarks/testbed/attention_worker.py) before the configurations, all ranks
at once, each figure the median of 5 repeats (the machine is shared: one repeat can be hit
by someone else's load), so each number is what a rank gets while every other rank is busy too -- the
state the attention runs in. Nothing here looks at the attention's timings: the planner
is calibrated per cluster, then compared with the attention rows it never saw.
benchmarks/testbed/testbed_model.py builds the planner's cluster (the test bed's preset) from
these figures.

* ``step_latency_s``: a tiny ring exchange over all ranks (process scheduling as much
  as the network on a shared CPU), per exchange of 20 run back to back.
* ``collective_latency_s``: a tiny all-to-all among the ranks of a node (a collective
  call's cost beyond its bytes), per call of 20 run back to back.

  Both are timed as chains because the schedule issues its steps and collectives one
  after another: a single call right after a barrier also pays how unevenly the ranks
  leave the barrier (measured on 2x4: 5.4 ms for one all-to-all, 1.9 ms per call in a
  chain), which the attention does not pay per call.
* ``inter_node_gbs``: every rank sends to a rank of the next node and receives from one of
  the previous node (all of a node's ranks share its shaped uplink), each connection
  carrying one direction only: bytes per node / time. What TCP over the shaped link
  really delivers (close to nominal since the link is shaped as a full-duplex NIC,
  benchmarks/testbed/netns_cluster.py).
* ``inter_node_duplex_gbs``: the same with every rank exchanging both ways with the
  same-index rank of its partner node (nodes paired 0-1, 2-3, ...), each direction on its
  own connection, as the project's transport sends on gloo (a second process group for
  transfers to a lower rank: a single message each way on one connection serialises,
  the burst probe, benchmarks/results/burst_probe.md). Before that, one connection
  carried both directions, and that moved 1-15% less (the link probe,
  benchmarks/results/link_probe.md: on 2x4 at 25 / 50 Mbit/s, one message per rank per
  round, one flow each way got 2.8 / 5.9 MB/s on one connection against 3.1 / 6.3 on
  two, four flows 3.0 / 6.0 against 3.1 / 6.2; under the earlier
  single-tbf shaping, whose queue held the reverse direction's ACKs behind data, the
  gap was 1.8 / 3.6 against 2.5 / 5.4). Ulysses x ring over 2 nodes (a ring of two)
  sends that way; ring attention's and StarTrail-2's transfers on 2 nodes do not.
* ``intra_node_gbs``: every rank exchanges with its neighbour inside the node over
  loopback: bytes per rank / time (loopback costs CPU, which the ranks share).
* ``attention_tflops``: every rank runs the block kernel's forward+backward on its own
  ``[s_local x s_local]`` block at once: FLOPs per rank / time.
* ``overlap``: compute and an inter-node exchange of about the same length, started
  together: the fraction of the shorter one hidden, ``(t_c + t_x - t_both) / min(t_c, t_x)``.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from megatron_startrail.comm import CommStats, Communicator
from megatron_startrail.transport import transport_for
from megatron_startrail.kernels import TorchCPUFlashKernel
from megatron_startrail.layout import KernelCall


def timed_max(fn, repeats: int, idle_s: float = 0.0) -> float:
    """Median over ``repeats`` of the slowest rank's time for ``fn`` (all ranks start
    together; with ``idle_s``, after that long with nothing sent)."""
    times = []
    for _ in range(repeats):
        dist.barrier()
        if idle_s:
            time.sleep(idle_s)
            dist.barrier()
        start = time.perf_counter()
        fn()
        t = torch.tensor([time.perf_counter() - start])
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        times.append(t.item())
    return statistics.median(times)


CHAIN = 20  # latencies are timed over this many calls back to back


def _chain(call):
    def run():
        for _ in range(CHAIN):
            call()

    return run


def inter_node_peers(rank: int, per_node: int, nodes: int) -> dict[str, tuple[int, int]]:
    """Traffic patterns between nodes: pattern -> (rank this one sends to, rank it receives
    from), with rank (n, i) = rank i of node n.

    ``"inter"``: (n, i) sends to (n + 1, i + n), so receives from (n - 1, i - (n - 1)); even
    with 2 nodes the two directions use different rank pairs (one TCP connection each).
    ``"duplex"``: (n, i) exchanges both ways with (n xor 1, i), one pair; absent on the
    last node of an odd count, which has no partner."""
    node, index = divmod(rank, per_node)
    prev = (node - 1) % nodes
    peers = {"inter": (((node + 1) % nodes) * per_node + (index + node) % per_node,
                       prev * per_node + (index - prev) % per_node)}
    if node ^ 1 < nodes:
        peers["duplex"] = ((node ^ 1) * per_node + index,) * 2
    return peers


def _exchange(send_to: int, recv_from: int, nbytes: int, reverse_group=None):
    """Post one send and one receive of ``nbytes`` through the project's transport
    (comm.Communicator over all ranks): with ``reverse_group``, a transfer to a lower rank
    goes through it, as the attention's transfers do."""
    buf, got = torch.empty(nbytes // 4), torch.empty(nbytes // 4)
    buf.uniform_()
    transport = transport_for({"startrail": dist.group.WORLD, "startrail_twin": reverse_group},
                              tuple(range(dist.get_world_size())))
    comm = Communicator(CommStats(), transport)

    def post():
        return [comm.post([(buf, send_to)], [(got, recv_from)], op="calibration")]  # waited on as a list

    return post


def measure_cluster(per_node: int, nominal_mbit: float, q, k, v, dout, causal: bool,
                    traffic_s: float = 1.0) -> dict:
    """The planner's per-cluster inputs (see the module docstring); same dict on every rank.

    Transfers are sent as the schedule sends them: messages of one rank's K, V
    (``[2, s_local, b, hkv, d]``), one after another, ``traffic_s`` of traffic per repeat
    at the nominal rate (the overlap probe: 0.3 of that). Tests that only count bytes pass
    a short one."""
    rank, world = dist.get_rank(), dist.get_world_size()
    nodes = world // per_node
    out = {}

    tiny = _exchange((rank + 1) % world, (rank - 1) % world, 4)
    out["step_latency_s"] = timed_max(_chain(lambda: [w.wait() for w in tiny()]), 7) / CHAIN

    if per_node > 1:
        # One tiny all-to-all among the ranks of each node: what a collective call costs
        # beyond its bytes (Ulysses' all-to-alls and the team's collectives are such calls;
        # gloo's cost more than one P2P step).
        node_groups = [dist.new_group(list(range(n * per_node, (n + 1) * per_node))) for n in range(nodes)]
        mine = node_groups[rank // per_node]
        small_in, small_out = torch.rand(per_node), torch.empty(per_node)
        out["collective_latency_s"] = timed_max(
            _chain(lambda: dist.all_to_all_single(small_out, small_in, group=mine)), 7) / CHAIN

    message = 2 * k.numel() * k.element_size()
    node_base = rank - rank % per_node
    peers = {**inter_node_peers(rank, per_node, nodes),
             "intra": (node_base + (rank + 1) % per_node, node_base + (rank - 1) % per_node)}

    # The project's transport sends to a lower rank through a second group on gloo, so the
    # two directions of a rank pair use two connections (groups.StarTrailGroups).
    reverse_group = dist.new_group(list(range(world))) if dist.get_backend() == "gloo" else None

    def stream(kind: str, messages: int):
        # A rank without a peer for ``kind`` (no duplex partner) posts nothing.
        post = _exchange(*peers[kind], message, reverse_group) if kind in peers else (lambda: [])

        def run():
            pending = []
            for _ in range(messages):
                pending += post()
            return pending

        return run

    # About a second of traffic per repeat: short transfers (0.4 s) measured the same
    # link between 82% and 104% of its nominal rate from one run to the next.
    inter_messages = max(1, round(nominal_mbit * 1e6 / 8 * traffic_s / per_node / message))
    if nodes > 1:
        t_x = timed_max(lambda: [w.wait() for w in stream("inter", inter_messages)()], 5)
        out["inter_node_gbs"] = per_node * inter_messages * message / t_x / 1e9
        t_d = timed_max(lambda: [w.wait() for w in stream("duplex", inter_messages)()], 5)
        out["inter_node_duplex_gbs"] = per_node * inter_messages * message / t_d / 1e9
    if per_node > 1:
        intra_messages = 8
        t_l = timed_max(lambda: [w.wait() for w in stream("intra", intra_messages)()], 5)
        out["intra_node_gbs"] = intra_messages * message / t_l / 1e9

    # Block kernel on this rank's own rows, as the sub-ring steps run it: one call, one sequence.
    kernel, scale = TorchCPUFlashKernel(), q.shape[-1] ** -0.5
    call = KernelCall(((0, q.shape[0]),), (((0, k.shape[0]),),))

    def compute():
        o, lse = kernel.forward(q, k, v, call, scale=scale)
        kernel.backward(dout, q, k, v, o, lse, call, scale=scale)

    t_c = timed_max(compute, 5)
    s, b, h, d = q.shape
    out["attention_tflops"] = 4 * b * h * s * s * d * 3.5 / t_c / 1e12  # forward + 2.5x backward
    if nodes > 1:
        # Compute and traffic of about the same length, alone and together.
        reps = max(1, round(0.3 * traffic_s / t_c))
        messages = max(1, round(reps * t_c * out["inter_node_gbs"] * 1e9 / per_node / message))
        send = stream("inter", messages)

        def computes():
            for _ in range(reps):
                compute()

        def both():
            pending = send()
            computes()
            for w in pending:
                w.wait()

        t_cs = timed_max(computes, 5)
        t_xs = timed_max(lambda: [w.wait() for w in send()], 5)
        t_both = timed_max(both, 5)
        out["overlap"] = min(1.0, max(0.0, (t_cs + t_xs - t_both) / min(t_cs, t_xs)))
        out["overlap_times_s"] = {"compute": t_cs, "transfer": t_xs, "both": t_both}
    return out
