"""Ring attention vs StarTrail on an emulated multi-node cluster (one command).

    python -m benchmarks.testbed.cluster_bench --nodes 2 --ranks-per-node 4 --rate-mbit 100 \
        --seq-length 8192 --heads 4 --head-dim 32 --configs ring startrail-2 ulysses-2xstartrail-2

Builds the cluster (network namespaces, see netns_cluster.py; needs root), runs every
configuration's attention forward+backward on every rank (benchmarks/testbed/attention_worker.py),
and reports per configuration: median time per iteration, P2P and collective bytes per
rank, bytes that crossed node boundaries (the project's accounting and the kernel's
interface counters), sequential P2P steps and the bytes kept for backward. Results go to
``--out`` as JSON, a Markdown table and a PNG plot; with several ``--rate-mbit`` values
the planner's predicted ranking is compared with the measured one per link speed.

``--window LEFT,RIGHT`` gives every configuration of the project a sliding window
(``startrail_attn(window_size=...)``: the halo exchange where it applies; a ``-nohalo``
configuration runs the schedule with the window instead, moving every rank's K, V).
PyTorch's ring runs causal without it: its context parallelism cannot apply a window on
CPU (benchmarks/README.md, "Sliding windows").
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

from benchmarks import RESULTS, ROOT
from benchmarks.testbed.netns_cluster import EmulatedCluster, check_requirements
from benchmarks.testbed.peer_models import predict_torch_ring
from benchmarks.testbed.ranking import check_ranking
from benchmarks.testbed.testbed_model import testbed_cluster
from benchmarks.testbed.timeline_report import phase_summary, phase_table, plot_timeline
from megatron_startrail.planning.cluster import ClusterSpec
from megatron_startrail.planning.planner import Workload, predict
from megatron_startrail.topology import valid_team_sizes


def cluster_spec(args, rate_mbit: float, calibration: dict, gloo_rules: bool = True) -> ClusterSpec:
    """The planner's view of this emulated cluster (benchmarks/testbed/testbed_model.py)."""
    return testbed_cluster(calibration, args.nodes, args.ranks_per_node, rate_mbit, args.topology == "full_mesh",
                           gloo_rules)


def workload(args, window: tuple[int, int] | None = None) -> Workload:
    """The planner's workload of this run; ``window``: a configuration's sliding window."""
    return Workload(args.seq_length, args.heads, args.kv_heads or args.heads, args.head_dim, args.batch,
                    4 if args.dtype == "float32" else 2, not args.no_causal,
                    window=None if window is None else tuple(window))


def predictions(args, rate_mbit: float, configs: list[dict], calibration: dict,
                gloo_rules: bool = True) -> dict[str, float]:
    """The planner's predicted time (ms) per configuration on this emulated cluster."""
    cluster = cluster_spec(args, rate_mbit, calibration, gloo_rules)
    world = args.nodes * args.ranks_per_node
    out = {}
    for c in configs:
        work = workload(args, c.get("window"))
        if c["impl"] == "torch":
            out[c["name"]] = 1000 * predict_torch_ring(cluster, work, world, c["rotate_method"])
        else:
            out[c["name"]] = 1000 * predict(cluster, work, world, c["team_size"], c["ulysses"], c["transfer"],
                                            c.get("regather", False), halo_exchange=c.get("halo", True),
                                            rotation=c.get("rotation", "auto")).time_s
    return out


def ranking_report(results: list[dict], interleaved: bool = True) -> str:
    """Per link rate: the measured and predicted rankings (medians), and whether the
    prediction orders every pair with a clear measured order (benchmarks/testbed/ranking.py)."""
    lines = ["| link Mbit/s | measured ranking (fastest first) | predicted ranking | match "
             "| pairs measured in one order every round | of them ordered wrongly |", "|---|---|---|---|---|---|"]
    for rate in sorted({r["rate_mbit"] for r in results}):
        rows = [r for r in results if r["rate_mbit"] == rate]
        lines.append(f"| {rate:g} | {check_ranking(rows, interleaved).cells()} |")
    return "\n".join(lines)


def parse_config(name: str) -> dict:
    """``ring`` | ``startrail-C`` | ``tasp`` | ``ulysses-Ux<ring|startrail-C>`` | ``startrail-C-multiring``,
    each optionally followed by ``-regather`` (``regather_in_backward=True``), ``-nohalo`` (a windowed
    layer through the schedule: ``halo_exchange=False``), ``-rotq`` / ``-rotkv`` (the backward
    rotation; default: the one that moves fewer bytes); ``torch-cp`` (PyTorch's ring attention, its
    default all-gather rotation) | ``torch-cp-alltoall``."""
    if name in ("torch-cp", "torch-cp-alltoall"):
        return {"name": name, "impl": "torch",
                "rotate_method": "alltoall" if name.endswith("alltoall") else "allgather",
                "team_size": 1, "ulysses": 1, "transfer": "ring", "regather": False}
    config = {"name": name, "impl": "startrail", "team_size": 1, "ulysses": 1, "transfer": "ring", "regather": False}
    for suffix, rotation in (("-rotq", "q"), ("-rotkv", "kv")):
        if name.endswith(suffix):
            config["rotation"] = rotation
            name = name[: -len(suffix)]
    if name.endswith("-nohalo"):
        config["halo"] = False
        name = name[: -len("-nohalo")]
    if name.endswith("-regather"):
        config["regather"] = True
        name = name[: -len("-regather")]
    parts = name.split("x")
    if parts[0].startswith("ulysses-"):
        config["ulysses"] = int(parts[0].split("-")[1])
        name = parts[1]
    if name == "tasp":
        config["transfer"] = "multiring"
    elif name.startswith("startrail-"):
        fields = name.split("-")
        config["team_size"] = int(fields[1])
        if len(fields) > 2 and fields[2] == "multiring":
            config["transfer"] = "multiring"
    elif name != "ring":
        raise ValueError(f"unknown configuration {name!r}")
    return config


