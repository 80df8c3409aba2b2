"""Kept attention by identity (Note [attention kept through recomputation]), against Megatron's
own ``tensor_parallel.checkpoint`` on one process: each call sequence a user runs gives the
gradients of the same model without recomputation, in float64, and leaves nothing kept.

The attention here is a plain differentiable float64 attention with a learnable sink (the
kept graph's parameter path); the StarTrail attention itself is checked kept in
tests/megatron/test_recompute.py and at model level in tests/megatron/test_kept_models.py.
On 9c6fece (graphs kept in a per-module queue, taken oldest first) the repeated-module,
forward-only, abandoned-step and memory tests here fail.
"""

from __future__ import annotations

import pytest

from tests.megatron.utils import cpu_patches  # noqa: F401  (import shims before megatron-core)

import torch  # noqa: E402
from megatron.core.tensor_parallel.random import checkpoint  # noqa: E402

from megatron_startrail.megatron.kept_attention import KeptAttention  # noqa: E402

S, H, D = 6, 2, 4  # tokens, heads, head dim


@pytest.fixture(autouse=True)
def _cpu_rng(monkeypatch):
    """Megatron's checkpoint saves and restores the CUDA RNG: on the CPU, only the CPU one
    (this process only; cpu_patches.apply() is for forked ranks)."""
    from megatron.core.tensor_parallel import random as megatron_random  # noqa: PLC0415

    monkeypatch.setattr(megatron_random, "_get_cuda_rng_state", lambda *a, **k: None)
    monkeypatch.setattr(megatron_random, "_set_cuda_rng_state", lambda *a, **k: None)


class Layer(torch.nn.Module):
    """A fused QKV projection (q, k, v handed on as its strided views, as Megatron does), a
    kept core attention with a learnable sink, and an output projection."""

    def __init__(self, seed: int, keep: bool = True):
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.qkv = torch.nn.Parameter(torch.randn(H * D, 3 * H * D, generator=g, dtype=torch.float64) / 4)
        self.proj = torch.nn.Parameter(torch.randn(H * D, H * D, generator=g, dtype=torch.float64) / 4)
        self.sink = torch.nn.Parameter(torch.randn(H, generator=g, dtype=torch.float64))
        self.kept, self.keep, self.attention_calls = KeptAttention(), keep, 0

    def attend(self, q, k, v):  # [s, h, d] each -> [s, h, d]
        self.attention_calls += 1
        # k and v scaled first: the graph saves the scaled copies, not k and v themselves (as
        # StarTrail keeps the team's K, V, not this rank's), so holding k, v would show
        k, v = k * 1.5, v * 0.5
        scores = torch.einsum("shd,thd->hst", q, k) / D ** 0.5
        causal = torch.ones(S, S, dtype=torch.bool).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        sink = self.sink[:, None, None].expand(H, S, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :S]
        return torch.einsum("hst,thd->shd", probs, v)

    def forward(self, x):  # [s, h*d]
        q, k, v = (x @ self.qkv).view(S, 3, H, D).unbind(1)  # strided views of the fused output
        out = self.kept.run(self.attend, q, k, v, training=self.training, enabled=self.keep)
        return x + out.reshape(S, H * D) @ self.proj


def _run(layers, x, recompute: bool):
    """Each entry of ``layers`` called in turn (a module may appear several times), each call
    in its own Megatron checkpoint when ``recompute``."""
    for layer in layers:
        x = checkpoint(layer, False, x) if recompute else layer(x)
    return x


def _inputs(seed: int):
    return torch.randn(S, H * D, generator=torch.Generator().manual_seed(seed), dtype=torch.float64,
                       requires_grad=True)


def _grads(modules, x):
    return [p.grad.clone() for m in modules for p in m.parameters()] + [x.grad.clone()]


def _step(layers, seed: int, recompute: bool):
    """One forward and backward; the parameters' and the input's gradients."""
    modules = list(dict.fromkeys(layers))
    for m in modules:
        m.zero_grad(set_to_none=True)
    x = _inputs(seed)
    (_run(layers, x, recompute) ** 2).sum().backward()
    return _grads(modules, x)


