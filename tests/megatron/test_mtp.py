"""Multi-token prediction (``--mtp-num-layers``, DeepSeek-V3 style) with StarTrail.

Megatron builds the MTP layers from their own spec (``get_gpt_mtp_block_spec``), apart from
the decoder's: ``to_startrail_spec`` (and so ``startrail_spec_from_args``) takes that block spec
too and gives the transformer layer inside each MTP layer StarTrail core attention. The MTP
loss is Megatron's own (``process_mtp_loss``: labels and loss mask rolled across the CP ranks'
zigzag chunks by ``roll_tensor``), with the package's roll (megatron/mtp_roll.py): the CP
group's target count, and packed documents in StarTrail's sample layout; and with per-token
loss the package's count of loss tokens (megatron/mtp_loss.py). examples/pretrain_gpt.py at
TP2 x CP4 with StarTrail C = 2 logs the lm and MTP losses of the same command at CP 1 and has
its first-step gradients; with --calculate-per-token-loss and --eod-mask-loss too (CP2, and
TP2 + SP x CP4). tests/megatron/test_mtp_loss.py: the loss and roll alone, under every mask.
"""

import math
import re

import pytest

from tests.megatron.example import run_example_rank  # first: the CPU import shims before megatron-core

from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.transformer.multi_token_prediction import (
    MultiTokenPredictionBlockSubmodules,
    get_mtp_layer_spec,
)

from megatron_startrail.megatron.core_attention import StarTrailCoreAttention
from megatron_startrail.megatron.layer_specs import to_startrail_spec
from megatron_startrail.megatron.packed_rope import PackedRopeSelfAttention
from tests.megatron.test_pretrain_example import COMMON, MLA
from tests.megatron.utils import assert_first_step_grads_match, record_first_step_grads
from tests.multiproc import run_ranks

MTP_LOSS = re.compile(r"iteration\s+(\d+)/.* lm loss: ([0-9.E+-]+) \| mtp_1 loss: ([0-9.E+-]+) \|")


def _attention_of(mtp_layer_spec):
    return mtp_layer_spec.submodules.mtp_model_layer.submodules.self_attention


def test_the_mtp_block_spec_gets_startrail_core_attention():
    megatron_layer = get_gpt_layer_local_spec()
    block = MultiTokenPredictionBlockSubmodules(
        layer_specs=[get_mtp_layer_spec(megatron_layer, use_transformer_engine=False)] * 2)
    groups = object()  # to_startrail_spec only hands the groups to the core attention's builder
    startrail = to_startrail_spec(block, groups)
    for layer in startrail.layer_specs:
        attention = _attention_of(layer)
        assert attention.module is PackedRopeSelfAttention
        assert attention.submodules.core_attention.module is StarTrailCoreAttention
        assert attention.submodules.core_attention.params["startrail_groups"] is groups
    # A copy: Megatron's spec (shared with the decoder's layer spec) is unchanged.
    assert _attention_of(block.layer_specs[0]).submodules.core_attention is \
        megatron_layer.submodules.self_attention.submodules.core_attention


def mtp_worker(rank, world_size, argv):
    """The logged (lm loss, mtp_1 loss) per iteration, and on rank 0 the first-step gradients
    and the class of each MTP layer's core attention."""
    recorded = record_first_step_grads()
    from megatron.training import training  # noqa: PLC0415

    finalize = training.finalize_model_grads

    def with_core_attention_classes(model, *args, **kwargs):
        recorded.setdefault("mtp_attention", sorted({
            type(m).__name__ for name, m in model[0].named_modules()
            if ".mtp." in f".{name}" and name.endswith("core_attention")}))
        return finalize(model, *args, **kwargs)

    training.finalize_model_grads = with_core_attention_classes
    log = run_example_rank(rank, world_size, argv)
    losses = [(int(m[1]), float(m[2]), float(m[3])) for m in MTP_LOSS.finditer(log)]
    return losses, (recorded.get("grads"), recorded.get("mtp_attention")) if rank == 0 else None


def mtp_run(world_size, *flags, iters=4):
    warmup = [] if iters > 1 else ["--lr-warmup-iters", "0"]  # Megatron wants warm-up < decay iterations
    argv = [*COMMON, "--mtp-num-layers", "1", "--train-iters", str(iters), *warmup, *flags]
    logged = run_ranks(mtp_worker, world_size, args=(argv,), timeout=300)
    losses = logged[-1][0]  # megatron.training logs on the last rank
    assert [i for i, _, _ in losses] == list(range(1, iters + 1))
    grads, attention = logged[0][1]
    return [(lm, mtp) for _, lm, mtp in losses], grads, attention


TP2_CP4_STARTRAIL = ["--tensor-model-parallel-size", "2", "--context-parallel-size", "4",
                     "--context-parallel-algo", "startrail", "--startrail-team-size", "2"]
TP2_CP1 = ["--tensor-model-parallel-size", "2", "--context-parallel-size", "1"]


