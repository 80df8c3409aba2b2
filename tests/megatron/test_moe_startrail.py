"""Mixture of experts with expert parallelism x StarTrail CP, through examples/pretrain_gpt.py
(megatron.training's pretrain: DDP with the expert-data-parallel gradient reduction, Adam,
finalize_model_grads with the sequence-parallel norms and router summed over TP).

GPT with 4 experts, top-2 routing, expert parallel 2 (``--num-experts 4 --moe-router-topk 2
--expert-model-parallel-size 2``), load-balancing loss on. StarTrail CP4 (team size 2) on 8
ranks logs the lm loss and load-balancing loss of CP1 with the same expert layout.

Why the comparison is fair: Megatron's expert grid has no CP axis (world = ETP x EP x EDP x
PP; the dense grid's CP and DP ranks fold into EP and EDP), so the CP1 twin keeps EP, ETP and
the global batch and is as small as that allows. With CPU initialisation every rank builds
its local experts from the same seeded generator, so EP rank e holds the same experts in both
layouts (local expert i starts alike on both EP ranks, experts 0 and 2 say; the router tells
them apart and they part after the first step); routing is dropless (no capacity factor), so a
token's output does not depend on which ranks its experts live on.

  layout (8 ranks)              expert groups of the CP run                    CP1 twin
  TP1 x CP4 x DP2, EP2 ETP1     EP [0,1] (CP ranks 0,1)  EDP [0,2,4,6]         TP1 x DP2, EP2 (2 ranks)
  TP2+SP x CP4, EP2 ETP2        EP [0,2] (CP ranks 0,1)  EDP [0,4]             TP2+SP x DP2, EP2 ETP2 (4)
  TP2+SP x CP4, EP2 ETP1        EP [0,1] (the TP pair)   EDP [0,2,4,6]         TP2+SP, EP2 ETP1 (2 ranks)
                                (the last as a HybridModel: test_hybrid_example.py)

The all-to-all dispatcher moves uneven per-rank token counts; with ETP2 it would all-gather
uneven sizes over the expert-TP group, which gloo cannot, so that row uses the all-gather
dispatcher (the GPU path is NCCL, which can).
"""

import math
import re

import pytest

from tests.megatron.example import run_example_rank
from tests.megatron.test_pretrain_example import COMMON
from tests.megatron.test_pretrain_example import LOG_LINE as DENSE_LINE
from tests.megatron.utils import assert_first_step_grads_match, record_first_step_grads
from tests.multiproc import run_ranks

LOG_LINE = re.compile(r"iteration\s+(\d+)/\s*(\d+) \|.* lm loss: ([0-9.E+-]+) \| load_balancing_loss: ([0-9.E+-]+) \|")
ITERS = 4

MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--expert-model-parallel-size", "2",
       "--moe-aux-loss-coeff", "1e-2"]
STARTRAIL_CP4 = ["--context-parallel-size", "4", "--context-parallel-algo", "startrail", "--startrail-team-size", "2"]
TP2_SP = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]

# (name, flags of both runs, ranks of the CP1 twin). TP2+SP with ETP1 (the expert-parallel
# group is the TP pair, all-to-all dispatcher) runs in test_hybrid_example.py as the HybridModel
# "*E*E", whose layers are these GPT layers split in two (the same losses).
LAYOUTS = [
    ("TP1xCP4xDP2_EP2", ["--moe-token-dispatcher-type", "alltoall"], 2),
    ("TP2SPxCP4_EP2_ETP2", [*TP2_SP, "--expert-tensor-parallel-size", "2", "--disable-bias-linear",  # ETP > 1: no bias
                            "--moe-token-dispatcher-type", "allgather"], 4),
]


def moe_worker(rank, world_size, argv):
    """The logged lines; on rank 0 also the first step's gradients after Megatron's reduction."""
    recorded = record_first_step_grads()
    log = run_example_rank(rank, world_size, argv)
    lines = [(int(m[1]), int(m[2]), float(m[3]), float(m[4])) for m in LOG_LINE.finditer(log)]
    return lines, recorded.get("grads") if rank == 0 else None


def logged(world_size, *flags):
    """[(lm loss, load-balancing loss)] per iteration, from Megatron's log lines (last rank),
    and global rank 0's first-step gradients by name."""
    results = run_ranks(moe_worker, world_size, args=([*COMMON, *flags],), timeout=240)
    lines = results[-1][0]
    assert [(i, n) for i, n, _, _ in lines] == [(i, ITERS) for i in range(1, ITERS + 1)], lines
    values = [(lm, aux) for _, _, lm, aux in lines]
    assert all(math.isfinite(x) for pair in values for x in pair)
    return values, results[0][1]


@pytest.mark.parametrize("layout", LAYOUTS, ids=[name for name, *_ in LAYOUTS])
def test_moe_expert_parallel_startrail_cp4_logs_the_losses_of_cp1(layout):
    name, flags, twin_ranks = layout
    startrail, grads = logged(8, *MOE, *flags, *STARTRAIL_CP4)
    reference, ref_grads = logged(twin_ranks, *MOE, *flags)
    for (lm, aux), (want_lm, want_aux) in zip(startrail, reference):
        assert abs(lm - want_lm) <= 1e-5 * want_lm, (name, startrail, reference)
        assert abs(aux - want_aux) <= 1e-5 * want_aux, (name, startrail, reference)
    # Every parameter's first-step gradient on rank 0: TP, CP, DP rank 0 and EP rank 0 (the
    # same local experts) in both layouts, after Megatron's DP x CP and expert-DP reductions.
    assert_first_step_grads_match(grads, ref_grads, f"MoE {name}")
    assert reference[-1][0] < reference[0][0]  # it learns
    if name == LAYOUTS[0][0]:
        # The comparison could pass with the experts silently dropped (the example once built
        # dense MLPs whatever --num-experts said): the same run without experts differs.
        dense = run_ranks(dense_worker, twin_ranks, args=([*COMMON],), timeout=240)[-1]
        assert len(dense) == ITERS
        assert [lm for lm, _ in reference] != pytest.approx(dense, rel=1e-5), (reference, dense)


def dense_worker(rank, world_size, argv):
    log = run_example_rank(rank, world_size, argv)
    return [float(m[3]) for m in DENSE_LINE.finditer(log)]
