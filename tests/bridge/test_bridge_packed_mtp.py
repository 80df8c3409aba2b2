"""Multi-token prediction on packed documents through Megatron-Bridge's own batch path, at CP2
and CP4 (StarTrail) against CP1.

Bridge's ``gpt_step.get_batch`` cuts a packed batch per document and ``get_packed_seq_params``
builds parameters WITHOUT padded boundaries (test_bridge_packed.py). The MTP roll (labels and
loss mask in ``process_mtp_loss``, input and position ids in the MTP layer) gets Bridge's
parameters from GPTModel, not the attention's corrected copy: it must still roll in the
document layout (``packed_layout.as_document_layout`` records that copy on Bridge's
parameters, ``mtp_roll.layout_as_cut`` takes it). Checked: every tensor the model rolled
equals Megatron's own packed roll of the whole batch at CP1, cut as Bridge cut it, and
Megatron's own packed roll at CP > 1 on Bridge's cut (right here: no document has padding);
with ``calculate_per_token_loss`` (the MTP scale of mtp_loss.py), every parameter's gradient
summed over the CP ranks equals CP1's within 1e-5.

Bridge builds the MTP layers' own modules with Transformer Engine only: the stand-in
``standins.mtp_block_spec`` builds the same block with megatron-core's local modules.
"""

from __future__ import annotations

import types

import pytest

from tests.bridge import require_bridge

require_bridge()

# first: the CPU import shims, then Bridge with the stand-ins
from tests.bridge.recipe_run import gpt_provider, gpt_step, patch_bridge_for_cpu  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.core import utils as mcore_utils  # noqa: E402
from megatron.core.packed_seq_params import PackedSeqParams  # noqa: E402
from megatron.core.process_groups_config import ProcessGroupCollection  # noqa: E402
from megatron.core.transformer import multi_token_prediction as mtp  # noqa: E402

from tests.bridge import standins  # noqa: E402
from tests.bridge.test_bridge_packed import CU_SEQLENS, VOCAB, packed_batch  # noqa: E402
from tests.megatron.utils import Utils, assert_first_step_grads_match  # noqa: E402
from tests.multiproc import run_ranks  # noqa: E402

from megatron_startrail.bridge import startrail_layer_spec  # noqa: E402
from megatron_startrail.megatron import cpu_patches  # noqa: E402
from megatron_startrail.megatron.core_attention import LocalMLACoreAttention  # noqa: E402
from megatron_startrail.megatron.layer_specs import with_core_attention  # noqa: E402
from megatron_startrail.megatron.mtp_roll import real_tensor  # noqa: E402

ROLLED = ("input ids", "position ids", "labels", "loss mask")


def provider(cp: int):
    model_cfg = gpt_provider.GPTModelProvider(
        num_layers=2, hidden_size=64, num_attention_heads=8, ffn_hidden_size=128, seq_length=CU_SEQLENS[-1],
        vocab_size=VOCAB, context_parallel_size=cp, position_embedding_type="rope", attention_dropout=0.0,
        hidden_dropout=0.0, use_cpu_initialization=True, bf16=False, params_dtype=torch.float32,
        mtp_num_layers=1, calculate_per_token_loss=True)
    cpu_patches.adapt_config(model_cfg)
    model_cfg.finalize()
    local = gpt_provider.local_layer_spec
    model_cfg.transformer_layer_spec = (startrail_layer_spec(team_size=2 if cp == 4 else 1, base=local) if cp > 1
                                        else with_core_attention(local(model_cfg), LocalMLACoreAttention))
    return model_cfg


def spy_on_the_roll(recorded: list):
    """Keep ``(input, rolled)`` of every roll the model makes (through Megatron's module global)."""
    roll = mtp.roll_tensor

    def spy(tensor, shifts=-1, dims=-1, cp_group=None, packed_seq_params=None):
        out = roll(tensor, shifts, dims, cp_group, packed_seq_params)
        recorded.append((real_tensor(tensor), real_tensor(out[0])))
        return out

    mtp.roll_tensor = spy


