"""StarTrail attention on gloo ranks against float64 full attention, plus exact comm counts.

One forked world per CP size P; inside it every valid (U, C), causal or not, MHA / GQA /
MQA and every input dtype runs, and each rank asserts its output and gradients and its
communication counters (against the closed forms in ``megatron_startrail.accounting``).
At P = 8 and 16 (8 and 16 ranks on CI's 2 cores: the suite's longest worlds) bf16 and fp16
run one case per (U, C), causal GQA: how a dtype is handled does not depend on P, and
P <= 4 runs every combination. At P = 16 the float32 product of head layouts and masks runs
for the (U, C) that no smaller world has (C^2 U = 16: C = 4 at U = 1, C = 2 at U = 4); its other
(U, C) run float32 GQA, causal and not: each of them is a P = 8 world's (U, C) on a longer ring,
and P = 8 runs every layout for it (43 cases in the 16-rank world, was 63: ~70 s of a full run).
"""

import itertools

import pytest
import torch

from megatron_startrail import new_startrail_groups, startrail_attn, valid_team_sizes
from megatron_startrail.accounting import AttentionShape, expected_comm
from tests.attention_cases import (
    TOLERANCE,
    causal_pairs,
    full_inputs,
    local_rows,
    max_logit_error,
    reference_max_logit,
    reference_with_grads,
    relative_error,
)
from tests.multiproc import run_ranks

BATCH, HEADS, DIM, CHUNK = 2, 4, 8, 3
HEAD_LAYOUTS = {"mha": 4, "gqa": 2, "mqa": 1}
DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64]
FULL_PRODUCT_UP_TO = 4  # worlds larger than this run low precision once per (U, C)
LAYOUT_PRODUCT_UP_TO = 8  # larger worlds run every float32 layout only for a (U, C) no world this size has


def cases(cp_size, ulysses_size=1, team_size=1):
    """(causal, (layout, kv_heads), dtype) run for (U, C) = (``ulysses_size``, ``team_size``) at ``cp_size``."""
    every_layout = cp_size <= LAYOUT_PRODUCT_UP_TO or team_size ** 2 * ulysses_size > LAYOUT_PRODUCT_UP_TO
    for case in itertools.product((True, False), HEAD_LAYOUTS.items(), DTYPES):
        causal, (layout, _), dtype = case
        if dtype == torch.float64:  # once per (U, C): the max logit within 1e-12
            if causal and layout == "gqa":
                yield case
        elif dtype == torch.float32:
            if every_layout or layout == "gqa":
                yield case
        elif cp_size <= FULL_PRODUCT_UP_TO or (causal and layout == "gqa"):
            yield case
STAT_FIELDS = ["p2p_bytes_sent", "p2p_bytes_recv", "collective_bytes_sent", "collective_bytes_recv", "p2p_steps"]


