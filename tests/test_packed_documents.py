"""Packed documents (THD): StarTrail against float64 block-diagonal attention, both layouts.

Sample layout (cu_seqlens only, the whole sample zigzagged, Megatron pretraining) and
document layout (cu_seqlens_padded, per-document zigzag, Transformer Engine / Megatron
SFT); documents of length 1, shorter than 2*CP, longer than a chunk; padding rows must
give exactly 0 output and 0 gradients. Also: the planner against a brute-force mask,
kernel calls follow the documents, and bad input raises on every rank.
"""

import dataclasses
import itertools
import re

import pytest
import torch

from megatron_startrail import attention, new_startrail_groups, startrail_attn, valid_team_sizes
from megatron_startrail.accounting import AttentionShape, expected_comm
from megatron_startrail.documents import CHECK_OP
from megatron_startrail.kernels import TorchCPUFlashKernel
from megatron_startrail.layout import (
    PADDING,
    cp_rank_segments,
    dense_sequence,
    documents_from_cu_seqlens,
    rows_of_cp_ranks,
)
from tests.attention_cases import (TOLERANCE, full_inputs, max_logit_error, plan_coverage, reference_max_logit,
                                   relative_error)
from tests.multiproc import run_ranks
from tests.packed_cases import (
    PAD,
    document_of_positions,
    held_positions,
    make_documents,
    reference_packed_with_grads,
    visible_pairs,
)

HEADS, DIM, CHUNK = 4, 8, 5
STAT_FIELDS = ["p2p_bytes_sent", "p2p_bytes_recv", "collective_bytes_sent", "collective_bytes_recv", "p2p_steps"]


# -- pure: which rows a rank holds, and the block plan ---------------------------------


