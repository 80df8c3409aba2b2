"""What a Ulysses (U > 1) layer holds through Megatron's recomputation: its attention's saved
tensors plus one more ``out`` share, the output after the all-to-all back, which the kept graph
holds (Note [the Ulysses output kept] in megatron_startrail/planning/memory_model.py). The planner
counts it (``memory_model.kept_per_layer_bytes``); here it is measured."""

import time

from tests.megatron.utils import cpu_patches  # noqa: F401  (import shims before megatron-core)
from tests.multiproc import run_ranks  # noqa: E402


# gloo's worker thread holds a collective's tensors (its work's inputs and outputs) until it takes
# the process group's lock again after marking the work done, so ``wait()`` can return first: the
# Ulysses all-to-all back's receive buffer (``_seq_scatter``'s ``got``, dead once permuted into the
# output) then outlives the layer by however long the scheduler keeps that thread off a core. On a
# loaded machine that was one out share more in 3 of 15 runs, on 3a17b64 as on 4f09a0c, and gone
# 0.3 s later without a garbage collection. Nothing of ours holds it; so the count is read once the
# backend has let go: waiting only lets bytes be freed, never added, so a storage the layer really
# keeps still fails, after ``SETTLE_S``, and a count under the model fails at once. (At U = 1 the
# count starts under the model -- k and v are the caller's -- so nothing is waited for there.)
SETTLE_S = 20.0


def _held_once_settled(live, out, model: int) -> int:
    """Bytes ``live`` counts, less ``out``'s, once at most ``model`` or after ``SETTLE_S``."""
    deadline = time.monotonic() + SETTLE_S
    while live.live - out.untyped_storage().nbytes() > model and time.monotonic() < deadline:
        time.sleep(0.01)
    return live.live - out.untyped_storage().nbytes()


def held_through_recomputation_worker(rank, world_size):
    """Per U: the bytes the checkpoint's first pass leaves alive (every storage its ops made and
    that is still referenced, less the checkpoint's output), the model's, and the out share."""
    import torch  # noqa: PLC0415
    from megatron.core.tensor_parallel import random as megatron_random  # noqa: PLC0415

    from megatron_startrail import new_startrail_groups, startrail_attn  # noqa: PLC0415
    from megatron_startrail.accounting import AttentionShape, kept_for_backward_bytes  # noqa: PLC0415
    from megatron_startrail.megatron import kept_attention  # noqa: PLC0415
    from megatron_startrail.planning.memory_model import kept_per_layer_bytes  # noqa: PLC0415
    from tests.fake_cuda.memory import LiveStorages  # noqa: PLC0415 - counts storages on any device

    # Megatron's checkpoint saves the CUDA RNG too: the CPU one only (this forked rank).
    megatron_random._get_cuda_rng_state = lambda *a, **k: None
    megatron_random._set_cuda_rng_state = lambda *a, **k: None
    n, heads, dim = 64, 4, 16
    gen = torch.Generator().manual_seed(rank)
    q, k, v = (torch.randn(n, 1, heads, dim, generator=gen) for _ in range(3))
    q.requires_grad_(True)
    shape = AttentionShape(n, 1, heads, heads, dim, 4)
    rows = []
    for u in (1, 2):
        groups = new_startrail_groups(team_size=1, ulysses_size=u)
        kept = kept_attention.KeptAttention()

        def layer(x):  # q from a projection inside the checkpoint; "* 2" stands in for linear_proj
            return kept.run(lambda *t: startrail_attn(*t, groups), x * 1, k, v, training=True) * 2  # noqa: B023

        layer(q.detach())  # warm-up: the groups' caches are made here, not measured
        model = kept_per_layer_bytes(shape, ulysses_size=u, team_size=1, regather_in_backward=False)
        with LiveStorages() as live:
            out = megatron_random.checkpoint(layer, False, q)
            held = _held_once_settled(live, out, model)
        saved = kept_for_backward_bytes(shape, ulysses_size=u, team_size=1, regather_in_backward=False)
        rows.append((u, held, model, saved))
        out.sum().backward()  # the recomputation takes the kept graph
        assert len(kept) == 0 and q.grad is not None
        q.grad = None
    return rows


def test_a_ulysses_layer_holds_one_more_out_share_and_the_model_counts_it():
    out_share = 64 * 1 * 4 * 16 * 4  # [n, b, h, dv] float32: the layer's output
    for rows in run_ranks(held_through_recomputation_worker, 4):
        (u1, held1, model1, saved1), (u2, held2, model2, saved2) = rows
        # U = 1: the output the layer gets is the one the attention saved; k and v, saved as they
        # are, were made before the measurement (the caller's), q inside it (x * 1).
        assert model1 == saved1 and held1 == saved1 - 2 * out_share, rows
        # U = 2: q, k, v and out after the all-to-all are the attention's own, and the output
        # after the all-to-all back is held too.
        assert held2 == model2 == saved2 + out_share, rows
