"""A tiny GPTModel with the StarTrail spec gives the loss and gradients of the CP=1 model.

Each parallel layout runs in one forked world; the CP=1 reference with the same TP/PP
runs in another. Weights are initialized on the CPU from the same seeds, so both worlds
hold identical weights per (TP, PP) rank (asserted). Losses are summed over tokens and
gradients over the DP x CP group (what Megatron's DDP does), then compared.
"""

import pytest
import torch

from tests.megatron.utils import Utils, parallel_state, sample_batch, tiny_gpt, train_steps, worst_grad_error
from tests.multiproc import run_ranks

# (name, world, tp, pp, cp, dp, team_size, ulysses, query_groups)
LAYOUTS = [
    ("TP2xCP4_C2", 8, 2, 1, 4, 1, 2, 1, None),
    ("PP2xCP4_C2", 8, 1, 2, 4, 1, 2, 1, None),
    ("DP2xCP4_C2", 8, 1, 1, 4, 2, 2, 1, None),
    ("CP8_C2", 8, 1, 1, 8, 1, 2, 1, None),
    ("CP8_U2xS4_C2_GQA", 8, 1, 1, 8, 1, 2, 2, 2),
    ("CP16_C4", 16, 1, 1, 16, 1, 4, 1, None),
]
STEPS, LR = 4, 1e-2  # the issue asks for 4 iterations


def concat_batches(batches):
    return {k: None if v is None else torch.cat([b[k] for b in batches]) for k, v in batches[0].items()}


def worker(rank, world_size, tp, pp, cp, team_size, ulysses, query_groups, window=None):
    """Train STEPS steps of SGD; return per-step losses and the first step's grads (rank-0 of DPxCP)."""
    Utils.initialize_model_parallel(
        tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, context_parallel_size=cp
    )
    model = tiny_gpt(tp, pp, cp, team_size, ulysses, query_groups, window=window)
    weights = {n: p.detach().double().sum().item() for n, p in model.named_parameters()}
    dp = parallel_state.get_data_parallel_world_size(with_context_parallel=False)
    dp_rank = parallel_state.get_data_parallel_rank(with_context_parallel=False)

    def batch_of_step(step):  # the reference (dp=1) sees every DP rank's sample in one batch
        batches = [sample_batch(10 * step + d) for d in range(2)]
        return batches[dp_rank] if dp > 1 else concat_batches(batches)

    losses, first_grads = train_steps(model, STEPS, LR, batch_of_step)
    keep = parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0
    key = (parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank())
    last_stage = parallel_state.is_pipeline_last_stage()
    Utils.destroy_model_parallel()
    return (key, weights, first_grads, losses if last_stage else None) if keep else None


def collect(results):
    by_key = {}
    for r in results:
        if r is not None:
            key, weights, grads, losses = r
            by_key[key] = (weights, grads, losses)
    return by_key


# Sliding windows (--window-size L,0 --window-attn-skip-freq 2: layer 1 windowed, layer 2
# global) on 64 tokens, CP4 (chunks of 8): 32 reaches past a chunk (the StarTrail schedule
# with masked blocks), 5 only into the neighbours' chunks (the halo exchange).
WINDOWS = [("TP2xCP4_C2_window32_skip2", 8, 2, 1, 4, 1, 2, 1, None, ((32, 0), 2)),
           ("TP2xCP4_C2_window5_skip2", 8, 2, 1, 4, 1, 2, 1, None, ((5, 0), 2))]


@pytest.mark.parametrize("layout", LAYOUTS + WINDOWS, ids=[l[0] for l in LAYOUTS + WINDOWS])
def test_startrail_gpt_matches_cp1(layout):
    name, world, tp, pp, cp, dp, c, u, qg = layout[:9]
    window = layout[9] if len(layout) > 9 else None
    got = collect(run_ranks(worker, world, args=(tp, pp, cp, c, u, qg, window), timeout=300))
    ref = collect(run_ranks(worker, tp * pp * (2 if dp > 1 else 1), args=(tp, pp, 1, 1, 1, qg, window),
                            timeout=300))
    assert set(got) == set(ref) and got
    for key in ref:
        (w, g, losses), (rw, rg, rlosses) = got[key], ref[key]
        assert w == rw, f"{name} {key}: weights differ between the two builds"
        err, pname = worst_grad_error(g, rg)  # per parameter (issue 36: losses alone miss 1e-2)
        assert err <= 1e-5, f"{name} {key} {pname}: relative grad error {err:.2e}"
        if rlosses is not None:
            assert losses == pytest.approx(rlosses, rel=1e-5), f"{name}: losses {losses} vs CP=1 {rlosses}"
    if window is not None:  # the window changes the model: a run that ignored it would be told apart
        full = collect(run_ranks(worker, tp * pp, args=(tp, pp, 1, 1, 1, qg, None), timeout=300))
        losses, unwindowed = ref[(0, pp - 1)][2], full[(0, pp - 1)][2]
        assert losses != pytest.approx(unwindowed, rel=1e-5), f"{name}: the window did not change the losses"
