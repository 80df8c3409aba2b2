"""Megatron-FSDP (``--use-megatron-fsdp``, sharding ``optim_grads_params`` and ``optim_grads``,
``--ckpt-format fsdp_dtensor``) and torch FSDP2 (``--use-torch-fsdp2``) with
``--context-parallel-algo startrail`` through examples/pretrain_gpt.py (Megatron's own
``pretrain``), on gloo (issue 54, finding 2).

Against the same FSDP run at CP = 1 (DP2, 2 ranks; same global batch): the first step's
gradient of every parameter, gathered whole from its shards (``utils.unsharded_grads``), and
the four logged losses, within 1e-5 relative; CP4 C2 is 4 ranks at DP1 (two micro-batches a
step), CP2 C1 4 ranks at DP2.

- Megatron-FSDP ``optim_grads_params``: CP4 C2 saves at step 2 (fsdp_dtensor); CP2 C1 (another
  CP and DP layout) resumes from it and continues the uninterrupted run: its first step's
  gradients are the CP = 1 run's step 3, its losses those of steps 3 and 4.
- Megatron-FSDP ``optim_grads``: CP2 C1 from step 1; FSDP2: CP2 C1 and CP4 C2 from step 1.
  FSDP2 has no resume test: megatron-core 0.19.2 cannot resume an FSDP2 run on any device
  (docs/composition.md): its torch_dist save stops in ``optim_state_to_sharding_state``
  ("Param id 0 does not match any model sharded param"), its torch_dcp load calls
  ``ChainedOptimizer.state_dict(is_loading=True)``, which takes no such argument.

Before ``cpu_patches`` learnt FSDP (3a17b64) every run here failed before any StarTrail code:
FSDP2 with "Expects the parameter to already be moved to device cuda:0 but got cpu",
Megatron-FSDP with "Cannot use ReduceOp.PREMUL_SUM with Gloo", and both first on
"CUDA_DEVICE_MAX_CONNECTIONS" (set to 1 for TP / CP without FSDP).
"""

import os
import queue
import re

import pytest

from tests.megatron.example import run_example_rank
from tests.megatron.utils import assert_first_step_grads_match, record_first_step_grads
from tests.multiproc import run_ranks

ITERS, SAVE_AT = 4, 2
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


def fsdp_worker(rank, world_size, argv, steps):
    """One rank of the example: the (iteration, lm loss) it logged, and on rank 0 the whole
    gradients of each of this run's ``steps`` (1: its first), gathered on every rank."""
    # The checkpoint writers' results queue (see test_resume.resume_worker): a forked rank
    # may not start the multiprocessing Manager that Megatron asks for.
    from megatron.core.dist_checkpointing.strategies import filesystem_async  # noqa: PLC0415

    filesystem_async._results_queue = queue.Queue()
    recorded = {step: record_first_step_grads(step) for step in steps}
    lines = [(int(i), float(loss)) for i, loss in LOG_LINE.findall(run_example_rank(rank, world_size, argv))]
    return lines, {step: r.get("grads") for step, r in recorded.items()} if rank == 0 else None


def run(world_size, kind, *flags, steps=(1,)):
    """{iteration: logged loss} (last rank) and {step: rank 0's gradients by name}."""
    logged = run_ranks(fsdp_worker, world_size, args=([*COMMON, *KINDS[kind], *flags], steps), timeout=300)
    return dict(logged[-1][0]), logged[0][1]


def assert_losses_match(losses, ref, what):
    assert losses and all(abs(losses[i] - ref[i]) <= TOL * abs(ref[i]) for i in losses), (what, losses, ref)


_references = {}


def reference(kind):
    """The kind's CP = 1 run (DP2), once: its losses and the gradients of steps 1 and SAVE_AT + 1."""
    if kind not in _references:
        _references[kind] = run(2, kind, *CP1, steps=(1, SAVE_AT + 1))
    return _references[kind]


def test_megatron_fsdp_cp4_c2_matches_cp1_and_resumes_at_cp2_c1(tmp_path):
    kind = "megatron_fsdp_optim_grads_params"
    ref_losses, ref_grads = reference(kind)
    assert sorted(ref_losses) == list(range(1, ITERS + 1))
    ckpt = str(tmp_path / "ckpt")
    losses, grads = run(4, kind, *CP4_C2, "--save", ckpt, "--save-interval", str(SAVE_AT))
    assert sorted(losses) == list(range(1, ITERS + 1))
    assert_losses_match(losses, ref_losses, f"{kind} CP4 C2")
    assert_first_step_grads_match(grads[1], ref_grads[1], f"{kind} CP4 C2", tol=TOL)
    with open(os.path.join(ckpt, "latest_checkpointed_iteration.txt")) as f:
        assert f.read().strip() == str(ITERS)  # saved at SAVE_AT and at the end
    resumed, resumed_grads = run(4, kind, *CP2_C1, "--load", ckpt, "--ckpt-step", str(SAVE_AT))
    assert sorted(resumed) == list(range(SAVE_AT + 1, ITERS + 1)), resumed
    # Megatron's first log line after a load does not reset its running loss sum: line
    # SAVE_AT + 2 is the mean of steps SAVE_AT + 1 and SAVE_AT + 2 (test_resume.check_continues)
    want = dict(ref_losses)
    want[SAVE_AT + 2] = (want[SAVE_AT + 1] + want[SAVE_AT + 2]) / 2
    assert_losses_match(resumed, want, f"{kind} resumed at CP2 C1")
    # the first step after the load: step SAVE_AT + 1's gradients, per parameter
    assert_first_step_grads_match(resumed_grads[1], ref_grads[SAVE_AT + 1], f"{kind} resumed at CP2 C1", tol=TOL)


@pytest.mark.parametrize("kind, layout", [
    ("megatron_fsdp_optim_grads", CP2_C1), ("torch_fsdp2", CP2_C1), ("torch_fsdp2", CP4_C2),
], ids=["megatron_fsdp_optim_grads-CP2_C1", "torch_fsdp2-CP2_C1", "torch_fsdp2-CP4_C2"])
def test_startrail_matches_cp1(kind, layout):
    ref_losses, ref_grads = reference(kind)
    what = f"{kind} CP{layout[1]} C{layout[-1]}"
    losses, grads = run(4, kind, *layout)
    assert sorted(losses) == list(range(1, ITERS + 1))
    assert_losses_match(losses, ref_losses, what)
    assert_first_step_grads_match(grads[1], ref_grads[1], what, tol=TOL)
