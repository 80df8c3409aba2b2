"""Megatron-FSDP (``--use-megatron-fsdp``, sharding ``optim_grads_params`` and ``optim_grads``,
``--ckpt-format fsdp_dtensor``) and torch FSDP2 (``--use-torch-fsdp2``) with
``--context-parallel-algo startrail`` through examples/pretrain_gpt.py (Megatron's own
``pretrain``), on gloo (issue 54, finding 2).

Against the same FSDP run at CP = 1 (DP2, 2 ranks; same global batch): the first step's
gradient of every parameter, gathered whole from its shards (``utils.unsharded_grads``), and
the four logged losses, within 1e-5 relative; CP4 C2 is 4 ranks at DP1 (two micro-batches a
step), CP2 C1 4 ranks at DP2.

Cases: Megatron-FSDP ``optim_grads_params`` at CP4 C2 and ``optim_grads`` at CP2 C1; FSDP2 at
both. No resume test (docs/composition.md, "Megatron-FSDP and torch FSDP2"): megatron-core
0.19.2 cannot resume FSDP2 on any device (its torch_dist save stops in
``optim_state_to_sharding_state``: "Param id 0 does not match any model sharded param"; its
torch_dcp load calls ``ChainedOptimizer.state_dict(is_loading=True)``, which takes no such
argument), and Megatron-FSDP's fsdp_dtensor save does not finish on gloo, at CP = 1 as well
(the ranks part ways in ``preprocess_fsdp_dtensor_state_dict``).

Before ``cpu_patches`` learnt FSDP (3a17b64) every run here failed before any StarTrail code:
FSDP2 with "Expects the parameter to already be moved to device cuda:0 but got cpu",
Megatron-FSDP with "Cannot use ReduceOp.PREMUL_SUM with Gloo", and both first on
"CUDA_DEVICE_MAX_CONNECTIONS" (set to 1 for TP / CP without FSDP).
"""

import re

import pytest

from tests.megatron.example import run_example_rank
from tests.megatron.utils import assert_first_step_grads_match, record_first_step_grads
from tests.multiproc import run_ranks

ITERS = 4
COMMON = [
    "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "8",
    "--seq-length", "128", "--micro-batch-size", "1", "--global-batch-size", "2", "--train-iters", str(ITERS),
    "--lr", "3e-3", "--lr-warmup-iters", "1", "--seed", "1234", "--log-interval", "1",
    "--distributed-timeout-minutes", "2",
]
MEGATRON_FSDP = ["--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor"]
KINDS = {
    "megatron_fsdp_optim_grads_params": [*MEGATRON_FSDP, "--data-parallel-sharding-strategy", "optim_grads_params"],
    "megatron_fsdp_optim_grads": [*MEGATRON_FSDP, "--data-parallel-sharding-strategy", "optim_grads"],
    # FSDP2 needs untied embeddings (Megatron's rule)
    "torch_fsdp2": ["--use-torch-fsdp2", "--untie-embeddings-and-output-weights"],
}
CP1 = ["--context-parallel-size", "1"]
CP2_C1 = ["--context-parallel-size", "2", "--context-parallel-algo", "startrail", "--startrail-team-size", "1"]
CP4_C2 = ["--context-parallel-size", "4", "--context-parallel-algo", "startrail", "--startrail-team-size", "2"]
LOG_LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.* lm loss: ([0-9.E+-]+) \|")
TOL = 1e-5


def fsdp_worker(rank, world_size, argv):
    """One rank of the example: the (iteration, lm loss) it logged, and on rank 0 the whole
    gradients of the first step (gathered from their shards on every rank)."""
    recorded = record_first_step_grads()
    lines = [(int(i), float(loss)) for i, loss in LOG_LINE.findall(run_example_rank(rank, world_size, argv))]
    return lines, recorded.get("grads") if rank == 0 else None


def run(world_size, kind, *flags):
    """{iteration: logged loss} (last rank) and rank 0's first-step gradients by name."""
    logged = run_ranks(fsdp_worker, world_size, args=([*COMMON, *KINDS[kind], *flags],), timeout=300)
    return dict(logged[-1][0]), logged[0][1]


def assert_losses_match(losses, ref, what):
    assert losses and all(abs(losses[i] - ref[i]) <= TOL * abs(ref[i]) for i in losses), (what, losses, ref)


_references = {}


def reference(kind):
    """The kind's CP = 1 run (DP2), once: its losses and its first step's gradients."""
    if kind not in _references:
        _references[kind] = run(2, kind, *CP1)
    return _references[kind]


CASES = [("megatron_fsdp_optim_grads_params", CP4_C2), ("megatron_fsdp_optim_grads", CP2_C1),
         ("torch_fsdp2", CP2_C1), ("torch_fsdp2", CP4_C2)]


@pytest.mark.parametrize("kind, layout", CASES, ids=[f"{k}-CP{l[1]}_C{l[-1]}" for k, l in CASES])
def test_startrail_matches_cp1(kind, layout):
    ref_losses, ref_grads = reference(kind)
    what = f"{kind} CP{layout[1]} C{layout[-1]}"
    losses, grads = run(4, kind, *layout)
    assert sorted(losses) == list(range(1, ITERS + 1))
    assert_losses_match(losses, ref_losses, what)
    assert_first_step_grads_match(grads, ref_grads, what, tol=TOL)
