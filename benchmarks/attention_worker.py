"""One rank of the attention benchmark (started by benchmarks/cluster_bench.py).

Runs forward+backward of ``startrail_attn`` for each configuration, times it, measures
the bytes kept for backward (saved tensors, the inputs q, k, v excluded) and, in one
extra untimed iteration, the peak of live tensor bytes (``benchmarks/memory.py``), and
reads two byte counts of what crossed node boundaries during the timed iterations:
the project's own accounting (P2P bytes to ranks of other nodes) and the kernel's
counters of the node's inter-node interfaces (read by the first rank of each node from
/sys/class/net inside its namespace). Rank 0 writes the results as JSON.

Environment: RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT (torch.distributed's env://),
RANKS_PER_NODE. Argument: a JSON file with the workload and configurations.
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

from benchmarks.memory import peak_live_bytes, saved_bytes
from megatron_startrail import new_startrail_groups, startrail_attn


def node_tx_bytes() -> int:
    """Bytes sent so far on this namespace's inter-node interfaces."""
    total = 0
    for dev in os.listdir("/sys/class/net"):
        if dev == "lo" or dev.startswith("stbh"):  # loopback, and the full mesh's host-only pair
            continue
        with open(f"/sys/class/net/{dev}/statistics/tx_bytes") as f:
            total += int(f.read())
    return total


def main() -> None:
    spec = json.load(open(sys.argv[1]))
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    rank, world = dist.get_rank(), dist.get_world_size()
    per_node = int(os.environ["RANKS_PER_NODE"])
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

    # Latency of one sequential P2P step here (tiny ring exchange, all ranks at once):
    # on a shared CPU it is process scheduling as much as the network.
    nxt, prv = (rank + 1) % world, (rank - 1) % world
    tiny, got, rounds = torch.zeros(1), torch.zeros(1), []
    for _ in range(30):
        start = time.perf_counter()
        for w_ in dist.batch_isend_irecv([dist.P2POp(dist.isend, tiny, nxt), dist.P2POp(dist.irecv, got, prv)]):
            w_.wait()
        rounds.append(time.perf_counter() - start)
    step_latency = torch.tensor([statistics.median(rounds[5:])])
    dist.all_reduce(step_latency, op=dist.ReduceOp.MAX)

    results = []
    for config in spec["configs"]:
        groups = new_startrail_groups(team_size=config["team_size"], ulysses_size=config.get("ulysses", 1))

        def step():
            q, k, v = (t.clone().requires_grad_(True) for t in (q0, k0, v0))
            out, kept = saved_bytes(
                lambda: startrail_attn(q, k, v, groups, causal=w["causal"], transfer=config.get("transfer", "ring"),
                                       regather_in_backward=config.get("regather", False)),
                exclude=(q, k, v),
            )
            out.backward(dout)
            return kept

        for _ in range(spec["warmup"]):
            step()
        _, peak = peak_live_bytes(step, q0.device)  # untimed: the profiler slows it down
        dist.barrier()
        tx0 = node_tx_bytes() if rank % per_node == 0 else 0
        times, kept = [], 0
        for _ in range(spec["iters"]):
            dist.barrier()
            start = time.perf_counter()
            kept = step()
            elapsed = torch.tensor([time.perf_counter() - start])
            dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)  # an iteration ends when the slowest rank does
            times.append(elapsed.item())
        dist.barrier()
        tx1 = node_tx_bytes() if rank % per_node == 0 else 0
        fwd, bwd = groups.last_forward_stats, groups.last_backward_stats
        cross = sum(
            nbytes
            for stats in (fwd, bwd)
            for peer, nbytes in stats.p2p_bytes_sent_to.items()
            if peer // per_node != node
        )
        mine = {
            "p2p_bytes_sent": fwd.p2p_bytes_sent + bwd.p2p_bytes_sent,
            "collective_bytes_sent": fwd.collective_bytes_sent + bwd.collective_bytes_sent,
            "p2p_steps_forward": fwd.p2p_steps,
            "p2p_steps_backward": bwd.p2p_steps,
            "internode_bytes_accounting": cross,
            "internode_bytes_kernel": (tx1 - tx0) / spec["iters"],
            "saved_for_backward_bytes": kept,
            "peak_live_bytes": peak,
        }
        gathered = [None] * world
        dist.all_gather_object(gathered, mine)
        if rank == 0:
            results.append({
                **config,
                "time_ms_median": 1000 * statistics.median(times),
                "time_ms": [1000 * t for t in times],
                "p2p_bytes_sent_max": max(g["p2p_bytes_sent"] for g in gathered),
                "collective_bytes_sent_max": max(g["collective_bytes_sent"] for g in gathered),
                "p2p_steps_forward": max(g["p2p_steps_forward"] for g in gathered),
                "p2p_steps_backward": max(g["p2p_steps_backward"] for g in gathered),
                "internode_bytes_accounting": sum(g["internode_bytes_accounting"] for g in gathered),
                "internode_bytes_kernel": sum(g["internode_bytes_kernel"] for g in gathered),
                "saved_for_backward_bytes_max": max(g["saved_for_backward_bytes"] for g in gathered),
                "peak_live_bytes_max": max(g["peak_live_bytes"] for g in gathered),
                "step_latency_ms": 1000 * step_latency.item(),
            })
    if rank == 0:
        with open(spec["output"], "w") as f:
            json.dump(results, f, indent=1)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
