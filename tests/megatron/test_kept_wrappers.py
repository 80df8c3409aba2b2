"""Kept attention under recomputations that are not Megatron's own replay (Note [attention kept
through recomputation], 'Wrappers'): torch's checkpoint (either ``use_reentrant``) inside or
outside Megatron's, saved-tensor hooks around the forward or inside the checkpoint. Every
wrapper order gives the gradients of the model without recomputation; where the wrapper
makes keeping wrong the attention is recomputed with its communication, saying so once and
naming the wrapper; where Megatron's replay runs, it is kept, silently.

On 9ee7a82 torch's non-reentrant checkpoint inside Megatron's raised ``CheckpointError:
Recomputed values ... different metadata`` (the recomputation took the kept graph, which
saves nothing, where torch's checkpoint had recorded the attention's saved tensors).
"""

from __future__ import annotations

import warnings

import pytest

from tests.megatron.utils import cpu_patches  # noqa: F401  (import shims before megatron-core)

import torch  # noqa: E402
from megatron.core.tensor_parallel.random import checkpoint as megatron_checkpoint  # noqa: E402
from torch.utils.checkpoint import checkpoint as torch_checkpoint  # noqa: E402

from megatron_startrail.megatron import kept_attention  # noqa: E402
from tests.megatron.test_kept_attention import Layer, _assert_same, _cpu_rng, _grads, _inputs  # noqa: E402, F401

NON_REENTRANT = "torch.utils.checkpoint.checkpoint(use_reentrant=False)"
REENTRANT = "torch.utils.checkpoint.checkpoint(use_reentrant=True)"
SAVE_ON_CPU = "save_on_cpu"  # in the name of torch.autograd.graph.save_on_cpu's pack hook


def megatron(f):
    return lambda x: megatron_checkpoint(f, False, x)


def torch_ckpt(f, reentrant=False):
    return lambda x: torch_checkpoint(f, x, use_reentrant=reentrant)


def hooked(f):
    def run(x):
        with torch.autograd.graph.save_on_cpu():
            return f(x)
    return run


# name: (how each layer is wrapped, the wrapper the warning names or None where it is kept silently)
ORDERS = {
    "megatron_alone": (megatron, None),
    "a_torch_inside_megatron": (lambda f: megatron(torch_ckpt(f)), NON_REENTRANT),
    "b_megatron_inside_torch": (lambda f: torch_ckpt(megatron(f)), NON_REENTRANT),
    "c_torch_alone": (torch_ckpt, None),  # no Megatron recomputation: nothing to keep
    "d_hooks_around_the_forward": ("around", SAVE_ON_CPU),
    "d_hooks_inside_megatron": (lambda f: megatron(hooked(f)), SAVE_ON_CPU),
    "e_reentrant_inside_megatron": (lambda f: megatron(torch_ckpt(f, reentrant=True)), REENTRANT),
    "e_megatron_inside_reentrant": (lambda f: torch_ckpt(megatron(f), reentrant=True), None),  # Megatron's replay
}


def _forward(layers, x, wrap):
    if wrap == "around":  # hooks around the whole forward (CPU offloading), Megatron's checkpoint per layer
        with torch.autograd.graph.save_on_cpu():
            return _forward(layers, x, megatron)
    for layer in layers:
        x = wrap(layer)(x)
    return x


def _startrail_warnings(caught):
    return [str(w.message) for w in caught if str(w.message).startswith("StarTrail")]


@pytest.fixture(autouse=True)
def _fresh_warnings():
    kept_attention._say_once.cache_clear()  # said once per process: once per test here
    yield
    kept_attention._say_once.cache_clear()


def _wrapped_steps(wrap, keep, steps=2):
    """Two layers, ``steps`` forward-backward steps under ``wrap``: (each step's gradients, the
    StarTrail warnings said, the attention calls, graphs kept once each forward had run)."""
    layers = [Layer(1, keep=keep), Layer(2, keep=keep)]
    grads, kept_after_forward = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(steps):
            for m in layers:
                m.zero_grad(set_to_none=True)
            x = _inputs(10 + step)
            loss = (_forward(layers, x, wrap) ** 2).sum()
            kept_after_forward.append(sum(len(m.kept) for m in layers))
            loss.backward()
            grads.append(_grads(layers, x))
            assert sum(len(m.kept) for m in layers) == 0
    return grads, _startrail_warnings(caught), sum(m.attention_calls for m in layers), kept_after_forward


