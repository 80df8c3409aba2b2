"""Packed documents through Megatron-Bridge's own batch path at CP4 (StarTrail, teams of 2)
against CP1: Bridge's ``gpt_step.get_batch`` cuts a packed batch per document
(``_partition_packed_batch_for_cp``) and ``get_packed_seq_params`` builds the params
WITHOUT padded boundaries; the model is Bridge's ``GPTModelProvider.provide`` with
``startrail_layer_spec``, RoPE on. The summed loss and every parameter's gradient must be
those of CP1 within 1e-5 (float32): without ``packed_layout.as_document_layout`` StarTrail
would take the per-document cut for the whole-sample zigzag.

Megatron-core's per-document cut calls Transformer Engine's ``thd_get_partitioned_indices``
(GPU-only): a stand-in (``standins.thd_get_partitioned_indices``) in the forked ranks only.
CP1 runs Megatron's own ``SelfAttention`` with ``LocalMLACoreAttention`` (causal attention
inside each document; Megatron's local ``DotProductAttention`` takes no packed input).
"""

from __future__ import annotations

import types

from tests.bridge import require_bridge

require_bridge()

# first: the CPU import shims, then Bridge with the stand-ins
from tests.bridge.recipe_run import gpt_provider, gpt_step, patch_bridge_for_cpu  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.core import utils as mcore_utils  # noqa: E402
from megatron.core.process_groups_config import ProcessGroupCollection  # noqa: E402

from tests.bridge.standins import thd_get_partitioned_indices  # noqa: E402
from tests.megatron.utils import Utils, assert_first_step_grads_match  # noqa: E402
from tests.multiproc import run_ranks  # noqa: E402

from megatron_startrail.bridge import startrail_layer_spec  # noqa: E402
from megatron_startrail.megatron import cpu_patches  # noqa: E402
from megatron_startrail.megatron.core_attention import LocalMLACoreAttention  # noqa: E402
from megatron_startrail.megatron.layer_specs import with_core_attention  # noqa: E402

VOCAB, CU_SEQLENS = 256, [0, 48, 176, 200, 256]  # 4 documents, each a multiple of 2 * CP = 8


def packed_batch() -> dict:
    """One packed sample of 256 tokens (as a packed dataset hands Bridge: no padded boundaries)."""
    gen = torch.Generator().manual_seed(7)
    total = CU_SEQLENS[-1]
    tokens = torch.randint(0, VOCAB, (1, total + 1), generator=gen)
    cu = torch.tensor(CU_SEQLENS, dtype=torch.int32)
    position_ids = torch.cat([torch.arange(e - s) for s, e in zip(CU_SEQLENS[:-1], CU_SEQLENS[1:])])[None]
    return dict(tokens=tokens[:, :-1].contiguous(), labels=tokens[:, 1:].contiguous(),
                loss_mask=(torch.rand(1, total, generator=gen) > 0.1).float(), position_ids=position_ids,
                cu_seqlens_q=cu[None], cu_seqlens_kv=cu[None], max_seqlen_q=torch.tensor(128),
                max_seqlen_kv=torch.tensor(128))


def packed_rank(rank, world_size, cp):
    patch_bridge_for_cpu()
    mcore_utils.tex = types.SimpleNamespace(thd_get_partitioned_indices=thd_get_partitioned_indices)
    Utils.initialize_model_parallel(context_parallel_size=cp, seed=1234)
    model_cfg = gpt_provider.GPTModelProvider(
        num_layers=2, hidden_size=64, num_attention_heads=8, ffn_hidden_size=128, seq_length=CU_SEQLENS[-1],
        vocab_size=VOCAB, context_parallel_size=cp, position_embedding_type="rope", attention_dropout=0.0,
        hidden_dropout=0.0, use_cpu_initialization=True, bf16=False, params_dtype=torch.float32)
    cpu_patches.adapt_config(model_cfg)
    model_cfg.finalize()  # Bridge defers TransformerConfig's post-init (init methods, ...) to here
    local = gpt_provider.local_layer_spec
    model_cfg.transformer_layer_spec = (startrail_layer_spec(team_size=2, base=local) if cp > 1
                                        else with_core_attention(local(model_cfg), LocalMLACoreAttention))
    pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    model_cfg._pg_collection = pg_collection
    torch.manual_seed(1234)
    model = model_cfg.provide()
    # Bridge's own batch path: its CP cut and its PackedSeqParams
    cfg = types.SimpleNamespace(model=model_cfg, dataset=types.SimpleNamespace())
    tokens, labels, loss_mask, _, position_ids, metadata = gpt_step.get_batch(
        iter([packed_batch()]), cfg, pg_collection=pg_collection)
    params = gpt_step.get_packed_seq_params(metadata)
    assert params.cu_seqlens_q_padded is None  # the case the Bridge spec must fix
    per_token = model(tokens, position_ids, None, labels=labels, packed_seq_params=params)  # [1, 256 / CP]
    loss = (per_token * loss_mask).sum()
    loss.backward()
    cp_group = parallel_state.get_context_parallel_group()
    total = loss.detach().double().reshape(1)
    dist.all_reduce(total, group=cp_group)
    grads = {}
    for name, p in model.named_parameters():  # summed over the CP ranks, as DDP does
        g = p.grad.detach().double().clone()
        dist.all_reduce(g, group=cp_group)
        grads[name] = g
    attention = {type(m.core_attention).__name__ for m in model.modules() if hasattr(m, "core_attention")}
    Utils.destroy_model_parallel()
    return total.item(), grads, attention


def test_packed_documents_through_bridges_batch_path_give_cp1s_loss_and_gradients():
    ((ref_loss, ref_grads, ref_attention),) = run_ranks(packed_rank, 1, args=(1,), timeout=240)
    ranks = run_ranks(packed_rank, 4, args=(4,), timeout=240)
    assert ref_attention == {"LocalMLACoreAttention"}
    loss, grads, attention = ranks[0]
    assert attention == {"StarTrailCoreAttention"}
    print(f"\npacked, summed loss: CP1 {ref_loss:.7f}, CP4 C2 {loss:.7f}")
    # The gradients first: a layout bug shows there most (the loss moves less, issue 36).
    assert_first_step_grads_match(grads, ref_grads, "Bridge packed CP4 C2 vs CP1")
    assert abs(loss - ref_loss) <= 1e-5 * abs(ref_loss)