def group_settings(cp_size):
    """Every (ulysses_size, team_size) valid for a CP group of ``cp_size``."""
    for u in (1, 2, 4):  # U = 4 with the GQA layout's 2 kv heads: K/V heads replicated for the all-to-all
        if cp_size % u == 0:
            for c in valid_team_sizes(cp_size // u):
                yield u, c


def run_case(groups, rank, cp_size, causal, kv_heads, dtype, seed):
    """Run one case on this rank; return (errors by tensor, stats, outputs). The errors include
    the max logit's (``startrail_attn(..., return_max_logit=True)`` after the MAX over CP)."""
    seq = 2 * cp_size * CHUNK
    full = full_inputs(seed, seq, BATCH, HEADS, kv_heads, DIM, dtype)
    scale = DIM**-0.5
    ref = reference_with_grads(*full, causal, scale)
    q, k, v, dout = (local_rows(t, rank, cp_size).to(dtype) for t in full)
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    out, max_logit = startrail_attn(q, k, v, groups, causal=causal, softmax_scale=scale, return_max_logit=True)
    out.backward(dout)
    got = (out.detach(), q.grad, k.grad, v.grad)
    errors = {
        name: relative_error(g, local_rows(r, rank, cp_size))
        for name, g, r in zip(("out", "dq", "dk", "dv"), got, ref)
    }
    want = reference_max_logit(full[0], full[1], causal_pairs(seq) if causal else None, scale)
    errors["max_logit"] = max_logit_error(max_logit, want)
    stats = {"forward": groups.last_forward_stats, "backward": groups.last_backward_stats}
    return errors, stats, got


def worker(rank, world_size):
    # Poison: every torch.empty is NaN-filled, so any row left unwritten shows up.
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    failures, checked = [], 0
    for u, c in group_settings(world_size):
        groups = new_startrail_groups(team_size=c, ulysses_size=u)
        for causal, (layout, kv_heads), dtype in cases(world_size, u, c):
            case = f"U={u} C={c} causal={causal} {layout} {dtype}"
            seed = 1000 + 10 * c + u
            errors, stats, _ = run_case(groups, rank, world_size, causal, kv_heads, dtype, seed)
            for name, err in errors.items():
                if not err <= TOLERANCE[dtype]:  # also catches NaN
                    failures.append(f"{case}: {name} error {err:.3g} > {TOLERANCE[dtype]:.0e}")
            shape = AttentionShape(2 * CHUNK, BATCH, HEADS, kv_heads, DIM, torch.empty((), dtype=dtype).element_size())
            want = expected_comm(
                shape, cp_size=world_size, team_size=c, ulysses_size=u,
                startrail_rank=groups.startrail_rank, rotation=groups.backward_rotation,
            )
            for phase in ("forward", "backward"):
                measured = {f: getattr(stats[phase], f) for f in STAT_FIELDS}
                if measured != want[phase]:
                    failures.append(f"{case}: {phase} comm {measured} != closed form {want[phase]}")
            checked += 1
    return failures, checked


@pytest.mark.parametrize("cp_size", [1, 2, 4, 8, 16])
def test_matches_float64_full_attention_and_closed_form_comm(cp_size):
    results = run_ranks(worker, cp_size, timeout=600)
    failures = sorted({f for fails, _ in results for f in fails})
    assert not failures, "\n".join(failures[:40])
    expected_cases = sum(len(list(cases(cp_size, u, c))) for u, c in group_settings(cp_size))
    assert all(n == expected_cases for _, n in results)


def rotation_worker(rank, world_size, team_size):
    """Both backward rotations give the same (correct) gradients; GQA picks "kv"."""
    out = {}
    for rotation in ("q", "kv", "auto"):
        groups = new_startrail_groups(team_size=team_size, backward_rotation=rotation)
        errors, stats, _ = run_case(groups, rank, world_size, True, 1, torch.float32, 7)
        out[rotation] = (errors, stats["backward"].p2p_bytes_sent)
    return out


def test_both_backward_rotations_are_exact_and_auto_picks_the_cheaper():
    results = run_ranks(rotation_worker, 8, args=(2,))
    for per_rank in results:
        for rotation, (errors, _) in per_rank.items():
            assert max(errors.values()) <= TOLERANCE[torch.float32], (rotation, errors)
        # MQA: circulating K, V is cheaper than circulating Q, dO, out, lse, dQ.
        assert per_rank["kv"][1] < per_rank["q"][1]
        assert per_rank["auto"][1] == per_rank["kv"][1]


def determinism_worker(rank, world_size):
    groups = new_startrail_groups(team_size=2)
    runs = [run_case(groups, rank, world_size, True, 2, torch.float32, 3) for _ in range(2)]
    errors = max(err for run in runs for err in run[0].values())
    return errors, all(torch.equal(a, b) for a, b in zip(runs[0][2], runs[1][2]))


def test_two_runs_are_bitwise_equal_and_exact():
    for errors, equal in run_ranks(determinism_worker, 8):
        assert errors <= TOLERANCE[torch.float32] and equal, (errors, equal)