def test_mtp_with_startrail_cp4_logs_the_losses_and_gradients_of_cp1():
    got, grads, attention = mtp_run(8, *TP2_CP4_STARTRAIL)
    want, ref_grads, ref_attention = mtp_run(2, *TP2_CP1)
    assert attention == ["StarTrailCoreAttention"] and ref_attention == ["DotProductAttention"]
    assert all(math.isfinite(x) for pair in got + want for x in pair)
    for (lm, mtp), (lm_ref, mtp_ref) in zip(got, want):
        assert abs(lm - lm_ref) <= 2e-6 * lm_ref and abs(mtp - mtp_ref) <= 2e-6 * mtp_ref, (got, want)
    assert_first_step_grads_match(grads, ref_grads, "example MTP TP2 CP4")  # measured 6.9e-7
    mtp_grads = [g for name, g in ref_grads.items() if ".mtp." in name]
    assert mtp_grads and all(g.abs().sum() > 0 for g in mtp_grads)  # the MTP loss trains its layers
    assert want[-1][1] < want[0][1]  # it learns to predict the token after next


def test_mtp_on_packed_documents_with_startrail_cp4_logs_the_losses_and_gradients_of_cp1(tmp_path):
    # StarTrail's packed sample layout (--dataloader-inter-document-masking): the MTP roll inside
    # each document follows it (mtp_roll.py). On 9c6fece: 1.2e-1 at CP2; IndexError at CP4.
    from tests.megatron.example import pretrain_gpt  # noqa: PLC0415

    prefix = str(tmp_path / "docs")
    pretrain_gpt.make_indexed_dataset.write_indexed_dataset(pretrain_gpt.make_indexed_dataset.short_documents(),
                                                           prefix)
    # MLA: its CP = 1 core attention (LocalMLACoreAttention) takes packed documents, Megatron's local one does not.
    packed = ["--data-path", prefix, "--split", "100,0,0", "--dataloader-inter-document-masking", *MLA,
              "--no-rope-fusion"]
    got, grads, _ = mtp_run(8, *TP2_CP4_STARTRAIL, *packed)
    want, ref_grads, _ = mtp_run(2, *TP2_CP1, *packed)
    for (lm, mtp), (lm_ref, mtp_ref) in zip(got, want):
        assert abs(lm - lm_ref) <= 2e-6 * lm_ref and abs(mtp - mtp_ref) <= 2e-6 * mtp_ref, (got, want)
    assert_first_step_grads_match(grads, ref_grads, "example MTP TP2 CP4, packed documents")


def test_the_mtp_roll_is_installed_by_the_groups_and_keeps_megatrons_for_cp1():
    from megatron.core.models.gpt import gpt_model  # noqa: PLC0415
    from megatron.core.transformer import multi_token_prediction as mtp  # noqa: PLC0415

    from megatron_startrail.megatron.mtp import install_startrail_mtp  # noqa: PLC0415
    from megatron_startrail.megatron.mtp_loss import startrail_process_mtp_loss  # noqa: PLC0415
    from megatron_startrail.megatron.mtp_roll import startrail_roll_tensor  # noqa: PLC0415

    install_startrail_mtp()
    install_startrail_mtp()  # idempotent
    assert mtp.roll_tensor is startrail_roll_tensor
    assert mtp.process_mtp_loss is gpt_model.process_mtp_loss is startrail_process_mtp_loss
    import torch  # noqa: PLC0415

    x = torch.arange(1.0, 9.0).view(1, 8)
    rolled, count = mtp.roll_tensor(x, -1, -1, None, None)  # CP 1: Megatron's own
    assert rolled.tolist() == [[2, 3, 4, 5, 6, 7, 8, 0]] and count.item() == 35


def short_documents(tmp_path):
    """--data-path flags of make_indexed_dataset.short_documents: many documents of 1-120 tokens in each sample."""
    from tests.megatron.example import pretrain_gpt  # noqa: PLC0415

    prefix = str(tmp_path / "docs")
    make = pretrain_gpt.make_indexed_dataset
    make.write_indexed_dataset(make.short_documents(), prefix)
    return ["--data-path", prefix, "--split", "100,0,0"]


PER_TOKEN_EOD = ["--calculate-per-token-loss", "--eod-mask-loss"]


@pytest.mark.parametrize("world_size, grid, ref_world_size, ref_grid", [
    (2, ["--context-parallel-size", "2", "--context-parallel-algo", "startrail", "--startrail-team-size", "1"],
     1, []),
    (8, [*TP2_CP4_STARTRAIL, "--sequence-parallel"], 2, [*TP2_CP1, "--sequence-parallel"]),
], ids=["cp2", "tp2-sp-cp4-c2"])
def test_mtp_per_token_loss_with_eod_masks_gives_the_gradients_of_cp1(tmp_path, world_size, grid, ref_world_size,
                                                                         ref_grid):
    # --eod-mask-loss over short documents: the CP ranks hold different numbers of loss tokens, and Megatron's
    # per-token MTP path scales each rank's loss by its own token count over the rolled count (mtp_loss.py).
    # On 9ee7a82 (the CP group's mean rolled count only): 7.6e-3 at CP2, 1.1e-2 at TP2 x CP4 C2, all in the MTP
    # parameters; with mtp_loss.py's count 6.9e-7 and 7.9e-7.
    data = short_documents(tmp_path)
    got, grads, _ = mtp_run(world_size, *grid, *data, *PER_TOKEN_EOD, iters=1)
    want, ref_grads, _ = mtp_run(ref_world_size, *ref_grid, *data, *PER_TOKEN_EOD, iters=1)
    (lm, mtp), (lm_ref, mtp_ref) = got[0], want[0]
    assert abs(lm - lm_ref) <= 2e-6 * lm_ref and abs(mtp - mtp_ref) <= 2e-6 * mtp_ref, (got, want)
    assert_first_step_grads_match(grads, ref_grads, f"example MTP per-token loss, EOD masks, {world_size} ranks")
