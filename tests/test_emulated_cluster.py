"""The emulated cluster (network namespaces): kernel byte counters agree with accounting.

Needs root and iproute2 (CI has both); skipped with the reason otherwise.
"""

import argparse

import pytest

from benchmarks.testbed.cluster_bench import parse_config, run_once
from benchmarks.testbed.netns_cluster import check_requirements
from megatron_startrail.accounting import halo_rows

REASON = check_requirements()
pytestmark = pytest.mark.skipif(REASON is not None, reason=REASON or "")


def bench_args(**overrides):
    args = dict(nodes=2, ranks_per_node=2, topology="bridge", seq_length=1024, batch=1, heads=2, kv_heads=None,
                head_dim=16, dtype="float32", no_causal=False, warmup=1, iters=2, port=29561, timeout=300,
                # byte counts need no link calibration: a short one (it still runs every probe)
                calibration_seconds=0.05)
    args.update(overrides)
    return argparse.Namespace(**args)


# 2 nodes x 2 ranks, 1024 tokens in chunks of 128; one launch of the ranks runs every
# configuration (starting the ranks is most of the time): ring and StarTrail-2 causal, and a
# 64-token window, which reaches the CP neighbours only (two of those pairs straddle the
# nodes: chunks 1|2 and 5|6), by the halo exchange and through the schedule.
WINDOW = (64, 0)


@pytest.fixture(scope="module")
def bridge_runs():
    configs = [parse_config("ring"), parse_config("startrail-2"),
               dict(parse_config("ring"), window=list(WINDOW), name="ring-window"),
               dict(parse_config("ring-nohalo"), window=list(WINDOW), name="ring-window-nohalo")]
    return {r["name"]: r for r in run_once(bench_args(), 400.0, configs)}


def test_kernel_counters_match_accounting_and_startrail_crosses_less(bridge_runs):
    results = {name: bridge_runs[name] for name in ("ring", "startrail-2")}
    for r in results.values():
        assert r["internode_bytes_accounting"] > 0
        # TCP/IP headers (MTU 9000) and acknowledgements add a few percent, no more.
        ratio = r["internode_bytes_kernel"] / r["internode_bytes_accounting"]
        assert 1.0 <= ratio < 1.1, (r["name"], ratio)
    assert results["startrail-2"]["internode_bytes_accounting"] < results["ring"]["internode_bytes_accounting"]
    assert results["ring"]["p2p_steps_forward"] == 3 and results["startrail-2"]["p2p_steps_forward"] == 1


def test_full_mesh_spreads_tasp_over_every_link():
    args = bench_args(topology="full_mesh", nodes=3, ranks_per_node=1, port=29562, seq_length=1020)
    results = {r["name"]: r for r in run_once(args, 400.0, [parse_config("ring"), parse_config("tasp")])}
    for r in results.values():
        ratio = r["internode_bytes_kernel"] / r["internode_bytes_accounting"]
        assert 1.0 <= ratio < 1.1, (r["name"], ratio)
    # Same bytes in total: TASP only spreads them over more links.
    assert results["tasp"]["internode_bytes_accounting"] == results["ring"]["internode_bytes_accounting"]


def test_a_windowed_layers_halo_crosses_its_closed_form_and_the_schedule_everything(bridge_runs):
    args, results = bench_args(), bridge_runs
    rows = halo_rows(args.seq_length, 4, WINDOW, True)
    crossing = sum(n for (owner, to), n in rows.items() if owner // 2 != to // 2)
    row_bytes = args.heads * 2 * args.head_dim * 4  # K|V, float32 both ways
    assert results["ring-window"]["path"] == "halo" and results["ring-window-nohalo"]["path"] == "schedule"
    assert results["ring-window"]["internode_bytes_accounting"] == 2 * crossing * row_bytes
    assert results["ring-window-nohalo"]["internode_bytes_accounting"] == results["ring"]["internode_bytes_accounting"]
    for name in ("ring-window", "ring-window-nohalo"):
        ratio = results[name]["internode_bytes_kernel"] / results[name]["internode_bytes_accounting"]
        assert 1.0 <= ratio < 1.25, (name, ratio)  # a halo's few small messages carry more headers
