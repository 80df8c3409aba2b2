"""The planner on sliding-window layers, against closed forms and brute-force counts.

A windowed layer whose windows reach only nearby ranks is the halo exchange: its priced
transfers must be accounting.halo_bytes (itself asserted against the counters in
tests/test_window.py), its compute the pairs inside the window (counted here on a dense
mask), and neither may depend on C or U. A longer window (or ``halo_exchange=False``)
runs the schedule: the full layer's transfers, the window's compute. With a skip
frequency, a prediction is the mean of the two kinds over the layers' mix (which layers
are windowed: Megatron's own rule, in tests/megatron/test_window_planning.py).
"""

import dataclasses

import pytest
import torch

from megatron_startrail.accounting import AttentionShape, expected_comm, halo_bytes, halo_rows, kept_for_backward_bytes
from megatron_startrail.planning.cluster import ClusterSpec, preset
from megatron_startrail.halo import MAX_HALO_SHARE
from megatron_startrail.planning.planner import (
    BACKWARD_FLOPS_RATIO,
    Workload,
    choose_plan,
    cluster_from_args,
    plan,
    predict,
    visible_pairs,
    window_layers,
)
from megatron_startrail.planning.planner import main as planner_main
from megatron_startrail.planning.planner import parser as planner_parser
from megatron_startrail.topology import valid_team_sizes
from tests.attention_cases import window_mask
from tests.test_planner import Recording, unlimited

WORK = Workload(seq_length=2048, heads=4, kv_heads=2, head_dim=32, batch=1, dtype_bytes=2, causal=True)
WINDOW = (256, 0)  # an eighth of the sequence: reaches two chunks of 8 ranks' 16
CP = 8


def mask_pairs(seq, window, causal):
    """(query, key) pairs inside the window, counted on a dense mask (the reference)."""
    i = torch.arange(seq)
    return int(window_mask(i[None, :] - i[:, None], window, causal).sum())  # key minus query


@pytest.mark.parametrize("seq", [1, 7, 64])
@pytest.mark.parametrize("window", [(0, 0), (3, 0), (5, 2), (-1, 4), (9, -1), (-1, -1), (63, 63), (200, 0)])
@pytest.mark.parametrize("causal", [True, False])
def test_visible_pairs_count_the_window_mask(seq, window, causal):
    assert visible_pairs(seq, window, causal) == mask_pairs(seq, window, causal)


def test_a_skip_list_shorter_than_the_layers_names_the_flag():
    with pytest.raises(ValueError, match="--window-attn-skip-freq"):
        window_layers(4, (1, 0))


def shape_of(work, cp):
    return AttentionShape(work.seq_length // cp, work.batch, work.heads, work.kv_heads, work.head_dim,
                          work.dtype_bytes, v_head_dim=work.v_head_dim)


