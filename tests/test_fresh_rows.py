"""Accumulators that start unwritten (Note [fresh rows] in blocks.py): the first call to reach a
row copies instead of merging into zeros / -inf, rows no call reaches are filled once. The
results must be bitwise those of the zero-initialised merge, forward and backward, with
calls that split a step's rows (``max_rows``), documents, and padding rows no call reaches."""

import pytest
import torch

from megatron_startrail import blocks
from megatron_startrail.kernels import ReferenceKernel
from megatron_startrail.layout import PADDING


def test_take_splits_a_run_into_fresh_and_written_parts():
    fresh = blocks.FreshRows(10)
    assert fresh.take(2, 5) == ([(2, 5)], [])
    assert fresh.take(0, 8) == ([(0, 2), (5, 8)], [(2, 5)])
    assert fresh.take(3, 4) == ([], [(3, 4)])
    filled = []
    fresh.fill(lambda a, b: filled.append((a, b)))
    assert filled == [(8, 10)]
    fresh.fill(lambda a, b: filled.append((a, b)))
    assert filled == [(8, 10)] and fresh.take(0, 10) == ([], [(0, 10)])


# q rows: zigzag chunks of one document and a padded second one; K, V arrive in two steps.
Q_SEGMENTS = ((0, 0, 8), (0, 24, 32), (1, 0, 5), (PADDING, 5, 8))
STEPS = (((0, 0, 8), (0, 24, 32), (1, 0, 5), (PADDING, 5, 8)), ((0, 8, 16), (0, 16, 24)))


def _steps(fresh: bool, dtype, seed=0):
    gen = torch.Generator().manual_seed(seed)
    rows, b, h, hkv, d = 24, 2, 4, 2, 16
    q = torch.randn(rows, b, h, d, generator=gen, dtype=torch.float64).to(dtype)
    kvs = [torch.randn(sum(s[2] - s[1] for s in segs), b, hkv, 2 * d, generator=gen, dtype=torch.float64).to(dtype)
           for segs in STEPS]
    dout = torch.randn(rows, b, h, d, generator=gen, dtype=torch.float64).to(dtype)
    kernel, kw = ReferenceKernel(), dict(causal=True, scale=d ** -0.5, max_rows=6)
    rows_fresh = blocks.FreshRows(rows) if fresh else None
    acc_out, acc_lse = blocks.new_partials(q, d, rows_fresh)
    if fresh:  # poison: what no call writes must be filled, never read
        acc_out.fill_(float("nan"))
        acc_lse.fill_(float("nan"))
    for kv, segs in zip(kvs, STEPS):
        blocks.forward_step(kernel, q, kv, Q_SEGMENTS, segs, acc_out, acc_lse, fresh=rows_fresh, **kw)
    blocks.fill_unseen(acc_out, acc_lse, rows_fresh)
    out, lse = blocks.finished(acc_out, acc_lse, dtype)
    acc = blocks.acc_dtype(dtype)
    dq = torch.full(q.shape, float("nan"), dtype=acc) if fresh else q.new_zeros(q.shape, dtype=acc)
    fresh_q = blocks.FreshRows(rows) if fresh else None
    dkvs = []
    for kv, segs in zip(kvs, STEPS):
        dkv = torch.full(kv.shape, float("nan"), dtype=acc) if fresh else kv.new_zeros(kv.shape, dtype=acc)
        fresh_kv = blocks.FreshRows(kv.shape[0]) if fresh else None
        blocks.backward_step(kernel, q, dout, out, lse, kv, Q_SEGMENTS, segs, dq, dkv, fresh_q=fresh_q,
                             fresh_kv=fresh_kv, **kw)
        if fresh:
            fresh_kv.fill(lambda a, b, dkv=dkv: dkv[a:b].zero_())
        dkvs.append(dkv)
    if fresh:
        fresh_q.fill(lambda a, b: dq[a:b].zero_())
    return out, lse, dq, dkvs


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_fresh_rows_give_the_zero_initialised_results_bitwise(dtype):
    plain, fresh = _steps(False, dtype), _steps(True, dtype)
    for a, b in zip(plain[:3], fresh[:3]):
        assert torch.equal(a, b)
    for a, b in zip(plain[3], fresh[3]):
        assert torch.equal(a, b)
    out, lse = plain[0], plain[1]
    assert torch.isneginf(lse[-3:]).all() and (out[-3:] == 0).all()  # the padding rows saw nothing
    assert torch.isfinite(lse[:-3]).all()


class _FusedLikeReference(ReferenceKernel):
    """The reference kernel's math, planned as a fused kernel is (Note [whole key runs] in layout.py)."""

    workspace_grows_with_keys = False


def _forward(kernel, q, kv, segments, max_rows):
    # q [Sq, b, h, d], kv [Sk, b, hkv, 2d]: one step over the whole payload; out/lse poisoned first
    rows_fresh = blocks.FreshRows(q.shape[0])
    acc_out, acc_lse = blocks.new_partials(q, q.shape[-1], rows_fresh)
    acc_out.fill_(float("nan"))
    acc_lse.fill_(float("nan"))
    merges = []
    original = blocks.merge_lse_
    blocks.merge_lse_ = lambda *args: (merges.append(args[0].shape[2]), original(*args))
    try:
        blocks.forward_step(kernel, q, kv, Q_SEGMENTS, segments, acc_out, acc_lse, causal=True,
                            scale=q.shape[-1] ** -0.5, max_rows=max_rows, fresh=rows_fresh)
    finally:
        blocks.merge_lse_ = original
    blocks.fill_unseen(acc_out, acc_lse, rows_fresh)
    return acc_out, acc_lse, merges


