"""Megatron-Bridge's own ``vanilla_gpt`` recipe trained by Bridge's own ``pretrain`` with
StarTrail (``startrail_layer_spec``) at CP4, teams of 2, on 4 gloo ranks, against the same
recipe at CP1 on 1 rank: every parameter's first-step gradient within 1e-5 (relative to the
parameter's largest entry) and the lm loss of 4 iterations within 1e-5 relative.

Bridge is installed by ``scripts/env.sh`` (its own step); the GPU-only packages it imports
are stand-ins (``standins.py``), and the places where it assumes a GPU are patched in the
forked ranks only (``recipe_run.py``).
"""

from __future__ import annotations

import pytest

from tests.bridge import require_bridge

require_bridge()

from tests.bridge.recipe_run import ITERS, run_recipe_rank  # noqa: E402
from tests.megatron.utils import assert_first_step_grads_match, worst_grad_error  # noqa: E402
from tests.multiproc import run_ranks  # noqa: E402


def test_vanilla_gpt_recipe_with_startrail_cp4_gives_the_losses_and_gradients_of_cp1():
    (reference,) = run_ranks(run_recipe_rank, 1, args=(1, None), timeout=300)
    ranks = run_ranks(run_recipe_rank, 4, args=(4, 2), timeout=300)
    assert reference["core_attention"] == {"DotProductAttention"}
    for rank in ranks:  # Bridge built StarTrail's core attention on every rank, and said so on rank 0
        assert rank["core_attention"] == {"StarTrailCoreAttention"}, rank["core_attention"]
    assert "> startrail (Megatron-Bridge): StarTrail CP=4" in ranks[0]["log"]
    assert "team size C=2" in ranks[0]["log"]

    ref_losses, losses = reference["losses"], ranks[0]["losses"]
    assert len(ref_losses) == len(losses) == ITERS
    print("\nCP1 losses:        ", " ".join(f"{x:.7f}" for x in ref_losses))
    print("CP4 C2 losses:     ", " ".join(f"{x:.7f}" for x in losses))
    assert losses == pytest.approx(ref_losses, rel=1e-5, abs=0)
    assert len(set(ref_losses)) > 1  # the run trains: the loss moves

    # DDP reduced the gradients over DP x CP: every CP rank holds the same ones.
    for rank in ranks[1:]:
        assert worst_grad_error(rank["grads"], ranks[0]["grads"])[0] == 0.0
    assert_first_step_grads_match(ranks[0]["grads"], reference["grads"], "Bridge vanilla_gpt CP4 C2 vs CP1")
