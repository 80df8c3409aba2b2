"""Where each rank's time went, per configuration: a Markdown table and a Gantt-style plot.

Input: the rows of benchmarks/testbed/cluster_bench.py, each with ``phase_seconds_per_rank``
(seconds blocked per phase of the schedule, and ``compute``, the rest of the iteration)
and ``spans_per_rank`` (``(op, start, end)`` relative to the iteration's start) of the
median iteration, recorded by :class:`~megatron_startrail.timeline.Timeline`. PyTorch's
ring attention has no timeline (it does not go through the project's Communicator).
"""

from __future__ import annotations

from megatron_startrail.timeline import PHASES, phase_of

COLUMNS = list(PHASES) + ["compute"]
COLORS = {"team gather": "tab:orange", "initial send": "tab:red", "ring wait": "tab:purple", "merge": "tab:green",
          "ulysses": "tab:brown", "document check": "tab:olive", "halo": "tab:cyan", "other comm": "tab:pink"}


def _with_timeline(results: list[dict]) -> list[dict]:
    return [r for r in results if r.get("impl") != "torch" and r.get("spans_per_rank")]


def phase_summary(results: list[dict]) -> str:
    """Per rate and configuration: ms per phase, averaged over the ranks."""
    head = "| link Mbit/s | configuration | " + " | ".join(f"{c} ms" for c in COLUMNS) + " | exposed comm ms |"
    lines = [head, "|" + "---|" * (len(COLUMNS) + 3)]
    for r in _with_timeline(results):
        per_rank = r["phase_seconds_per_rank"]
        mean = {c: sum(ph.get(c, 0.0) for ph in per_rank) / len(per_rank) for c in COLUMNS}
        cells = " | ".join(f"{1000 * mean[c]:.0f}" for c in COLUMNS)
        exposed = sum(v for k, v in mean.items() if k != "compute")
        lines.append(f"| {r['rate_mbit']:g} | {r['name']} | {cells} | {1000 * exposed:.0f} |")
    return "\n".join(lines)


def phase_table(results: list[dict]) -> str:
    """Per rate, configuration and rank: ms per phase; exposed comm = all but compute."""
    head = "| link Mbit/s | configuration | rank | " + " | ".join(f"{c} ms" for c in COLUMNS) + " | exposed comm ms |"
    lines = ["Per-phase time of the median iteration, per rank (blocked in each communication "
             "phase; compute is the rest of the iteration):", "", head, "|" + "---|" * (len(COLUMNS) + 4)]
    for r in _with_timeline(results):
        for rank, ph in enumerate(r["phase_seconds_per_rank"]):
            exposed = sum(v for k, v in ph.items() if k != "compute")
            cells = " | ".join(f"{1000 * ph.get(c, 0.0):.0f}" for c in COLUMNS)
            lines.append(f"| {r['rate_mbit']:g} | {r['name']} | {rank} | {cells} | {1000 * exposed:.0f} |")
    return "\n".join(lines)


def plot_timeline(results: list[dict], path: str) -> None:
    """One panel per (rate, configuration): ranks on the y axis, the iteration on the x
    axis; grey = computing, coloured = blocked on a phase's communication."""
    rows = _with_timeline(results)
    if not rows:
        return
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415
    from matplotlib.patches import Patch  # noqa: PLC0415

    fig, axes = plt.subplots(len(rows), 1, figsize=(11, 1.0 + 0.32 * sum(len(r["spans_per_rank"]) for r in rows)),
                             squeeze=False)
    for ax, r in zip(axes[:, 0], rows):
        for rank, spans in enumerate(r["spans_per_rank"]):
            end = max(b for _, _, b in spans)
            ax.broken_barh([(0, 1000 * end)], (rank - 0.4, 0.8), color="lightgrey")
            for op, a, b in spans:
                if op != "end" and b > a:
                    ax.broken_barh([(1000 * a, 1000 * (b - a))], (rank - 0.4, 0.8), color=COLORS[phase_of(op)])
        ax.set_yticks(range(len(r["spans_per_rank"])))
        ax.set_ylabel("rank")
        ax.invert_yaxis()
        ax.set_title(f"{r['name']} at {r['rate_mbit']:g} Mbit/s: median iteration {r['time_ms_median']:.0f} ms",
                     fontsize=9)
    axes[-1, 0].set_xlabel("ms since the iteration started (forward, then backward)")
    handles = [Patch(color="lightgrey", label="compute")] + [Patch(color=c, label=p) for p, c in COLORS.items()]
    fig.legend(handles=handles, loc="upper center", ncol=len(handles), fontsize=8)
    fig.tight_layout(rect=(0, 0, 1, 0.97))
    fig.savefig(path, dpi=100)
