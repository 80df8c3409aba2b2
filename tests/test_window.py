"""Sliding-window attention (``startrail_attn(..., window_size=(left, right))``) against float64.

Windows shorter than a chunk take the halo exchange (only the neighbours' keys move),
longer ones the StarTrail schedule with masked and skipped blocks; both must equal dense
float64 attention with the window mask inside each document, in the dense and both packed
layouts, for C in {1, 2, 4}, Ulysses x StarTrail, GQA and MLA head dims, forward and
backward, with padding rows exactly 0. The halo's bytes equal their closed form.
"""

import pytest
import torch

from megatron_startrail import new_startrail_groups, startrail_attn
from megatron_startrail.accounting import AttentionShape, expected_comm, halo_bytes, halo_rows
from megatron_startrail.halo import MAX_HALO_SHARE
from megatron_startrail.layout import plan_calls
from tests.attention_cases import full_inputs, max_logit_error, plan_coverage, reference_max_logit, relative_error
from tests.multiproc import run_ranks
from tests.packed_cases import (PAD, document_of_positions, held_positions, make_documents, visible_pairs,
                                windowed_reference)

CHUNK, HEADS, DIM = 8, 4, 8
TOL = 1e-10  # float64 inputs: every path is exact up to rounding


CASES = [
    # (layout, window, causal): windows < a chunk (halo), between a chunk and the sequence, > the sequence
    ("dense", (5, 0), True), ("dense", (20, 0), True), ("dense", (1000, 0), True),
    ("dense", (3, 4), False), ("dense", (30, 11), False),
    ("sample", (5, 0), True), ("sample", (20, 0), True),
    ("document", (2, 0), True), ("document", (20, 0), True), ("document", (2, 1), False),
]


def window_worker(rank, world_size, team_size, ulysses, kv_heads, v_dim):
    groups = new_startrail_groups(team_size=team_size, ulysses_size=ulysses)
    cp = world_size
    failures, bytes_seen = [], {}
    for index, (layout, window, causal) in enumerate(CASES):
        if layout == "dense":
            cu = padded = None
            seq = 2 * cp * CHUNK
            doc, mine = torch.zeros(seq, dtype=torch.long), held_positions(rank, cp, torch.tensor([0, seq]), None)
        else:
            cu, padded = make_documents(cp, CHUNK, layout, seed=30 + index)
            doc = document_of_positions(cu, padded)
            mine = held_positions(rank, cp, cu, padded)
            seq = len(doc)
        q, k, v, dout = full_inputs(100 + index, seq, 1, HEADS, kv_heads, DIM, torch.float64)
        v, dout = v[..., :v_dim].contiguous(), dout[..., :v_dim].contiguous()  # MLA: V's own head dim
        positions = torch.arange(seq)
        ref = windowed_reference(q, k, v, dout, doc, positions, window, causal, DIM**-0.5)
        lq, lk, lv = (t[mine].clone().requires_grad_(True) for t in (q, k, v))
        out, max_logit = startrail_attn(lq, lk, lv, groups, causal=causal, cu_seqlens=cu, cu_seqlens_padded=padded,
                                        window_size=window, return_max_logit=True)
        out.backward(dout[mine])
        case = f"{layout} window={window} causal={causal} C={team_size} U={ulysses} hkv={kv_heads} dv={v_dim}"
        want = reference_max_logit(q, k, visible_pairs(doc, positions, window, causal), DIM**-0.5)
        err = max_logit_error(max_logit, want)  # the halo's pass and the schedule's
        if not err <= 1e-12:
            failures.append(f"{case}: max logit error {err:.2e}")
        for name, got, want in zip(("out", "dq", "dk", "dv"), (out, lq.grad, lk.grad, lv.grad), ref):
            err = relative_error(got, want[mine])
            if err > TOL:
                failures.append(f"{case}: {name} error {err:.2e}")
        padding = doc[mine] == PAD
        if any(int(t[padding].count_nonzero()) for t in (out, lq.grad, lk.grad, lv.grad)):
            failures.append(f"{case}: padding rows are not exactly 0")
        fwd, bwd = groups.last_forward_stats, groups.last_backward_stats
        bytes_seen[(layout, window, causal)] = (dict(fwd.bytes_sent_by_op), dict(bwd.bytes_sent_by_op))
    return failures, bytes_seen, groups.cp_rank