def _assert_same(got, want):
    assert len(got) == len(want)
    for g, w in zip(got, want):
        assert torch.allclose(g, w, rtol=1e-12, atol=1e-12), (g - w).abs().max()


def _kept(*layers):
    return sum(len(layer.kept) for layer in dict.fromkeys(layers))


def test_a_module_called_twice_per_forward_takes_each_calls_graph():
    # A repeated MTP layer: one layer's core attention in two checkpoints of one forward.
    shared, other = Layer(1), Layer(2)
    sequence = [other, shared, shared]
    want = _step(sequence, 7, recompute=False)
    got = _step(sequence, 7, recompute=True)
    _assert_same(got, want)
    assert shared.attention_calls == 4 and other.attention_calls == 2  # never recomputed
    assert _kept(*sequence) == 0


def test_selective_recomputation_kept_graph_stays_off_the_layers_graph():
    # --recompute-modules core_attn: the checkpoint holds the core attention alone, its inputs
    # q, k, v still on the layer's graph (a RoPE-like product); the kept graph must end at them.
    layer = Layer(70)
    freqs = torch.randn(S, 1, D, generator=torch.Generator().manual_seed(71), dtype=torch.float64)

    def core(q, k, v):
        return layer.kept.run(layer.attend, q, k, v, training=True).reshape(S, H * D)

    def step(recompute):
        layer.zero_grad(set_to_none=True)
        x = _inputs(72)
        q, k, v = (x @ layer.qkv).view(S, 3, H, D).unbind(1)
        q, k = q * freqs, k * freqs  # saved tensors the layer's graph frees once it has run
        out = checkpoint(core, False, q, k, v) if recompute else core(q, k, v)
        (out @ layer.proj).pow(2).sum().backward()
        return _grads([layer], x)

    want = step(False)
    _assert_same(step(True), want)
    assert layer.attention_calls == 2 and _kept(layer) == 0


def test_a_module_called_twice_inside_one_checkpoint():
    shared = Layer(3)

    class Twice(torch.nn.Module):
        def forward(self, x):
            return shared(shared(x))

    twice = Twice()
    want = _step([shared, shared], 4, recompute=False)
    shared.zero_grad(set_to_none=True)
    x = _inputs(4)
    (checkpoint(twice, False, x) ** 2).sum().backward()
    _assert_same(_grads([shared], x), want)
    assert _kept(shared) == 0


@pytest.mark.parametrize("between", ["forward_only_train", "abandoned_step", "exception", "evaluation"])
def test_a_forward_without_backward_leaves_nothing_for_the_next_step(between):
    layers = [Layer(5), Layer(6)]
    want = _step(layers, 11, recompute=False)
    if between == "forward_only_train":  # RL frameworks scoring log-probs between steps, model in train mode
        _run(layers, _inputs(12), recompute=True).sum()
    elif between == "abandoned_step":  # the forward ran, the step was dropped (e.g. a skipped batch)
        loss = (_run(layers, _inputs(13), recompute=True) ** 2).sum()
        del loss
    elif between == "exception":  # a rank's step that raised inside the second checkpoint
        def broken(x):
            raise RuntimeError("mid-step")
        with pytest.raises(RuntimeError, match="mid-step"):
            _run([layers[0], broken], _inputs(14), recompute=True)
        from megatron.core.tensor_parallel import random as megatron_random  # noqa: PLC0415
        megatron_random._unset_checkpointing()  # Megatron leaves its flag set when a checkpoint raises
    else:
        for m in layers:
            m.eval()
        with torch.no_grad():
            _run(layers, _inputs(15), recompute=True)
        for m in layers:
            m.train()
    assert _kept(*layers) == 0, "a forward without backward left kept graphs"
    _assert_same(_step(layers, 11, recompute=True), want)
    assert _kept(*layers) == 0


def test_forward_only_passes_do_not_grow_what_is_held():
    layers = [Layer(8), Layer(9)]
    outs = []
    for i in range(5):
        outs.append(_run(layers, _inputs(20 + i), recompute=True).detach())  # what a scorer keeps
        assert _kept(*layers) == 0, i


