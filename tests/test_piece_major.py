"""Rotation "q" on sub-rings of one position (G = 1: P = 4 with C = 2, P = 16 with C = 4)
runs piece-major (Note [piece-major rotation q] in megatron_startrail/backward.py): pieces
of K, V outside, the team's query side broadcast inside, and with regathering the
initial send streamed piece by piece (team.streamed_team_send, a buffer per piece).

Against float64 attention: MHA, GQA and MQA with MLA head dims, causal and not, a window
longer than a chunk, packed documents in both layouts; regathering on and off gives
bitwise the same result; the byte counters equal the closed forms (which count the
query side broadcast once per piece). NaN-poisoned empty memory, NCCL rules checked by
the harness.
"""

import pytest
import torch

from megatron_startrail import new_startrail_groups, startrail_attn
from megatron_startrail.accounting import AttentionShape, expected_comm
from megatron_startrail.initial_send import reverse_overlaps
from tests.attention_cases import TOLERANCE, local_rows, reference_with_grads, relative_error
from tests.multiproc import run_ranks
from tests.packed_cases import windowed_reference
from tests.test_packed_documents import run_packed_case
from tests.test_regather_and_mla import CHUNK, HEAD_CASES, HEADS, STAT_FIELDS, mla_inputs, run


def comm_failures(groups, world_size, shape, regather, case):
    want = expected_comm(shape, cp_size=world_size, team_size=groups.team_size, startrail_rank=groups.startrail_rank,
                         rotation="q", regather_in_backward=regather)
    failures = []
    for phase, stats in (("forward", groups.last_forward_stats), ("backward", groups.last_backward_stats)):
        measured = {f: getattr(stats, f) for f in STAT_FIELDS}
        if measured != want[phase]:
            failures.append(f"{case}: {phase} comm {measured} != closed form {want[phase]}")
    return failures


def piece_major_worker(rank, world_size, team_size):
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True  # NaN-poisoned empty memory
    groups = new_startrail_groups(team_size=team_size, backward_rotation="q")
    assert groups.topology.sub_ring_size == 1
    failures, checked = [], 0
    seq = 2 * world_size * CHUNK
    # (head dims, kv heads, causal, window): a window between a chunk (CHUNK rows per zigzag
    # half) and the sequence takes the StarTrail schedule with masked blocks, not the halo.
    cases = [(case, n != 2, None) for n, case in enumerate(HEAD_CASES)] + [(HEAD_CASES[1], True, (3 * CHUNK, 0))]
    for n, ((dqk, dv, kv_heads), causal, window) in enumerate(cases):
        full = mla_inputs(50 + 7 * n + team_size, seq, kv_heads, dqk, dv)
        if window is None:
            ref = reference_with_grads(*full, causal, dqk**-0.5)
        else:
            ref = windowed_reference(*full, torch.zeros(seq, dtype=torch.long), torch.arange(seq), window, causal,
                                     dqk**-0.5)
        ref = [local_rows(t, rank, world_size) for t in ref]
        results = {}
        for regather in (False, True):
            case = f"P={world_size} C={team_size} dqk={dqk} dv={dv} kv_heads={kv_heads} causal={causal} " \
                   f"window={window} regather={regather}"
            if window is None:
                got, _ = run(groups, rank, world_size, full, regather=regather, causal=causal)
            else:
                q, k, v, dout = (local_rows(t, rank, world_size).float() for t in full)
                q, k, v = (t.requires_grad_(True) for t in (q, k, v))
                out = startrail_attn(q, k, v, groups, causal=causal, softmax_scale=dqk**-0.5, window_size=window,
                                     regather_in_backward=regather)
                out.backward(dout)
                got = (out.detach(), q.grad, k.grad, v.grad)
            results[regather] = got
            for name, g, r in zip(("out", "dq", "dk", "dv"), got, ref):
                err = relative_error(g, r)
                if not err <= TOLERANCE[torch.float32]:  # also catches NaN
                    failures.append(f"{case}: {name} error {err:.3g}")
            if window is None:
                shape = AttentionShape(2 * CHUNK, 1, HEADS, kv_heads, dqk, 4, v_head_dim=dv)
                failures += comm_failures(groups, world_size, shape, regather, case)
            checked += 1
        if not all(torch.equal(a, b) for a, b in zip(results[False], results[True])):
            failures.append(f"P={world_size} C={team_size} case {n}: regathering changed the result")
    for layout in ("sample", "document"):
        for regather in (False, True):
            errors, pad_nonzero, _ = run_packed_case(groups, rank, world_size, layout, True, 2, torch.float32, 9,
                                                     thd=True, regather=regather)
            if not max(errors.values()) <= TOLERANCE[torch.float32] or pad_nonzero:
                failures.append(f"packed {layout} regather={regather}: errors {errors}, {pad_nonzero} nonzero padding")
            checked += 1
    failures += kept_pieces_failures(groups, team_size)
    failures += no_reverse_overlap_failures(groups, rank, world_size, team_size)
    return failures, checked + 2


