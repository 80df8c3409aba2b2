"""Block kernels against float64 attention, the lse merge's edge cases, causal plans."""

import pytest
import torch

from megatron_startrail.blocks import merge_lse_, merge_partials
from megatron_startrail.kernels import ReferenceKernel, TorchCPUFlashKernel, kernel_for
from megatron_startrail.layout import (
    cp_rank_segments,
    dense_sequence,
    plan_blocks,
    segment_rows,
    split_rows,
    split_segments,
    startrail_position_chunks,
    zigzag_chunks,
)
from tests.attention_cases import TOLERANCE, plan_coverage, reference_with_grads, relative_error, zigzag_ranges

KERNELS = [ReferenceKernel(), TorchCPUFlashKernel()]


def whole_chunks(chunks, chunk_len):
    """Segments (document 0, start, stop) of whole chunks of one dense sequence, in the order listed."""
    return tuple((0, c * chunk_len, (c + 1) * chunk_len) for c in chunks)


def _bhsd(x):
    return x.permute(1, 2, 0, 3)


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.name)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
@pytest.mark.parametrize("causal", [True, False])
def test_block_kernel_forward_backward(kernel, dtype, kv_heads, causal):
    gen = torch.Generator().manual_seed(5)
    s, b, h, d = 12, 2, 4, 8
    q, k, v, dout = (
        torch.randn(shape, generator=gen, dtype=torch.float64).to(dtype)
        for shape in [(s, b, h, d), (s, b, kv_heads, d), (s, b, kv_heads, d), (s, b, h, d)]
    )
    scale = d**-0.5
    ref_out, ref_dq, ref_dk, ref_dv = reference_with_grads(
        *(t.double() for t in (q, k, v, dout)), causal, scale
    )
    # Kernels take [b, h, s, d] views of sequence-first tensors, as the schedule passes them.
    out, lse = kernel.forward(_bhsd(q), _bhsd(k), _bhsd(v), causal=causal, scale=scale)
    assert out.dtype == dtype and lse.dtype == torch.float32 and lse.shape == (b, h, s)
    dq, dk, dv = kernel.backward(_bhsd(dout), _bhsd(q), _bhsd(k), _bhsd(v), out, lse, causal=causal, scale=scale)
    tol = TOLERANCE[dtype]
    assert relative_error(out.permute(2, 0, 1, 3), ref_out) <= tol
    for got, want in ((dq, ref_dq), (dk, ref_dk), (dv, ref_dv)):
        assert got.shape == _bhsd(want).shape
        assert relative_error(got.permute(2, 0, 1, 3), want) <= tol


def test_reference_kernel_is_exact_in_float64():
    gen = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(10, 1, 2, 4, generator=gen, dtype=torch.float64) for _ in range(3))
    out, lse = ReferenceKernel().forward(_bhsd(q), _bhsd(k), _bhsd(v), causal=True, scale=0.5)
    want = reference_with_grads(q, k, v, torch.ones_like(q), True, 0.5)[0]
    assert relative_error(out.permute(2, 0, 1, 3), want) <= 1e-14


def float64_attention(q, k, v, dout, scale):
    """Plain float64 softmax attention on ``[b, h, s, d]`` (no mask): out, lse and the
    gradients of q, k, v for ``dout``, by autograd; nothing of the project's kernels."""
    q, k, v = (t.double().requires_grad_(True) for t in (q, k, v))
    scores = (q @ k.transpose(-1, -2)) * scale  # [b, h, sq, sk]
    out = torch.softmax(scores, dim=-1) @ v
    out.backward(dout.double())
    return out.detach(), torch.logsumexp(scores, dim=-1).detach(), q.grad, k.grad, v.grad


