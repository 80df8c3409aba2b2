"""Median time per configuration and link rate, side by side over several runs of
benchmarks/testbed/cluster_bench.py (e.g. the same command before and after a change, alternated).

    python -m benchmarks.testbed.compare_runs A1.json B1.json A2.json B2.json --labels before pipelined before pipelined
"""

from __future__ import annotations

import argparse
import json
import statistics


def table(runs: list[dict], labels: list[str]) -> str:
    keys = list(dict.fromkeys((r["rate_mbit"], r["name"]) for run in runs for r in run["results"]))
    groups = list(dict.fromkeys(labels))
    head = "| link Mbit/s | configuration | " + " | ".join(f"{lab} (run {i + 1}) ms" for i, lab in enumerate(labels))
    head += " | " + " | ".join(f"mean of {g} ms" for g in groups) + " |"
    lines = [head, "|" + "---|" * (2 + len(labels) + len(groups))]
    for rate, name in keys:
        medians = [next((r["time_ms_median"] for r in run["results"] if (r["rate_mbit"], r["name"]) == (rate, name)),
                        None) for run in runs]
        means = [statistics.mean(m for m, lab in zip(medians, labels) if lab == g and m is not None) for g in groups]
        lines.append(f"| {rate:g} | {name} | " + " | ".join("-" if m is None else f"{m:.0f}" for m in medians)
                     + " | " + " | ".join(f"{m:.0f}" for m in means) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("runs", nargs="+", help="JSON outputs of cluster_bench.py")
    p.add_argument("--labels", nargs="+", required=True, help="one label per run")
    args = p.parse_args()
    if len(args.labels) != len(args.runs):
        p.error("give one --labels entry per run")
    print(table([json.load(open(path)) for path in args.runs], args.labels))


if __name__ == "__main__":
    main()