def test_two_models_in_one_process_interleaved():
    a, b = [Layer(30), Layer(31)], [Layer(32)]
    want_a, want_b = _step(a, 1, recompute=False), _step(b, 2, recompute=False)
    for m in a + b:
        m.zero_grad(set_to_none=True)
    xa, xb = _inputs(1), _inputs(2)
    ya, yb = _run(a, xa, recompute=True), _run(b, xb, recompute=True)  # both forwards, then both backwards
    (yb ** 2).sum().backward()
    (ya ** 2).sum().backward()
    _assert_same(_grads(a, xa), want_a)
    _assert_same(_grads(b, xb), want_b)


def test_micro_batches_backward_in_any_order():
    # Pipeline schedules run several micro-batches' forwards before their backwards; here the
    # backwards run newest first, the opposite of 1F1B's order.
    layers = [Layer(40), Layer(41)]
    want = [_step(layers, 50 + i, recompute=False) for i in range(3)]
    for m in layers:
        m.zero_grad(set_to_none=True)
    xs = [_inputs(50 + i) for i in range(3)]
    losses = [(_run(layers, x, recompute=True) ** 2).sum() for x in xs]
    for i in (2, 0, 1):
        before = [p.grad.clone() if p.grad is not None else torch.zeros_like(p) for m in layers for p in m.parameters()]
        losses[i].backward()
        after = [p.grad for m in layers for p in m.parameters()]
        _assert_same([a - b for a, b in zip(after, before)] + [xs[i].grad], want[i])


def _held_storages(tensors, leaves: bool = True) -> dict[tuple[int, int], int]:
    """The distinct storages that ``tensors`` and their autograd graphs hold: the tensors, the
    variables of the graphs' leaves (unless ``leaves`` is False: the caller's), and every saved
    tensor of every node."""
    held, seen, nodes = {}, set(), []

    def add(t):
        if isinstance(t, torch.Tensor) and t.numel():
            s = t.untyped_storage()
            held[(s.data_ptr(), s.nbytes())] = s.nbytes()

    for t in tensors:
        add(t)
        nodes.append(t.grad_fn)
    while nodes:
        node = nodes.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if leaves:
            add(getattr(node, "variable", None))  # AccumulateGrad: the leaf
        for saved in getattr(node, "saved_tensors", ()) or ():  # custom Functions
            add(saved)
        for name in dir(node):  # C++ nodes: _saved_self, _saved_other, ...
            if name.startswith("_saved_") and not name.endswith("_sym_sizes"):
                value = getattr(node, name, None)
                for t in value if isinstance(value, (tuple, list)) else (value,):
                    add(t)
        nodes.extend(n for n, _ in node.next_functions)
    return held


def test_what_is_kept_is_what_the_attention_saves_not_the_fused_qkv():
    # Without recomputation the attention's graph holds its saved tensors; kept through a
    # checkpoint it must hold the same bytes (not the leaves', not Megatron's fused QKV output).
    layer = Layer(60)
    x = _inputs(61).detach()
    q, k, v = (x @ layer.qkv).view(S, 3, H, D).unbind(1)
    dense = [t.detach().contiguous().requires_grad_(True) for t in (q, k, v)]
    plain = layer.attend(*dense)
    want = sum(_held_storages([plain], leaves=False).values())  # the caller's q, k, v only where saved
    from megatron.core.tensor_parallel import random as megatron_random  # noqa: PLC0415

    kept_outs = []  # what the first pass's attention returned: the kept output, with its graph
    attend = layer.attend
    layer.attend = lambda *t: kept_outs.append(attend(*t)) or kept_outs[-1]
    with torch.no_grad():
        checkpoint(layer, False, x.requires_grad_(True))
    assert not megatron_random.is_checkpointing()
    (out,) = kept_outs
    assert out.requires_grad  # kept, with its graph
    held = _held_storages([out])
    for p in layer.parameters():  # the sink's parameter: the model's, not kept
        s = p.untyped_storage()
        held.pop((s.data_ptr(), s.nbytes()), None)
    got = sum(held.values())
    assert got == want, (got, want)
