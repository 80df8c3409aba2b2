"""Every piece of state that outlives a call (docs/design.md, Note [state that outlives a call])
tried as a user's call sequences would try it, to make it serve another call's data: the same
shapes with other documents one micro-batch after another (after the requests were learned),
the dense layout at one shape with two batch sizes, an entry whose tensor died, the pure
layout caches after other inputs, Megatron's groups for other options and back, and a layer
whose forward raised. (The kept attention graphs: tests/megatron/test_kept_attention.py.)
Outputs and gradients against float64 references.
"""

from __future__ import annotations

import argparse
import gc
import random
import weakref

import pytest

from tests.megatron.utils import Utils  # first: the CPU import shims before megatron-core (forked ranks inherit it)

import torch  # noqa: E402

from megatron_startrail import new_startrail_groups, startrail_attn  # noqa: E402
from megatron_startrail import layout as layout_module  # noqa: E402
from megatron_startrail import microbatch  # noqa: E402
from megatron_startrail.microbatch import MicroBatchCache  # noqa: E402
from tests.attention_cases import full_inputs, local_rows, reference_with_grads, relative_error  # noqa: E402
from tests.multiproc import run_ranks  # noqa: E402
from tests.test_packed_documents import run_packed_case  # noqa: E402

TOLERANCE = 1e-5  # float32 against float64


def same_shapes_other_documents_worker(rank, world_size):
    """Micro-batches of one shape with other documents each, one after another on the same
    groups (their caches and the learned requests warm), each against its own reference."""
    torch.utils.deterministic.fill_uninitialized_memory = True
    groups = new_startrail_groups(team_size=2)
    failures, computed = [], []
    for layout in ("sample", "document"):
        for seed in (11, 12, 11, 13):  # 11 twice: a layout seen before, with new tensors
            errors, pad_nonzero, _ = run_packed_case(groups, rank, world_size, layout, True, 2, torch.float32, seed,
                                                     thd=False)
            failures += [f"{layout} seed {seed}: {n} {e:.2e}" for n, e in errors.items() if not e <= TOLERANCE]
            failures += [f"{layout} seed {seed}: padding not zero"] if pad_nonzero else []
            computed.append(groups.documents_cache.computed)
    learned = sum(len(r) for r in microbatch._REQUESTS.values())
    return failures, computed, learned


def test_same_shapes_with_other_documents_one_after_another():
    for failures, computed, learned in run_ranks(same_shapes_other_documents_worker, 4):
        assert not failures, failures
        # Every micro-batch (new cu_seqlens tensors) computed its documents anew: no entry served
        # another micro-batch, even one of the same shape and the same boundaries.
        assert computed == sorted(set(computed)) and len(computed) == 8, computed
        assert learned > 0  # the requests were learned, and served the later micro-batches


def dense_batches_worker(rank, world_size):
    """The dense layout of one shape (one Documents object on the groups, with its device metadata)
    at batch 1, then 2, then 1 again."""
    groups = new_startrail_groups(team_size=2)
    failures = []
    for batch in (1, 2, 1):
        q, k, v, dout = full_inputs(20 + batch, 64, batch, 4, 2, 8, torch.float32)
        ref = reference_with_grads(*(t.double() for t in (q, k, v, dout)), True, 8 ** -0.5)
        mine = [local_rows(t, rank, world_size).clone().requires_grad_(t is not dout) for t in (q, k, v, dout)]
        out = startrail_attn(*mine[:3], groups, causal=True, softmax_scale=8 ** -0.5)
        out.backward(mine[3])
        for name, got, want in zip(("out", "dq", "dk", "dv"), (out, *(t.grad for t in mine[:3])), ref):
            err = relative_error(got.double(), local_rows(want, rank, world_size))
            if not err <= TOLERANCE:
                failures.append(f"batch {batch}: {name} {err:.2e}")
    return failures


def test_the_dense_layout_of_one_shape_serves_every_batch_size():
    for failures in run_ranks(dense_batches_worker, 4):
        assert not failures, failures


def test_a_micro_batch_cache_entry_goes_with_its_tensor():
    cache = MicroBatchCache(capacity=4)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    assert cache.get("docs", (cu,), 8, lambda: "first") == "first"
    assert cache.get("docs", (cu,), 8, lambda: "again") == "first"  # the same tensor: a hit
    same_values = cu.clone()  # equal values, another tensor: another micro-batch
    assert cache.get("docs", (same_values,), 8, lambda: "second") == "second"
    del cu, same_values
    gc.collect()
    assert not cache._entries  # both entries went with their tensors: a recycled id finds nothing
    fresh = torch.tensor([0, 5, 8], dtype=torch.int32)
    assert cache.get("docs", (fresh,), 8, lambda: "third") == "third"


def _random_segments(rng: random.Random):
    segments, row = [], 0
    for doc in range(rng.randint(1, 4)):
        length = rng.randint(1, 9)
        segments.append((doc, row, row + length))
        row += length + rng.randint(0, 3)
    return tuple(segments)


