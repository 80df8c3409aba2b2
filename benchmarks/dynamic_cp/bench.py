"""Static StarTrail CP against Megatron's hybrid (dynamic) CP, with ring attention and with
StarTrail, on an emulated cluster (one command; needs root).

    sudo .venv/bin/python -m benchmarks.dynamic_cp.bench --nodes 2 --ranks-per-node 4 --rate-mbit 100

The same variable-length documents (``--min-doc`` to ``--max-doc`` tokens, log-uniform:
most short, a few long), packed into samples of ``--seq-length`` tokens by Megatron's
``GPTDataset`` with ``--dataloader-inter-document-masking``, train a small GPT through
``examples/pretrain_gpt.py`` three ways on the same ranks:

    static          --context-parallel-size P --startrail-team-size C (every sample on all P ranks)
    dynamic-ring    --hybrid-context-parallel, team size 1 on every CP size (ring attention)
    dynamic-C       --hybrid-context-parallel, team size C where C*C divides the CP size

and reports per configuration: the median time per iteration (Megatron's train step, after
``--warmup`` steps), the bytes that crossed node links during the timed steps (kernel
counters, every node; the data-parallel gradient all-reduce over all ranks is in all three),
the planner's price of the attention's inter-node bytes for the sub-samples that ran
(:mod:`megatron_startrail.planning.dynamic_cp`), and each rank's busy time: its train-step
time less what it waited in the hybrid schedule's barriers for other ranks (the balance
hybrid CP is for). Writes ``--out``.json and .md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

import numpy as np

from benchmarks import RESULTS, ROOT
from benchmarks.testbed.netns_cluster import EmulatedCluster, check_requirements
from megatron_startrail.planning.cluster import preset
from megatron_startrail.planning.dynamic_cp import price_dynamic_batch
from megatron_startrail.planning.planner import Workload, predict


def documents(count: int, low: int, high: int, seed: int = 0) -> list[np.ndarray]:
    """``count`` documents of log-uniform lengths in [low, high]: a repeated random pattern,
    then EOD (what a document holds predicts its next tokens)."""
    sys.path.insert(0, os.path.join(ROOT, "examples", "data"))
    from make_indexed_dataset import EOD  # noqa: PLC0415

    rng = np.random.default_rng(seed)
    lengths = np.exp(rng.uniform(np.log(low), np.log(high), size=count)).astype(int)
    return [np.append(np.resize(rng.integers(0, EOD, size=rng.integers(2, 7)), n - 1), EOD) for n in lengths]


def configurations(args) -> dict[str, list[str]]:
    world = args.nodes * args.ranks_per_node
    dynamic = ["--hybrid-context-parallel", "--max-seqlen-per-dp-cp-rank", str(args.max_seqlen_per_rank),
               "--rerun-mode", "disabled"]
    return {
        f"static CP{world} C{args.team_size}": ["--context-parallel-size", str(world),
                                                "--startrail-team-size", str(args.team_size)],
        "dynamic, ring (C1)": [*dynamic, "--startrail-team-size", "1"],
        f"dynamic, StarTrail (C{args.team_size})": [*dynamic, "--startrail-team-size", str(args.team_size)],
    }


def run_config(cluster, args, flags: list[str], data: str, port: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        argv = ["--num-layers", str(args.num_layers), "--hidden-size", str(args.hidden_size),
                "--num-attention-heads", str(args.heads), "--seq-length", str(args.seq_length),
                "--micro-batch-size", "1", "--global-batch-size", str(args.global_batch),
                "--train-iters", str(args.warmup + args.iters), "--lr", "1e-3", "--seed", str(args.seed),
                "--log-interval", "1", "--calculate-per-token-loss", "--context-parallel-algo", "startrail",
                "--dataloader-inter-document-masking", "--data-path", data, "--split", "100,0,0",
                "--distributed-timeout-minutes", "5", *flags]
        spec = os.path.join(tmp, "spec.json")
        json.dump({"argv": argv, "output": tmp, "warmup": args.warmup}, open(spec, "w"))
        cluster.run_ranks(args.ranks_per_node, [sys.executable, "-m", "benchmarks.dynamic_cp.worker", spec],
                          {"PYTHONPATH": ROOT}, port, timeout=args.timeout)
        world = args.nodes * args.ranks_per_node
        return [json.load(open(os.path.join(tmp, f"rank{r}.json"))) for r in range(world)]


def timed_sub_samples(ranks: list[dict], warmup: int) -> list[tuple[int, int]]:
    """``(CP size, padded length)`` of every sub-sample of the timed steps, once each (each
    of its ``k`` ranks recorded it)."""
    records: dict[tuple[int, int], int] = {}
    for r in ranks:
        for step, k, n in r["sub_samples"]:
            if step >= warmup:
                records[(k, n)] = records.get((k, n), 0) + 1
    return [(k, n) for (k, n), count in records.items() for _ in range(count // k)]


def summarize(name: str, ranks: list[dict], args) -> dict:
    timed = slice(args.warmup, None)
    step_s = [statistics.median(s["seconds"] for s in r["steps"][timed]) for r in ranks]
    busy = [sum(s["seconds"] - s["barrier_wait_s"] for s in r["steps"][timed]) / args.iters for r in ranks]
    # Every node's inter-node interfaces (measured on its local rank 0), per iteration: the
    # mean over nodes, to set beside the planner's busiest node (the groups here are symmetric).
    internode = sum(r["internode_tx_bytes"] or 0 for r in ranks) / args.iters / args.nodes
    row = {"name": name, "time_ms_median": 1000 * max(step_s), "internode_bytes_per_node_per_iter": internode,
           "busy_ms_per_rank": [1000 * b for b in busy]}
    subs = timed_sub_samples(ranks, args.warmup)
    if subs:
        sizes = sorted({k for k, _ in subs})
        row["sub_samples_per_iter"] = {k: sum(1 for kk, _ in subs if kk == k) / args.iters for k in sizes}
    return row


def predicted(args, ranks: list[dict], name: str) -> float:
    """The planner's inter-node bytes of the attention per iteration (all layers, busiest
    node) for the sub-samples that ran; static CP: the global batch's packed samples."""
    world = args.nodes * args.ranks_per_node
    cluster = preset("h100-nvlink-8x400ib", args.nodes, gpus_per_node=args.ranks_per_node)
    work = Workload(args.seq_length, args.heads, args.heads, args.hidden_size // args.heads, dtype_bytes=4)
    subs = timed_sub_samples(ranks, args.warmup)
    if not subs:  # static CP: every sample on all ranks
        return predict(cluster, work, world, args.team_size).internode_bytes * args.global_batch * args.num_layers
    team = 1 if "C1" in name else args.team_size
    price = price_dynamic_batch(cluster, work, [n for _, n in subs], dp_cp=world,
                                max_seqlen_per_rank=args.max_seqlen_per_rank, team_size=team, static_cp=world,
                                static_team_size=args.team_size, samples=args.global_batch * args.iters)
    return price.internode_bytes * args.num_layers / args.iters


def table(rows: list[dict]) -> str:
    lines = ["| configuration | time/iter ms | inter-node MiB/iter per node (kernel, all traffic) | attention "
             "inter-node MiB/iter, busiest node (planner) | busy ms/rank: min-max | sub-samples per iteration at "
             "CP 1/2/4/8 |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        subs = {int(k): n for k, n in r["sub_samples_per_iter"].items()} if r.get("sub_samples_per_iter") else None
        cells = " / ".join(f"{subs.get(k, 0):.1f}" for k in (1, 2, 4, 8)) if subs else "- (all on CP 8)"
        lines.append(f"| {r['name']} | {r['time_ms_median']:.0f} | {r['internode_bytes_per_node_per_iter'] / 2**20:.2f} | "
                     f"{r['predicted_attention_internode_bytes_per_iter'] / 2**20:.2f} | "
                     f"{min(r['busy_ms_per_rank']):.0f}-{max(r['busy_ms_per_rank']):.0f} | {cells} |")
    return "\n".join(lines)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--ranks-per-node", type=int, default=4)
    p.add_argument("--rate-mbit", type=float, default=100.0)
    p.add_argument("--seq-length", type=int, default=1024)
    p.add_argument("--max-seqlen-per-rank", type=int, default=128, help="--max-seqlen-per-dp-cp-rank")
    p.add_argument("--min-doc", type=int, default=8)
    p.add_argument("--max-doc", type=int, default=1024)
    p.add_argument("--team-size", type=int, default=2)
    p.add_argument("--num-layers", type=int, default=2)
    p.add_argument("--hidden-size", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--global-batch", type=int, default=8)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--seed", type=int, default=3)
    p.add_argument("--port", type=int, default=29571)
    p.add_argument("--timeout", type=float, default=900.0)
    p.add_argument("--out", default=None, help="results path without extension (default: "
                   "benchmarks/results/dynamic_cp_<nodes>x<ranks>_<rate>mbit)")
    return p


def main(argv=None) -> None:
    args = parser().parse_args(argv)
    args.out = args.out or os.path.join(RESULTS, f"dynamic_cp_{args.nodes}x{args.ranks_per_node}_"
                                                         f"{args.rate_mbit:g}mbit")
    reason = check_requirements()
    if reason:
        raise SystemExit(reason)
    import torch  # noqa: PLC0415

    if not torch.cuda.is_available():  # megatron-core imports GPU-only modules: the example's CPU shims first
        from megatron_startrail.megatron import cpu_patches  # noqa: PLC0415

        cpu_patches.install_import_shims()
    sys.path.insert(0, os.path.join(ROOT, "examples", "data"))
    from make_indexed_dataset import write_indexed_dataset  # noqa: PLC0415

    rows = []
    with tempfile.TemporaryDirectory() as data_dir, EmulatedCluster(args.nodes, args.rate_mbit) as cluster:
        data = os.path.join(data_dir, "docs")
        write_indexed_dataset(documents(2000, args.min_doc, args.max_doc), data)
        for index, (name, flags) in enumerate(configurations(args).items()):
            ranks = run_config(cluster, args, flags, data, args.port + index)
            row = summarize(name, ranks, args)
            row["predicted_attention_internode_bytes_per_iter"] = predicted(args, ranks, name)
            rows.append(row)
            print(table(rows[-1:]).splitlines()[-1], flush=True)
    result = {"args": vars(args), "rows": rows}
    with open(args.out + ".json", "w") as f:
        json.dump(result, f, indent=1)
    given = " ".join(sys.argv[1:] if argv is None else argv)
    command = f"`sudo .venv/bin/python -m benchmarks.dynamic_cp.bench{' ' + given if given else ''}`" + \
        ("" if given else " (the defaults)")
    with open(args.out + ".md", "w") as f:
        f.write(f"{args.nodes} nodes x {args.ranks_per_node} ranks, {args.rate_mbit:g} Mbit/s node links, "
                f"documents of {args.min_doc}-{args.max_doc} tokens in samples of {args.seq_length}, "
                f"--max-seqlen-per-dp-cp-rank {args.max_seqlen_per_rank}, {args.iters} timed iterations.\n\n"
                f"{command}\n\n{table(rows)}\n")
    print(table(rows))


if __name__ == "__main__":
    main()
