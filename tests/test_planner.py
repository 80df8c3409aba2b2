"""The planner against the accounting's closed forms and the committed measurements.

No expected time below is a constant copied from the model: each is derived here from
the closed forms of megatron_startrail/accounting.py, from FLOPs, bytes and link rates, or
read from the benchmark runs committed under benchmarks/results/.
"""

import glob
import json
import os
from dataclasses import dataclass, field, replace

import pytest

from benchmarks.testbed.cluster_bench import cluster_spec, parser, workload
from benchmarks.testbed.planner_validation import TOLERANCE, cluster_key, load
from benchmarks.testbed.ranking import check_ranking
from megatron_startrail.accounting import AttentionShape, expected_comm, kept_for_backward_bytes
from megatron_startrail.planning.cluster import DEFAULT_CLUSTER, IB_EFFICIENCY, ClusterSpec, preset
from megatron_startrail.planning.memory_model import layer_memory_bytes
from megatron_startrail.planning.planner import (
    BACKWARD_FLOPS_RATIO,
    Workload,
    choose_plan,
    cluster_from_args,
    overlapped_steps,
    plan,
    predict,
)
from megatron_startrail.planning.planner import parser as planner_parser
from megatron_startrail.topology import StarTrailTopology, valid_team_sizes
from megatron_startrail.transfer import sub_ring_lanes

RESULTS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks", "results")
# The runs of benchmarks/testbed/README.md's "Planner vs measurement" (its planner_validation.json lists them).
VALIDATION_RUNS = [os.path.join(RESULTS, os.path.basename(p))
                   for p in json.load(open(os.path.join(RESULTS, "planner_validation.json")))["runs"]]
WORK = Workload(seq_length=8192, heads=4, kv_heads=4, head_dim=32, batch=1, dtype_bytes=4, causal=True)


@dataclass(frozen=True)
class Recording(ClusterSpec):
    """A cluster that logs what the planner prices: P2P rounds as ``(src, dst, bytes)``
    and collectives as ``(groups, bytes per rank)`` (a collective's bandwidth ring is not logged)."""

    p2p: list = field(default_factory=list, compare=False)
    collectives: list = field(default_factory=list, compare=False)

    def exchange_time(self, sends, latency=True):
        sends = list(sends)
        self.p2p.extend(s for s in sends if s[0] != s[1] and s[2])
        return super().exchange_time(sends, latency)

    def collective_time(self, groups, bytes_per_rank, calls=1, ring=True):
        logged = len(self.p2p)
        out = super().collective_time(groups, bytes_per_rank, calls, ring)
        del self.p2p[logged:]
        self.collectives.append((groups, bytes_per_rank))
        return out


def shape_of(work: Workload, cp_size: int) -> AttentionShape:
    return AttentionShape(work.seq_length // cp_size, work.batch, work.heads, work.kv_heads, work.head_dim,
                          work.dtype_bytes, v_head_dim=work.v_head_dim)


def accounted(work, cp_size, c, u, regather, key, pos):
    """Forward + backward ``key`` of StarTrail position ``pos`` in the closed forms."""
    comm = expected_comm(shape_of(work, cp_size), cp_size=cp_size, team_size=c, ulysses_size=u,
                         startrail_rank=pos, regather_in_backward=regather)
    return comm["forward"][key] + comm["backward"][key]