@pytest.mark.parametrize("name, arguments", [
    ("_split_segments", lambda rng: (_random_segments(rng), rng.randint(1, 3))),
    ("_segment_rows", lambda rng: (_random_segments(rng), rng.randint(0, 3), rng.randint(4, 12))),
    ("_plan_calls", lambda rng: (_random_segments(rng), _random_segments(rng), rng.random() < 0.5,
                                 rng.choice([None, (3, 0), (2, 2)]), rng.choice([None, 4]))),
])
def test_the_pure_layout_caches_answer_what_the_function_computes(name, arguments):
    cached = getattr(layout_module, name)
    rng = random.Random(name)
    for _ in range(200):  # the cache warm with other inputs before each comparison
        args = arguments(rng)
        assert cached(*args) == cached.__wrapped__(*args), (name, args)


def groups_from_args_worker(rank, world_size):
    """Megatron's groups for the flags (built_groups._built, through from_args) for options A, then B, then A: each
    call gets groups of its own options, and groups built before still attend correctly."""
    from megatron_startrail.megatron.from_args import startrail_groups_from_args  # noqa: PLC0415

    Utils.initialize_model_parallel(context_parallel_size=4)

    def args(team_size):
        return argparse.Namespace(
            startrail_team_size=team_size, ulysses_degree_in_cp=1, startrail_backward_rotation="auto",
            startrail_transfer="ring", startrail_regather_in_backward=False, startrail_kernel="auto",
            deterministic_mode=False, startrail_recompute_attention=False, startrail_reverse_overlap=True,
            distributed_timeout_minutes=1,
            context_parallel_algo="startrail", nccl_communicator_config_path=None, hybrid_context_parallel=False)

    first = startrail_groups_from_args(args(2))
    again = startrail_groups_from_args(args(2))
    other = startrail_groups_from_args(args(1))
    back = startrail_groups_from_args(args(2))
    sizes = (first.team_size, other.team_size, back.team_size, again is first, back is first)
    q, k, v, dout = full_inputs(5, 64, 1, 4, 4, 8, torch.float32)
    ref = reference_with_grads(*(t.double() for t in (q, k, v, dout)), True, 8 ** -0.5)
    errors = []
    for groups in (first, other, back):  # the first model's groups still work after others were built
        out = startrail_attn(*(local_rows(t, rank, world_size) for t in (q, k, v)), groups, causal=True,
                             softmax_scale=8 ** -0.5)
        errors.append(relative_error(out.double(), local_rows(ref[0], rank, world_size)))
    Utils.destroy_model_parallel()
    return sizes, errors


def test_megatrons_groups_for_other_options_and_back():
    for sizes, errors in run_ranks(groups_from_args_worker, 4, timeout=120):
        assert sizes == (2, 1, 2, True, False), sizes  # built again for options seen before, after others
        assert all(e <= TOLERANCE for e in errors), errors


def test_a_packed_rope_layer_whose_forward_raised_holds_no_positions(monkeypatch):
    from megatron.core.packed_seq_params import PackedSeqParams  # noqa: PLC0415
    from megatron.core.transformer.attention import SelfAttention  # noqa: PLC0415

    from megatron_startrail.megatron import packed_rope  # noqa: PLC0415

    def raising(self, hidden_states, attention_mask=None, **kwargs):
        assert self._sample_layout_freqs is not None  # set for this call...
        raise RuntimeError("mid-forward")

    class Group:
        def size(self):
            return 2

        def rank(self):
            return 0

    monkeypatch.setattr(SelfAttention, "forward", raising)
    layer = object.__new__(packed_rope.PackedRopeSelfAttention)
    torch.nn.Module.__init__(layer)
    layer.pg_collection = argparse.Namespace(cp=Group())
    layer.config = argparse.Namespace(no_rope_freq=None, sequence_parallel=False, tensor_model_parallel_size=1)
    layer.layer_number = 1
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    freqs = torch.randn(8, 1, 1, 4)
    with pytest.raises(RuntimeError, match="mid-forward"):
        layer.forward(torch.randn(4, 1, 16), None, rotary_pos_emb=freqs, packed_seq_params=params)
    assert layer._sample_layout_freqs is None and layer._rope_cp_group is None  # ...and cleared by the raise


def dense_layout_lifetime_worker(rank, world_size):
    """The dense layout of a shape and its device metadata are held by the groups, not the process."""
    groups = new_startrail_groups(team_size=2)
    q, k, v = (torch.randn(16, 1, 2, 8, requires_grad=True) for _ in range(3))
    startrail_attn(q, k, v, groups, causal=True).sum().backward()
    [dense] = [value for key, (_, value) in groups.documents_cache._entries.items() if key[0] == "dense"]
    made_once = dense.__dict__.get("_device_calls") is not None  # the calls' metadata hangs on it
    startrail_attn(q, k, v, groups, causal=True).sum().backward()
    served_again = [v for key, (_, v) in groups.documents_cache._entries.items() if key[0] == "dense"] == [dense]
    alive = weakref.ref(dense)
    del dense, groups
    gc.collect()
    return made_once, served_again, alive() is None


def test_the_dense_layout_lives_with_its_groups_not_the_process():
    assert not hasattr(layout_module.dense_sequence, "cache_info")  # no process-lifetime cache of it
    for made_once, served_again, gone in run_ranks(dense_layout_lifetime_worker, 4):
        assert made_once and served_again and gone
