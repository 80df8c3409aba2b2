"""Measured vs predicted rankings of the configurations of one cluster, up to measurement noise.

Two configurations whose measured times are within the run's noise have no measured
order, and a planner cannot be right or wrong about them. A pair has a *clear* measured
order when one configuration was faster in every round of the run: the timed iterations
are interleaved (benchmarks/testbed/attention_worker.py: round ``i`` runs every configuration
once), so round ``i`` of two configurations saw the same machine load and link state.
With 5 rounds, a pair of configurations that are really equal comes out clear by chance
with probability 2/32. Older runs, timed one configuration after another, count a pair
as clear only when their time ranges do not overlap.

The ranking is *correct up to noise* when the prediction orders every clear pair as
measured; the strict ranking (medians) is reported next to it. Every wrongly ordered
pair is shown with its measured gap (slower median / faster median - 1): on a quiet
link two implementations of the same schedule can differ by 2-5% in every round, a
clear order that a cost model of bytes, latencies and FLOPs does not resolve (it prices
them the same: shown as "predicted a tie", still counted as wrong). ``MATERIAL_GAP``
splits those from the pairs a planner has to get right.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import combinations

MATERIAL_GAP = 0.05  # clear pairs at least this far apart (medians) are counted apart


def clearly_faster(a: dict, b: dict, interleaved: bool) -> bool:
    """Whether row ``a`` was measured faster than row ``b`` beyond the noise (``time_ms``
    per round)."""
    if interleaved:
        return all(x < y for x, y in zip(a["time_ms"], b["time_ms"]))
    return max(a["time_ms"]) < min(b["time_ms"])


def clear_pairs(rows: list[dict], interleaved: bool) -> list[tuple[str, str]]:
    """``(faster, slower)`` names of every pair with a clear measured order."""
    pairs = []
    for a, b in combinations(rows, 2):
        if clearly_faster(a, b, interleaved):
            pairs.append((a["name"], b["name"]))
        elif clearly_faster(b, a, interleaved):
            pairs.append((b["name"], a["name"]))
    return pairs


def ranking_errors(rows: list[dict], predicted_ms: dict[str, float], interleaved: bool) -> list[tuple[str, str]]:
    """Clear pairs ``(faster, slower)`` that the prediction orders the other way."""
    return [(a, b) for a, b in clear_pairs(rows, interleaved) if predicted_ms[a] >= predicted_ms[b]]


def ties(rows: list[dict], interleaved: bool) -> list[tuple[str, str]]:
    """Pairs without a clear measured order (within the noise of the run)."""
    clear = {frozenset(p) for p in clear_pairs(rows, interleaved)}
    return [(a["name"], b["name"]) for a, b in combinations(rows, 2) if frozenset((a["name"], b["name"])) not in clear]


@dataclass(frozen=True)
class RankingCheck:
    """One cluster's rows (``time_ms_median``, ``time_ms``, ``predicted_ms``) compared."""

    measured: list[str]  # fastest first, by median
    predicted: list[str]  # fastest first
    clear: list[tuple[str, str]]  # pairs with a clear measured order
    wrong: list[tuple[str, str]]  # of those, predicted the other way
    gap: dict[tuple[str, str], float]  # clear pair -> slower median / faster median - 1
    tied: list[tuple[str, str]]  # wrong pairs the model prices the same (no order claimed, still counted)

    def material(self, pairs: list[tuple[str, str]]) -> list[tuple[str, str]]:
        """The pairs measured at least ``MATERIAL_GAP`` apart."""
        return [p for p in pairs if self.gap[p] >= MATERIAL_GAP]

    def cells(self) -> str:
        """Table cells: measured ranking | predicted ranking | strict match | clear pairs | wrong ones."""
        def shown(a: str, b: str) -> str:
            tie = ", predicted a tie" if (a, b) in self.tied else ""
            return f"{a} < {b} ({100 * self.gap[(a, b)]:.1f}%{tie})"

        wrong = ", ".join(shown(a, b) for a, b in self.wrong) or "none"
        return (f"{' < '.join(self.measured)} | {' < '.join(self.predicted)} | "
                f"{'yes' if self.measured == self.predicted else 'no'} | {len(self.clear)} | {wrong}")


def check_ranking(rows: list[dict], interleaved: bool) -> RankingCheck:
    median = {r["name"]: r["time_ms_median"] for r in rows}
    predicted = {r["name"]: r["predicted_ms"] for r in rows}
    clear = clear_pairs(rows, interleaved)
    wrong = ranking_errors(rows, predicted, interleaved)
    return RankingCheck(
        measured=[r["name"] for r in sorted(rows, key=lambda r: r["time_ms_median"])],
        predicted=[r["name"] for r in sorted(rows, key=lambda r: r["predicted_ms"])],
        clear=clear,
        wrong=wrong,
        gap={(a, b): median[b] / median[a] - 1 for a, b in clear},
        tied=[(a, b) for a, b in wrong if abs(predicted[a] - predicted[b]) <= 1e-9 * max(predicted[a], predicted[b])],
    )
