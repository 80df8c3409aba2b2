"""The max-logit pass (megatron_startrail/max_logit.py) on its own, and what it costs.

- One kernel call's pass against the brute force of flash-attn's rule in float64: windows,
  uneven sequences, equal ones folded into one launch, GQA, and tiles of a few rows (the
  tiling and the keys a tile skips); the distributed tests (test_attention_distributed,
  test_window, test_packed_documents) check the layer's value after the MAX over CP.
- With both flags off (``return_max_logit=False``) none of the pass runs: its functions are
  replaced by ones that raise, and the layer dispatches no op of its kind; with it on the
  extra ops are exactly the pass's (benchmarks/counters/launch_budget.py's counter, meta tensors): no
  P2P, no collective, no kernel call, no copy (``_to_copy``, ``copy_`` are not among its ops)
  and no host sync (on meta tensors ``.item()`` and ``.tolist()`` raise).
"""

import pytest
import torch

from benchmarks.counters.launch_budget import Case, count
from megatron_startrail import max_logit
from megatron_startrail.layout import KernelCall
from tests.attention_cases import flash_rule

CALLS = [
    KernelCall.back_to_back([(7, 7)], (-1, 0)),  # causal square
    KernelCall.back_to_back([(5, 9), (6, 3)], (-1, 0)),  # causal, bottom-right aligned
    KernelCall.back_to_back([(4, 4), (4, 4), (4, 4)], (-1, 0)),  # equal sequences: one launch
    KernelCall.back_to_back([(6, 11)], (3, 0)),  # a window
    KernelCall.back_to_back([(8, 8), (3, 10)], (2, 4)),  # two-sided window
    KernelCall.back_to_back([(5, 6)], (-1, -1)),  # full
]


def brute_force(q, k, call):
    """Per head, the largest q . k over the pairs :func:`flash_rule` lets through, float64."""
    heads = q.shape[2]
    k = k.repeat_interleave(heads // k.shape[2], dim=2)
    best = torch.full((heads,), float("-inf"), dtype=torch.float64)
    for (q0, q1), (k0, k1) in zip(zip(call.cu_seqlens_q[:-1], call.cu_seqlens_q[1:]),
                                  zip(call.cu_seqlens_k[:-1], call.cu_seqlens_k[1:])):
        scores = torch.einsum("sbhd,tbhd->bhst", q[q0:q1], k[k0:k1])
        scores = scores.masked_fill(~flash_rule(q1 - q0, k1 - k0, call.window), float("-inf"))
        best = torch.maximum(best, scores.amax(dim=(0, 2, 3)))
    return best


@pytest.mark.parametrize("tile", [max_logit.TILE_ELEMENTS, 16])
@pytest.mark.parametrize("kv_heads", [4, 2, 1])
def test_a_call_gives_the_brute_force_maximum(monkeypatch, tile, kv_heads):
    monkeypatch.setattr(max_logit, "TILE_ELEMENTS", tile)  # 16: tiles of one or two query rows
    gen = torch.Generator().manual_seed(kv_heads)
    for call in CALLS:
        q = torch.randn(call.cu_seqlens_q[-1], 2, 4, 8, generator=gen, dtype=torch.float64)
        k = torch.randn(call.cu_seqlens_k[-1], 2, kv_heads, 8, generator=gen, dtype=torch.float64)
        best = max_logit.new_accumulator(q)
        max_logit.fold_call_(best, q, k, call)
        want = brute_force(q, k, call)
        assert torch.allclose(best, want, rtol=0, atol=1e-12), (call, best, want)
        # Folding into a larger running maximum leaves it
        high = want + 1
        max_logit.fold_call_(high, q, k, call)
        assert torch.equal(high, want + 1)


def test_ulysses_heads_go_back_to_their_places():
    best = torch.tensor([3.0, 4.0])
    full = max_logit.place_heads(best, 6, 3, 1)
    assert full.tolist() == [float("-inf")] * 2 + [3.0, 4.0] + [float("-inf")] * 2


TOKENS = 2048  # P8: chunks of 128 rows; a window of 64 takes the halo exchange

PASS_OPS = {"aten.bmm", "aten._unsafe_view", "aten.new_full", "aten.amax", "aten.maximum", "aten.masked_fill_", "aten.triu_", "aten.tril_",
            "aten.logical_or_", "aten.mul_", "aten.clone", "aten.fill_", "aten.ones", "aten.full"}


@pytest.mark.parametrize("kw", [{}, {"window": (64, 0), "docs": "document", "kv_heads": 1}])  # schedule; halo
def test_with_both_flags_off_nothing_is_computed(monkeypatch, kw):
    """--qk-clip and --log-max-attention-logit off: the layer's ops are those without the pass
    (its functions would raise if called); on, the extra ops are the pass's kinds only."""
    count(Case("warm-up", 8, 2, TOKENS, **kw))  # what a process makes once (plans, metadata) is not compared
    with_pass = count(Case("max logit", 8, 2, TOKENS, max_logit=True, **kw))

    def refuse(*args, **kwargs):
        raise AssertionError("the max-logit pass ran with both flags off")

    for name in ("new_accumulator", "fold_call_", "finish", "place_heads"):
        monkeypatch.setattr(max_logit, name, refuse)
    without = count(Case("plain", 8, 2, TOKENS, **kw))
    assert not {"aten.bmm", "aten.amax", "aten.maximum"} & set(without.by_op), without.by_op
    extra = with_pass.by_op - without.by_op
    assert extra and set(extra) <= PASS_OPS, extra
    assert with_pass.comm == without.comm and with_pass.kernel == without.kernel  # no new P2P, no new call
    assert with_pass.launch - without.launch == sum(extra.values())
