"""What PyTorch's ring rotation costs beyond its message, on the emulated cluster (one command).

    python benchmarks/rotation_probe.py --nodes 2 --ranks-per-node 4 --rate-mbit 50 100 \
        --out benchmarks/results/rotation_probe

Why: PyTorch's ring attention (benchmarks/torch_cp_peer.py) passes K, V (rotate method
``alltoall``) and always dK, dV to the next rank with ``permute_tensor``: an all-to-all
over all ranks in which only the neighbour's split is non-empty. gloo's all-to-all
(``alltoallv``) still posts a send and a receive to every rank, so each call also puts
an empty message on the wire for every other rank, and the ones to other nodes cross
the shaped link. The project's ring sends one P2P message. On 2 x 4 at 100 Mbit/s the
kernel counted 2.9 % more inter-node bytes for PyTorch's all-to-all ring than for the
project's ring with the same payload (results/peers_2x4_pipelined.md); this probe
measures where that comes from, per call, so that the peer's model
(benchmarks/peer_models.py) can price it from a measured figure.

Each rank passes a tensor around the ring of all ranks, round after round, each round
waiting for the previous one (``p2p``: ``batch_isend_irecv`` to the next rank, as the
project's ring sends; ``permute``: PyTorch's ``permute_tensor``), with a 4-byte tensor
and with one rank's K, V (256 KiB). Per round: time (slowest rank, median of 5) and the
bytes the node's inter-node interfaces sent (kernel counters). The bytes ``permute``
adds over ``p2p``, divided by the empty messages that cross nodes per round, are the
wire bytes of one empty message (gloo's framing, TCP/IP headers, ACKs).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

KINDS = ("p2p", "permute")


def worker() -> None:
    import torch  # noqa: PLC0415 - only the ranks need torch
    import torch.distributed as dist  # noqa: PLC0415
    import torch.distributed._functional_collectives as funcol  # noqa: PLC0415

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    per_node = int(os.environ["RANKS_PER_NODE"])
    links = [dev for dev in os.environ["INTER_NODE_LINKS"].split(",") if dev]
    next_rank = [(r + 1) % world for r in range(world)]

    def node_tx() -> int:
        return sum(int(open(f"/sys/class/net/{dev}/statistics/tx_bytes").read()) for dev in links)

    def p2p(buf):
        got = torch.empty_like(buf)
        ops = [dist.P2POp(dist.isend, buf, (rank + 1) % world), dist.P2POp(dist.irecv, got, (rank - 1) % world)]
        for work in dist.batch_isend_irecv(ops):
            work.wait()
        return got

    def permute(buf):
        return funcol.permute_tensor(buf, next_rank, dist.group.WORLD).wait()

    rows = []
    for nbytes, rounds in ((4, 50), (int(os.environ["MESSAGE"]), int(os.environ["ROUNDS"]))):
        for kind, rotate in zip(KINDS, (p2p, permute)):
            times, sent = [], []
            for _ in range(5):
                buf = torch.rand(nbytes // 4)
                dist.barrier()
                tx0, start = node_tx(), time.perf_counter()
                for _ in range(rounds):
                    buf = rotate(buf)
                elapsed = torch.tensor([time.perf_counter() - start])
                dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
                # One rank per node reads the node's counters; the sum over nodes / nodes.
                tx = torch.tensor([float(node_tx() - tx0) if rank % per_node == 0 else 0.0])
                dist.all_reduce(tx)
                times.append(elapsed.item())
                sent.append(tx.item() / (world // per_node))
            rows.append({"kind": kind, "message_bytes": nbytes, "rounds": rounds,
                         "ms_per_round": 1000 * statistics.median(times) / rounds,
                         "internode_bytes_per_node_per_round": statistics.median(sent) / rounds})
    if rank == 0:
        json.dump(rows, open(os.environ["OUTPUT"], "w"))
    dist.destroy_process_group()


def per_message(rows: list[dict], message_bytes: int, crossing: int) -> dict:
    """``permute`` minus ``p2p`` at one message size: bytes per empty message, ms per round."""
    got = {r["kind"]: r for r in rows if r["message_bytes"] == message_bytes}
    extra = got["permute"]["internode_bytes_per_node_per_round"] - got["p2p"]["internode_bytes_per_node_per_round"]
    return {"wire_bytes_per_empty_message": extra / crossing,
            "extra_ms_per_round": got["permute"]["ms_per_round"] - got["p2p"]["ms_per_round"]}


def main() -> None:
    from benchmarks.netns_cluster import EmulatedCluster  # noqa: PLC0415
    from benchmarks.peer_models import empty_messages_crossing  # noqa: PLC0415
    from megatron_startrail.cluster import ClusterSpec  # noqa: PLC0415

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--ranks-per-node", type=int, default=4)
    p.add_argument("--rate-mbit", type=float, nargs="+", default=[50.0, 100.0])
    p.add_argument("--message-bytes", type=int, default=256 * 1024)
    p.add_argument("--port", type=int, default=29573)
    p.add_argument("--out", required=True, help="writes OUT.json and OUT.md")
    args = p.parse_args()
    crossing = empty_messages_crossing(ClusterSpec(args.nodes, args.ranks_per_node), args.nodes * args.ranks_per_node)
    runs = []
    for rate in args.rate_mbit:
        output = f"{args.out}.{rate:g}.tmp.json"
        # ~0.4 s of payload per repeat at the nominal rate (all crossing ranks share the link).
        rounds = max(5, round(rate * 1e6 / 8 * 0.4 / args.message_bytes))
        with EmulatedCluster(args.nodes, rate) as cluster:
            cluster.run_ranks(args.ranks_per_node, [sys.executable, os.path.abspath(__file__), "--worker"],
                              {"MESSAGE": str(args.message_bytes), "ROUNDS": str(rounds), "OUTPUT": output}, args.port)
        rows = json.load(open(output))
        os.remove(output)
        runs.append({"rate_mbit": rate, "rows": rows,
                     **{f"{size}": per_message(rows, size, crossing) for size in (4, args.message_bytes)}})
    lines = [f"{args.nodes} nodes x {args.ranks_per_node} ranks: one `permute_tensor` call sends "
             f"{crossing} empty messages from each node to other nodes", "",
             "| link Mbit/s | message | p2p ms/round | permute ms/round | p2p inter-node bytes/node/round "
             "| permute inter-node bytes/node/round | wire bytes per empty message |", "|---|---|---|---|---|---|---|"]
    for run in runs:
        for size in (4, args.message_bytes):
            got = {r["kind"]: r for r in run["rows"] if r["message_bytes"] == size}
            lines.append(f"| {run['rate_mbit']:g} | {size} B | {got['p2p']['ms_per_round']:.2f} "
                         f"| {got['permute']['ms_per_round']:.2f} "
                         f"| {got['p2p']['internode_bytes_per_node_per_round']:.0f} "
                         f"| {got['permute']['internode_bytes_per_node_per_round']:.0f} "
                         f"| {run[str(size)]['wire_bytes_per_empty_message']:.0f} |")
    json.dump({"argv": sys.argv, "empty_messages_crossing_per_node": crossing, "runs": runs},
              open(args.out + ".json", "w"), indent=1)
    open(args.out + ".md", "w").write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    worker() if sys.argv[1:] == ["--worker"] else main()
