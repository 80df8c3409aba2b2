"""Attention sinks (``softmax_offset``, Megatron's ``--softmax-type off-by-one | learnable``)
against float64 attention with Megatron's ``SoftmaxOne`` rule, the sinks' gradient included.

Every setting of the layout fuzz (both rotations, regathering, Ulysses with 1 < kv heads < U,
TASP's multi-ring, windows by halo and by schedule, both packed layouts, MLA, GQA/MQA) runs
with learnable sinks in float64 and float32 and with off-by-one sinks in float64, on the
fused-QKV views Megatron hands over; C = 4 (P = 16: the piece-major backward, the scheduled
window) with learnable sinks in float64. The sinks' gradient is each rank's rows' share, summed
over the ranks as Megatron's gradient all-reduce does.
"""

import pytest
import torch

from megatron_startrail import new_startrail_groups, startrail_attn
from tests.multiproc import run_ranks
from tests.test_layout_fuzz import SETTINGS, WORLD, Setting, check_settings

RUNS = [("learnable", torch.float64), ("off-by-one", torch.float64), ("learnable", torch.float32)]


def sinks_worker(rank, world_size):
    return check_settings(rank, [("fused", dtype, sink) for sink, dtype in RUNS], seed=900)


# C = 4 needs P = 16 (C * C divides P): the piece-major backward (sub-rings of one position).
C4_SETTINGS = [
    Setting("C4 q", team=4, rotation="q"),
    Setting("C4 kv regather GQA", team=4, rotation="kv", regather=True, kv_heads=2),
    Setting("C4 window schedule", team=4, rotation="q", window=(3 * 4, 0), halo=False),
]


def c4_sinks_worker(rank, world_size):
    return check_settings(rank, [("fused", torch.float64, "learnable")], seed=950, settings=C4_SETTINGS)


def test_sinks_are_exact_at_c4():
    results = run_ranks(c4_sinks_worker, 16, timeout=600)
    failures = sorted({f for fails, _ in results for f in fails})
    assert not failures, "\n".join(failures[:40])
    assert all(n == len(C4_SETTINGS) for _, n in results)


def test_sinks_are_exact_on_every_setting():
    results = run_ranks(sinks_worker, WORLD, timeout=600)
    failures = sorted({f for fails, _ in results for f in fails})
    assert not failures, "\n".join(failures[:40])
    assert all(n == len(SETTINGS) * len(RUNS) for _, n in results)


def bad_sink_worker(rank, world_size, shape, dtype):
    groups = new_startrail_groups(team_size=1)
    q = torch.randn(4, 1, 4, 8)
    with pytest.raises(ValueError, match="softmax_offset"):
        startrail_attn(q, q[:, :, :2], q[:, :, :2], groups, softmax_offset=torch.zeros(shape, dtype=dtype))
    return True


@pytest.mark.parametrize("shape, dtype", [((2,), torch.float32), ((1, 4), torch.float32), ((4,), torch.int64)])
def test_a_sink_of_the_wrong_shape_or_dtype_is_refused(shape, dtype):
    assert all(run_ranks(bad_sink_worker, 2, args=(shape, dtype)))


def checkpointed_sinks_worker(rank, world_size):
    """Learnable sinks under torch's non-reentrant checkpoint: the backward unpacks each saved
    tensor once (a second unpack raises there; on 9ee7a82 the sink's gradient read out, lse
    before the backward read everything again), and the gradients are the plain run's."""
    from torch.utils.checkpoint import checkpoint  # noqa: PLC0415

    gen = torch.Generator().manual_seed(970 + rank)
    fused = torch.randn(16, 1, 3 * 4, 8, generator=gen, dtype=torch.float64)
    dout = torch.randn(16, 1, 4, 8, generator=gen, dtype=torch.float64)
    sink0 = torch.randn(4, generator=torch.Generator().manual_seed(971), dtype=torch.float64)
    failures = []
    for rotation, regather in (("kv", False), ("q", False), ("kv", True), ("q", True)):
        groups = new_startrail_groups(team_size=2, backward_rotation=rotation, regather_in_backward=regather)

        def attend(qkv, sink):  # q, k, v: strided views of a fused projection, as Megatron hands them
            q, k, v = qkv.view(16, 1, 3, 4, 8).unbind(2)
            return startrail_attn(q, k, v, groups, softmax_offset=sink)  # noqa: B023

        grads = []
        for wrapped in (False, True):
            qkv, sink = fused.clone().requires_grad_(True), sink0.clone().requires_grad_(True)
            out = checkpoint(attend, qkv, sink, use_reentrant=False) if wrapped else attend(qkv, sink)
            (out * dout).sum().backward()
            grads.append((qkv.grad, sink.grad))
        if not all(torch.equal(a, b) for a, b in zip(*grads)):
            failures.append(f"rotation {rotation} regather {regather}")
    return failures


def test_sinks_under_torchs_non_reentrant_checkpoint_are_the_plain_runs():
    for failures in run_ranks(checkpointed_sinks_worker, 4, timeout=120):
        assert not failures, failures
