"""StarTrail core attention: Megatron's signatures, the spec helper, and exact outputs."""

import functools
import inspect
import re
import types

import pytest
import torch

from tests.megatron.utils import Utils, parallel_state
from tests.multiproc import run_ranks

from megatron.core.packed_seq_params import PackedSeqParams  # noqa: E402
from megatron.core.process_groups_config import ProcessGroupCollection  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_decoder_block_spec, get_gpt_layer_local_spec  # noqa: E402
from megatron.core.transformer.dot_product_attention import DotProductAttention  # noqa: E402
from megatron.core.transformer.enums import AttnMaskType  # noqa: E402
from megatron.core.transformer.transformer_config import TransformerConfig  # noqa: E402

from megatron_startrail.documents import CHECK_OP  # noqa: E402
from megatron_startrail.megatron.core_attention import StarTrailCoreAttention  # noqa: E402
from megatron_startrail.megatron.layer_specs import to_startrail_spec  # noqa: E402
from megatron_startrail.megatron.parallel_state import initialize_startrail  # noqa: E402
from tests.attention_cases import local_rows  # noqa: E402
from tests.packed_cases import (  # noqa: E402
    PAD,
    document_of_positions,
    held_positions,
    make_documents,
    reference_packed_with_grads,
)

# DotProductAttention.__init__ / forward parameters in megatron-core 0.16.1, read from its
# source (megatron/core/transformer/dot_product_attention.py in the 0.16.1 wheel).
INIT_0_16_1 = ("config", "layer_number", "attn_mask_type", "attention_type", "attention_dropout",
               "softmax_scale", "cp_comm_type", "pg_collection")
FORWARD_0_16_1 = ("query", "key", "value", "attention_mask", "attn_mask_type", "attention_bias",
                  "packed_seq_params")


def params(fn):
    return [n for n in inspect.signature(fn).parameters if n != "self"]


@pytest.mark.parametrize("version, init, forward", [
    ("installed", tuple(params(DotProductAttention.__init__)), tuple(params(DotProductAttention.forward))),
    ("0.16.1", INIT_0_16_1, FORWARD_0_16_1),
])
def test_signatures_match_megatrons_dot_product_attention(version, init, forward):
    ours_init, ours_forward = params(StarTrailCoreAttention.__init__), params(StarTrailCoreAttention.forward)
    # Same leading parameters in the same order (Megatron passes them by keyword; positional
    # callers still line up), and forward identical.
    assert tuple(ours_init[: len(init)]) == init, version
    assert tuple(ours_forward) == forward, version
    # Our extra constructor arguments are keyword-only (given through ModuleSpec / partial) or optional.
    for name in ours_init[len(init):]:
        p = inspect.signature(StarTrailCoreAttention.__init__).parameters[name]
        assert p.kind is p.KEYWORD_ONLY or p.default is not p.empty, name


def attention_cores(spec):
    layers = spec.layer_specs if hasattr(spec, "layer_specs") else [spec]
    return [layer.submodules.self_attention.submodules.core_attention for layer in layers]


@pytest.mark.parametrize("make_spec", [
    get_gpt_layer_local_spec,
    functools.partial(get_gpt_layer_local_spec, qk_layernorm=True),
], ids=["local", "local_qk_layernorm"])
def test_spec_helper_swaps_only_core_attention(make_spec):
    groups = object()  # the helper only passes it on
    spec = make_spec()
    new = to_startrail_spec(spec, groups)
    (core,) = attention_cores(new)
    assert core.module is StarTrailCoreAttention
    assert core.params == {"startrail_groups": groups}  # the settings travel with the groups (their config)
    assert attention_cores(spec) == [DotProductAttention]  # the original is untouched
    old_attn, new_attn = spec.submodules.self_attention, new.submodules.self_attention
    assert new_attn.params == old_attn.params
    # SelfAttention -> its subclass with sample-layout RoPE for packed documents (packed_rope.py)
    assert old_attn.module.__name__ == "SelfAttention" and new_attn.module.__name__ == "PackedRopeSelfAttention"
    assert new_attn.submodules.linear_qkv is old_attn.submodules.linear_qkv
    assert new.submodules.mlp is spec.submodules.mlp


