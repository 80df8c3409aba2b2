"""RoPE of Multi-Latent Attention with packed documents (megatron_startrail/megatron/packed_mla.py):
on every CP rank, in both packed layouts, the q, k, v that StarTrail's MLA layer makes from the
rows it holds are exactly those rows of the q, k, v Megatron's MLA makes from the whole sample
at CP = 1 (float64), i.e. every rotary part is rotated by its position in its document."""

import copy

import pytest

from tests.megatron.utils import Utils, cpu_patches  # noqa: F401  (import shims before megatron)

import torch  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.packed_seq_params import PackedSeqParams  # noqa: E402
from megatron.core.transformer.multi_latent_attention import MLASelfAttention  # noqa: E402
from megatron.core.transformer.spec_utils import build_module  # noqa: E402
from megatron.core.transformer.transformer_config import MLATransformerConfig  # noqa: E402

from megatron_startrail.megatron.core_attention import LocalMLACoreAttention  # noqa: E402
from megatron_startrail.megatron.layer_specs import with_core_attention  # noqa: E402
from megatron_startrail.megatron.packed_mla import PackedRopeMLASelfAttention  # noqa: E402
from megatron_startrail.megatron.packed_rope import document_layout_positions  # noqa: E402
from tests.megatron.test_packed_rope import FakeCPGroup  # noqa: E402
from tests.multiproc import run_ranks  # noqa: E402
from tests.packed_cases import held_positions, make_documents  # noqa: E402

CP, CHUNK, HIDDEN, HEADS = 4, 6, 32, 4


@pytest.mark.parametrize("cp_size", [1, 2, 4])
def test_document_layout_positions_count_from_each_documents_start(cp_size):
    cu, padded = make_documents(cp_size, CHUNK, "document", seed=cp_size)
    for cp_rank in range(cp_size):
        rows = held_positions(cp_rank, cp_size, cu, padded)  # rows of the padded sample this rank holds
        start = padded[torch.searchsorted(padded[1:], rows, right=True)]  # its document's span start
        got = document_layout_positions(padded, cp_size, cp_rank, int(padded[-1]) // cp_size)
        assert torch.equal(got, rows - start)


def packed_params(cu, padded):
    spans = (cu if padded is None else padded).diff()
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=padded,
                           cu_seqlens_kv_padded=padded, max_seqlen_q=int(spans.max()),
                           max_seqlen_kv=int(spans.max()))


def mla_layer(module):
    """One float64 MLA self-attention (q/k head dim 8 + 8 rotary, v head dim 12, TP = CP = 1)."""
    config = MLATransformerConfig(num_layers=1, hidden_size=HIDDEN, num_attention_heads=HEADS, q_lora_rank=None,
                                  kv_lora_rank=16, qk_head_dim=8, qk_pos_emb_head_dim=8, v_head_dim=12,
                                  rope_type="rope", use_cpu_initialization=True, attention_dropout=0.0)
    spec = with_core_attention(get_gpt_layer_local_spec(multi_latent_attention=True), LocalMLACoreAttention,
                               {MLASelfAttention: module})
    return build_module(spec.submodules.self_attention, config=config, layer_number=1).double()


def on_fake_cp_rank(layer, cp_rank):
    """``layer`` as seen on CP rank ``cp_rank`` of CP: only its CP group and size change (this
    test computes no attention, so no rank talks to another)."""
    layer = copy.copy(layer)
    layer.pg_collection = copy.copy(layer.pg_collection)
    layer.pg_collection.cp = FakeCPGroup(CP, cp_rank)
    layer.config = copy.copy(layer.config)
    layer.config.context_parallel_size = CP
    return layer


def rope_worker(rank, world_size, layout):
    Utils.initialize_model_parallel()
    megatron = mla_layer(MLASelfAttention)
    startrail = mla_layer(PackedRopeMLASelfAttention)
    startrail.load_state_dict(megatron.state_dict())
    cu, padded = make_documents(CP, CHUNK, layout, seed=3)
    params = packed_params(cu, padded)
    total = int((cu if padded is None else padded)[-1])
    hidden = torch.randn(total, 1, HIDDEN, dtype=torch.float64, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        # The whole sample at CP = 1: Megatron's THD RoPE restarts positions at every (padded) document.
        want = megatron.get_query_key_value_tensors(hidden, packed_seq_params=params)[:3]  # q, k, v [t, np, d]
        megatron_differs = False
        for cp_rank in range(CP):
            rows = held_positions(cp_rank, CP, cu, padded)
            got = on_fake_cp_rank(startrail, cp_rank).get_query_key_value_tensors(hidden[rows],
                                                                                 packed_seq_params=params)
            for name, g, w in zip("qkv", got, want):
                torch.testing.assert_close(g, w[rows], rtol=0, atol=1e-12, msg=f"{layout} rank {cp_rank} {name}")
            try:  # what Megatron's own MLA makes of the same rows
                theirs = on_fake_cp_rank(megatron, cp_rank).get_query_key_value_tensors(hidden[rows],
                                                                                     packed_seq_params=params)
                megatron_differs |= not all(torch.allclose(t, g) for t, g in zip(theirs[:3], got))
            except RuntimeError:  # a document length not divisible by CP: Megatron's THD split fails
                megatron_differs = True
    Utils.destroy_model_parallel()
    return megatron_differs


@pytest.mark.parametrize("layout", ["sample", "document"])
def test_mla_rope_on_every_cp_rank_is_the_whole_samples_per_document_rope(layout):
    (megatron_differs,) = run_ranks(rope_worker, 1, args=(layout,), timeout=120)
    # Megatron's THD RoPE is written for the document layout: it agrees there and not in the sample layout.
    assert megatron_differs == (layout == "sample")


def fusion_worker(rank, world_size):
    Utils.initialize_model_parallel()
    layer = on_fake_cp_rank(mla_layer(PackedRopeMLASelfAttention), 0)
    layer.config = copy.copy(layer.config)
    layer.config.apply_rope_fusion = True  # (megatron-core's own checks need a GPU for it)
    cu, _ = make_documents(CP, CHUNK, "sample", seed=3)
    try:
        layer.get_query_key_value_tensors(torch.randn(int(cu[-1]) // CP, 1, HIDDEN, dtype=torch.float64),
                                          packed_seq_params=packed_params(cu, None))
    except ValueError as e:
        return str(e)
    finally:
        Utils.destroy_model_parallel()


def test_fused_mla_rope_in_the_sample_layout_is_refused_naming_the_flag():
    (error,) = run_ranks(fusion_worker, 1, timeout=120)
    assert error is not None and "--no-rope-fusion" in error