def run_once(args, rate_mbit: float, configs: list[dict]) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp, EmulatedCluster(args.nodes, rate_mbit, args.topology) as cluster:
        spec_path, out_path = os.path.join(tmp, "spec.json"), os.path.join(tmp, "out.json")
        json.dump({
            "workload": {"seq_length": args.seq_length, "batch": args.batch, "heads": args.heads,
                         "kv_heads": args.kv_heads or args.heads, "head_dim": args.head_dim,
                         "dtype": args.dtype, "causal": not args.no_causal},
            "configs": configs, "warmup": args.warmup, "iters": args.iters, "output": out_path,
            "rate_mbit": rate_mbit or 10000.0, "calibration_s": args.calibration_seconds,
        }, open(spec_path, "w"))
        cluster.run_ranks(args.ranks_per_node, [sys.executable, "-m", "benchmarks.testbed.attention_worker", spec_path],
                          {"PYTHONPATH": ROOT}, args.port, timeout=args.timeout)
        results = json.load(open(out_path))
    for r in results:
        r["rate_mbit"] = rate_mbit
        r["nodes"], r["ranks_per_node"] = args.nodes, args.ranks_per_node
    return results


def window_cell(r: dict) -> str:
    """What a row's attention applied: the window and the path that ran it, or causal only."""
    if not r.get("window"):
        return "none: causal" + (" (PyTorch's CP has no window on CPU)" if r.get("impl") == "torch" else "")
    return f"{r['window'][0]},{r['window'][1]} {r.get('path', '?')}"


def table(results: list[dict]) -> str:
    """One row per (link rate, configuration); speed-up is over PyTorch's ring (``torch-cp``,
    its default rotation) at the same rate, when it ran. With windows, a column says what
    each row applied (the halo exchange or the schedule, or causal only)."""
    windows = any(r.get("window") for r in results)
    head = ("| link Mbit/s | configuration | " + ("window (path) | " if windows else "") +
            "time/iter ms | speed-up over torch-cp | predicted ms "
            "| predicted / measured "
            "| P2P MiB/rank | collective MiB/rank | inter-node MiB (accounting) | inter-node MiB (kernel) "
            "| steps fwd/bwd | kept for bwd MiB/rank | peak live MiB/rank |")
    lines = [head, "|" + "---|" * (13 + windows)]
    mib = 2.0**20

    def num(r, key, scale=mib):
        return f"{r[key] / scale:.2f}" if key in r else "-"

    for r in results:
        base = next((x for x in results if x["rate_mbit"] == r["rate_mbit"] and x["name"] == "torch-cp"), None)
        speedup = f"{base['time_ms_median'] / r['time_ms_median']:.2f}x" if base else "-"
        steps = f"{r['p2p_steps_forward']}/{r['p2p_steps_backward']}" if "p2p_steps_forward" in r else "-"
        lines.append(
            f"| {r['rate_mbit']:g} | {r['name']} | " + (f"{window_cell(r)} | " if windows else "") +
            f"{r['time_ms_median']:.0f} | {speedup} | {r['predicted_ms']:.0f} | "
            f"{r['predicted_ms'] / r['time_ms_median']:.2f} | {num(r, 'p2p_bytes_sent_max')} | "
            f"{num(r, 'collective_bytes_sent_max')} | {num(r, 'internode_bytes_accounting')} | "
            f"{num(r, 'internode_bytes_kernel')} | {steps} | {num(r, 'saved_for_backward_bytes_max')} | "
            f"{num(r, 'peak_live_bytes_max')} |"
        )
    return "\n".join(lines)


