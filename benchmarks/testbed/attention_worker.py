"""One rank of the attention benchmark (started by benchmarks/testbed/cluster_bench.py).

First measures the planner's inputs on this cluster (benchmarks/testbed/calibration.py). Then
runs forward+backward of each configuration (timed iterations interleaved: round ``i``
runs every configuration once) -- ``startrail_attn`` or PyTorch's ring
attention (benchmarks/testbed/torch_cp_peer.py) -- times it, records per rank where the time of
each iteration went (a :class:`~megatron_startrail.timeline.Timeline`: blocked in which
communication, the rest compute), measures the bytes kept for backward (saved tensors,
the inputs q, k, v excluded) and, in one extra untimed iteration, the peak of live
tensor bytes (``benchmarks/counters/memory.py``), and reads two byte counts of what crossed node
boundaries during the timed iterations:
the project's own accounting (P2P bytes to ranks of other nodes) and the kernel's
counters of the node's inter-node interfaces (read by the first rank of each node from
/sys/class/net inside its namespace). Rank 0 writes the results as JSON.

Environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (torch.distributed's env://),
RANKS_PER_NODE, INTER_NODE_LINKS (set by netns_cluster.EmulatedCluster.spawn).
Argument: a JSON file with the workload and configurations.
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import sys
import time

import torch
import torch.distributed as dist

from benchmarks.counters.memory import peak_live_bytes, saved_bytes
from benchmarks.testbed.calibration import measure_cluster
from benchmarks.testbed.netns_cluster import inter_node_links, node_tx_bytes
from benchmarks.testbed.torch_cp_peer import torch_ring_attn
from megatron_startrail import new_startrail_groups, startrail_attn
from megatron_startrail.timeline import Timeline


class ConfigRun:
    """One configuration of the benchmark on this rank: its attention, its timed
    iterations (time, where it went, bytes that crossed nodes) and its summary row."""

    def __init__(self, config: dict, w: dict, q0, k0, v0, dout, timeline: Timeline) -> None:
        self.config, self.w, self.inputs, self.dout, self.timeline = config, w, (q0, k0, v0), dout, timeline
        self.torch_peer = config.get("impl") == "torch"
        self.groups = None if self.torch_peer else new_startrail_groups(
            team_size=config["team_size"], ulysses_size=config.get("ulysses", 1),
            backward_rotation=config.get("rotation", "auto"))
        self.times, self.phases, self.spans, self.tx_bytes, self.kept, self.peak = [], [], [], 0, 0, 0

    def attention(self, q, k, v):
        c, w = self.config, self.w
        if self.torch_peer:
            return torch_ring_attn(q, k, v, dist.group.WORLD, causal=w["causal"], rotate_method=c["rotate_method"])
        return startrail_attn(q, k, v, self.groups, causal=w["causal"], transfer=c.get("transfer", "ring"),
                              regather_in_backward=c.get("regather", False), timeline=self.timeline,
                              window_size=c.get("window"), halo_exchange=c.get("halo", True))

    def step(self) -> int:
        """Forward + backward; returns the bytes kept for backward (inputs excluded)."""
        q, k, v = (t.clone().requires_grad_(True) for t in self.inputs)
        out, kept = saved_bytes(lambda: self.attention(q, k, v), exclude=(q, k, v))
        out.backward(self.dout)
        return kept

    def timed_iteration(self, links: list[str]) -> None:
        """One timed forward+backward, all ranks starting together; ``links``: this node's
        inter-node interfaces when this rank counts the node's bytes (else empty)."""
        # Read the counters before the barrier: once past it, the node's other ranks may
        # already be sending this iteration's bytes.
        tx0 = node_tx_bytes(links)
        dist.barrier()
        self.timeline.clear()
        start = time.perf_counter()
        self.kept = self.step()
        end = time.perf_counter()
        self.phases.append(self.timeline.phase_seconds(start, end))
        self.spans.append([(op, a - start, b - start) for op, a, b in self.timeline.spans]
                          + [("end", end - start, end - start)])
        elapsed = torch.tensor([end - start])
        dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # an iteration ends when the slowest rank does
        self.times.append(elapsed.item())
        self.tx_bytes += node_tx_bytes(links) - tx0  # after the all-reduce: every rank is done

    def summary(self, per_node: int, node: int) -> dict:
        """This rank's figures (the median iteration's phases and spans)."""
        median_iter = sorted(range(len(self.times)), key=lambda i: self.times[i])[len(self.times) // 2]
        mine = {
            "internode_bytes_kernel": self.tx_bytes / len(self.times),
            "saved_for_backward_bytes": self.kept,
            "phase_seconds": self.phases[median_iter],
            "spans": self.spans[median_iter],
            "peak_live_bytes": self.peak,
        }
        if not self.torch_peer:  # the project's own counters (PyTorch's ring has none)
            fwd, bwd = self.groups.last_forward_stats, self.groups.last_backward_stats
            mine.update({
                "p2p_bytes_sent": fwd.p2p_bytes_sent + bwd.p2p_bytes_sent,
                "collective_bytes_sent": fwd.collective_bytes_sent + bwd.collective_bytes_sent,
                "p2p_steps_forward": fwd.p2p_steps,
                "p2p_steps_backward": bwd.p2p_steps,
                "internode_bytes_accounting": sum(
                    nbytes for stats in (fwd, bwd) for peer, nbytes in stats.p2p_bytes_sent_to.items()
                    if peer // per_node != node
                ),
            })
        return mine

    def row(self, gathered: list[dict], calibration: dict) -> dict:
        """The configuration's result row from every rank's :meth:`summary` (rank 0)."""
        row = {
            **self.config,
            "time_ms_median": 1000 * statistics.median(self.times),
            "time_ms": [1000 * t for t in self.times],  # per round, in round order (interleaved)
            "internode_bytes_kernel": sum(g["internode_bytes_kernel"] for g in gathered),
            "saved_for_backward_bytes_max": max(g["saved_for_backward_bytes"] for g in gathered),
            "peak_live_bytes_max": max(g["peak_live_bytes"] for g in gathered),
            "phase_seconds_per_rank": [g["phase_seconds"] for g in gathered],
            "spans_per_rank": [g["spans"] for g in gathered],
            "calibration": calibration,
        }
        if not self.torch_peer:
            row.update({
                "p2p_bytes_sent_max": max(g["p2p_bytes_sent"] for g in gathered),
                "collective_bytes_sent_max": max(g["collective_bytes_sent"] for g in gathered),
                "p2p_steps_forward": max(g["p2p_steps_forward"] for g in gathered),
                "p2p_steps_backward": max(g["p2p_steps_backward"] for g in gathered),
                "internode_bytes_accounting": sum(g["internode_bytes_accounting"] for g in gathered),
                # which path a windowed layer took: the halo exchange or the schedule
                "path": "halo" if "halo" in self.groups.last_forward_stats.bytes_sent_by_op else "schedule",
            })
        return row


def main() -> None:
    spec = json.load(open(sys.argv[1]))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    rank, world = dist.get_rank(), dist.get_world_size()
    per_node = int(os.environ["RANKS_PER_NODE"])
    links = inter_node_links()
    node = rank // per_node
    torch.set_num_threads(1)
    w = spec["workload"]
    dtype = getattr(torch, w["dtype"])
    s_local = w["seq_length"] // world
    gen = torch.Generator().manual_seed(rank)
    q0 = torch.randn(s_local, w["batch"], w["heads"], w["head_dim"], generator=gen).to(dtype)
    k0 = torch.randn(s_local, w["batch"], w["kv_heads"], w["head_dim"], generator=gen).to(dtype)
    v0 = torch.randn(s_local, w["batch"], w["kv_heads"], w["head_dim"], generator=gen).to(dtype)
    dout = torch.randn_like(q0)

    calibration = measure_cluster(per_node, spec["rate_mbit"], q0, k0, v0, dout, w["causal"],
                                  spec.get("calibration_s", 1.0))

    timeline = Timeline()
    runs = [ConfigRun(config, w, q0, k0, v0, dout, timeline) for config in spec["configs"]]
    for run in runs:  # warm-up and the (untimed, profiled) peak of live tensors, per configuration
        for _ in range(spec["warmup"]):
            run.step()
        run.peak = peak_live_bytes(run.step, q0.device)[1]
    # Timed iterations, interleaved: round i runs every configuration once, so a load spike
    # of the shared machine or a drift of the link hits all configurations alike and the
    # per-round comparison between two configurations stays fair.
    for _ in range(spec["iters"]):
        for run in runs:
            run.timed_iteration(links if rank % per_node == 0 else [])

    results = []
    for run in runs:
        mine = run.summary(per_node, node)
        gathered = [None] * world
        dist.all_gather_object(gathered, mine)
        if rank == 0:
            results.append(run.row(gathered, calibration))
    if rank == 0:
        with open(spec["output"], "w") as f:
            json.dump(results, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