@pytest.mark.parametrize("order", list(ORDERS))
def test_every_wrapper_order_has_the_gradients_of_no_recomputation(order):
    wrap, wrapper = ORDERS[order]
    want, _, plain_calls, _ = _wrapped_steps(lambda f: f, keep=True)
    keeping_off, said_off, calls_off, _ = _wrapped_steps(wrap, keep=False)
    got, said, calls, kept_after_forward = _wrapped_steps(wrap, keep=True)
    for step in range(2):
        _assert_same(keeping_off[step], want[step])
        _assert_same(got[step], want[step])
    assert said_off == []
    if wrapper is None:  # Megatron's replay, or no recomputation of Megatron's: kept (or not needed), silently
        assert said == [], said
        assert calls <= calls_off
    else:  # recomputed as without keeping, said once for both layers and both steps, naming the wrapper
        assert len(said) == 1 and wrapper in said[0], said
        assert calls == calls_off > plain_calls, (calls, calls_off)
        assert kept_after_forward == [0, 0]  # nothing kept that no recomputation would take
    if order == "megatron_alone":
        assert calls == plain_calls and kept_after_forward == [2, 2]


def test_a_module_called_inside_and_outside_torchs_checkpoint_in_one_megatron_checkpoint():
    # The n-th call takes the n-th entry: the call under torch's checkpoint leaves its place
    # (recomputed), the call outside it keeps and takes its own graph.
    shared = Layer(3)

    def both(x):
        return shared(torch_checkpoint(shared, x, use_reentrant=False))

    def reference(x):
        return shared(shared(x))

    shared.zero_grad(set_to_none=True)
    x = _inputs(4)
    (reference(x) ** 2).sum().backward()
    want = _grads([shared], x)
    shared.zero_grad(set_to_none=True)
    shared.attention_calls = 0
    x = _inputs(4)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        y = megatron_checkpoint(both, False, x)
        assert len(shared.kept) == 1  # the call outside torch's checkpoint, kept
        (y ** 2).sum().backward()
    _assert_same(_grads([shared], x), want)
    said = _startrail_warnings(caught)
    assert len(said) == 1 and NON_REENTRANT in said[0], said
    # first pass 2, Megatron's recomputation 1 (the wrapped call), torch's recomputation 1
    assert shared.attention_calls == 4 and len(shared.kept) == 0


# The StarTrail attention itself under each wrapper order, at CP4 with teams of 2 (4 gloo
# ranks, float64): every parameter's gradient, summed over the CP ranks, and the input's
# gradient equal CP = 1's (plain attention on the whole sequence).
CP_TOKENS, CP_HEADS, CP_DIM = 32, 2, 4


class StarTrailLayer(torch.nn.Module):
    """A fused QKV projection (strided views of it into the attention), the StarTrail attention
    (kept, unless ``groups`` is None: then plain float64 attention on the whole sequence), a
    learnable sink per head and an output projection; ``x [s, 1, heads * dim]``."""

    def __init__(self, seed: int, groups):
        super().__init__()
        g, hidden = torch.Generator().manual_seed(seed), CP_HEADS * CP_DIM
        self.qkv = torch.nn.Parameter(torch.randn(hidden, 3 * hidden, generator=g, dtype=torch.float64) / 3)
        self.proj = torch.nn.Parameter(torch.randn(hidden, hidden, generator=g, dtype=torch.float64) / 3)
        self.sink = torch.nn.Parameter(torch.randn(CP_HEADS, generator=g, dtype=torch.float64))
        self.groups, self.kept, self.attention_calls = groups, kept_attention.KeptAttention(), 0

    def attend(self, q, k, v):  # [s, 1, h, d] -> [s, 1, h, d]
        self.attention_calls += 1
        if self.groups is not None:
            from megatron_startrail import startrail_attn  # noqa: PLC0415
            return startrail_attn(q, k, v, self.groups, softmax_offset=self.sink)
        s = q.shape[0]
        scores = torch.einsum("sbhd,tbhd->bhst", q, k) / CP_DIM ** 0.5
        scores = scores.masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(), float("-inf"))
        sink = self.sink[None, :, None, None].expand(1, CP_HEADS, s, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :s]
        return torch.einsum("bhst,tbhd->sbhd", probs, v)

    def forward(self, x):
        s = x.shape[0]
        q, k, v = (x @ self.qkv).view(s, 1, 3, CP_HEADS, CP_DIM).unbind(2)
        out = self.kept.run(self.attend, q, k, v, training=True)
        return x + out.reshape(s, 1, -1) @ self.proj


