"""Megatron's CP types priced beside StarTrail (megatron_startrail/planning/cp_types.py).

The byte closed forms are checked against a direct count: the CP type run on simulated
ranks in float64 (outputs and gradients against full attention, so the count is of the
algorithm that really computes the layer), counting the bytes of every piece one rank
hands to another in the all-gather, reduce-scatter, all-to-all or ring step (what
torch.distributed's all_gather_into_tensor / reduce_scatter_tensor / all_to_all_single /
isend would move for those tensors).
"""

import dataclasses
import re

import pytest
import torch

from megatron_startrail.accounting import AttentionShape, allgather_cp_comm, expected_comm
from megatron_startrail.planning.cluster import preset
from megatron_startrail.planning.cp_types import (
    CP_TYPES,
    price_all_gather,
    price_cp_types,
    price_ulysses,
    ulysses_degrees,
    winner,
)
from megatron_startrail.planning.planner import BACKWARD_FLOPS_RATIO, Workload, predict

# Counted in bf16 (e = 2), computed in float64.
SHAPE = AttentionShape(seq_local=4, batch=2, heads=4, kv_heads=2, head_dim=8, dtype_bytes=2, v_head_dim=6)


def chunks_of(rank: int, p: int, n: int) -> torch.Tensor:
    """Sequence positions of CP rank ``rank``: chunks ``rank`` and ``2P-1-rank`` of ``n``."""
    return torch.cat([torch.arange(c * n, (c + 1) * n) for c in (rank, 2 * p - 1 - rank)])


def attention(q, k, v, q_pos, k_pos):
    """Causal attention, [s, b, h, d] with GQA K/V heads, by positions; float64."""
    rep = q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(rep, 2), v.repeat_interleave(rep, 2)
    scores = torch.einsum("sbhd,tbhd->bhst", q, k) / q.shape[-1] ** 0.5
    scores = scores.masked_fill(k_pos[None, None, None, :] > q_pos[None, None, :, None], float("-inf"))
    return torch.einsum("bhst,tbhd->sbhd", scores.softmax(-1), v)


def full_inputs(p: int, generator, shape: AttentionShape = SHAPE):
    s, b = shape.seq_local * p, shape.batch
    draw = lambda *size: torch.randn(*size, dtype=torch.float64, generator=generator)  # noqa: E731
    return (draw(s, b, shape.heads, shape.head_dim), draw(s, b, shape.kv_heads, shape.head_dim),
            draw(s, b, shape.kv_heads, shape.v_dim), draw(s, b, shape.heads, shape.v_dim))


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * SHAPE.dtype_bytes  # the accounting's dtype, not float64's


@pytest.mark.parametrize("p", [2, 4])
def test_allgather_cp_bytes_are_a_direct_count(p):
    """all_gather: K, V gathered (forward and again in the backward), dK, dV reduce-scattered;
    every rank's output and gradients equal full attention's."""
    g = torch.Generator().manual_seed(p)
    q, k, v, dout = full_inputs(p, g)
    n = SHAPE.seq_local // 2
    pos = [chunks_of(r, p, n) for r in range(p)]
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    ref_out = attention(*ref, torch.arange(len(q)), torch.arange(len(q)))
    (ref_out * dout).sum().backward()

    sent = {r: {"forward": 0, "backward": 0} for r in range(p)}
    dk_full, dv_full = torch.zeros_like(k), torch.zeros_like(v)
    for r in range(p):
        # all_gather_into_tensor of K and V: every other rank's local piece lands here.
        gathered = [k[pos[src]] for src in range(p)], [v[pos[src]] for src in range(p)]
        for src in range(p):
            if src != r:  # bandwidth-optimal: a rank sends (P-1) pieces, as it receives
                sent[r]["forward"] += nbytes(gathered[0][src]) + nbytes(gathered[1][src])
        all_pos = torch.cat(pos)
        kg = torch.cat(gathered[0]).requires_grad_()
        vg = torch.cat(gathered[1]).requires_grad_()
        qr = q[pos[r]].clone().requires_grad_()
        out = attention(qr, kg, vg, pos[r], all_pos)
        torch.testing.assert_close(out, ref_out.detach()[pos[r]])
        (out * dout[pos[r]]).sum().backward()
        torch.testing.assert_close(qr.grad, ref[0].grad[pos[r]])
        # Backward: the same gather again, then reduce_scatter_tensor of the whole-sequence dK, dV:
        # the slices of the other ranks' positions leave this rank.
        sent[r]["backward"] += sent[r]["forward"]
        for dst in range(p):
            if dst != r:
                rows = slice(dst * 2 * n, (dst + 1) * 2 * n)  # gathered in rank order
                sent[r]["backward"] += nbytes(kg.grad[rows]) + nbytes(vg.grad[rows])
        dk_full[all_pos] += kg.grad
        dv_full[all_pos] += vg.grad
    torch.testing.assert_close(dk_full, ref[1].grad)
    torch.testing.assert_close(dv_full, ref[2].grad)
    closed = allgather_cp_comm(SHAPE, cp_size=p)
    for r in range(p):
        for phase in ("forward", "backward"):
            assert closed[phase]["collective_bytes_sent"] == sent[r][phase]
            assert closed[phase]["p2p_bytes_sent"] == 0