def test_a_fused_kernel_takes_a_run_of_keys_whole_in_the_forward():
    # Q_SEGMENTS' rows against keys at positions 0..23 of document 0, one run of 24 rows, with
    # max_rows 6: the reference kernel's keys come in tiles of 6 (a merge per tile and query row);
    # a kernel whose temporaries do not grow with the keys takes the run in one call. The results
    # agree to float64 rounding (merged in another order), and match attention over the whole rows.
    gen = torch.Generator().manual_seed(3)
    b, h, hkv, d = 2, 4, 2, 16
    q = torch.randn(24, b, h, d, generator=gen, dtype=torch.float64)
    kv = torch.randn(24, b, hkv, 2 * d, generator=gen, dtype=torch.float64)
    segments = ((0, 0, 24),)
    tiled_out, tiled_lse, tiled_merges = _forward(ReferenceKernel(), q, kv, segments, 6)
    whole_out, whole_lse, whole_merges = _forward(_FusedLikeReference(), q, kv, segments, 6)
    assert not whole_out.isnan().any() and not whole_lse.isnan().any()
    torch.testing.assert_close(whole_out, tiled_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(whole_lse, tiled_lse, rtol=1e-12, atol=1e-12)
    # Rows 8..15 (positions 24..31) see all 24 keys: tiled, 4 calls of 6 keys, the first copied in
    # and 3 merged (rows cut at 6: merges of 6 and 2 rows); whole, one call copied in. Rows 0..7
    # (the causal diagonal) take one call either way; document 1 and the padding see nothing.
    assert tiled_merges == [6, 6, 6, 2, 2, 2] and whole_merges == []
    # Against attention over the rows themselves
    k, v = kv[..., :d].repeat_interleave(h // hkv, 2), kv[..., d:].repeat_interleave(h // hkv, 2)
    scores = torch.einsum("qbhd,kbhd->bhqk", q[8:16], k) * d ** -0.5
    want = torch.einsum("bhqk,kbhd->bhqd", scores.softmax(-1), v)
    torch.testing.assert_close(whole_out[:, :, 8:16], want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(whole_lse[:, :, 8:16], scores.logsumexp(-1), rtol=1e-12, atol=1e-12)


def test_the_backward_runs_a_steps_largest_call_first_and_zeroes_nothing():
    # Note [largest call first]: zigzag chunks (0, 3) of document 0 with document 1 stored between
    # them, against themselves, plan a full call (chunk 3's queries, chunk 0's keys: 4 + 4 rows)
    # before the diagonal one (the three runs: 12 + 12). The backward runs the diagonal first: every
    # row of it unwritten, written as it is; the full call adds. In plan order the diagonal call
    # would find dQ rows 8..11 written and zero rows 0..7 first. (Chunks 0 and 3 next to each other
    # in storage make one causal call: Note [own rows in one call].)
    from torch.utils._python_dispatch import TorchDispatchMode  # noqa: PLC0415

    from megatron_startrail.layout import plan_calls  # noqa: PLC0415

    segments = ((0, 0, 4), (1, 0, 4), (0, 12, 16))
    assert [len(c.q_rows) for c in plan_calls(segments, segments, True)] == [1, 3]  # full, then diagonal
    own = ((0, 0, 4), (0, 12, 16))
    assert [len(c.q_rows) for c in plan_calls(own, own, True)] == [1]  # own rows

    class Zeroes(TorchDispatchMode):
        count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            Zeroes.count += func.overloadpacket.__name__ == "zero_"
            return func(*args, **(kwargs or {}))

    gen = torch.Generator().manual_seed(5)
    b, h, d = 2, 4, 16
    q, dout, out = (torch.randn(12, b, h, d, generator=gen, dtype=torch.float64) for _ in range(3))
    kv = torch.randn(12, b, h, 2 * d, generator=gen, dtype=torch.float64)
    lse = torch.randn(12, b, h, generator=gen, dtype=torch.float64)
    kw = dict(causal=True, scale=d ** -0.5)
    dq, dkv = torch.full_like(q, float("nan")), torch.full_like(kv, float("nan"))
    with Zeroes():
        blocks.backward_step(ReferenceKernel(), q, dout, out, lse, kv, segments, segments, dq, dkv,
                             fresh_q=blocks.FreshRows(12), fresh_kv=blocks.FreshRows(12), **kw)
    assert Zeroes.count == 0
    want_dq, want_dkv = torch.zeros_like(q), torch.zeros_like(kv)
    blocks.backward_step(ReferenceKernel(), q, dout, out, lse, kv, segments, segments, want_dq, want_dkv, **kw)
    torch.testing.assert_close(dq, want_dq, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dkv, want_dkv, rtol=1e-12, atol=1e-12)
