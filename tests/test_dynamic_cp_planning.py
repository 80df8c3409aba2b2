"""The planner's price of hybrid (dynamic) CP (megatron_startrail/planning/dynamic_cp.py):
every sub-sample on a CP group of its own size and team size, against static CP."""

import pytest

from megatron_startrail.planning.cluster import preset
from megatron_startrail.planning.dynamic_cp import cp_size_for, main, price_dynamic_batch
from megatron_startrail.planning.planner import Workload, predict

CLUSTER = preset("h100-nvlink-8x400ib", 2, gpus_per_node=4)  # 2 nodes x 4 ranks
WORK = Workload(1024, 4, 4, 16, dtype_bytes=4)


def test_cp_size_is_megatrons_power_of_two_rule():
    # BalancedCPScheduler.gpus_needed: max(1, 2 ** ceil(log2(length / max_seqlen_per_rank)))
    assert [cp_size_for(n, 128, 8) for n in (1, 128, 129, 256, 257, 512, 1024)] == [1, 1, 2, 2, 4, 4, 8]
    with pytest.raises(ValueError, match="needs 16 ranks"):
        cp_size_for(1025, 128, 8)


def test_only_groups_across_nodes_cost_inter_node_bytes_and_startrail_lowers_them():
    short = price_dynamic_batch(CLUSTER, WORK, [100, 200, 400, 500], dp_cp=8, max_seqlen_per_rank=128, team_size=2,
                                static_cp=8, static_team_size=2, samples=1)
    assert short.sub_samples == {1: 1, 2: 1, 4: 2} and short.internode_bytes == 0  # groups of <= 4: one node
    lengths = [1000, 900, 60, 300]
    ring, startrail = (price_dynamic_batch(CLUSTER, WORK, lengths, dp_cp=8, max_seqlen_per_rank=128, team_size=c,
                                           static_cp=8, static_team_size=2, samples=2) for c in (1, 2))
    assert ring.team_sizes == {1: 1, 4: 1, 8: 1} and startrail.team_sizes == {1: 1, 4: 2, 8: 2}
    # Only the two CP-8 sub-samples cross: each costs what the planner says for its own length.
    each = [predict(CLUSTER, Workload(n, 4, 4, 16, dtype_bytes=4), 8, 2).internode_bytes for n in (1008, 912)]
    assert startrail.internode_bytes == pytest.approx(sum(each))
    assert 0 < startrail.internode_bytes < ring.internode_bytes
    assert startrail.static_internode_bytes == pytest.approx(2 * predict(CLUSTER, WORK, 8, 2).internode_bytes)


def test_the_command_line_prints_the_three_ways(capsys):
    main(["--nodes", "2", "--gpus-per-node", "4", "--seq-length", "1024", "--max-seqlen-per-dp-cp-rank", "128",
          "--heads", "4", "--head-dim", "16", "--context-parallel-size", "8", "--document-lengths", "1000", "60"])
    out = capsys.readouterr().out
    assert "hybrid CP, ring attention (C = 1)" in out and "static CP 8, StarTrail C = 2" in out
    assert "1: 1 (1), 8: 1 (2)" in out


def test_the_benchmark_summarizes_what_its_ranks_recorded():
    import argparse  # noqa: PLC0415

    from benchmarks.dynamic_cp.bench import summarize, table  # noqa: PLC0415

    args = argparse.Namespace(warmup=1, iters=2, nodes=2)
    # Two ranks of a CP-2 sub-sample and one of a CP-1 one per timed step; the warm-up step is left out.
    ranks = [{"steps": [{"seconds": 9.0, "barrier_wait_s": 0.0}] + [{"seconds": 2.0, "barrier_wait_s": w}] * 2,
              "sub_samples": [[0, 2, 64]] + [[s, 2, 64] for s in (1, 2)] + [[s, 1, 32] for s in (1, 2)][:2 if r else 0],
              "internode_tx_bytes": 4 * 2**20 if r == 0 else 0} for r, w in ((0, 0.5), (1, 0.0))]
    row = summarize("dynamic", ranks, args)
    assert row["time_ms_median"] == 2000 and row["busy_ms_per_rank"] == [1500, 2000]
    assert row["sub_samples_per_iter"] == {1: 1.0, 2: 1.0}
    assert row["internode_bytes_per_node_per_iter"] == 2**20  # 4 MiB over 2 iterations and 2 nodes
    row["predicted_attention_internode_bytes_per_iter"] = 0.0
    assert "| dynamic | 2000 | 1.00 | 0.00 | 1500-2000 | 1.0 / 1.0 / 0.0 / 0.0 |" in table([row])