def _docs(cp, layout, seed=0):
    cu, padded = make_documents(cp, CHUNK, layout, seed)
    total = int((padded if padded is not None else cu)[-1])
    found = documents_from_cu_seqlens(tuple(cu.tolist()), None if padded is None else tuple(padded.tolist()),
                                      cp, total // cp)
    assert not isinstance(found, str), found
    return found, cu, padded


@pytest.mark.parametrize("layout", ["sample", "document"])
@pytest.mark.parametrize("cp", [1, 2, 3, 4, 8])
def test_segments_follow_both_layouts(cp, layout):
    docs, cu, padded = _docs(cp, layout)
    doc_of = document_of_positions(cu, padded)
    for r in range(cp):
        segs = cp_rank_segments(docs, r)
        positions = torch.tensor([t for _, a, b in segs for t in range(a, b)])
        assert torch.equal(positions, held_positions(r, cp, cu, padded))
        labels = torch.tensor([d for d, a, b in segs for _ in range(a, b)])
        assert torch.equal(labels, doc_of[positions])  # documents and padding named right


def test_docstring_example_of_the_document_layout():
    docs = documents_from_cu_seqlens((0, 3, 8), (0, 4, 12), 2, 6)
    assert cp_rank_segments(docs, 0) == ((0, 0, 1), (PADDING, 3, 4), (1, 4, 6), (PADDING, 10, 12))
    assert cp_rank_segments(docs, 1) == ((0, 1, 2), (0, 2, 3), (1, 6, 8), (1, 8, 9), (PADDING, 9, 10))


@pytest.mark.parametrize("layout", ["sample", "document"])
@pytest.mark.parametrize("cp", [2, 4])
def test_plan_covers_exactly_the_same_document_pairs(cp, layout):
    # Every pair of CP-rank sets (as after Ulysses / team gathers) against a brute-force mask.
    docs, _, _ = _docs(cp, layout, seed=cp)
    sets = [(r,) for r in range(cp)] + [tuple(range(cp)), (cp - 1, 0)]
    for qs, ks in itertools.product(sets, sets):
        q_segs, k_segs = rows_of_cp_ranks(docs, qs), rows_of_cp_ranks(docs, ks)
        qd = torch.tensor([d for d, a, b in q_segs for _ in range(a, b)])
        kd = torch.tensor([d for d, a, b in k_segs for _ in range(a, b)])
        qp = torch.tensor([t for _, a, b in q_segs for t in range(a, b)])
        kp = torch.tensor([t for _, a, b in k_segs for t in range(a, b)])
        same = (qd[:, None] == kd[None, :]) & (qd[:, None] != PADDING)
        for causal in (True, False):
            want = same & (kp[None, :] <= qp[:, None]) if causal else same
            assert torch.equal(plan_coverage(q_segs, k_segs, causal), want.long()), (qs, ks, causal)


def test_empty_documents_hold_no_rows():
    # Repeated boundaries (empty documents, e.g. collate padding left in) take no rows.
    sample = documents_from_cu_seqlens((0, 0, 5, 5, 8), None, 2, 4)
    assert cp_rank_segments(sample, 0) == ((1, 0, 2), (3, 6, 8))
    assert cp_rank_segments(sample, 1) == ((1, 2, 4), (1, 4, 5), (3, 5, 6))
    document = documents_from_cu_seqlens((0, 3, 3, 4), (0, 4, 4, 8), 2, 4)
    assert cp_rank_segments(document, 0) == ((0, 0, 1), (PADDING, 3, 4), (2, 4, 5), (PADDING, 7, 8))


def test_dense_sequence_is_one_document():
    assert cp_rank_segments(dense_sequence(2, 8), 1) == ((0, 4, 8), (0, 8, 12))


# -- distributed: against float64 per-document attention -------------------------------


def group_settings(cp):
    for u in (1, 2):
        if cp % u == 0:
            for c in valid_team_sizes(cp // u):
                if c <= 3 and (u == 1 or c <= 2):
                    yield u, c


def run_packed_case(groups, rank, cp, layout, causal, kv_heads, dtype, seed, thd, transfer="ring", regather=False):
    cu, padded = make_documents(cp, CHUNK, layout, seed)
    doc = document_of_positions(cu, padded)
    full = full_inputs(seed, len(doc), 1, HEADS, kv_heads, DIM, dtype)
    scale = DIM**-0.5
    ref = reference_packed_with_grads(*full, doc, causal, scale)
    mine = held_positions(rank, cp, cu, padded)
    q, k, v, dout = (t[mine].to(dtype) for t in full)
    if thd:  # [t, 1, h, d] -> [t, h, d]
        q, k, v, dout = (t.squeeze(1) for t in (q, k, v, dout))
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    out, max_logit = startrail_attn(q, k, v, groups, causal=causal, softmax_scale=scale, cu_seqlens=cu,
                                    cu_seqlens_padded=padded, transfer=transfer, regather_in_backward=regather,
                                    return_max_logit=True)
    assert out.shape == q.shape
    out.backward(dout)
    got = [t.reshape(len(mine), 1, *t.shape[-2:]) for t in (out.detach(), q.grad, k.grad, v.grad)]
    errors = {n: relative_error(g, r[mine]) for n, g, r in zip(("out", "dq", "dk", "dv"), got, ref)}
    # Per document, padding never: the MAX over CP of every rank's max logit
    visible = visible_pairs(doc, torch.arange(len(doc)), (-1, -1), causal)
    errors["max_logit"] = max_logit_error(max_logit, reference_max_logit(full[0], full[1], visible, scale))
    padding = doc[mine] == PAD
    pad_nonzero = sum(int(g[padding].count_nonzero()) for g in got)
    return errors, pad_nonzero, int(padding.sum())


HEAD_LAYOUTS_UP_TO = 4  # larger worlds run every head layout only for a (U, C) no world this size has


def packed_cases(world_size, ulysses_size, team_size):
    """(layout, causal, kv heads, dtype) run for (U, C) at ``world_size``: both layouts, causal or
    not, MHA / GQA / MQA in float32, and bf16 / fp16 once each. At P = 8 and 9 (the suite's longest
    packed worlds on CI's 2 cores) the head layouts other than GQA run only for a (U, C) with
    C^2 U > 4 (U = 2 C = 2 at 8, C = 3 at 9): the others are a P <= 4 world's (U, C) on a longer
    ring, which runs every head layout for them, and how K/V heads are shared does not depend on
    the ring's length (P = 8: 32 cases, was 56; P = 9: 20, was 28)."""
    every_head_layout = world_size <= HEAD_LAYOUTS_UP_TO or team_size ** 2 * ulysses_size > HEAD_LAYOUTS_UP_TO
    cases = [(layout, causal, kv_heads, torch.float32)
             for layout, causal, kv_heads in itertools.product(("sample", "document"), (True, False), (4, 2, 1))
             if every_head_layout or kv_heads == 2]
    return cases + [("document", True, 2, torch.bfloat16), ("sample", True, 4, torch.float16)]


def packed_worker(rank, world_size):
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True  # NaN-poisoned empty memory
    failures, checked, padding_rows = [], 0, 0
    for u, c in group_settings(world_size):
        groups = new_startrail_groups(team_size=c, ulysses_size=u)
        for n, (layout, causal, kv_heads, dtype) in enumerate(packed_cases(world_size, u, c)):
            case = f"U={u} C={c} {layout} causal={causal} kv_heads={kv_heads} {dtype}"
            thd = n % 2 == 0
            errors, pad_nonzero, n_pad = run_packed_case(
                groups, rank, world_size, layout, causal, kv_heads, dtype, 100 + world_size, thd
            )
            for name, err in errors.items():
                if not err <= TOLERANCE[dtype]:  # also catches NaN
                    failures.append(f"{case}: {name} error {err:.3g} > {TOLERANCE[dtype]:.0e}")
            if pad_nonzero:
                failures.append(f"{case}: {pad_nonzero} nonzero output/gradient values on padding rows")
            padding_rows += n_pad
            # The attention phases move exactly what the dense closed form says; the
            # document check is its own small op.
            cu, padded = make_documents(world_size, CHUNK, layout, 100 + world_size)
            local = int((padded if padded is not None else cu)[-1]) // world_size
            shape = AttentionShape(local, 1, HEADS, kv_heads, DIM, torch.empty((), dtype=dtype).element_size())
            want = expected_comm(shape, cp_size=world_size, team_size=c, ulysses_size=u,
                                 startrail_rank=groups.startrail_rank, rotation=groups.backward_rotation)
            fwd = groups.last_forward_stats
            check = fwd.bytes_sent_by_op.get(CHECK_OP, 0)
            want_check = 2 * (world_size - 1) * 16 * 8 // world_size  # one all-reduce over the CP group
            if check != want_check:
                failures.append(f"{case}: document check moved {check} bytes, want {want_check}")
            for phase, stats, minus in (("forward", fwd, check), ("backward", groups.last_backward_stats, 0)):
                measured = {f: getattr(stats, f) - (minus if f.startswith("collective") else 0) for f in STAT_FIELDS}
                if measured != want[phase]:
                    failures.append(f"{case}: {phase} comm {measured} != closed form {want[phase]}")
            checked += 1
    return failures, checked, padding_rows


@pytest.mark.parametrize("cp_size", [1, 2, 4, 8, 9])
def test_packed_matches_float64_per_document_attention(cp_size):
    results = run_ranks(packed_worker, cp_size, timeout=600)
    failures = sorted({f for fails, _, _ in results for f in fails})
    assert not failures, "\n".join(failures[:40])
    expected = sum(len(packed_cases(cp_size, u, c)) for u, c in group_settings(cp_size))
    assert all(n == expected for _, n, _ in results)
    assert expected == {1: 14, 2: 28, 4: 42, 8: 32, 9: 20}[cp_size]
    assert sum(p for _, _, p in results) > 0  # padding rows were exercised


def multiring_worker(rank, world_size):
    failures = []
    cases = itertools.product(("q", "kv"), ("sample", "document"), (True, False), (4, 1))
    for rotation, layout, causal, kv_heads in cases:
        groups = new_startrail_groups(team_size=1, backward_rotation=rotation)
        errors, pad_nonzero, _ = run_packed_case(groups, rank, world_size, layout, causal, kv_heads, torch.float32,
                                                 7, thd=False, transfer="multiring")
        case = f"multiring rotation={rotation} {layout} causal={causal} kv_heads={kv_heads}"
        failures += [f"{case}: {n} error {e:.3g}" for n, e in errors.items() if not e <= TOLERANCE[torch.float32]]
        failures += [f"{case}: padding not zero"] if pad_nonzero else []
    return failures


def test_packed_with_tasp_multiring_sub_ring():
    # 4 ranks, C = 1: one sub-ring of 4 carried on 3 concurrent rings, each with a part of every payload.
    failures = sum(run_ranks(multiring_worker, 4), [])
    assert not failures, "\n".join(failures[:30])


# -- kernel calls follow the documents -------------------------------------------------


class CountingKernel:
    """Wraps the real block kernel and counts its calls."""

    def __init__(self, inner):
        self.inner, self.name, self.calls = inner, inner.name, {"forward": 0, "backward": 0}

    def forward(self, *args, **kwargs):
        self.calls["forward"] += 1
        return self.inner.forward(*args, **kwargs)

    def backward(self, *args, **kwargs):
        self.calls["backward"] += 1
        return self.inner.backward(*args, **kwargs)


def counting_worker(rank, world_size, team_size):
    counter = CountingKernel(TorchCPUFlashKernel())
    chosen = attention.choose_layer_kernel  # the entry's choice, its kernel counted (this forked rank only)
    attention.choose_layer_kernel = lambda *args, **kwargs: dataclasses.replace(chosen(*args, **kwargs), kernel=counter)
    groups = new_startrail_groups(team_size=team_size)
    total = 2 * world_size * CHUNK
    one_per_chunk = torch.arange(0, total + 1, CHUNK, dtype=torch.int32)
    one_per_token = torch.arange(0, total + 1, dtype=torch.int32)
    calls = {}
    for name, cu in (("dense", None), ("chunk", one_per_chunk), ("token", one_per_token)):
        for causal in (True, False):
            counter.calls = {"forward": 0, "backward": 0}
            q, k, v = (torch.randn(2 * CHUNK, 1, HEADS, DIM, requires_grad=True) for _ in range(3))
            startrail_attn(q, k, v, groups, causal=causal, cu_seqlens=cu).sum().backward()
            calls[name, causal] = dict(counter.calls)
    return calls


@pytest.mark.parametrize("team_size", [1, 2])
def test_kernel_calls_do_not_grow_with_documents(team_size):
    """Note [kernel calls]: one variable-length call takes every document of a step, so a
    sample of one document per token makes exactly the calls of one document per chunk (before:
    one call per token): C per team, on the member that holds the team's own K, V -- a call
    takes at most one rank's rows of queries (max_rows), and the team has C ranks' rows."""
    cp = 4
    results = run_ranks(counting_worker, cp, args=(team_size,))
    total = {key: {p: sum(r[key][p] for r in results) for p in ("forward", "backward")} for key in results[0]}
    for causal in (True, False):
        assert total["token", causal] == total["chunk", causal], total
        assert total["chunk", causal] == {"forward": cp, "backward": cp}, total
    # Dense causal: every chunk meets every earlier chunk, at every step.
    assert total["dense", True]["forward"] >= cp


# -- bad input: ValueError on every rank, before the attention communicates ------------


def error_worker(rank, world_size, case):
    groups = new_startrail_groups(team_size=1)
    local = 2 * CHUNK
    total = world_size * local
    cu, padded = torch.tensor([0, 4, total], dtype=torch.int32), None
    if case == "non_monotonic":
        cu = torch.tensor([0, 6, 3, total], dtype=torch.int32)
    elif case == "last_entry":
        cu = torch.tensor([0, 4, total - 2], dtype=torch.int32)
    elif case == "span":
        cu = torch.tensor([0, 3, total - 6], dtype=torch.int32)
        padded = torch.tensor([0, 6, total], dtype=torch.int32)  # span 6, 2*CP = 4
    elif case == "differ":
        cu = torch.tensor([0, 4 + rank, total], dtype=torch.int32)
    elif case == "differ_same_moments":  # equal sum(cu) and sum(i * cu): the check must still see it
        cu = torch.tensor([0, 1, 4, 5, total] if rank == 0 else [0, 2, 2, 6, total], dtype=torch.int32)
    elif case == "one_rank_bad":
        cu = torch.tensor([0, 6, 3, total] if rank == 1 else [0, 4, total], dtype=torch.int32)
    q, k, v = (torch.randn(local, 1, HEADS, DIM) for _ in range(3))
    try:
        startrail_attn(q, k, v, groups, cu_seqlens=cu, cu_seqlens_padded=padded)
    except ValueError as exc:
        return str(exc), dict(groups.last_forward_stats.bytes_sent_by_op)
    return None, None


@pytest.mark.parametrize("case, message", [
    ("non_monotonic", "cu_seqlens must be non-decreasing"),
    ("last_entry", r"cu_seqlens\[-1\] = 18 must equal the tokens"),
    ("span", r"divisible by 2 \* --context-parallel-size = 4"),
    ("differ", "differ across the 2 context-parallel ranks"),
    ("differ_same_moments", "differ across the 2 context-parallel ranks"),
    ("one_rank_bad", "non-decreasing|differ across the 2 context-parallel ranks"),
])
def test_bad_input_raises_on_every_rank_before_communicating(case, message):
    for error, sent in run_ranks(error_worker, 2, args=(case,)):
        assert error is not None and re.search(message, error), error
        assert set(sent) == {CHECK_OP}  # only the check ran
