"""How fast the emulated inter-node link moves one message per rank per round, one way per
rank pair or both ways on one pair, with 1 or all ranks of a node sending (one command).

    python benchmarks/link_probe.py --nodes 2 --ranks-per-node 4 --rate-mbit 25 50 \
        --out benchmarks/results/link_probe

Why: gloo carries both directions of a rank pair on one TCP connection. Ulysses x ring
over two nodes (a ring of two) sends that way; ring attention and StarTrail-2 on two
nodes send one way per pair. This probe measured the difference that made the
calibration (benchmarks/calibration.py) keep two inter-node rates, and then showed that
most of it came from the link's shaping: with one tbf queue per node the reverse
direction's ACKs waited behind data (1.8 MB/s both ways against 2.5 one way at 25
Mbit/s); with ACKs served first (benchmarks/netns_cluster.py) 2.8 against 3.1.

Patterns (the calibration's, ``calibration.inter_node_peers``), for the first ``flows``
ranks of every node; rank (n, i) = rank i of node n:

    one way    (n, i) sends to (n + 1, i + n): the two directions between two nodes use
               different rank pairs
    both ways  (n, i) exchanges with (n xor 1, i): one rank pair, both directions

Each round posts one message (256 KiB by default: one rank's K, V in the 2x4, 2048-token
benchmark) per sending rank and waits for it; rounds run back to back for ~0.6 s at the
nominal rate; the figure is bytes per node / time of the slowest rank, median of 5.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))


def worker() -> None:
    import torch  # noqa: PLC0415 - only the ranks need torch
    import torch.distributed as dist  # noqa: PLC0415

    from benchmarks.calibration import inter_node_peers, timed_max  # noqa: PLC0415

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    per_node, message, rate = int(os.environ["RANKS_PER_NODE"]), int(os.environ["MESSAGE"]), float(os.environ["RATE"])
    index = rank % per_node
    buf, got = torch.rand(message // 4), torch.empty(message // 4)
    calibration_peers = inter_node_peers(rank, per_node, world // per_node)  # --nodes is even: all have duplex
    peers = {"one way": calibration_peers["inter"], "both ways": calibration_peers["duplex"]}

    def one_round(pattern: str, flows: int) -> None:
        to, frm = peers[pattern]
        ops = [dist.P2POp(dist.isend, buf, to)] if index < flows else []
        ops += [dist.P2POp(dist.irecv, got, frm)] if frm % per_node < flows else []  # my sender sends
        for work in dist.batch_isend_irecv(ops) if ops else []:
            work.wait()

    out = []
    for pattern in peers:
        for flows in sorted({1, per_node}):
            rounds = max(1, round(rate * 1e6 / 8 * 0.6 / (flows * message)))
            elapsed = timed_max(lambda: [one_round(pattern, flows) for _ in range(rounds)], 5)  # noqa: B023
            out.append({"pattern": pattern, "flows": flows, "rounds": rounds,
                        "mb_per_s": flows * message * rounds / elapsed / 1e6})
    if rank == 0:
        json.dump(out, open(os.environ["OUTPUT"], "w"))
    dist.destroy_process_group()


def main() -> None:
    from benchmarks.netns_cluster import EmulatedCluster  # noqa: PLC0415

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--ranks-per-node", type=int, default=4)
    p.add_argument("--rate-mbit", type=float, nargs="+", default=[25.0, 50.0])
    p.add_argument("--message-bytes", type=int, default=256 * 1024)
    p.add_argument("--port", type=int, default=29571)
    p.add_argument("--out", required=True, help="writes OUT.json and OUT.md")
    args = p.parse_args()
    if args.nodes < 2 or args.nodes % 2:
        p.error("--nodes must be even: 'both ways' pairs node 0 with 1, 2 with 3, ...")
    rows = []
    for rate in args.rate_mbit:
        output = f"{args.out}.{rate:g}.tmp.json"
        with EmulatedCluster(args.nodes, rate) as cluster:
            cluster.run_ranks(args.ranks_per_node, [sys.executable, os.path.abspath(__file__), "--worker"],
                              {"MESSAGE": str(args.message_bytes), "RATE": str(rate), "OUTPUT": output}, args.port)
        rows += [{"rate_mbit": rate, **row} for row in json.load(open(output))]
        os.remove(output)
    lines = [f"{args.nodes} nodes x {args.ranks_per_node} ranks, {args.message_bytes // 1024} KiB per message",
             "", "| link Mbit/s | nominal MB/s | flows per node | one way per pair MB/s | both ways on one pair MB/s |",
             "|---|---|---|---|---|"]
    for rate in args.rate_mbit:
        for flows in sorted({r["flows"] for r in rows}):
            got = {r["pattern"]: r["mb_per_s"] for r in rows if r["rate_mbit"] == rate and r["flows"] == flows}
            lines.append(f"| {rate:g} | {rate / 8:.2f} | {flows} | {got['one way']:.2f} | {got['both ways']:.2f} |")
    json.dump({"argv": sys.argv, "rows": rows}, open(args.out + ".json", "w"), indent=1)
    open(args.out + ".md", "w").write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    worker() if sys.argv[1:] == ["--worker"] else main()