@pytest.mark.parametrize("world, team_size, ulysses, kv_heads, v_dim", [
    (4, 1, 1, 2, DIM),         # ring attention's layout
    (8, 2, 1, 2, DIM),         # StarTrail C = 2, GQA
    (8, 1, 2, 4, DIM // 2),    # Ulysses 2 x StarTrail, MLA head dims
    (16, 4, 1, 1, DIM),        # C = 4, MQA
])
def test_window_matches_float64_and_the_halo_moves_only_the_window(world, team_size, ulysses, kv_heads, v_dim):
    results = run_ranks(window_worker, world, args=(team_size, ulysses, kv_heads, v_dim), timeout=600)
    failures = [f for fails, _, _ in results for f in fails]
    assert not failures, "\n".join(failures[:30])
    row_bytes = (DIM + v_dim) * kv_heads * 8  # one K|V row, float64
    for _, seen, cp_rank in results:
        # Dense causal window (5, 0) < a chunk: the halo path, the last 5 rows of a chunk to each
        # existing CP neighbour, and their dK|dV back; no StarTrail phase runs.
        fwd, bwd = seen[("dense", (5, 0), True)]
        neighbours = int(cp_rank > 0) + int(cp_rank < world - 1)
        assert fwd == {"halo": 5 * row_bytes * neighbours}, fwd
        assert bwd == {"halo_grad": 5 * row_bytes * neighbours}, bwd  # float64 gradients
        # A window reaching past a quarter of the sequence runs the StarTrail schedule; a
        # shorter one longer than a chunk exchanges with the further ranks it reaches.
        seq = 2 * world * CHUNK
        fwd, _ = seen[("dense", (1000, 0), True)]
        assert "halo" not in fwd and ("sub_ring" in fwd or "team_all_gather" in fwd), fwd
        fwd, _ = seen[("dense", (20, 0), True)]
        assert ("halo" in fwd) == (2 * 20 <= seq // 4), fwd  # a middle rank: 20 rows before each chunk


# (window, causal, halo_exchange): within a chunk, between one and two chunks, past a quarter
# of the sequence (the schedule runs), non-causal both sides, and the halo switched off.
HALO_CASES = [((3, 0), True, True), ((8, 0), True, True), ((13, 0), True, True), ((20, 0), True, True),
              ((3, 4), False, True), ((9, 6), False, True), ((1000, 0), True, True), ((3, 0), True, False)]
FIELDS = ("p2p_bytes_sent", "p2p_bytes_recv", "collective_bytes_sent", "collective_bytes_recv", "p2p_steps")


def halo_bytes_worker(rank, world_size, team_size, ulysses, kv_heads, v_dim, dtype):
    """Dense windowed attention for every case of HALO_CASES; returns this rank's counters
    (and, in float64, the errors against the windowed reference)."""
    groups = new_startrail_groups(team_size=team_size, ulysses_size=ulysses)
    seq = 2 * world_size * CHUNK
    mine = held_positions(rank, world_size, torch.tensor([0, seq]), None)
    seen, errors = [], []
    for index, (window, causal, halo) in enumerate(HALO_CASES):
        q, k, v, dout = full_inputs(200 + index, seq, 1, HEADS, kv_heads, DIM, torch.float64)
        v, dout = v[..., :v_dim].contiguous(), dout[..., :v_dim].contiguous()
        lq, lk, lv = (t[mine].to(dtype).requires_grad_(True) for t in (q, k, v))
        out = startrail_attn(lq, lk, lv, groups, causal=causal, window_size=window, halo_exchange=halo)
        out.backward(dout[mine].to(dtype))
        fwd, bwd = groups.last_forward_stats, groups.last_backward_stats
        seen.append((fwd.as_dict(), bwd.as_dict()))
        if dtype == torch.float64:
            ref = windowed_reference(q, k, v, dout, torch.zeros(seq, dtype=torch.long), torch.arange(seq), window,
                                     causal, DIM**-0.5)
            errors += [relative_error(got, want[mine]) for got, want in zip((out, lq.grad, lk.grad, lv.grad), ref)]
    return groups.cp_rank, seen, max(errors, default=0.0)


@pytest.mark.parametrize("world, team_size, ulysses, kv_heads, v_dim, dtype", [
    (4, 1, 1, 2, DIM, torch.float64),          # ring attention's layout
    (8, 2, 1, 1, DIM, torch.bfloat16),         # StarTrail C = 2, MQA; K|V in bf16, dK|dV in float32
    (8, 2, 2, 2, DIM // 2, torch.float64),     # Ulysses 2 x StarTrail C = 2, MLA head dims
])
def test_halo_bytes_equal_their_closed_form(world, team_size, ulysses, kv_heads, v_dim, dtype):
    """Each rank's counters equal accounting.halo_bytes (and per peer halo_rows) wherever no
    rank's window reaches past MAX_HALO_SHARE of the sequence, whatever C and U; elsewhere,
    and with halo_exchange=False, the schedule's closed form (expected_comm): a window
    skips blocks, never transfers."""
    results = run_ranks(halo_bytes_worker, world, args=(team_size, ulysses, kv_heads, v_dim, dtype), timeout=600)
    seq, e = 2 * world * CHUNK, torch.tensor([], dtype=dtype).element_size()
    shape = AttentionShape(seq // world, 1, HEADS, kv_heads, DIM, e, v_head_dim=v_dim)
    row = kv_heads * (DIM + v_dim)  # elements of one K|V row
    halo_runs = 0
    for cp_rank, seen, error in results:
        assert error <= TOL, f"rank {cp_rank}: windowed attention off by {error:.2e}"
        for (window, causal, halo), (fwd, bwd) in zip(HALO_CASES, seen):
            rows = halo_rows(seq, world, window, causal)
            received = [sum(n for (_, r), n in rows.items() if r == x) for x in range(world)]
            if halo and max(received) <= MAX_HALO_SHARE * seq:
                halo_runs += 1
                want = halo_bytes(shape, cp_size=world, window=window, causal=causal, cp_rank=cp_rank)
                sent_to = {peer: n * row * e for (owner, peer), n in rows.items() if owner == cp_rank}
                assert fwd["bytes_sent_by_op"] == {"halo": want["forward"]["p2p_bytes_sent"]}, (window, fwd)
                assert fwd["p2p_bytes_sent_to"] == sent_to, (window, fwd)
            else:
                want = expected_comm(shape, cp_size=world, team_size=team_size, ulysses_size=ulysses,
                                     startrail_rank=cp_rank // ulysses)
                assert "halo" not in fwd["bytes_sent_by_op"], (window, halo, fwd)
            for phase, got in (("forward", fwd), ("backward", bwd)):
                assert {f: got[f] for f in FIELDS} == want[phase], (window, causal, halo, cp_rank, phase)
    assert halo_runs >= 3 * world  # the halo ran for three windows or more on every rank


def test_blocks_outside_the_window_make_no_kernel_call():
    """Two chunks of 64 far apart (positions 0.. and 1000..): with a 32-token window no call;
    with the chunk adjacent, one call of one sequence (the band's edge); the count of visible
    pairs is exact."""
    q = ((0, 1000, 1064),)
    assert plan_calls(q, ((0, 0, 64),), True, (32, 0)) == ()
    calls = plan_calls(q, ((0, 936, 1000),), True, (32, 0))
    assert len(calls) == 1 and len(calls[0].q_rows) == 1
    assert calls[0].q_rows == ((0, 32),)  # queries 1032.. see none of these keys: no rows for them
    coverage = plan_coverage(q, ((0, 936, 1000),), True, (32, 0))
    assert int(coverage.sum()) == sum(32 - i for i in range(32))  # query 1000 + i sees keys 1000 + i - 32 .. 999


def test_the_halo_plan_cache_does_not_keep_a_micro_batch_alive():
    # A micro-batch's Documents carries its kernel calls' device metadata (microbatch.py):
    # the plan is cached by the documents' fields, so the object goes with its micro-batch.
    import gc
    import weakref

    from megatron_startrail.halo import halo_plan
    from megatron_startrail.layout import Documents

    docs = Documents(4, (0, 10, 64), None)
    gone = weakref.ref(docs)
    assert halo_plan(docs, (3, 0), True, 1) is not None
    del docs
    gc.collect()
    assert gone() is None
