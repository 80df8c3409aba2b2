"""Block kernels against float64 attention, the lse merge's edge cases, causal plans."""

import pytest
import torch

from megatron_startrail.blocks import merge_lse_, merge_partials
from megatron_startrail.kernels import ReferenceKernel, TorchCPUFlashKernel, kernel_for
from megatron_startrail.layout import (
    KernelCall,
    Documents,
    cp_rank_segments,
    dense_sequence,
    plan_calls,
    rows_of_cp_ranks,
    segment_rows,
    split_rows,
    split_segments,
    zigzag_chunks,
)
from tests.attention_cases import TOLERANCE, flash_rule, plan_coverage, reference_with_grads, relative_error, zigzag_ranges

KERNELS = [ReferenceKernel(), TorchCPUFlashKernel()]


def whole_chunks(chunks, chunk_len):
    """Segments (document 0, start, stop) of whole chunks of one dense sequence, in the order listed."""
    return tuple((0, c * chunk_len, (c + 1) * chunk_len) for c in chunks)


def float64_call(q, k, v, dout, call, scale):
    """A call's out, lse and gradients in float64 by autograd, sequence by sequence with
    :func:`flash_rule`; nothing of the project's kernels. ``[T, b, h, d]`` tensors."""
    q, k, v = (t.double().requires_grad_(True) for t in (q, k, v))
    outs, lses = [], []
    cq, ck = call.cu_seqlens_q, call.cu_seqlens_k
    for i in range(len(cq) - 1):
        qi, ki, vi = q[cq[i]:cq[i + 1]], k[ck[i]:ck[i + 1]], v[ck[i]:ck[i + 1]]
        ki = ki.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
        vi = vi.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
        scores = torch.einsum("qbhd,kbhd->bhqk", qi, ki) * scale
        scores = scores.masked_fill(~flash_rule(qi.shape[0], ki.shape[0], call.window), float("-inf"))
        lse = torch.logsumexp(scores, dim=-1)  # [b, h, sq]
        probs = torch.exp(scores - lse.masked_fill(lse.isneginf(), 0)[..., None])
        outs.append(torch.einsum("bhqk,kbhd->qbhd", probs, vi))
        lses.append(lse)
    out, lse = torch.cat(outs), torch.cat(lses, dim=-1)
    out.backward(dout.double())
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


def random_call(gen, window, n_seq=3):
    """A call of ``n_seq`` sequences of random, unequal lengths (rows packed in order)."""
    lq = torch.randint(1, 9, (n_seq,), generator=gen).tolist()
    lk = torch.randint(1, 9, (n_seq,), generator=gen).tolist()
    return KernelCall.back_to_back(zip(lq, lk), window)


WINDOWS = [(-1, -1), (-1, 0), (3, 0), (0, -1), (2, 1), (4, -1), (-1, 2)]


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
@pytest.mark.parametrize("window", WINDOWS, ids=str)
def test_block_kernel_has_flash_attns_varlen_semantics(kernel, dtype, kv_heads, window):
    """Sequences of unequal query and key lengths in one call, every window class the planner
    makes (causal bottom-right aligned), GQA/MQA, MLA's v head dim: against float64."""
    gen = torch.Generator().manual_seed(5 + kv_heads)
    call = random_call(gen, window)
    tq, tk = call.cu_seqlens_q[-1], call.cu_seqlens_k[-1]
    b, h, d, dv = 2, 4, 8, 6
    q, k, v, dout = (torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
                     for shape in [(tq, b, h, d), (tk, b, kv_heads, d), (tk, b, kv_heads, dv), (tq, b, h, dv)])
    scale = d**-0.5
    ref_out, ref_lse, ref_dq, ref_dk, ref_dv = float64_call(q, k, v, dout, call, scale)
    out, lse = kernel.forward(q, k, v, call, scale=scale)
    assert out.dtype == dtype and lse.dtype == torch.float32 and lse.shape == (b, h, tq) and out.shape == (tq, b, h, dv)
    seen = ~ref_lse.isneginf()  # rows that see no key: out 0, lse -inf (flash-attn returns them too)
    assert torch.equal(~lse.isneginf(), seen)
    assert out.double().permute(1, 2, 0, 3)[~seen].abs().max().item() == 0 if (~seen).any() else True
    tol = TOLERANCE[dtype]
    assert relative_error(out, ref_out) <= tol
    assert relative_error(lse[seen], ref_lse[seen]) <= tol
    if (~seen).any():
        return  # flash-attn's backward is not defined for rows that see nothing; the planner makes none
    dq, dk, dv_ = kernel.backward(dout, q, k, v, out, lse, call, scale=scale)
    for got, want in ((dq, ref_dq), (dk, ref_dk), (dv_, ref_dv)):
        assert got.shape == want.shape
        assert relative_error(got, want) <= tol