def startrail_orders_worker(rank, world_size):
    import torch.distributed as dist  # noqa: PLC0415
    from megatron.core.tensor_parallel import random as megatron_random  # noqa: PLC0415

    from megatron_startrail import new_startrail_groups  # noqa: PLC0415
    from tests.attention_cases import local_rows  # noqa: PLC0415

    megatron_random._get_cuda_rng_state = lambda *a, **k: None  # the CPU RNG only (this forked rank)
    megatron_random._set_cuda_rng_state = lambda *a, **k: None
    groups = new_startrail_groups(team_size=2)
    x_full = torch.randn(CP_TOKENS, 1, CP_HEADS * CP_DIM, generator=torch.Generator().manual_seed(5),
                         dtype=torch.float64, requires_grad=True)
    cp1 = [StarTrailLayer(20, None), StarTrailLayer(21, None)]
    (_forward(cp1, x_full, lambda f: f) ** 2).sum().backward()
    want = [p.grad for m in cp1 for p in m.parameters()] + [local_rows(x_full.grad, rank, world_size)]
    results = {}
    for order, (wrap, _) in ORDERS.items():
        kept_attention._say_once.cache_clear()
        layers = [StarTrailLayer(20, groups), StarTrailLayer(21, groups)]
        x = local_rows(x_full.detach(), rank, world_size).requires_grad_(True)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loss = (_forward(layers, x, wrap) ** 2).sum()
            kept_after_forward = sum(len(m.kept) for m in layers)
            loss.backward()
        got = [p.grad for m in layers for p in m.parameters()]
        for g in got:
            dist.all_reduce(g)  # CP1's parameter gradients are the sum of the CP ranks'
        errors = [((g - w).abs().max() / w.abs().max()).item() for g, w in zip(got + [x.grad], want)]
        results[order] = (max(errors), _startrail_warnings(caught), sum(m.attention_calls for m in layers),
                          kept_after_forward, sum(len(m.kept) for m in layers))
    return results


def test_startrail_attention_under_every_wrapper_order_equals_cp1():
    from tests.multiproc import run_ranks  # noqa: PLC0415

    for rank, results in enumerate(run_ranks(startrail_orders_worker, 4, timeout=120)):
        for order, (error, said, calls, kept_after_forward, kept_after_backward) in results.items():
            wrapper = ORDERS[order][1]
            if rank == 0:  # shown with pytest -s
                print(f"{order}: worst relative gradient error against CP = 1 {error:.1e}, attention calls {calls}")
            assert error <= 1e-10, (order, error)
            assert kept_after_backward == 0, order
            if wrapper is None:
                assert said == [], (order, said)
            else:  # recomputed, with its communication: first pass, Megatron's and torch's recomputation
                assert len(said) == 1 and wrapper in said[0], (order, said)
                assert kept_after_forward == 0, order
                assert calls == (2 if order.startswith("d_") else 3) * 2, (order, calls)
        assert results["megatron_alone"][2:4] == (2, 2)  # kept: each layer's attention ran once


# examples/pretrain_gpt.py, StarTrail CP2, each TransformerLayer wrapped in torch's
# non-reentrant checkpoint (what a framework's activation checkpointing does): under
# --recompute-granularity full that is order (a), under selective core_attn order (b). Every
# first-step parameter gradient equals CP = 1's (no wrapper, no recomputation).

def _wrap_every_transformer_layer_in_torchs_checkpoint():
    """Patch this forked rank: every ``TransformerLayer.forward`` runs inside
    ``torch.utils.checkpoint.checkpoint(use_reentrant=False)``."""
    from megatron.core.transformer.transformer_layer import TransformerLayer  # noqa: PLC0415

    forward = TransformerLayer.forward

    def checkpointed(self, *args, **kwargs):
        return torch_checkpoint(forward, self, *args, use_reentrant=False, **kwargs)

    TransformerLayer.forward = checkpointed


def wrapped_example_worker(rank, world_size, argv, wrap):
    from tests.megatron.example import run_example_rank  # noqa: PLC0415
    from tests.megatron.utils import record_first_step_grads  # noqa: PLC0415

    if wrap:
        _wrap_every_transformer_layer_in_torchs_checkpoint()
    kept_attention._say_once.cache_clear()
    recorded = record_first_step_grads()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_example_rank(rank, world_size, argv)
    return recorded.get("grads") if rank == 0 else None, _startrail_warnings(caught)


@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_the_example_with_every_layer_in_torchs_checkpoint_has_cp1s_gradients(recompute, cp1_example_grads):
    from tests.megatron.test_kept_models import CP2  # noqa: PLC0415
    from tests.megatron.test_pretrain_example import COMMON  # noqa: PLC0415
    from tests.megatron.test_recompute import FULL_UNIFORM, SELECTIVE  # noqa: PLC0415
    from tests.megatron.utils import assert_first_step_grads_match  # noqa: PLC0415
    from tests.multiproc import run_ranks  # noqa: PLC0415

    flags = FULL_UNIFORM if recompute == "full" else SELECTIVE
    results = run_ranks(wrapped_example_worker, 2, args=([*COMMON, *CP2, *flags], True), timeout=300)
    assert_first_step_grads_match(results[0][0], cp1_example_grads,
                                  f"CP2, {recompute} recomputation, layers in torch's checkpoint")
    for _, said in results:  # each rank: once, naming torch's checkpoint
        assert len(said) == 1 and NON_REENTRANT in said[0], said


@pytest.fixture(scope="module")
def cp1_example_grads():
    from tests.megatron.test_pretrain_example import COMMON  # noqa: PLC0415
    from tests.multiproc import run_ranks  # noqa: PLC0415

    (grads, said), = run_ranks(wrapped_example_worker, 1, args=([*COMMON], False), timeout=300)
    assert said == []
    return grads