@pytest.mark.parametrize("p,u", [(4, 4), (4, 2)])
def test_ulysses_and_a2a_p2p_bytes_are_a_direct_count(p, u):
    """a2a (U = P) and a2a+p2p (U < P, a ring of P/U after it): the all-to-all pieces of
    q, k, v (forward), out back; the ring's K, V steps; against expected_comm's closed form
    (team size 1), and the attention computed that way against full attention."""
    g = torch.Generator().manual_seed(10 * p + u)
    shape = dataclasses.replace(SHAPE, heads=8, kv_heads=4)  # TE's all-to-all: K/V heads divisible by U
    q, k, v, _ = full_inputs(p, g, shape)
    n = SHAPE.seq_local // 2
    pos = [chunks_of(r, p, n) for r in range(p)]
    full = attention(q, k, v, torch.arange(len(q)), torch.arange(len(q)))
    a2a = {r: 0 for r in range(p)}

    def head_split(t, r):  # [s, b, h, d] -> U pieces of h/U heads; piece j to Ulysses rank j
        return t[pos[r]].chunk(u, dim=2)

    groups = [list(range(s * u, (s + 1) * u)) for s in range(p // u)]  # consecutive CP ranks
    after = {}  # (position s, Ulysses rank x) -> (positions, q, k, v) after the all-to-all
    for group in groups:
        for x, dst in enumerate(group):
            for src in group:
                pieces = [head_split(t, src)[x] for t in (q, k, v)]
                if src != dst:
                    a2a[src] += sum(nbytes(t) for t in pieces)
            after[(group[0] // u, x)] = (
                torch.cat([pos[src] for src in group]),
                *(torch.cat([head_split(t, src)[x] for src in group]) for t in (q, k, v)))
    ring_sent = {key: 0 for key in after}
    for (s, x), (qpos, qx, _, _) in after.items():
        # The ring over positions (same Ulysses rank x): P/U - 1 steps, each sending the K, V held.
        keys = [after[(t, x)] for t in range(p // u)]
        for step in range(p // u - 1):
            held = keys[(s - step) % (p // u)]
            ring_sent[(s, x)] += nbytes(held[2]) + nbytes(held[3])
        out = attention(qx, torch.cat([t[2] for t in keys]), torch.cat([t[3] for t in keys]), qpos,
                        torch.cat([t[0] for t in keys]))
        heads = slice(x * shape.heads // u, (x + 1) * shape.heads // u)
        torch.testing.assert_close(out, full[qpos][:, :, heads])
        # out goes back by the all-to-all: U pieces of the sequence, all but one to another rank.
        a2a[s * u + x] += sum(nbytes(piece) for j, piece in enumerate(out.chunk(u, dim=0)) if j != x)
    for (s, x), ring in ring_sent.items():
        closed = expected_comm(shape, cp_size=p, team_size=1, ulysses_size=u, startrail_rank=s)
        for phase in ("forward", "backward"):  # the backward's all-to-alls: dout in, dq, dk, dv out
            assert closed[phase]["collective_bytes_sent"] == a2a[s * u + x]
        assert closed["forward"]["p2p_bytes_sent"] == ring


def test_ulysses_degree_rule():
    """TE's all-to-all needs the K/V heads divisible by U; StarTrail's Ulysses replicates K/V
    up to U; the hybrids keep U inside a node; a2a itself needs both heads divisible by CP."""
    cluster = preset("h100-nvlink-8x400ib", 2)
    gqa, mha = Workload(131072, 32, 8, 128), Workload(131072, 32, 32, 128)
    assert ulysses_degrees(gqa, 16, cluster, replicate_kv=False) == [2, 4, 8]
    assert ulysses_degrees(Workload(131072, 32, 2, 128), 16, cluster, replicate_kv=False) == [2]
    assert ulysses_degrees(Workload(131072, 32, 2, 128), 16, cluster, replicate_kv=True) == [2, 4, 8]
    assert ulysses_degrees(mha, 8, preset("h100-nvlink-8x400ib", 1), replicate_kv=False) == [2, 4]  # U < CP
    assert price_ulysses(cluster, gqa, 16).time_s is None
    assert "not divisible by CP 16" in price_ulysses(cluster, gqa, 16).why_not
    assert price_ulysses(cluster, mha, 16).time_s is not None
    assert price_ulysses(preset("h100-nvlink-8x400ib", 8), mha, 64).time_s is None  # 64 > 32 heads


def test_cp_type_prices():
    """Each price from its parts: all-gather three exposed collectives (node-striped) and the
    compute; Ulysses its all-to-alls and one fused call; the others the planner's predict;
    the winner the fastest."""
    cluster = preset("h100-nvlink-1x400ib", 4)
    work = Workload(262144, 32, 8, 128)
    cp = 32
    prices = price_cp_types(cluster, work, cp)
    assert set(prices) == set(CP_TYPES)
    assert prices["ring"].time_s == predict(cluster, work, cp, 1).time_s
    assert prices["startrail"].time_s == min(predict(cluster, work, cp, c).time_s for c in (2, 4))
    assert prices["a2a+p2p"].time_s == min(predict(cluster, work, cp, 1, u).time_s for u in (2, 4, 8))
    assert prices["a2a+startrail"].time_s == min(predict(cluster, work, cp, c, u).time_s
                                                 for u, cs in ((2, (2, 4)), (4, (2,)), (8, (2,))) for c in cs)
    assert winner(prices) == min((p for p in prices.values() if p.time_s), key=lambda p: p.time_s).cp_type

    ag = price_all_gather(cluster, work, cp)
    kv_bytes = work.seq_length // cp * work.kv_heads * 2 * work.head_dim * 2
    one_nic_node_rate = cluster.inter_node_gbs * 1e9  # striped: the node's rate, not a NIC's
    compute = (1 + BACKWARD_FLOPS_RATIO) * work.attention_flops(cp) / cluster.attention_rate(work.seq_length / cp)
    # Three collectives of (P-1) pieces, each crossing the node boundary, 2 calls each, P-1 hops.
    comm = 3 * ((cp - 1) * kv_bytes / one_nic_node_rate + 2 * (cp - 1) * cluster.inter_latency_s)
    assert ag.time_s == pytest.approx(compute + comm, rel=1e-9)
    fused = (1 + BACKWARD_FLOPS_RATIO) * work.attention_flops(cp) / (cluster.attention_tflops * 1e12)
    assert ag.fused_rate_time_s == pytest.approx(fused + comm, rel=1e-9)

    # Ulysses on one node (NVLink only): 8 all-to-alls, one fused call.
    node = preset("h100-nvlink-8x400ib", 1)
    mha = Workload(65536, 32, 32, 128)
    uly = price_ulysses(node, mha, 8)
    tensors = mha.seq_length // 8 * 32 * (128 + 2 * 128 + 128) * 2  # q, k, v, out of one rank
    a2a = 2 * (7 / 8 * tensors / (node.intra_node_gbs * 1e9) + 4 * node.intra_latency_s)
    assert uly.time_s == pytest.approx(a2a + (1 + BACKWARD_FLOPS_RATIO) * mha.attention_flops(8)
                                       / (node.attention_tflops * 1e12), rel=1e-9)


def test_paper_clusters_md_has_every_cp_type_per_row():
    """The committed table lists every CP type on every H100 row (2 presets x 2 head layouts x
    4 node counts x 4 lengths) and names the winner; two rows re-priced against it."""
    import os

    from benchmarks.planner import paper_clusters

    md = open(os.path.join(os.path.dirname(os.path.dirname(__file__)), "benchmarks/results/paper_clusters.md")).read()
    section = md.split("## Every CP type")[1]
    rows = [line for line in section.splitlines() if re.match(r"\| \d+ \(\d+\) \| \d+K \|", line)]
    assert len(rows) == 2 * 2 * 4 * 4
    assert all(len(r.split("|")) == len(CP_TYPES) + 6 for r in rows)
    for links, heads, nodes, tokens in (("1x400Gbps IB", "MHA 32 x 128", 16, 131072),
                                        ("8x400Gbps IB", "GQA 32/8 x 128", 2, 1048576)):
        cluster = preset(paper_clusters.H100_LINKS[links], nodes)
        work = Workload(tokens, 32, paper_clusters.H100_HEADS[heads], 128)
        prices = price_cp_types(cluster, work, nodes * 8)
        table = section.split(f"### {links}, {heads}")[1].split("###")[0]
        row = next(r for r in table.splitlines() if r.startswith(f"| {nodes} ({nodes * 8}) | {tokens // 1024}K |"))
        assert [c.strip() for c in row.split("|")[3:3 + len(CP_TYPES)]] == [
            paper_clusters.cp_type_cell(prices[t]) for t in CP_TYPES]
        assert paper_clusters.LABELS[winner(prices)] in row
