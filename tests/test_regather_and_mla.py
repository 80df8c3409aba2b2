"""Regathering in the backward (ring attention's memory) and V head dims of their own (MLA).

Against float64 full attention: regathering on and off, ``v_head_dim != qk_head_dim``,
MHA / GQA, Ulysses U = 2, TASP multi-ring, both backward rotations, packed documents;
regathering gives bitwise the same results and moves exactly what the closed forms say.
Memory: the bytes kept for backward, measured with ``saved_tensors_hooks`` (the inputs
q, k, v excluded), are at most 1.10x ring attention's with regathering (C = 2 at P = 8,
C = 4 at P = 16), and equal :func:`~megatron_startrail.accounting.kept_for_backward_bytes`.
"""

import itertools

import torch

from benchmarks.counters.memory import saved_bytes
from megatron_startrail import new_startrail_groups, startrail_attn
from megatron_startrail.accounting import AttentionShape, expected_comm, kept_for_backward_bytes
from tests.attention_cases import TOLERANCE, local_rows, pairs_not_run, reference_with_grads, relative_error
from tests.multiproc import run_ranks
from tests.test_packed_documents import run_packed_case

HEADS, CHUNK = 4, 4
STAT_FIELDS = ["p2p_bytes_sent", "p2p_bytes_recv", "collective_bytes_sent", "collective_bytes_recv", "p2p_steps"]
# (q/k head dim, v head dim, kv heads): MHA with one head dim; MLA-like dims with GQA and MQA
HEAD_CASES = [(8, 8, 4), (12, 8, 2), (6, 10, 1)]


ROTATIONS = ("q", "kv")


def rotation_of(setting_index, head_case_index):
    """The backward rotation a (group setting, head case) runs with: alternating, so that every
    setting runs both rotations, every head case both, and every setting every head case (one
    rotation each, not both: the 8-rank world's cases were 48 runs of the ring, now 24)."""
    return ROTATIONS[(setting_index + head_case_index) % 2]