def test_spec_helper_on_a_decoder_block_spec():
    config = TransformerConfig(num_layers=3, hidden_size=64, num_attention_heads=8, use_cpu_initialization=True)
    block = get_gpt_decoder_block_spec(config, use_transformer_engine=False, pp_rank=0)
    groups = object()
    cores = attention_cores(to_startrail_spec(block, groups))
    assert len(cores) == 3 and all(c.module is StarTrailCoreAttention and c.params["startrail_groups"] is groups
                                   for c in cores)
    assert attention_cores(block) == [DotProductAttention] * 3


def config_for(cp, dropout=0.0):
    return TransformerConfig(num_layers=1, hidden_size=64, num_attention_heads=8, context_parallel_size=cp,
                             attention_dropout=dropout, use_cpu_initialization=True)


def test_constructor_errors_name_the_setting():
    groups = types.SimpleNamespace(cp_size=4)
    with pytest.raises(ValueError, match="--attention-dropout 0"):
        StarTrailCoreAttention(config_for(4, dropout=0.1), 1, AttnMaskType.causal, startrail_groups=groups)
    with pytest.raises(ValueError, match="--context-parallel-size is 2"):
        StarTrailCoreAttention(config_for(2), 1, AttnMaskType.causal, startrail_groups=groups)
    with pytest.raises(ValueError, match="self-attention"):
        StarTrailCoreAttention(config_for(4), 1, AttnMaskType.causal, "cross", startrail_groups=groups)


@pytest.mark.parametrize("field, value, flag", [
    ("apply_query_key_layer_scaling", True, "--apply-query-key-layer-scaling"),
    ("experimental_attention_variant", "dsa", "--experimental-attention-variant dsa"),
    ("fp8_dot_product_attention", True, "TransformerConfig.fp8_dot_product_attention"),
    ("fp8_multi_head_attention", True, "TransformerConfig.fp8_multi_head_attention"),
    ("cuda_graph_impl", "local", "--cuda-graph-impl local"),
    ("hybrid_context_parallel", True, "--hybrid-context-parallel"),
])
def test_a_config_asking_for_another_attention_is_refused(field, value, flag):
    """A TransformerConfig built by hand (no Megatron parser) meets the same table: the core
    attention refuses to be built rather than compute full softmax attention."""
    config = config_for(4)
    object.__setattr__(config, field, value)  # set after __post_init__, which checks GPU-only variants
    with pytest.raises(ValueError, match=re.escape(flag)):
        StarTrailCoreAttention(config, 1, AttnMaskType.causal, startrail_groups=types.SimpleNamespace(cp_size=4))


SEQ, BATCH, HEADS, KV_HEADS, DIM = 64, 2, 4, 2, 16