def test_reference_kernel_is_exact_in_float64():
    gen = torch.Generator().manual_seed(1)
    call = random_call(gen, (-1, 0))
    tq, tk = call.cu_seqlens_q[-1], call.cu_seqlens_k[-1]
    q, dout = (torch.randn(tq, 1, 2, 4, generator=gen, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(tk, 1, 2, 4, generator=gen, dtype=torch.float64) for _ in range(2))
    out, lse = ReferenceKernel().forward(q, k, v, call, scale=0.5)
    want = float64_call(q, k, v, dout, call, 0.5)
    assert relative_error(out, want[0]) <= 1e-14


def float64_attention(q, k, v, dout, scale):
    """Plain float64 softmax attention on ``[s, b, h, d]`` (no mask): out, lse ``[b, h, s]``
    and the gradients of q, k, v for ``dout``, by autograd; nothing of the project's kernels."""
    q, k, v = (t.double().requires_grad_(True) for t in (q, k, v))
    scores = torch.einsum("qbhd,kbhd->bhqk", q, k) * scale
    out = torch.einsum("bhqk,kbhd->qbhd", torch.softmax(scores, dim=-1), v)
    out.backward(dout.double())
    return out.detach(), torch.logsumexp(scores, dim=-1).detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.name)
def test_block_backward_with_merged_lse_is_exact_per_block(kernel):
    # The schedule's premise: keys split in calls, forward parts merged by lse, then each
    # call's backward run with the *merged* (final) out and lse gives that call's exact
    # share of the gradients. Checked against float64 attention over all keys, not against
    # the kernel on the whole key range (a kernel bug would then cancel out).
    gen = torch.Generator().manual_seed(2)
    q, k, v, dout = (torch.randn(16, 1, 2, 8, generator=gen) for _ in range(4))
    scale = 0.3
    ref_out, ref_lse, ref_dq, ref_dk, ref_dv = float64_attention(q, k, v, dout, scale)
    blocks = [(0, 5), (5, 11), (11, 16)]  # uneven key blocks
    calls = [KernelCall(((0, 16),), (((a, b),),)) for a, b in blocks]
    acc_out = torch.zeros(1, 2, 16, 8)
    acc_lse = torch.full((1, 2, 16), float("-inf"))
    for call, (a, b) in zip(calls, blocks):
        o, l = kernel.forward(q, k[a:b], v[a:b], call, scale=scale)
        merge_lse_(acc_out, acc_lse, o.permute(1, 2, 0, 3), l)
    tol = TOLERANCE[torch.float32]
    out = acc_out.permute(2, 0, 1, 3)
    assert relative_error(out, ref_out) <= tol and relative_error(acc_lse, ref_lse) <= tol
    dq = torch.zeros_like(q)
    dk, dv = [], []
    for call, (a, b) in zip(calls, blocks):
        gq, gk, gv = kernel.backward(dout, q, k[a:b], v[a:b], out, acc_lse, call, scale=scale)
        dq += gq
        dk.append(gk)
        dv.append(gv)
    for got, want in ((dq, ref_dq), (torch.cat(dk), ref_dk), (torch.cat(dv), ref_dv)):
        assert relative_error(got, want) <= tol


