"""The attention kept through recomputation, at model level, along the call sequences users run
(examples/pretrain_gpt.py, StarTrail CP2): with recomputation every parameter's gradient is the
run's without it, to 1e-6 relative.

- ``--mtp-num-layers 2 --mtp-use-repeated-layer``: one MTP layer's core attention runs twice per
  forward, each depth in its own checkpoint (on 9c6fece: 2.6e-1 relative under full
  recomputation, 3.6e-3 under selective ``core_attn``);
- a ``forward_only=True`` pass of Megatron's schedule with the model in train mode before every
  training step (what RL frameworks do to score log-probs): nothing stays kept after it, and the
  step after it is exact (on 9c6fece: 8.8e-1 relative).
"""

import math

import pytest

from tests.megatron.example import run_example_rank
from tests.megatron.test_pretrain_example import COMMON
from tests.megatron.test_recompute import FULL_UNIFORM, SELECTIVE
from tests.megatron.utils import assert_first_step_grads_match, record_first_step_grads
from tests.multiproc import run_ranks

CP2 = ["--context-parallel-size", "2", "--context-parallel-algo", "startrail"]
REPEATED_MTP = ["--mtp-num-layers", "2", "--mtp-use-repeated-layer"]


def _forward_only_before_every_step(state):
    """Patch this forked rank: before each training step, a forward-only pass of Megatron's
    schedule on the next micro-batches with the model left in train mode; record how many kept
    graphs are alive right after it (all KeptAttention objects made, read weakly)."""
    from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: PLC0415
    from megatron.training import get_args, training  # noqa: PLC0415
    from megatron.core.num_microbatches_calculator import get_num_microbatches  # noqa: PLC0415

    from megatron_startrail.megatron import kept_attention  # noqa: PLC0415

    made, init = [], kept_attention.KeptAttention.__init__

    def registering_init(self):
        init(self)
        made.append(self)

    kept_attention.KeptAttention.__init__ = registering_init
    train_step = training.train_step

    def scored_then_trained(forward_step_func, data_iterator, model, *args, **kwargs):
        a = get_args()
        assert all(m.training for m in model)
        get_forward_backward_func()(forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
                                    num_microbatches=get_num_microbatches(), seq_length=a.seq_length,
                                    micro_batch_size=a.micro_batch_size, forward_only=True)
        state["alive_after_forward_only"].append(sum(len(k) for k in made))
        return train_step(forward_step_func, data_iterator, model, *args, **kwargs)

    training.train_step = scored_then_trained


def kept_worker(rank, world_size, argv, forward_only_between):
    state = {"alive_after_forward_only": []}
    if forward_only_between:
        _forward_only_before_every_step(state)
    recorded = record_first_step_grads(step=2 if forward_only_between else 1)
    log = run_example_rank(rank, world_size, argv)
    losses = [float(x) for x in __import__("re").findall(r" lm loss: ([0-9.E+-]+) \|", log)]
    return losses, recorded.get("grads") if rank == 0 else None, state["alive_after_forward_only"]


def run(*flags, forward_only_between=False):
    results = run_ranks(kept_worker, 2, args=([*COMMON, *CP2, *flags], forward_only_between), timeout=300)
    losses = results[-1][0]
    assert len(losses) == 4 and all(math.isfinite(x) for x in losses), losses
    return losses, results[0][1], [r[2] for r in results]


def assert_same(got, want, what):
    for g, w in zip(got[0], want[0]):
        assert abs(g - w) <= 1e-6 * abs(w), (what, got[0], want[0])
    assert_first_step_grads_match(got[1], want[1], what, tol=1e-6)


@pytest.mark.parametrize("recompute", [FULL_UNIFORM, SELECTIVE], ids=["full", "selective"])
def test_a_repeated_mtp_layer_under_recomputation_has_the_gradients_of_no_recomputation(recompute):
    want = run(*REPEATED_MTP)
    got = run(*REPEATED_MTP, *recompute)
    assert_same(got, want, f"repeated MTP layer, {' '.join(recompute)}")


def test_a_step_after_forward_only_passes_in_train_mode_is_exact_and_nothing_stays_kept():
    want = run(forward_only_between=True)
    got = run(*FULL_UNIFORM, forward_only_between=True)
    assert got[2] == [[0, 0, 0, 0]] * 2, got[2]  # kept graphs alive after each forward-only pass, per rank
    assert_same(got, want, "full recomputation, a forward-only pass in train mode before every step")