def no_reverse_overlap_failures(groups, rank, world_size, team_size) -> list[str]:
    """reverse_overlap=False (Note [reverse overlap] in initial_send.py): each piece's dK, dV land
    and are reduced before the next piece computes -- the same sums in the same order, so bitwise
    the overlapped result, and the same bytes; with and without regathering. And on what Megatron
    hands the attention: q, k, v strided views into a wider buffer (its fused QKV's split) and a
    non-contiguous dO, whose gradients reach the buffer; against the contiguous run."""
    serial = new_startrail_groups(team_size=team_size, backward_rotation="q", reverse_overlap=False)
    dqk, dv, kv_heads = HEAD_CASES[1]
    full = mla_inputs(77 + team_size, 2 * world_size * CHUNK, kv_heads, dqk, dv)
    shape = AttentionShape(2 * CHUNK, 1, HEADS, kv_heads, dqk, 4, v_head_dim=dv)
    failures = []
    for regather in (False, True):
        want, _ = run(groups, rank, world_size, full, regather=regather, causal=True)
        got, _ = run(serial, rank, world_size, full, regather=regather, causal=True)
        if not all(torch.equal(a, b) for a, b in zip(got, want)):
            failures.append(f"P={world_size} C={team_size} regather={regather}: no reverse overlap changed the result")
        failures += comm_failures(serial, world_size, shape, regather, f"no reverse overlap, regather={regather}")
        q, k, v, dout = (local_rows(t, rank, world_size).float() for t in full)
        buffers = [torch.cat([t, torch.randn_like(t)], dim=-1).requires_grad_(True) for t in (q, k, v)]
        views = [b[..., :t.shape[-1]] for b, t in zip(buffers, (q, k, v))]  # strided, as Megatron's split
        out = startrail_attn(*views, serial, causal=True, softmax_scale=dqk**-0.5, regather_in_backward=regather)
        dout_strided = torch.cat([dout, torch.randn_like(dout)], dim=-1)[..., :dout.shape[-1]]
        assert not dout_strided.is_contiguous() and not views[0].is_contiguous()
        out.backward(dout_strided)
        strided = (out.detach(), *(b.grad[..., :t.shape[-1]] for b, t in zip(buffers, (q, k, v))))
        for name, g, w in zip(("out", "dq", "dk", "dv"), strided, want):
            if not relative_error(g, w) <= 1e-6:
                failures.append(f"no reverse overlap, strided inputs, regather={regather}: {name} "
                                f"{relative_error(g, w):.3g} from the contiguous run")
        if any(b.grad[..., t.shape[-1]:].abs().max() != 0 for b, t in zip(buffers, (q, k, v))):
            failures.append("no reverse overlap, strided inputs: a gradient outside the views' columns")
    return failures


def kept_pieces_failures(groups, team_size) -> list[str]:
    """Note [kept pieces]: without regathering the forward keeps K, V as C tensors, and the
    backward frees each one's storage (though autograd holds them to its end); a second
    backward through the graph is refused by name, on every rank before any communication."""
    gen = torch.Generator().manual_seed(groups.startrail_rank)
    q, k, v, dout = (torch.randn(2 * CHUNK, 1, HEADS, 8, generator=gen) for _ in range(4))
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        out = startrail_attn(q, k, v, groups, causal=True, regather_in_backward=False)
    pieces = [t for t in saved if t.shape == (2 * CHUNK, 1, HEADS, 16)]  # [n, b, hkv, dqk + dv]
    if len(pieces) != team_size or not all(p.untyped_storage().nbytes() > 0 for p in pieces):
        return [f"kept: {[tuple(t.shape) for t in saved]}, not {team_size} pieces of K | V"]
    out.backward(dout, retain_graph=True)
    if any(p.untyped_storage().nbytes() for p in pieces):
        return [f"kept pieces not freed by the backward: {[p.untyped_storage().nbytes() for p in pieces]}"]
    try:
        out.backward(dout)
    except RuntimeError as error:
        if "--startrail-regather-in-backward" not in str(error):
            return [f"a second backward: {error}"]
        return []
    return ["a second backward through the graph ran on freed pieces"]


@pytest.mark.parametrize("world_size, team_size", [(4, 2), (16, 4)])
def test_piece_major_rotation_q_matches_float64_and_closed_form_comm(world_size, team_size):
    results = run_ranks(piece_major_worker, world_size, args=(team_size,), timeout=600)
    failures = sorted({f for fails, _ in results for f in fails})
    assert not failures, "\n".join(failures[:40])
    assert all(n == 2 * (len(HEAD_CASES) + 1) + 6 for _, n in results)


def test_reverse_overlap_keeps_a_piece_flying_only_where_the_freed_pieces_pay_for_it():
    """Note [reverse overlap]: entry j says whether piece j-1's dK, dV fly back while piece j
    computes. By default every piece after the first; without the overlap only where the K, V
    pieces and accumulators then live are at most piece 0's (every kept piece, one accumulator)."""
    kv = 1000  # bytes of a piece of K | V; its accumulator is as large (float32) or twice (bf16)
    assert reverse_overlaps(4, kv, kv, regathered=False) == (False, True, True, True)
    assert reverse_overlaps(4, kv, kv, regathered=False, overlap=False) == (False, False, True, True)
    assert reverse_overlaps(4, kv, 2 * kv, regathered=False, overlap=False) == (False,) * 4
    assert reverse_overlaps(8, kv, 2 * kv, regathered=False, overlap=False) == (False,) * 4 + (True,) * 4
    # Regathering lands piece j and the next one (and its send buffer): the K, V held do not
    # shrink until the last piece.
    assert reverse_overlaps(4, kv, kv, regathered=True, overlap=False) == (False, False, False, True)
    assert reverse_overlaps(4, kv, 2 * kv, regathered=True, overlap=False) == (False,) * 4
    assert reverse_overlaps(1, kv, kv, regathered=False, overlap=False) == (False,)