def test_merge_of_a_first_part_and_the_team_merge_of_rows_nobody_saw():
    # Rows that have seen nothing yet (acc_lse -inf) take the new part whole; a call's rows
    # always see a key (Note [kernel calls]), so its lse is finite.
    acc_out = torch.full((1, 1, 3, 2), 0.0)
    acc_lse = torch.tensor([[[float("-inf"), 0.0, float("-inf")]]])
    acc_out[0, 0, 1] = torch.tensor([9.0, 9.0])
    out = torch.tensor([[[[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]]])
    lse = torch.tensor([[[0.5, 0.0, 1.0]]])
    merge_lse_(acc_out, acc_lse, out, lse)
    assert not acc_out.isnan().any()
    assert acc_out[0, 0, 0].tolist() == [1.0, 2.0] and acc_out[0, 0, 2].tolist() == [5.0, 6.0]
    assert acc_out[0, 0, 1].tolist() == [6.0, 6.5]  # equal weights: the mean
    assert torch.allclose(acc_lse, torch.tensor([[[0.5, torch.log(torch.tensor(2.0)).item(), 1.0]]]))
    # Team merge: member 0 saw nothing for row 0, member 1 everything; a row nobody saw -> 0.
    outs = torch.stack([torch.full((1, 1, 2, 2), 7.0), torch.full((1, 1, 2, 2), 3.0)])
    lses = torch.tensor([[[[float("-inf"), float("-inf")]]], [[[0.0, float("-inf")]]]])
    merged, merged_lse = merge_partials(outs, lses)
    assert not merged.isnan().any()
    assert merged[0, 0, 0].tolist() == [3.0, 3.0] and merged[0, 0, 1].tolist() == [0.0, 0.0]
    assert merged_lse[0, 0, 1].item() == float("-inf")


def _positions(segments):
    return torch.tensor([t for _, a, b in segments for t in range(a, b)])


@pytest.mark.parametrize("seed", range(30))
def test_plan_covers_exactly_the_visible_pairs(seed):
    # Random runs of tokens of random chunks (two documents), on both sides, against a
    # brute-force mask, with and without windows and a cap on the rows of a call.
    rng = torch.Generator().manual_seed(seed)
    chunk_len = 6

    def random_segments():
        segs = []
        for chunk in torch.randperm(5, generator=rng)[: 1 + seed % 4].tolist():
            a, b = sorted(torch.randint(0, chunk_len + 1, (2,), generator=rng).tolist())
            doc = int(chunk * chunk_len + a >= 13)  # document 1 from position 13
            cut = min(max(13, chunk * chunk_len + a), chunk * chunk_len + b)
            for d, lo, hi in ((0, chunk * chunk_len + a, min(cut, chunk * chunk_len + b)),
                              (1, max(cut, chunk * chunk_len + a), chunk * chunk_len + b)):
                if hi > lo and (d == 0) == (hi <= 13):
                    segs.append((d, lo, hi))
            del doc
        return tuple(segs) or ((0, 0, chunk_len),)

    q_segments, k_segments = random_segments(), random_segments()
    qp, kp = _positions(q_segments), _positions(k_segments)
    qd = torch.tensor([d for d, a, b in q_segments for _ in range(a, b)])
    kd = torch.tensor([d for d, a, b in k_segments for _ in range(a, b)])
    delta = kp[None, :] - qp[:, None]
    for causal in (True, False):
        for window in (None, (3, 0), (0, 2), (7, 4), (4, -1), (-1, 1)):
            for max_rows, whole_key_runs in ((None, False), (5, False), (5, True)):
                visible = qd[:, None] == kd[None, :]
                if causal:
                    visible &= delta <= 0
                if window is not None:
                    if window[0] >= 0:
                        visible &= delta >= -window[0]
                    if window[1] >= 0:
                        visible &= delta <= window[1]
                got = plan_coverage(q_segments, k_segments, causal, window, max_rows, whole_key_runs)
                assert torch.equal(got, visible.long()), (causal, window, max_rows, whole_key_runs)


def _class_count(q, k, causal, window=None):
    return len(plan_calls(whole_chunks(q, 4), whole_chunks(k, 4), causal, window))


def test_causal_plan_matches_the_chunk_picture():
    # CP = 2: rank 0 holds chunks (0, 3), rank 1 holds (1, 2); chunks of 4 tokens.
    assert zigzag_chunks(0, 2) == (0, 3) and zigzag_chunks(1, 2) == (1, 2)

    def plan(q, k):
        return [(c.q_rows, c.k_rows, c.window) for c in plan_calls(whole_chunks(q, 4), whole_chunks(k, 4), True)]

    # query chunk 0 sees nothing of (1, 2); query chunk 3 sees both, in one call, no gather.
    assert plan((0, 3), (1, 2)) == [(((4, 8),), (((0, 8),),), (-1, -1))]
    # query chunks 1 and 2 both see all of key chunk 0 (and none of 3): one sequence.
    assert plan((1, 2), (0, 3)) == [(((0, 8),), (((0, 4),),), (-1, -1))]
    # Against itself: chunks 0 and 3 in storage order are in position order, so one causal sequence
    # over both (Note [own rows in one call]) holds the full block (chunk 3 sees chunk 0) and the
    # two diagonals: one call, views on both sides.
    assert plan((0, 3), (0, 3)) == [(((0, 8),), (((0, 8),),), (-1, 0))]
    # Stored the other way round they are not: the full block and the two diagonals, two calls.
    assert plan((3, 0), (3, 0)) == [(((0, 4),), (((4, 8),),), (-1, -1)),
                                    (((0, 4), (4, 8)), (((0, 4),), ((4, 8),)), (-1, 0))]
    # Ulysses U=2 over CP=4: StarTrail position 1 holds CP ranks 2 and 3's chunks, (2, 5, 3, 4)
    # of 8 chunks of 8 tokens (what team.team_segments asks for).
    assert rows_of_cp_ranks(Documents(4, (0, 64)), (2, 3)) == tuple((0, 8 * c, 8 * c + 8) for c in (2, 5, 3, 4))


def test_calls_do_not_grow_with_documents_or_window_tiles():
    """Note [kernel calls]: the calls of a step are one per window class, whatever the
    number of documents or the window's length."""
    q = k = whole_chunks((0, 1, 2, 3), 64)
    assert _class_count((0, 1, 2, 3), (0, 1, 2, 3), True, (5, 0)) == 1  # one run of keys: one band
    for window in ((5, 0), (40, 0), (100, 0)):
        calls = plan_calls(whole_chunks((0, 3), 64), whole_chunks((1, 2), 64), True, window)
        assert len(calls) <= 2, (window, calls)
    # 64 one-token documents against themselves: one call.
    docs = tuple((i, i, i + 1) for i in range(64))
    assert len(plan_calls(docs, docs, True)) == 1 and len(plan_calls(docs, docs, False)) == 1
    assert len(plan_calls(q, k, True, None, 256)) == 1


def test_split_segments_cuts_storage_in_contiguous_parts():
    segs = whole_chunks((3, 0, 5), 7)  # 21 rows
    parts = split_segments(segs, 4)
    assert split_rows(21, 4) == [(0, 5), (5, 10), (10, 15), (15, 21)]
    assert parts[1] == ((0, 26, 28), (0, 0, 3))  # rows 5..10: the end of chunk 3, the start of chunk 0
    assert torch.equal(_positions(sum(parts, ())), _positions(segs))


def test_segment_rows_is_a_row_slice_of_the_storage():
    # A piece of a lane's part (multiring parts and initial-send pieces do not align),
    # with documents and padding: the segments of rows [a, b) hold exactly those rows.
    segs = ((0, 3, 7), (-1, 7, 9), (1, 0, 5), (2, 10, 12))  # 13 rows

    def per_row(segments):  # (document, position) of every row
        return [(doc, t) for doc, lo, hi in segments for t in range(lo, hi)]

    for a, b in ((0, 13), (2, 6), (4, 11), (6, 6), (12, 13)):
        assert per_row(segment_rows(segs, a, b)) == per_row(segs)[a:b]
    assert segment_rows(segs, 5, 10) == ((-1, 8, 9), (1, 0, 4))  # cut inside the padding


@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
def test_package_layout_is_megatrons(cp):
    # The tests lay out their inputs with their own copy of Megatron's layout
    # (tests.attention_cases.zigzag_ranges); the package's chunks and a dense sample's
    # segments must hold the same rows, in the same order.
    chunk = 5
    for r in range(cp):
        want = zigzag_ranges(r, cp, 2 * cp * chunk)
        assert [(c * chunk, (c + 1) * chunk) for c in zigzag_chunks(r, cp)] == want
        assert [(a, b) for _, a, b in cp_rank_segments(dense_sequence(cp, 2 * chunk), r)] == want


@pytest.mark.parametrize("cp", [2, 4, 8, 16])
def test_zigzag_pairs_balance_causal_work(cp):
    # A query pair against a key pair of whole chunks: two full blocks (2 L^2), or, for
    # the pair against itself, one full block and two diagonal ones (2 L^2 + L).
    chunk_len = 4
    for x in range(cp):
        for y in range(cp):
            q, k = whole_chunks(zigzag_chunks(x, cp), chunk_len), whole_chunks(zigzag_chunks(y, cp), chunk_len)
            work = plan_coverage(q, k, True).sum().item()
            assert work == 2 * chunk_len**2 + (chunk_len if x == y else 0)


def test_kernel_for_cpu_tensors():
    q, k, v = (torch.randn(8, 2, 16) for _ in range(3))
    assert kernel_for(q, k, v).name == "torch_cpu_flash"
    assert kernel_for(q, k, v, "reference").name == "reference"
    with pytest.raises(ValueError, match="kernel"):
        kernel_for(q, k, v, "flash_attn")
    with pytest.raises(ValueError, match="kernel"):
        kernel_for(q, k, v, "nope")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_gqa_head_groups_are_summed_in_float32_and_rounded_once(dtype):
    # dK, dV of GQA 32/4 from a kernel that ran on expanded heads: 8 query heads' gradients per
    # K/V head. Summed in float32, each entry is the exact sum rounded once: within half an
    # ulp of the float64 sum (a running sum in bf16 would round 7 times). torch's own reductions
    # of half types accumulate in float32 too (this test passed with a plain .sum on the CPU);
    # the explicit dtype makes it the kernel's contract whatever reduction runs.
    from megatron_startrail.kernels.reference import sum_kv_head_groups

    x = torch.randn(2, 32, 64, 16, generator=torch.Generator().manual_seed(3)).to(dtype)
    got = sum_kv_head_groups(x, 4)
    assert got.dtype == dtype and got.shape == (2, 4, 64, 16)
    exact = x.double().view(2, 4, 8, 64, 16).sum(dim=2)
    half_ulp = exact.abs() * torch.finfo(dtype).eps / 2 + torch.finfo(dtype).tiny
    assert ((got.double() - exact).abs() <= half_ulp).all()
    running = x[:, ::8].clone()  # a running sum in the input's dtype, for contrast: it does not hold
    for j in range(1, 8):
        running += x[:, j::8]
    assert ((running.double() - x.double().view(2, 4, 8, 64, 16).sum(dim=2)).abs() > half_ulp).any()


@pytest.mark.parametrize("parts", [2, 4])
@pytest.mark.parametrize("with_sink", [False, True], ids=["plain", "sink"])
def test_the_team_merge_writes_the_normalised_result_in_its_last_op(parts, with_sink):
    # Note [merged in place] (blocks.py): the team merge with ``dtype`` gives what the merge,
    # the sinks' normalisation (add_sink_) and finished()'s cast gave in three passes, within
    # float64 rounding, rows nobody saw included (out 0; lse -inf, or the sink's logit)...
    from megatron_startrail.blocks import finished

    gen = torch.Generator().manual_seed(parts)
    outs = torch.randn(parts, 2, 3, 5, 4, generator=gen, dtype=torch.float64)
    lses = torch.randn(parts, 2, 3, 5, generator=gen, dtype=torch.float64)
    lses[:, :, :, 0] = float("-inf")  # row 0: nobody saw a key
    lses[0, :, :, 1] = float("-inf")  # row 1: member 0 saw none
    sink = torch.randn(3, generator=gen, dtype=torch.float64) if with_sink else None
    merged, merged_lse = merge_partials(outs, lses)
    want, want_lse = finished(merged, merged_lse, torch.float64, sink)
    got, got_lse = merge_partials(outs, lses, torch.float64, sink)
    assert got.shape == want.shape == (5, 2, 3, 4) and got_lse.shape == want_lse.shape == (5, 2, 3)
    assert torch.allclose(got, want, rtol=0, atol=1e-14) and not got.isnan().any()
    assert torch.equal(got_lse.isneginf(), want_lse.isneginf())
    finite = want_lse.isfinite()
    assert torch.allclose(got_lse[finite], want_lse[finite], rtol=0, atol=1e-14)
    # ...and moves at most (6 + 10 (C - 2) + 8) bytes per element of bf16 parts as memory sees
    # them (the first product, an addcmul_ per middle part, the last one written cast), plus
    # one for the per-row lse work: the three passes moved 30 at C = 2, 66 at C = 4. Counted
    # with the layer-traffic counter (its touched bytes), on meta.
    from benchmarks.counters.launch_budget import Counts, _OpCounter

    counts = Counts()
    meta = dict(device="meta")
    with _OpCounter(counts):
        merge_partials(torch.empty(parts, 1, 8, 1024, 128, dtype=torch.bfloat16, **meta),
                       torch.empty(parts, 1, 8, 1024, **meta), torch.bfloat16,
                       torch.empty(8, **meta) if with_sink else None)
    elements = 8 * 1024 * 128
    assert counts.touched <= (6 + 10 * (parts - 2) + 8 + 1) * elements, dict(counts.by_op_bytes)


def test_exchange_parts_casts_the_seen_rows_and_writes_the_unseen_ones_zero():
    # Note [unseen rows]: C = 3 members of n = 4 rows; unseen runs inside member 0, across the edge of
    # members 1 and 2, and member 2's end. The unseen rows of acc_out are NaN (never written): the
    # exchange buffer has 0 there and the float32 rows cast everywhere else.
    from megatron_startrail.blocks import exchange_parts  # noqa: PLC0415

    gen = torch.Generator().manual_seed(0)
    b, h, c, n, dv = 2, 3, 3, 4, 5
    acc_out = torch.randn(b, h, c * n, dv, generator=gen)
    unseen = [(10, 12), (1, 2), (6, 9)]  # any order
    seen = torch.ones(c * n, dtype=torch.bool)
    for a, e in unseen:
        acc_out[:, :, a:e] = float("nan")
        seen[a:e] = False
    parts = exchange_parts(acc_out, unseen, c, torch.bfloat16)
    assert parts.shape == (c, b, h, n, dv) and parts.dtype == torch.bfloat16 and parts.is_contiguous()
    want = torch.where(seen[:, None], acc_out, 0.0).view(b, h, c, n, dv).permute(2, 0, 1, 3, 4).to(torch.bfloat16)
    assert torch.equal(parts, want)
    assert torch.equal(exchange_parts(acc_out.nan_to_num(), [], c, torch.bfloat16),
                       acc_out.nan_to_num().view(b, h, c, n, dv).permute(2, 0, 1, 3, 4).to(torch.bfloat16))