def expected_rolls(batch: dict, cp: int, rank: int) -> dict:
    """Megatron's own packed roll of the whole batch at CP1, cut as Bridge cut it for ``rank``."""
    megatron_roll = getattr(mtp, "_startrail_megatron_roll_tensor", mtp.roll_tensor)
    cu = torch.tensor(CU_SEQLENS, dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu)
    held = standins.thd_get_partitioned_indices(cu, CU_SEQLENS[-1], cp, rank)
    full = dict(zip(ROLLED, (batch["tokens"], batch["position_ids"], batch["labels"], batch["loss_mask"])))
    return {name: megatron_roll(t, -1, -1, None, params)[0][..., held] for name, t in full.items()}


def packed_mtp_rank(rank, world_size, cp):
    patch_bridge_for_cpu()
    mcore_utils.tex = types.SimpleNamespace(thd_get_partitioned_indices=standins.thd_get_partitioned_indices)
    gpt_provider.mtp_block_spec = standins.mtp_block_spec
    Utils.initialize_model_parallel(context_parallel_size=cp, seed=1234)
    model_cfg = provider(cp)
    pg_collection = ProcessGroupCollection.use_mpu_process_groups()
    model_cfg._pg_collection = pg_collection
    torch.manual_seed(1234)
    model = model_cfg.provide()
    recorded = []
    spy_on_the_roll(recorded)
    cfg = types.SimpleNamespace(model=model_cfg, dataset=types.SimpleNamespace())
    tokens, labels, loss_mask, _, position_ids, metadata = gpt_step.get_batch(
        iter([packed_batch()]), cfg, True, pg_collection=pg_collection)
    params = gpt_step.get_packed_seq_params(metadata)
    assert params.cu_seqlens_q_padded is None  # the case the Bridge spec must fix
    per_token = model(tokens, position_ids, None, labels=labels, loss_mask=loss_mask, packed_seq_params=params)
    (per_token * loss_mask).sum().backward()

    cp_group = parallel_state.get_context_parallel_group()
    wrong = {}
    if cp > 1:
        megatron_roll = mtp._startrail_megatron_roll_tensor
        for name, local in zip(ROLLED, (tokens, position_ids, labels, loss_mask)):
            rolled = [out for inp, out in recorded if inp.dtype == local.dtype and torch.equal(inp, local)]
            assert len(rolled) == 1, f"{name}: rolled {len(rolled)} times"
            want = expected_rolls(packed_batch(), cp, rank)[name]
            megatrons = megatron_roll(local, -1, -1, cp_group, params)[0]  # Megatron's own, on Bridge's cut
            wrong[name] = (int((rolled[0] != want).sum()), int((megatrons != want).sum()), want.numel())
    grads = {}
    for name, p in model.named_parameters():  # summed over the CP ranks, as DDP does with per-token loss
        g = p.grad.detach().double().clone()
        dist.all_reduce(g, group=cp_group)
        grads[name] = g
    Utils.destroy_model_parallel()
    return wrong, grads


@pytest.mark.parametrize("cp", [2, 4])
def test_packed_mtp_through_bridges_batch_path_rolls_in_bridges_layout_and_gives_cp1s_gradients(cp):
    # On 9ee7a82 (the roll took Bridge's parameters for the sample layout), rank 0 rolled wrong: at CP2 10 input
    # ids, 7 position ids, 10 labels, 4 loss-mask rows of 128; at CP4 8, 5, 8, 7 of 64 (Megatron's own: 0);
    # gradients 5.3e-1 (CP2) and 5.2e-1 (CP4), now 9.1e-7 and 7.8e-7.
    ((_, ref_grads),) = run_ranks(packed_mtp_rank, 1, args=(1,), timeout=240)
    ranks = run_ranks(packed_mtp_rank, cp, args=(cp,), timeout=240)
    for rank, (wrong, _) in enumerate(ranks):
        # (rows the model rolled wrong, rows Megatron's own roll got wrong, rows) per rolled tensor
        assert all(ours == 0 and megatrons == 0 for ours, megatrons, _ in wrong.values()), (rank, wrong)
    mtp_grads = [g for name, g in ref_grads.items() if ".mtp." in f".{name}"]
    assert mtp_grads and all(g.abs().sum() > 0 for g in mtp_grads)  # the MTP loss trains its layers
    assert_first_step_grads_match(ranks[0][1], ref_grads, f"Bridge packed MTP CP{cp} vs CP1")
