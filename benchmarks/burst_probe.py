"""How fast one message each way per rank pair crosses the emulated link, right after
another round or after the link sat idle (one command).

    python benchmarks/burst_probe.py --nodes 2 --ranks-per-node 4 --rate-mbit 50 \
        --out benchmarks/results/burst_probe

Why: the calibration (benchmarks/calibration.py) measures the both-ways rate with a
stream of messages posted back to back (~1 s of traffic), and the planner prices every
round in which rank pairs send both ways at that rate. A pair exchange of the schedule
(Ulysses x ring's ring of two, StarTrail's pair sends) is one message per rank each way,
often after the link sat idle during compute or an all-to-all. Ulysses 4 x ring on 2
nodes is under-predicted by 8-17%, Ulysses 2 x StarTrail-2 by up to 14%: this probe
measures whether such rounds move slower than the stream.

Rank (n, i) exchanges one message with (n xor 1, i), for the first ``flows`` ranks of every
node, after a barrier and ``idle`` seconds; the figure is bytes per node / time of the
slowest rank (median of 5), MB/s, with no latency taken off. The last row sends the two
directions of one pair through two process groups, i.e. on two gloo connections: a
lone pair's single message each way on one connection took twice the one-way time (the
two directions serialised), on two connections the one-way time.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

IDLE_S = (0.0, 0.15)
SIZES = (256 * 1024, 1024 * 1024)


def worker() -> None:
    import torch  # noqa: PLC0415 - only the ranks need torch
    import torch.distributed as dist  # noqa: PLC0415

    from benchmarks.calibration import timed_max  # noqa: PLC0415

    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank = dist.get_rank()
    per_node = int(os.environ["RANKS_PER_NODE"])
    node, index = divmod(rank, per_node)
    partner = (node ^ 1) * per_node + index
    # A second group over the same ranks: its own gloo connection per rank pair.
    twin = dist.new_group(list(range(dist.get_world_size())))
    rows = []
    for nbytes in SIZES:  # one pair, each direction on its own connection
        buf, got = torch.rand(nbytes // 4), torch.empty(nbytes // 4)
        up = node < node ^ 1  # the lower node sends on the twin group, receives on the default

        def both_connections():
            if index == 0:
                for work in (dist.isend(buf, partner, group=twin if up else None),  # noqa: B023
                             dist.irecv(got, partner, group=None if up else twin)):  # noqa: B023
                    work.wait()

        rows.append({"idle_s": 0.0, "flows": 1, "message_bytes": nbytes, "two_connections": True,
                     "mb_per_s": nbytes / timed_max(both_connections, 5) / 1e6})
    for idle in IDLE_S:
        for flows in sorted({1, 2, per_node}):
            for nbytes in SIZES:
                buf, got = torch.rand(nbytes // 4), torch.empty(nbytes // 4)

                def one_connection():
                    if index < flows:  # noqa: B023
                        ops = [dist.P2POp(dist.isend, buf, partner), dist.P2POp(dist.irecv, got, partner)]  # noqa: B023
                        for work in dist.batch_isend_irecv(ops):
                            work.wait()

                elapsed = timed_max(one_connection, 5, idle_s=idle)
                rows.append({"idle_s": idle, "flows": flows, "message_bytes": nbytes, "two_connections": False,
                             "mb_per_s": flows * nbytes / elapsed / 1e6})
    if rank == 0:
        json.dump(rows, open(os.environ["OUTPUT"], "w"))
    dist.destroy_process_group()


def main() -> None:
    from benchmarks.netns_cluster import EmulatedCluster  # noqa: PLC0415

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--ranks-per-node", type=int, default=4)
    p.add_argument("--rate-mbit", type=float, default=50.0)
    p.add_argument("--port", type=int, default=29575)
    p.add_argument("--out", required=True, help="writes OUT.json and OUT.md")
    args = p.parse_args()
    if args.nodes < 2 or args.nodes % 2:
        p.error("--nodes must be even: node 0 pairs with 1, 2 with 3, ...")
    output = f"{args.out}.tmp.json"
    with EmulatedCluster(args.nodes, args.rate_mbit) as cluster:
        cluster.run_ranks(args.ranks_per_node, [sys.executable, os.path.abspath(__file__), "--worker"],
                          {"OUTPUT": output}, args.port)
    rows = json.load(open(output))
    os.remove(output)
    lines = [f"{args.nodes} nodes x {args.ranks_per_node} ranks at {args.rate_mbit:g} Mbit/s "
             f"({args.rate_mbit / 8:.2f} MB/s): one message each way per rank pair, MB/s per node", "",
             "| idle before (s) | flows per node | " + " | ".join(f"{s // 1024} KiB" for s in SIZES) + " |",
             "|---|---|" + "---|" * len(SIZES)]
    for idle in IDLE_S:
        for flows in sorted({r["flows"] for r in rows}):
            got = {r["message_bytes"]: r["mb_per_s"] for r in rows
                   if r["idle_s"] == idle and r["flows"] == flows and not r["two_connections"]}
            lines.append(f"| {idle:g} | {flows} | " + " | ".join(f"{got[s]:.2f}" for s in SIZES) + " |")
    got = {r["message_bytes"]: r["mb_per_s"] for r in rows if r["two_connections"]}
    lines.append("| 0 | 1, each direction on its own connection | "
                 + " | ".join(f"{got[s]:.2f}" for s in SIZES) + " |")
    json.dump({"argv": sys.argv, "rows": rows}, open(args.out + ".json", "w"), indent=1)
    open(args.out + ".md", "w").write("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    worker() if sys.argv[1:] == ["--worker"] else main()
