"""Planner vs measurement over several emulated clusters (the outputs of cluster_bench.py).

    python -m benchmarks.testbed.planner_validation RUN1.json RUN2.json ... --out benchmarks/results/planner_validation

Every run measured its own cluster first (calibration.py: effective link rates, step
latency, attention rate under contention, overlap) and the planner priced every
configuration from those numbers alone; no attention timing went into any prediction (the
model's structure did learn from earlier runs: benchmarks/testbed/README.md says which
runs came after which change). Predictions are recomputed here from each run's stored
calibration with the current planner and the test bed's preset (testbed_model.py;
``--without-gloo-rules``: the package's model alone on the same figures). Writes OUT.md
(per row: measured, predicted, error, within 20 %; per cluster: rankings, strict (medians)
and up to noise, see ranking.py), OUT.json and OUT.png (predicted vs measured).
"""

from __future__ import annotations

import argparse
import json
import os

from benchmarks.testbed.cluster_bench import parser, predictions
from benchmarks.testbed.ranking import MATERIAL_GAP, check_ranking

TOLERANCE = 0.20


def load(paths: list[str], gloo_rules: bool = True) -> list[dict]:
    rows = []
    for path in paths:
        run = json.load(open(path))
        args = parser().parse_args(run["argv"][1:])
        for rate in dict.fromkeys(r["rate_mbit"] for r in run["results"]):
            measured = [r for r in run["results"] if r["rate_mbit"] == rate]
            predicted = predictions(args, rate, measured, measured[0]["calibration"], gloo_rules)
            for r in measured:
                rows.append({**{k: r[k] for k in ("name", "rate_mbit", "nodes", "ranks_per_node", "time_ms_median",
                                                   "time_ms", "calibration")},
                             "interleaved": run.get("interleaved", False),
                             "predicted_ms": predicted[r["name"]], "seq_length": args.seq_length,
                             "source": os.path.basename(path)})
    return rows


def cluster_key(r: dict) -> tuple:
    return (r["nodes"], r["ranks_per_node"], r["seq_length"], r["rate_mbit"], r["source"])


def report(rows: list[dict]) -> str:
    lines = ["| run | cluster | seq | link Mbit/s | configuration | measured ms | predicted ms | error | within 20% |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        err = r["predicted_ms"] / r["time_ms_median"] - 1
        lines.append(f"| {r['source'][:-5]} | {r['nodes']}x{r['ranks_per_node']} | {r['seq_length']} "
                     f"| {r['rate_mbit']:g} | {r['name']} | "
                     f"{r['time_ms_median']:.0f} | {r['predicted_ms']:.0f} | {100 * err:+.0f}% | "
                     f"{'yes' if abs(err) <= TOLERANCE else 'no'} |")
    lines += ["", "| run | cluster | seq | link Mbit/s | measured ranking (fastest first) | predicted ranking "
                  "| match (medians) | clear pairs (same order every round) | clear pairs predicted in the wrong order "
                  "| measured: eff. inter-node MB/s (one way / both ways on one pair), intra MB/s, GFLOP/s per rank, "
                  "overlap, step latency ms |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    clear_total = wrong_total = material_total = material_wrong = tied_total = 0
    wrong_gaps = []
    for key in dict.fromkeys(cluster_key(r) for r in rows):
        group = [r for r in rows if cluster_key(r) == key]
        cal = group[0]["calibration"]
        check = check_ranking(group, group[0]["interleaved"])
        clear_total, wrong_total = clear_total + len(check.clear), wrong_total + len(check.wrong)
        material_total += len(check.material(check.clear))
        material_wrong += len(check.material(check.wrong))
        wrong_gaps += [check.gap[p] for p in check.wrong]
        tied_total += len(check.tied)
        lines.append(
            f"| {key[4][:-5]} | {key[0]}x{key[1]} | {key[2]} | {key[3]:g} | {check.cells()} | "
            f"{1e3 * cal.get('inter_node_gbs', 0):.1f} / {1e3 * cal.get('inter_node_duplex_gbs', float('nan')):.1f}, "
            f"{1e3 * cal.get('intra_node_gbs', 0):.0f}, {1e3 * cal['attention_tflops']:.1f}, "
            f"{cal.get('overlap', 1.0):.2f}, {1e3 * cal['step_latency_s']:.1f} |")
    errors = [abs(r["predicted_ms"] / r["time_ms_median"] - 1) for r in rows]
    within = sum(e <= TOLERANCE for e in errors)
    lines += ["", f"{within} of {len(rows)} predictions within 20 % of the measured time; "
                  f"largest error {100 * max(errors):.0f} %. Rankings: {wrong_total} of {clear_total} pairs with a "
                  "clear measured order (faster in every round) predicted in the wrong order"
                  + (f" ({tied_total} of them priced the same: a tie counts as wrong)" if tied_total else "")
                  + (f", measured at most {100 * max(wrong_gaps):.1f} % apart" if wrong_gaps else "")
                  + f"; of the {material_total} clear pairs at least {100 * MATERIAL_GAP:.0f} % apart, "
                  f"{material_wrong} predicted in the wrong order."]
    return "\n".join(lines)


def plot(rows: list[dict], path: str) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    fig, ax = plt.subplots(figsize=(6, 5))
    names = list(dict.fromkeys(r["name"] for r in rows))
    for name in names:
        pts = [r for r in rows if r["name"] == name]
        ax.scatter([r["time_ms_median"] for r in pts], [r["predicted_ms"] for r in pts], label=name, s=18)
    hi = 1.1 * max(max(r["time_ms_median"], r["predicted_ms"]) for r in rows)
    ax.plot([0, hi], [0, hi], "k-", lw=0.8)
    ax.fill_between([0, hi], [0, 0.8 * hi], [0, 1.2 * hi], color="grey", alpha=0.15, label="within 20 %")
    ax.set_xlim(0, hi)
    ax.set_ylim(0, hi)
    ax.set_xlabel("measured ms per forward+backward")
    ax.set_ylabel("predicted ms")
    ax.legend(fontsize=7)
    ax.set_title("planner vs emulated clusters (no attention timing fitted)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="JSON outputs of cluster_bench.py")
    p.add_argument("--out", required=True)
    p.add_argument("--without-gloo-rules", action="store_true",
                   help="price with the package's model alone (testbed_model.py's rules left out)")
    args = p.parse_args()
    rows = load(args.runs, gloo_rules=not args.without_gloo_rules)
    text = report(rows)
    with open(args.out + ".md", "w") as f:
        f.write(text + "\n")
    with open(args.out + ".json", "w") as f:
        json.dump({"runs": args.runs, "rows": rows}, f, indent=1)
    plot(rows, args.out + ".png")
    print(text)


if __name__ == "__main__":
    main()