CONFIGS = [(u, c) for u in (1, 2) for c in valid_team_sizes(CP // u)]


@pytest.mark.parametrize("u,c", CONFIGS)
@pytest.mark.parametrize("window,causal", [(WINDOW, True), ((5, 0), True), ((40, 24), False)])
def test_a_halo_layer_prices_the_halo_bytes_whatever_c_and_u(u, c, window, causal):
    work = dataclasses.replace(WORK, window=window, causal=causal)
    cluster = Recording(nodes=2, gpus_per_node=CP // 2)
    predict(cluster, work, CP, c, u)
    assert not cluster.collectives  # no team, no Ulysses all-to-all
    for rank in range(CP):
        want = halo_bytes(shape_of(WORK, CP), cp_size=CP, window=window, causal=causal, cp_rank=rank)
        sent = sum(n for src, _, n in cluster.p2p if src == rank)
        assert sent == want["forward"]["p2p_bytes_sent"] + want["backward"]["p2p_bytes_sent"]


def test_free_links_leave_the_windows_flops_and_slow_links_the_halos_crossing_bytes():
    work = dataclasses.replace(WORK, window=WINDOW)
    tflops = 0.01
    flops = 2 * work.heads * mask_pairs(work.seq_length, WINDOW, True) * 2 * work.head_dim / CP  # QK^T and PV
    pred = predict(unlimited(gpus_per_node=CP // 2, attention_tflops=tflops), work, CP, 2)
    assert pred.time_s == pytest.approx(flops * (1 + BACKWARD_FLOPS_RATIO) / (tflops * 1e12), rel=1e-9)
    # A slow link and a free kernel: the busiest node's crossing rows, forward in bf16 and
    # backward in float32, one blocking round each.
    gbs = 0.001
    pred = predict(unlimited(gpus_per_node=CP // 2, inter_node_gbs=gbs), work, CP, 2)
    rows = halo_rows(work.seq_length, CP, WINDOW, True)
    row = work.kv_heads * 2 * work.head_dim
    node = lambda rank: rank // (CP // 2)  # noqa: E731
    crossing = [sum(n for (a, b), n in rows.items() if node(a) == x and node(b) != x) for x in (0, 1)]
    back = [sum(n for (a, b), n in rows.items() if node(b) == x and node(a) != x) for x in (0, 1)]
    assert pred.internode_bytes == pytest.approx(max(crossing) * row * 2 + max(back) * row * 4)
    assert pred.time_s == pytest.approx(pred.internode_bytes / (gbs * 1e9), rel=1e-6)


def test_a_halo_layer_keeps_ring_attentions_bytes_and_the_received_rows():
    work = dataclasses.replace(WORK, window=WINDOW, layers=3)
    rows = halo_rows(work.seq_length, CP, WINDOW, True)
    received = max(sum(n for (_, r), n in rows.items() if r == x) for x in range(CP))
    ring = kept_for_backward_bytes(shape_of(WORK, CP), ulysses_size=1, team_size=1, regather_in_backward=False)
    want = 3 * (ring + received * work.kv_heads * 2 * work.head_dim * work.dtype_bytes)
    assert predict(preset("a100-8gpu-100gbe", 1), work, CP, 2).activation_bytes == want


@pytest.mark.parametrize("u,c", CONFIGS)
def test_past_a_quarter_or_without_the_halo_the_schedule_moves_the_full_layers_bytes(u, c):
    # 700 tokens back reach past a quarter of 2048 for some rank: the schedule runs.
    long = dataclasses.replace(WORK, window=(700, 0))
    rows = halo_rows(long.seq_length, CP, long.window, True)
    assert max(sum(n for (_, r), n in rows.items() if r == x) for x in range(CP)) > MAX_HALO_SHARE * long.seq_length
    for work, halo in ((long, True), (dataclasses.replace(WORK, window=WINDOW), False)):
        windowed, full = Recording(nodes=2, gpus_per_node=CP // 2), Recording(nodes=2, gpus_per_node=CP // 2)
        predict(windowed, work, CP, c, u, halo_exchange=halo)
        predict(full, WORK, CP, c, u)
        assert windowed.p2p == full.p2p and windowed.collectives == full.collectives
        for rank in range(CP):  # which are the accounting's closed forms of the schedule
            comm = expected_comm(shape_of(WORK, CP), cp_size=CP, team_size=c, ulysses_size=u, startrail_rank=rank // u)
            sent = sum(n for src, _, n in windowed.p2p if src == rank)
            assert sent == pytest.approx(comm["forward"]["p2p_bytes_sent"] + comm["backward"]["p2p_bytes_sent"])
        # and the compute of the pairs in the window
        fast = unlimited(gpus_per_node=CP // 2, attention_tflops=0.01)
        ratio = mask_pairs(WORK.seq_length, work.window, True) / (WORK.seq_length**2 / 2)
        assert predict(fast, work, CP, c, u, halo_exchange=halo).compute_s == pytest.approx(
            ratio * predict(fast, WORK, CP, c, u).compute_s, rel=1e-9)


@pytest.mark.parametrize("freq", [None, 2, 4, (1, 0, 1, 1, 1, 0, 0, 1)])
def test_with_a_skip_frequency_a_prediction_is_the_mean_over_the_layers_mix(freq):
    cluster, layers = preset("a100-8gpu-100gbe", 1), 8
    work = dataclasses.replace(WORK, window=WINDOW, window_skip_freq=freq, layers=layers)
    windowed, full = window_layers(layers, freq)
    one_windowed = predict(cluster, dataclasses.replace(work, window_skip_freq=None, layers=1), CP, 2)
    one_full = predict(cluster, dataclasses.replace(WORK, layers=1), CP, 2)
    pred = predict(cluster, work, CP, 2)
    for field in ("time_s", "compute_s", "exposed_comm_s", "internode_bytes"):
        want = (windowed * getattr(one_windowed, field) + full * getattr(one_full, field)) / layers
        assert getattr(pred, field) == pytest.approx(want, rel=1e-12), field
    assert pred.activation_bytes == windowed * one_windowed.activation_bytes + full * one_full.activation_bytes


@pytest.mark.parametrize("cluster", [
    preset("h100-nvlink-8x400ib", 4),                             # the default: fast links
    preset("a100-8gpu-100gbe", 4),                                # one 100 GbE link per node
    ClusterSpec(nodes=2, gpus_per_node=16, inter_node_gbs=0.0125, nics_per_node=1,  # the test bed's 100 Mbit/s
                intra_node_gbs=0.2, inter_latency_s=4e-3, intra_latency_s=4e-3, attention_tflops=0.03,
                block_loop=None),
])
def test_a_windowed_layer_is_predicted_cheaper_than_a_full_one(cluster):
    cp = cluster.nodes * cluster.gpus_per_node
    work = Workload(131072, heads=8, kv_heads=8, head_dim=128)
    windowed = dataclasses.replace(work, window=(work.seq_length // 16, 0))
    for u, c in [(1, 1), (1, 2), (1, 4), (2, 1)]:
        if c not in valid_team_sizes(cp // u):
            continue
        full = predict(cluster, work, cp, c, u)
        halo = predict(cluster, windowed, cp, c, u)
        schedule = predict(cluster, windowed, cp, c, u, halo_exchange=False)
        assert halo.time_s < schedule.time_s <= full.time_s, (u, c)
        assert halo.internode_bytes < full.internode_bytes == schedule.internode_bytes
    # The plan: every windowed configuration is the same halo layer; with a skip frequency
    # the fastest team size is the full layers' choice.
    preds = plan(cluster, windowed, cp)
    assert max(p.time_s for p in preds) == pytest.approx(min(p.time_s for p in preds), rel=1e-12)
    inputs = dict(cp_size=cp, ulysses_size=1, gpus_per_node=cluster.gpus_per_node, seq_length=work.seq_length,
                  num_heads=8, num_kv_heads=8, head_dim=128, micro_batch_size=1, dtype_bytes=2, cluster=cluster,
                  layers=4)
    mixed = choose_plan(**inputs, window_size=windowed.window, window_skip_freq=2)
    assert mixed.team_size == choose_plan(**inputs).team_size
    assert mixed.time_s < choose_plan(**inputs).time_s


def test_the_command_line_prices_a_windowed_model(capsys):
    argv = ["--cluster", "a100-8gpu-100gbe", "--nodes", "2", "--cp-size", "16", "--seq-length", "65536",
            "--heads", "8", "--num-layers", "4"]
    args = planner_parser().parse_args(argv + ["--window-size", "4096,0", "--window-attn-skip-freq", "4"])
    assert (args.window_size, args.window_attn_skip_freq) == ((4096, 0), 4)
    args = planner_parser().parse_args(argv + ["--window-attn-skip-freq", "1,1,0,1"])
    assert args.window_attn_skip_freq == (1, 1, 0, 1)
    with pytest.raises(SystemExit):
        planner_parser().parse_args(argv + ["--window-size", "4096"])
    assert "--window-size" in capsys.readouterr().err
    cluster = cluster_from_args(args)
    work = Workload(65536, 8, 8, 128, layers=4, window=(4096, 0), window_skip_freq=4)
    best = plan(cluster, work, 16)[0]
    planner_main(argv + ["--window-size", "4096,0", "--window-attn-skip-freq", "4"])
    out = capsys.readouterr().out
    assert "3 of 4 layers windowed" in out and f"{best.time_s * 1e3:.2f}" in out