@pytest.mark.parametrize("kernel", KERNELS, ids=lambda k: k.name)
def test_block_backward_with_merged_lse_is_exact_per_block(kernel):
    # The schedule's premise: keys split in blocks, forward parts merged by lse, then each
    # block's backward run with the *merged* (final) out and lse gives that block's exact
    # share of the gradients. Checked against float64 attention over all keys, not against
    # the kernel on the whole key range (a kernel bug would then cancel out).
    gen = torch.Generator().manual_seed(2)
    q, k, v, dout = (torch.randn(1, 2, 16, 8, generator=gen) for _ in range(4))
    scale = 0.3
    ref_out, ref_lse, ref_dq, ref_dk, ref_dv = float64_attention(q, k, v, dout, scale)
    blocks = [(0, 5), (5, 11), (11, 16)]  # uneven key blocks
    acc_out = torch.zeros(1, 2, 16, 8)
    acc_lse = torch.full((1, 2, 16), float("-inf"))
    for a, b in blocks:
        o, l = kernel.forward(q, k[:, :, a:b], v[:, :, a:b], causal=False, scale=scale)
        merge_lse_(acc_out, acc_lse, o, l)
    tol = TOLERANCE[torch.float32]
    assert relative_error(acc_out, ref_out) <= tol and relative_error(acc_lse, ref_lse) <= tol
    dq = torch.zeros_like(q)
    dk, dv = [], []
    for a, b in blocks:
        gq, gk, gv = kernel.backward(dout, q, k[:, :, a:b], v[:, :, a:b], acc_out, acc_lse, causal=False, scale=scale)
        dq += gq
        dk.append(gk)
        dv.append(gv)
    for got, want in ((dq, ref_dq), (torch.cat(dk, dim=2), ref_dk), (torch.cat(dv, dim=2), ref_dv)):
        assert relative_error(got, want) <= tol


def test_merge_gives_rows_without_keys_zero_weight_not_nan():
    acc_out = torch.zeros(1, 1, 3, 2)
    acc_lse = torch.full((1, 1, 3), float("-inf"))
    out = torch.tensor([[[[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]]])
    lse = torch.tensor([[[0.5, float("-inf"), 1.0]]])  # row 1 saw no key in this block
    merge_lse_(acc_out, acc_lse, out, lse)
    assert not acc_out.isnan().any()
    assert acc_lse[0, 0, 1].item() == float("-inf") and acc_out[0, 0, 1].abs().sum() == 0
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
    # Random runs of tokens of random chunks, on both sides, against a brute-force mask.
    rng = torch.Generator().manual_seed(seed)
    chunk_len = 6

    def random_segments():  # runs of one dense sequence (document 0)
        segs = []
        for chunk in torch.randperm(5, generator=rng)[: 1 + seed % 4].tolist():
            a, b = sorted(torch.randint(0, chunk_len + 1, (2,), generator=rng).tolist())
            if b > a:
                segs.append((0, chunk * chunk_len + a, chunk * chunk_len + b))
        return tuple(segs) or ((0, 0, chunk_len),)

    q_segments, k_segments = random_segments(), random_segments()
    for causal in (True, False):
        qp, kp = _positions(q_segments), _positions(k_segments)
        visible = (kp[None, :] <= qp[:, None]) if causal else torch.ones(len(qp), len(kp), dtype=torch.bool)
        assert torch.equal(plan_coverage(q_segments, k_segments, causal), visible.long())


def test_causal_plan_matches_the_chunk_picture():
    # CP = 2: rank 0 holds chunks (0, 3), rank 1 holds (1, 2); chunks of 4 tokens.
    assert zigzag_chunks(0, 2) == (0, 3) and zigzag_chunks(1, 2) == (1, 2)

    def plan(q, k):
        return [(b.q_rows, b.k_rows, b.causal) for b in plan_blocks(whole_chunks(q, 4), whole_chunks(k, 4), True)]

    # query chunk 0 sees nothing of (1, 2); query chunk 3 sees both, in one call.
    assert plan((0, 3), (1, 2)) == [((4, 8), ((0, 8),), False)]
    # query chunks 1 and 2 both see all of key chunk 0 (and none of 3): one call.
    assert plan((1, 2), (0, 3)) == [((0, 8), ((0, 4),), False)]
    assert plan((0, 3), (0, 3)) == [((0, 4), ((0, 4),), True), ((4, 8), ((0, 4),), False), ((4, 8), ((4, 8),), True)]
    # Ulysses U=2 over CP=4: StarTrail position 1 holds CP ranks 2 and 3's chunks.
    assert startrail_position_chunks(1, 2, 4) == (2, 5, 3, 4)


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