def reference(q, k, v, causal):
    """Float64 softmax attention on the whole sequence; [s, b, h, d] with GQA."""
    q, k, v = (t.double().permute(1, 2, 0, 3) for t in (q, k, v))  # [b, h, s, d]
    k, v = (t.repeat_interleave(q.shape[1] // t.shape[1], dim=1) for t in (k, v))
    scores = q @ k.transpose(-1, -2) / DIM**0.5
    if causal:
        scores = scores.masked_fill(torch.ones(SEQ, SEQ, dtype=torch.bool).triu(1), float("-inf"))
    return (scores.softmax(-1) @ v).permute(2, 0, 1, 3)  # [s, b, h, d]


def attention_worker(rank, world_size, team_size, ulysses, mask_type):
    Utils.initialize_model_parallel(context_parallel_size=world_size)
    groups = initialize_startrail(team_size, ulysses)
    # Megatron's CP group is reused, and without Ulysses it is the StarTrail group (Note [communicators]).
    assert groups.cp_group is parallel_state.get_context_parallel_group()
    assert (groups.startrail_group is groups.cp_group) == (ulysses == 1)
    config = TransformerConfig(num_layers=1, hidden_size=HEADS * DIM, num_attention_heads=HEADS,
                               num_query_groups=KV_HEADS, context_parallel_size=world_size,
                               attention_dropout=0.0, use_cpu_initialization=True)
    core = StarTrailCoreAttention(config=config, layer_number=1, attn_mask_type=mask_type, attention_type="self",
                                  cp_comm_type=None, softmax_scale=None, pg_collection=None,
                                  startrail_groups=groups)
    gen = torch.Generator().manual_seed(7)
    full = [torch.randn(SEQ, BATCH, h, DIM, generator=gen) for h in (HEADS, KV_HEADS, KV_HEADS)]
    grad_full = torch.randn(SEQ, BATCH, HEADS * DIM, generator=gen)
    cp_rank = parallel_state.get_context_parallel_rank()
    q, k, v = (local_rows(t, cp_rank, world_size).requires_grad_() for t in full)
    out = core(q, k, v, None, attn_mask_type=mask_type, attention_bias=None, packed_seq_params=None)
    out.backward(local_rows(grad_full, cp_rank, world_size))

    ref_inputs = [t.double().requires_grad_() for t in full]
    ref = reference(*ref_inputs, causal=mask_type == AttnMaskType.causal).reshape(SEQ, BATCH, -1)
    ref.backward(grad_full.double())
    errors = [(out.double() - local_rows(ref, cp_rank, world_size)).abs().max().item()]
    errors += [(t.grad.double() - local_rows(r.grad, cp_rank, world_size)).abs().max().item()
               for t, r in zip((q, k, v), ref_inputs)]
    Utils.destroy_model_parallel()
    return tuple(out.shape), errors


@pytest.mark.parametrize("mask_type", [AttnMaskType.causal, AttnMaskType.no_mask], ids=["causal", "no_mask"])
@pytest.mark.parametrize("team_size, ulysses", [(2, 1), (1, 2)], ids=["C2", "U2xS2"])
def test_core_attention_is_exact_on_megatrons_cp_shards(mask_type, team_size, ulysses):
    for shape, errors in run_ranks(attention_worker, 4, args=(team_size, ulysses, mask_type), timeout=120):
        assert shape == (SEQ // 4, BATCH, HEADS * DIM)  # [s/CP, b, np * hn]
        assert max(errors) < 1e-5, errors


def packed_worker(rank, world_size, team_size, ulysses, layout, with_pg_collection=False):
    """THD input with Megatron's PackedSeqParams, against float64 per-document attention;
    ``with_pg_collection``: the core attention is handed Megatron's ProcessGroupCollection."""
    Utils.initialize_model_parallel(context_parallel_size=world_size)
    groups = initialize_startrail(team_size, ulysses)
    config = TransformerConfig(num_layers=1, hidden_size=HEADS * DIM, num_attention_heads=HEADS,
                               num_query_groups=KV_HEADS, context_parallel_size=world_size,
                               attention_dropout=0.0, use_cpu_initialization=True)
    pg_collection = ProcessGroupCollection.use_mpu_process_groups(required_pgs=["tp", "cp"]) \
        if with_pg_collection else None
    core = StarTrailCoreAttention(config=config, layer_number=1, attn_mask_type=AttnMaskType.causal,
                                  attention_type="self", startrail_groups=groups, pg_collection=pg_collection)
    checked_on = []  # the group of every packed-document check collective
    start = groups.transport.collective
    groups.transport.collective = lambda fn, *a, group, label, **kw: (
        checked_on.append(group) if label == CHECK_OP else None, start(fn, *a, group=group, label=label, **kw))[1]
    cu, padded = make_documents(world_size, 4, layout, seed=11)
    doc = document_of_positions(cu, padded)
    gen = torch.Generator().manual_seed(8)
    full = [torch.randn(len(doc), 1, h, DIM, generator=gen, dtype=torch.float64) for h in (HEADS, KV_HEADS, KV_HEADS)]
    grad_full = torch.randn(len(doc), 1, HEADS, DIM, generator=gen, dtype=torch.float64)
    ref = reference_packed_with_grads(*full, grad_full, doc, True, DIM**-0.5)
    mine = held_positions(parallel_state.get_context_parallel_rank(), world_size, cu, padded)
    # Megatron's attention squeezes the batch dim for THD: [t/CP, np, hn]
    q, k, v = (t[mine, 0].float().requires_grad_() for t in full)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=padded,
                             cu_seqlens_kv_padded=padded, max_seqlen_q=int((cu[1:] - cu[:-1]).max()),
                             max_seqlen_kv=int((cu[1:] - cu[:-1]).max()))
    out = core(q, k, v, None, attn_mask_type=AttnMaskType.causal, attention_bias=None, packed_seq_params=params)
    out.backward(grad_full[mine, 0].float().reshape(len(mine), -1))
    got = [out.detach().reshape(len(mine), HEADS, DIM)] + [t.grad for t in (q, k, v)]
    errors = [(g.double() - r[mine, 0]).abs().max().item() for g, r in zip(got, ref)]
    padding = doc[mine] == PAD
    pad_nonzero = sum(int(g[padding].count_nonzero()) for g in got)
    megatron_cp = parallel_state.get_context_parallel_group()
    check_groups = ["megatron cp" if g is megatron_cp else "startrail cp" if g is groups.cp_group else "other"
                    for g in checked_on]
    Utils.destroy_model_parallel()
    return tuple(out.shape), len(mine), errors, pad_nonzero, check_groups


def test_core_attention_uses_the_cp_group_of_the_pg_collection_it_is_handed():
    """Megatron passes modules a pg_collection: its CP group carries the document check (one
    collective per micro-batch); without one, the StarTrail groups' own CP group does -- which
    initialize_startrail takes from Megatron too (Note [communicators]: no second communicator
    over the same ranks)."""
    for with_pgs, want in ((True, "megatron cp"), (False, "megatron cp")):
        for _, _, errors, _, check_groups in run_ranks(packed_worker, 4, args=(2, 1, "sample", with_pgs),
                                                        timeout=120):
            assert max(errors) < 1e-5 and check_groups == [want]


def mismatched_pg_collection_worker(rank, world_size):
    Utils.initialize_model_parallel(context_parallel_size=world_size)
    groups = initialize_startrail(2)
    config = TransformerConfig(num_layers=1, hidden_size=HEADS * DIM, num_attention_heads=HEADS,
                               context_parallel_size=world_size, attention_dropout=0.0, use_cpu_initialization=True)
    wrong = types.SimpleNamespace(cp=parallel_state.get_tensor_model_parallel_group())  # ranks [rank] only
    try:
        StarTrailCoreAttention(config, 1, AttnMaskType.causal, startrail_groups=groups, pg_collection=wrong)
    except ValueError as exc:
        return str(exc)
    finally:
        Utils.destroy_model_parallel()


def test_a_pg_collection_from_another_cp_layout_is_refused():
    for rank, message in enumerate(run_ranks(mismatched_pg_collection_worker, 4, timeout=120)):
        assert f"pg_collection.cp holds ranks [{rank}]" in message and "[0, 1, 2, 3]" in message


@pytest.mark.parametrize("layout", ["sample", "document"])
@pytest.mark.parametrize("team_size, ulysses", [(2, 1), (1, 2)], ids=["C2", "U2xS2"])
def test_core_attention_takes_megatrons_packed_seq_params(team_size, ulysses, layout):
    for shape, t_local, errors, pad_nonzero, _ in run_ranks(packed_worker, 4, args=(team_size, ulysses, layout),
                                                            timeout=120):
        assert shape == (t_local, HEADS * DIM)  # [t/CP, np * hn]
        assert max(errors) < 1e-5, errors
        assert pad_nonzero == 0


def test_packed_seq_params_errors_name_the_problem():
    from megatron_startrail.megatron.core_attention import packed_documents

    cu = torch.tensor([0, 4, 8], dtype=torch.int32)
    with pytest.raises(ValueError, match="'thd' format"):
        packed_documents(PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=cu, cu_seqlens_kv=cu))
    with pytest.raises(ValueError, match="cu_seqlens_q and cu_seqlens_kv differ"):
        packed_documents(PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu + 1))
    got = packed_documents(PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu.unsqueeze(0), cu_seqlens_kv=None))
    assert torch.equal(got[0], cu) and got[1] is None