CONFIGS = [(cp, u, c, transfer, regather)
           for cp in (8, 16) for u in (1, 2) for c in valid_team_sizes(cp // u)
           for transfer in ("ring", "multiring") for regather in (False, True)
           if not (regather and c == 1)]
WORKS = [WORK, Workload(8192, heads=4, kv_heads=1, head_dim=32, dtype_bytes=2),  # MQA: rotation "kv"
         Workload(8192, heads=4, kv_heads=4, head_dim=48, v_head_dim=16, dtype_bytes=2)]  # MLA dims


@pytest.mark.parametrize("work", WORKS)
@pytest.mark.parametrize("cp,u,c,transfer,regather", CONFIGS)
def test_priced_transfers_are_the_accounting_closed_forms(work, cp, u, c, transfer, regather):
    cluster = Recording(nodes=2, gpus_per_node=cp // 2)
    predict(cluster, work, cp, c, u, transfer, regather)
    for rank in range(cp):
        pos = rank // u
        p2p = sum(n for src, _, n in cluster.p2p if src == rank)
        coll = sum(n for groups, n in cluster.collectives for g in groups if rank in g and len(g) > 1)
        assert p2p == pytest.approx(accounted(work, cp, c, u, regather, "p2p_bytes_sent", pos), rel=1e-9)
        assert coll == pytest.approx(accounted(work, cp, c, u, regather, "collective_bytes_sent", pos), rel=1e-9)


def committed_rows():
    """Every committed run's row of the project's attention with its counters and calibration."""
    for path in sorted(glob.glob(os.path.join(RESULTS, "*.json"))):
        run = json.load(open(path))
        if "results" not in run:  # not a cluster_bench.py run
            continue
        args = parser().parse_args(run["argv"][1:])
        for r in run["results"]:
            if r.get("impl") != "torch" and "internode_bytes_accounting" in r and "calibration" in r:
                yield os.path.basename(path), args, r


def test_priced_inter_node_bytes_are_the_committed_runs_counters():
    # The bytes the planner prices between nodes (P2P: the project's counters count P2P)
    # are what each run's counters measured crossing nodes, on every committed cluster.
    checked = 0
    for source, args, r in committed_rows():
        world = args.nodes * args.ranks_per_node
        base = cluster_spec(args, r["rate_mbit"], r["calibration"])
        cluster = Recording(**{f: getattr(base, f) for f in ClusterSpec.__dataclass_fields__})
        predict(cluster, workload(args, r.get("window")), world, r["team_size"], r["ulysses"], r["transfer"],
                r.get("regather", False), halo_exchange=r.get("halo", True))
        crossing = sum(n for a, b, n in cluster.p2p if cluster.node_of(a) != cluster.node_of(b))
        assert crossing == pytest.approx(r["internode_bytes_accounting"], rel=1e-9), (source, r["name"])
        checked += 1
    assert checked >= 60  # the 13 validation runs, the memory and full-mesh runs


def test_committed_runs_are_ranked_and_predicted_within_bounds():
    # The 13 validation runs (benchmarks/testbed/README.md, "Planner vs measurement"), priced from
    # each run's own calibration: every pair of configurations one of which was faster in
    # every round is ordered as measured, and every prediction is within 20 %.
    rows = load(VALIDATION_RUNS)
    assert len(rows) >= 70
    clear = wrong = 0
    for key in dict.fromkeys(cluster_key(r) for r in rows):
        group = [r for r in rows if cluster_key(r) == key]
        check = check_ranking(group, group[0]["interleaved"])
        clear, wrong = clear + len(check.clear), wrong + len(check.wrong)
        assert not check.wrong, (key, check.wrong)
    assert clear >= 100  # enough pairs with a measured order for the check to mean something
    errors = {(r["source"], r["rate_mbit"], r["name"]): r["predicted_ms"] / r["time_ms_median"] - 1 for r in rows}
    assert all(abs(e) <= TOLERANCE for e in errors.values()), {k: e for k, e in errors.items() if abs(e) > TOLERANCE}


def unlimited(**kw) -> ClusterSpec:
    """Links with no latency and no limit, a kernel that takes no time (at ``attention_tflops``
    flat: no measured block-loop efficiency): override what matters."""
    return ClusterSpec(**{"nodes": 2, "gpus_per_node": 4, "intra_node_gbs": 1e12, "inter_node_gbs": 1e12,
                          "nics_per_node": 1, "intra_latency_s": 0.0, "inter_latency_s": 0.0,
                          "attention_tflops": 1e15, "block_loop": None, **kw})


@pytest.mark.parametrize("work", WORKS[:2])
def test_a_link_bound_ring_costs_its_crossing_bytes_at_the_link_rate(work):
    # Ring attention on 2 nodes x 4: one rank per node sends across (3 -> 4, 7 -> 0), and
    # every step waits for its transfer. Time = that rank's P2P bytes (closed form) / rate.
    gbs = 0.01
    pred = predict(unlimited(inter_node_gbs=gbs), work, 8, 1)
    crossing = accounted(work, 8, 1, 1, False, "p2p_bytes_sent", 3)
    assert pred.internode_bytes == pytest.approx(crossing)
    assert pred.time_s == pytest.approx(crossing / (gbs * 1e9), rel=1e-6)
    # Overlap has nothing to hide when compute is free; slower compute hides nothing more
    # than itself: time = max(compute, transfer) per step, bounded by their sums.
    slow = predict(unlimited(inter_node_gbs=gbs, attention_tflops=1e-3), work, 8, 1)
    assert max(slow.compute_s, pred.time_s) <= slow.time_s <= slow.compute_s + pred.time_s


@pytest.mark.parametrize("cp,u,c,transfer,regather", CONFIGS)
def test_with_free_links_the_time_is_the_attention_flops(cp, u, c, transfer, regather):
    # FLOPs of one rank: QK^T and PV over its s/P rows of all s columns, half of them
    # causal; the backward 2.5x the forward.
    tflops = 0.05
    flops = 2 * 2 * WORK.batch * WORK.heads * WORK.seq_length**2 * WORK.head_dim / cp / 2
    pred = predict(unlimited(gpus_per_node=cp // 2, attention_tflops=tflops), WORK, cp, c, u, transfer, regather)
    assert pred.time_s == pytest.approx(flops * (1 + BACKWARD_FLOPS_RATIO) / (tflops * 1e12), rel=1e-6)
    assert pred.exposed_comm_s == pytest.approx(0.0, abs=1e-6 * pred.time_s)


@pytest.mark.parametrize("layout", ["2 nodes", "a node per rank"])
@pytest.mark.parametrize("cp,u,c,transfer,regather", CONFIGS)
def test_every_step_of_the_accounting_pays_a_latency(cp, u, c, transfer, regather, layout):
    # Free bandwidth and compute: what is left is latency, at least one per sequential
    # P2P step the closed forms count (the slowest position's); with a node per rank,
    # every step crosses nodes and pays the inter-node latency.
    lat = 1e-3
    nodes = 2 if layout == "2 nodes" else cp
    pred = predict(unlimited(nodes=nodes, gpus_per_node=cp // nodes, intra_latency_s=lat, inter_latency_s=lat),
                   WORK, cp, c, u, transfer, regather)
    steps = max(accounted(WORK, cp, c, u, regather, "p2p_steps", p) for p in range(cp // u))
    assert pred.time_s >= steps * lat * (1 - 1e-9)


def test_multiring_spreads_a_step_over_the_full_mesh_links():
    # TASP on 8 nodes of one rank, full mesh, link-bound: the step's bytes split over the
    # sub-ring's Hamiltonian cycles, one link each, so each link carries 1/lanes of them.
    # Behind one switch port per node (no mesh) the node's bytes are the same either way.
    lanes = len(sub_ring_lanes(StarTrailTopology(8, 1), 0, "multiring"))
    assert lanes > 1
    for mesh, speedup in ((True, lanes), (False, 1)):
        cluster = unlimited(nodes=8, gpus_per_node=1, inter_node_gbs=0.01, inter_node_mesh=mesh)
        ring, tasp = (predict(cluster, WORK, 8, 1, transfer=t).time_s for t in ("ring", "multiring"))
        assert tasp == pytest.approx(ring / speedup, rel=1e-6)


def test_overlap_prices_hidden_and_serialised_steps():
    assert overlapped_steps(1.0, [3.0, 1.0], [1.0, 2.0]) == pytest.approx(3.0 + 2.0)
    assert overlapped_steps(0.0, [3.0, 1.0], [1.0, 2.0]) == pytest.approx(3.0 + 1.0 + 1.0 + 2.0)
    assert overlapped_steps(0.5, [3.0], [1.0]) == pytest.approx(3.0 + 0.5)


def test_the_default_cluster_is_one_preset_everywhere():
    # Documented (cluster.py, planner.py, README): H100, 8 per node, 8 x 400 Gbit/s InfiniBand.
    default = preset(DEFAULT_CLUSTER, 4)
    assert default == ClusterSpec(4)  # the dataclass's defaults
    assert (default.gpus_per_node, default.nics_per_node) == (8, 8)
    assert default.inter_node_gbs == pytest.approx(8 * 400 / 8 * IB_EFFICIENCY)
    assert "8 x 400 Gbit/s" in ClusterSpec.__doc__ and DEFAULT_CLUSTER in ClusterSpec.__doc__
    cli = planner_parser().parse_args(["--nodes", "4", "--cp-size", "32", "--seq-length", "8192", "--heads", "8"])
    assert cluster_from_args(cli) == default
    # --startrail-team-size auto (choose_plan without a cluster) prices the same cluster.
    kw = dict(cp_size=32, ulysses_size=1, gpus_per_node=8, seq_length=131072, num_heads=32, num_kv_heads=8,
              head_dim=128, micro_batch_size=1, dtype_bytes=2)
    assert choose_plan(**kw) == choose_plan(**kw, cluster=default)


def test_a_slow_inter_node_link_prefers_teams_and_fast_links_prefer_the_ring():
    # StarTrail moves fewer bytes across nodes than ring attention and more inside them:
    # with the inter-node link the bottleneck it wins. With compute the bottleneck and
    # every transfer hidden behind it (overlap 1), ring attention exposes only its last
    # hop, while a team also waits on its collectives: the ring wins.
    slow = unlimited(nodes=2, gpus_per_node=8, intra_node_gbs=1.0, inter_node_gbs=50 / 8 / 1000)
    ring, st2 = (predict(slow, WORK, 16, c) for c in (1, 2))
    assert st2.internode_bytes < ring.internode_bytes and st2.time_s < ring.time_s
    assert choose_plan(cp_size=16, ulysses_size=1, gpus_per_node=8, seq_length=8192, num_heads=4,
                       num_kv_heads=4, head_dim=32, micro_batch_size=1, dtype_bytes=4, cluster=slow).team_size > 1
    compute_bound = preset(DEFAULT_CLUSTER, 2, attention_tflops=1e-3, overlap=1.0, block_loop=None)
    assert choose_plan(cp_size=16, ulysses_size=1, gpus_per_node=8, seq_length=8192, num_heads=4,
                       num_kv_heads=4, head_dim=32, micro_batch_size=1, dtype_bytes=4,
                       cluster=compute_bound).team_size == 1


def test_memory_limit_leaves_out_configurations_or_makes_them_regather():
    cluster = unlimited(nodes=2, gpus_per_node=8, intra_node_gbs=1.0, inter_node_gbs=50 / 8 / 1000)
    work = replace(WORK, layers=8)  # enough layers for regathering to pay for its transient
    free = {(p.ulysses_size, p.name): p for p in plan(cluster, work, 16, transfers=("ring",))}
    # The peak is every layer's kept tensors plus one layer's transient (memory_model.py).
    for p in free.values():
        shape = shape_of(work, 16)
        # With Ulysses, one more out share per layer (Note [the Ulysses output kept]).
        kept = kept_for_backward_bytes(shape, ulysses_size=p.ulysses_size, team_size=p.team_size,
                                       regather_in_backward=p.regather_in_backward)
        if p.ulysses_size > 1:
            kept += shape.seq_local * shape.heads * shape.v_dim * shape.batch * shape.dtype_bytes
        layer = layer_memory_bytes(shape, cp_size=16, team_size=p.team_size, ulysses_size=p.ulysses_size,
                                   regather_in_backward=p.regather_in_backward)
        assert p.activation_bytes == 8 * kept and p.peak_bytes == 8 * kept + layer["peak"] - layer["kept"]
    # Below every team's peak as it is: a team stays where the streamed rotation "q" or
    # regathering (tried in that order, then both) brings it under the limit.
    limit = min(p.peak_bytes for p in free.values() if p.team_size > 1) - 1
    tight = {(p.ulysses_size, p.team_size): p for p in plan(cluster, work, 16, transfers=("ring",),
                                                              memory_limit_bytes=limit)}
    options = [(False, "auto"), (False, "q"), (True, "auto"), (True, "q")]
    for p in free.values():
        fitting = [(regather, rotation) for regather, rotation in (options if p.team_size > 1 else options[:2])
                   if predict(cluster, work, 16, p.team_size, p.ulysses_size, regather_in_backward=regather,
                              rotation=rotation).peak_bytes <= limit]
        got = tight.get((p.ulysses_size, p.team_size))
        if not fitting:
            assert got is None
        else:
            assert (got.regather_in_backward, got.rotation) == fitting[0] and got.peak_bytes <= limit
    assert any(p.team_size > 1 for p in tight.values())  # the limit is not one that only ring attention meets
    assert any(p.rotation == "q" or p.regather_in_backward for p in tight.values() if p.team_size > 1)
    # Regathering costs time: the same configuration without it is faster when memory allows.
    loose = {(p.ulysses_size, p.team_size): p.time_s for p in free.values()}
    assert all(p.time_s > loose[key] for key, p in tight.items() if p.regather_in_backward)
    # Below the smallest peak nothing fits; auto says which flag to change.
    least = min(predict(cluster, work, 16, p.team_size, p.ulysses_size, regather_in_backward=regather,
                        rotation=rotation).peak_bytes
                for p in free.values() for regather, rotation in options if p.team_size > 1 or not regather)
    assert plan(cluster, work, 16, memory_limit_bytes=least - 1) == []
    with pytest.raises(ValueError, match="--startrail-memory-limit-gb"):
        choose_plan(cp_size=16, ulysses_size=1, gpus_per_node=8, seq_length=8192, num_heads=4, num_kv_heads=4,
                    head_dim=32, micro_batch_size=1, dtype_bytes=4, cluster=cluster, layers=8,
                    memory_limit_bytes=least - 1)


def test_the_reverse_overlap_is_priced_where_it_runs():
    """Note [reverse overlap]: without it, on sub-rings of one position (P16 C4), rotation q's
    reverse sends stop hiding behind the next piece's compute (bf16: none of the three does) and
    its peak falls; elsewhere (P8 C2: sub-rings of two) nothing changes."""
    work = Workload(131072, 32, 32, 128)
    for cp, team, changes in ((16, 4, True), (8, 2, False)):
        cluster = preset("h100-nvlink-8x400ib", cp // 8)
        overlapped, serial = (predict(cluster, work, cp, team, rotation="q", reverse_overlap=o) for o in (True, False))
        assert (serial.time_s > overlapped.time_s and serial.peak_bytes < overlapped.peak_bytes) == changes
        assert changes or (serial.time_s, serial.peak_bytes) == (overlapped.time_s, overlapped.peak_bytes)
        assert serial.name.endswith("-no-reverse-overlap") and not serial.reverse_overlap