def mla_inputs(seed, seq, kv_heads, dqk, dv):
    """q ``[seq, 1, h, dqk]``, k ``[seq, 1, hkv, dqk]``, v ``[seq, 1, hkv, dv]``, dout ``[seq, 1, h, dv]``."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(seq, 1, HEADS, dqk), (seq, 1, kv_heads, dqk), (seq, 1, kv_heads, dv), (seq, 1, HEADS, dv)]
    return [torch.randn(s, generator=gen, dtype=torch.float64) for s in shapes]


def run(groups, rank, cp, full, *, regather, transfer="ring", causal=True):
    """One forward+backward on this rank: (out, dq, dk, dv), bytes kept for backward."""
    scale = full[0].shape[-1] ** -0.5
    q, k, v, dout = (local_rows(t, rank, cp).float() for t in full)
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    out, kept = saved_bytes(
        lambda: startrail_attn(q, k, v, groups, causal=causal, softmax_scale=scale, transfer=transfer,
                               regather_in_backward=regather),
        exclude=(q, k, v),
    )
    assert out.shape == dout.shape
    out.backward(dout)
    return (out.detach(), q.grad, k.grad, v.grad), kept


def exactness_worker(rank, world_size):
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True  # NaN-poisoned empty memory
    failures, checked = [], 0
    settings = [(1, 2, "ring"), (2, 2, "ring"), (1, 1, "multiring"), (2, 1, "multiring")]
    for (s, (u, c, transfer)), rotation in itertools.product(enumerate(settings), ROTATIONS):
        groups = new_startrail_groups(team_size=c, ulysses_size=u, backward_rotation=rotation)
        for n, (dqk, dv, kv_heads) in enumerate(HEAD_CASES):
            if rotation_of(s, n) != rotation:
                continue
            causal = n != 2
            full = mla_inputs(7 * n + c + u, 2 * world_size * CHUNK, kv_heads, dqk, dv)
            ref = [local_rows(t, rank, world_size) for t in reference_with_grads(*full, causal, dqk**-0.5)]
            results = {}
            for regather in (False, True):
                case = (f"U={u} C={c} {transfer} rotation={rotation} dqk={dqk} dv={dv} kv_heads={kv_heads} "
                        f"causal={causal} regather={regather}")
                got, _ = run(groups, rank, world_size, full, regather=regather, transfer=transfer, causal=causal)
                results[regather] = got
                for name, g, r in zip(("out", "dq", "dk", "dv"), got, ref):
                    err = relative_error(g, r)
                    if not err <= TOLERANCE[torch.float32]:  # also catches NaN
                        failures.append(f"{case}: {name} error {err:.3g}")
                shape = AttentionShape(2 * CHUNK, 1, HEADS, kv_heads, dqk, 4, v_head_dim=dv)
                want = expected_comm(shape, cp_size=world_size, team_size=c, ulysses_size=u,
                                     startrail_rank=groups.startrail_rank, rotation=rotation,
                                     regather_in_backward=regather)
                for phase, stats in (("forward", groups.last_forward_stats),
                                     ("backward", groups.last_backward_stats)):
                    measured = {f: getattr(stats, f) for f in STAT_FIELDS}
                    if measured != want[phase]:
                        failures.append(f"{case}: {phase} comm {measured} != closed form {want[phase]}")
                checked += 1
            if not all(torch.equal(a, b) for a, b in zip(results[False], results[True])):
                failures.append(f"U={u} C={c} {transfer} {rotation} dqk={dqk} dv={dv}: regathering changed the result")
    # Packed documents (both layouts) with regathering, C = 2.
    groups = new_startrail_groups(team_size=2)
    for layout in ("sample", "document"):
        errors, pad_nonzero, _ = run_packed_case(groups, rank, world_size, layout, True, 2, torch.float32, 5,
                                                 thd=True, regather=True)
        if max(errors.values()) > TOLERANCE[torch.float32] or pad_nonzero:
            failures.append(f"packed {layout} regather: errors {errors}, {pad_nonzero} nonzero padding values")
        checked += 1
    return failures, checked


def test_regather_and_mla_head_dims_match_float64_and_closed_form_comm():
    results = run_ranks(exactness_worker, 8, timeout=600)
    failures = sorted({f for fails, _ in results for f in fails})
    assert not failures, "\n".join(failures[:40])
    assert all(n == 4 * len(HEAD_CASES) * 2 + 2 for _, n in results)
    # every setting with both rotations, every head case with both
    runs = [(s, n, rotation_of(s, n)) for s in range(4) for n in range(len(HEAD_CASES))]
    assert pairs_not_run(runs, [range(4), range(len(HEAD_CASES)), ROTATIONS]) == []


def memory_worker(rank, world_size, team_size):
    """Bytes kept for backward (inputs excluded) by ring and StarTrail-C, with and without
    regathering, and the closed form; results must agree with each other and float64."""
    dqk, dv, kv_heads = 16, 16, HEADS
    full = mla_inputs(11, 2 * world_size * 8, kv_heads, dqk, dv)
    ref = [local_rows(t, rank, world_size) for t in reference_with_grads(*full, True, dqk**-0.5)]
    kept, closed, outs = {}, {}, {}
    for c, regather in ((1, False), (team_size, False), (team_size, True)):
        groups = new_startrail_groups(team_size=c)
        outs[c, regather], kept[c, regather] = run(groups, rank, world_size, full, regather=regather)
        shape = AttentionShape(16, 1, HEADS, kv_heads, dqk, 4, v_head_dim=dv)
        # The closed form counts q, k, v when kept (ring, regathering); the measurement excludes them.
        inputs = 16 * HEADS * dqk * 4 + 16 * kv_heads * (dqk + dv) * 4 if regather or c == 1 else 0
        closed[c, regather] = kept_for_backward_bytes(shape, ulysses_size=1, team_size=c,
                                                      regather_in_backward=regather) - inputs
    errors = [relative_error(g, r) for got in outs.values() for g, r in zip(got, ref)]
    same = all(torch.equal(a, b) for a, b in zip(outs[team_size, False], outs[team_size, True]))
    return kept, closed, max(errors), same


def _check_memory(world_size, team_size):
    for kept, closed, error, same in run_ranks(memory_worker, world_size, args=(team_size,), timeout=600):
        assert error <= TOLERANCE[torch.float32] and same
        assert kept == closed, (kept, closed)
        ring = kept[1, False]
        assert kept[team_size, True] <= 1.10 * ring, (kept, ring)
        # Without regathering StarTrail keeps the team's Q and K, V: (3C + 1)/1 of ring's out + lse.
        assert kept[team_size, False] > 2 * ring


def test_regather_keeps_ring_memory_c2_p8():
    _check_memory(8, 2)


def test_regather_keeps_ring_memory_c4_p16():
    _check_memory(16, 4)