def plot(results: list[dict], path: str) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    rates = sorted({r["rate_mbit"] for r in results})
    fig, axes = plt.subplots(1, 3, figsize=(16, 4))
    names = list(dict.fromkeys(r["name"] for r in results))
    width = 0.8 / len(names)
    for i, name in enumerate(names):
        rows = {r["rate_mbit"]: r for r in results if r["name"] == name}
        xs = [k + i * width for k in range(len(rates))]
        axes[0].bar(xs, [rows[x]["time_ms_median"] if x in rows else 0 for x in rates], width, label=name)
        axes[1].bar(xs, [rows[x]["internode_bytes_kernel"] / 2**20 if x in rows else 0 for x in rates], width,
                    label=name)
    for i, name in enumerate(names):  # memory against time, one point per configuration and link rate
        rows = [r for r in results if r["name"] == name]
        axes[2].scatter([r["time_ms_median"] for r in rows], [r["peak_live_bytes_max"] / 2**20 for r in rows],
                        label=name, color=f"C{i}")
        axes[2].scatter([r["time_ms_median"] for r in rows], [r["saved_for_backward_bytes_max"] / 2**20 for r in rows],
                        marker="x", color=f"C{i}")
    axes[2].set_xlabel("time per forward+backward (ms, median)")
    axes[2].set_ylabel("MiB per rank (max over ranks)")
    axes[2].set_title("peak live tensors (o) and kept for backward (x)")
    axes[2].grid(alpha=0.3)
    for ax, title in zip(axes, ("time per forward+backward (ms, median)", "bytes across nodes per iteration (MiB)")):
        ax.set_xticks([k + 0.4 - width / 2 for k in range(len(rates))])
        ax.set_xticklabels([f"{x:g} Mbit/s" for x in rates])
        ax.set_title(title)
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend()
    r0 = results[0]
    windowed = next((r["window"] for r in results if r.get("window")), None)
    fig.suptitle(f"{r0['nodes']} nodes x {r0['ranks_per_node']} ranks, inter-node link shaped per node"
                 + (f"; window {windowed[0]},{windowed[1]} (PyTorch's ring: causal)" if windowed else ""))
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def window_flag(text: str) -> tuple[int, int]:
    try:
        left, right = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"--window takes LEFT,RIGHT (e.g. 256,0), got {text!r}") from None
    return left, right


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--nodes", type=int, default=2)
    p.add_argument("--ranks-per-node", type=int, default=4)
    p.add_argument("--topology", choices=("bridge", "full_mesh"), default="bridge")
    p.add_argument("--rate-mbit", type=float, nargs="+", default=[100.0], help="inter-node link rate(s)")
    p.add_argument("--seq-length", type=int, default=8192)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=None)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--no-causal", action="store_true")
    p.add_argument("--window", type=window_flag, default=None, metavar="LEFT,RIGHT",
                   help="sliding window for every configuration of the project (flash-attn's meaning, -1 "
                        "unbounded); PyTorch's ring runs without it")
    p.add_argument("--configs", nargs="+", default=["ring", "startrail-2", "startrail-4", "ulysses-2xstartrail-2"])
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--calibration-seconds", type=float, default=1.0,
                   help="traffic per repeat of the link calibration (the planner's inputs), at the nominal rate")
    p.add_argument("--iters", type=int, default=3)
    p.add_argument("--intra-node-gbs", type=float, default=1.0,
                   help="loopback bandwidth per rank for the planner's model (GB/s)")
    p.add_argument("--port", type=int, default=29555)
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--out", default=os.path.join(RESULTS, "cluster_bench"))
    return p


def main() -> int:
    p = parser()
    args = p.parse_args()
    if args.window is None and any(name.endswith("-nohalo") for name in args.configs):
        p.error("a -nohalo configuration runs a windowed layer without the halo: give --window")
    reason = check_requirements()
    if reason:
        print(f"cluster_bench: {reason}", file=sys.stderr)
        return 2
    world = args.nodes * args.ranks_per_node
    configs = []
    for name in args.configs:
        c = parse_config(name)
        if c["team_size"] not in valid_team_sizes(world // c["ulysses"]):
            print(f"skipping {name}: team size {c['team_size']} does not fit {world // c['ulysses']} ranks "
                  f"(valid: {valid_team_sizes(world // c['ulysses'])})")
            continue
        if args.window is not None:  # PyTorch's ring cannot apply one (module docstring): causal only
            c["window"] = None if c["impl"] == "torch" else list(args.window)
        configs.append(c)
    results = []
    for rate in args.rate_mbit:
        measured = run_once(args, rate, configs)
        calibration = measured[0]["calibration"]
        print(f"{rate:g} Mbit/s, measured on the cluster: {json.dumps(calibration)}")
        predicted = predictions(args, rate, configs, calibration)
        for r in measured:
            r["predicted_ms"] = predicted[r["name"]]
            results.append(r)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out + ".json", "w") as f:
        # interleaved: the timed iterations of the configurations alternate (attention_worker.py)
        json.dump({"argv": sys.argv, "interleaved": True, "results": results}, f, indent=1)
    text = "\n\n".join([table(results), ranking_report(results), "Mean over ranks:", phase_summary(results),
                          phase_table(results)])
    with open(args.out + ".md", "w") as f:
        f.write(text + "\n")
    plot(results, args.out + ".png")
    plot_timeline(results, args.out + "_timeline.png")
    print(text)
    print(f"\nwrote {args.out}.json, {args.out}.md, {args.out}.png, {args.out}_timeline.png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
