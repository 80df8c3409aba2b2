"""benchmarks/testbed/ranking.py: which measured orders count, and which predictions get them wrong."""

from benchmarks.testbed.ranking import clear_pairs, ranking_errors, ties


def row(name, times):
    return {"name": name, "time_ms": times}


def test_interleaved_rounds_give_a_clear_order_only_when_every_round_agrees():
    a = row("a", [10, 11, 12, 10, 11])
    b = row("b", [12, 13, 14, 11, 12])  # slower in every round
    c = row("c", [11, 10, 13, 9, 12])  # beats a in round 2 and 4: no clear order with a
    rows = [a, b, c]
    assert sorted(clear_pairs(rows, interleaved=True)) == [("a", "b")]
    assert sorted(ties(rows, interleaved=True)) == [("a", "c"), ("b", "c")]
    # a prediction that swaps a and b is wrong; one that swaps a and c is not judged
    assert ranking_errors(rows, {"a": 2.0, "b": 1.0, "c": 3.0}, interleaved=True) == [("a", "b")]
    assert ranking_errors(rows, {"a": 2.0, "b": 3.0, "c": 1.0}, interleaved=True) == []


def test_sequential_runs_need_disjoint_time_ranges():
    a = row("a", [10, 14, 12])
    b = row("b", [13, 15, 16])  # faster in every position, but the ranges overlap (14 > 13)
    d = row("d", [20, 21, 22])
    assert clear_pairs([a, b], interleaved=True) == [("a", "b")]
    assert clear_pairs([a, b], interleaved=False) == []
    assert sorted(clear_pairs([a, b, d], interleaved=False)) == [("a", "d"), ("b", "d")]
    assert ranking_errors([a, d], {"a": 5.0, "d": 5.0}, interleaved=False) == [("a", "d")]  # a tie is not an order


def test_wrong_pairs_carry_their_measured_gap():
    from benchmarks.testbed.ranking import MATERIAL_GAP, check_ranking  # noqa: PLC0415

    rows = [dict(row("a", [100, 101, 100]), time_ms_median=100, predicted_ms=2.0),
            dict(row("b", [102, 103, 102]), time_ms_median=102, predicted_ms=1.0),  # 2% slower, predicted faster
            dict(row("c", [130, 131, 129]), time_ms_median=130, predicted_ms=3.0)]
    check = check_ranking(rows, interleaved=True)
    assert check.wrong == [("a", "b")]
    assert check.gap[("a", "b")] < MATERIAL_GAP <= check.gap[("a", "c")]
    assert check.material(check.wrong) == [] and check.material(check.clear) == [("a", "c"), ("b", "c")]
    assert "a < b (2.0%)" in check.cells() and check.tied == []
    rows[1]["predicted_ms"] = 2.0  # priced the same as a: still wrong, shown as a tie
    check = check_ranking(rows, interleaved=True)
    assert check.wrong == check.tied == [("a", "b")]
    assert "a < b (2.0%, predicted a tie)" in check.cells()
