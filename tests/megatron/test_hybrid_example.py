"""examples/pretrain_gpt.py --hybrid-layer-pattern: megatron-core's HybridModel trained by
megatron.training's pretrain (DDP, Adam, Megatron's data) with StarTrail CP4 (team size 2)
x TP2 logs the losses of CP1, with attention and MLP or MoE (EP2) layers and with packed
documents; patterns it cannot run are refused at start-up with an error naming the flag."""

import argparse

import pytest

from tests.megatron.test_pretrain_example import losses as example_losses
from tests.megatron.test_pretrain_example import losses_and_grads, pretrain_gpt
from tests.megatron.utils import assert_first_step_grads_match

# "**--" is attention, attention, MLP, MLP ("*-*-" would be the 2-layer GPT itself: the
# same modules, initialised alike, log the same losses).
EXAMPLE_HYBRID = ["--hybrid-layer-pattern", "**--", "--tensor-model-parallel-size", "2"]
EXAMPLE_STARTRAIL_CP4 = ["--context-parallel-size", "4", "--context-parallel-algo", "startrail",
                         "--startrail-team-size", "2"]


# MoE layers ('E') with 4 experts, top-2, expert parallel 2 over the TP pair (ETP1; TP > 1 needs
# --sequence-parallel with MoE, and no linear biases: see test_moe_startrail.py).
HYBRID_MOE = ["--hybrid-layer-pattern", "*E*E", "--tensor-model-parallel-size", "2", "--sequence-parallel",
              "--num-experts", "4", "--moe-router-topk", "2", "--expert-model-parallel-size", "2",
              "--moe-aux-loss-coeff", "1e-2", "--expert-tensor-parallel-size", "1", "--disable-bias-linear",
              "--moe-token-dispatcher-type", "alltoall"]


@pytest.mark.parametrize("flags", [EXAMPLE_HYBRID, HYBRID_MOE], ids=["attention_mlp", "attention_moe_EP2"])
def test_example_trains_a_hybrid_model_with_startrail_tp2_cp4_as_at_cp1(flags):
    startrail, grads = losses_and_grads(8, *flags, *EXAMPLE_STARTRAIL_CP4)
    reference, ref_grads = losses_and_grads(2, *flags)
    for got, want in zip(startrail, reference):
        assert abs(got - want) <= 1e-5 * want, (startrail, reference)
    # every parameter's first-step gradient on rank 0 (TP, CP, DP, EP rank 0 in both runs)
    assert_first_step_grads_match(grads, ref_grads, f"example hybrid {flags[1]} CP4")
    assert reference[-1] < reference[0]  # it learns
    if flags is EXAMPLE_HYBRID:  # the pattern reaches the model: the GPT of the same flags differs
        gpt = example_losses(2, "--tensor-model-parallel-size", "2")
        assert reference != pytest.approx(gpt, rel=1e-5), (reference, gpt)


def test_example_hybrid_packed_documents_with_startrail_log_the_losses_of_the_dense_document_mask(tmp_path):
    make = pretrain_gpt.make_indexed_dataset
    make.write_indexed_dataset(make.short_documents(), str(tmp_path / "docs"))
    data = [*EXAMPLE_HYBRID, "--data-path", str(tmp_path / "docs"), "--split", "100,0,0"]
    packed, grads = losses_and_grads(8, *data, *EXAMPLE_STARTRAIL_CP4, "--dataloader-inter-document-masking")
    dense_mask, ref_grads = losses_and_grads(2, *data, "--reset-attention-mask", "--reset-position-ids")
    for got, want in zip(packed, dense_mask):
        assert abs(got - want) <= 1e-5 * want, (packed, dense_mask)
    assert_first_step_grads_match(grads, ref_grads, "example hybrid packed CP4")


@pytest.mark.parametrize("impl, pattern, packed, message", [
    ("local", "M*M-", False, r"--hybrid-layer-pattern 'M\*M-': without Transformer Engine"),
    ("local", "*-/*-", False, "MTP"),
    ("transformer_engine", "M*M-", True, "drop --dataloader-inter-document-masking"),
    ("transformer_engine", "*D-", False, r"--hybrid-layer-pattern '\*D-' has DeepSeek sparse attention"),
], ids=["mamba-on-cpu", "mtp-on-cpu", "mamba-packed", "dsa"])
def test_example_refuses_hybrid_patterns_it_cannot_run(impl, pattern, packed, message):
    args = argparse.Namespace(context_parallel_algo="startrail", context_parallel_size=4, transformer_impl=impl,
                              dataloader_inter_document_masking=packed, sft=False, hybrid_layer_pattern=pattern)
    with pytest.raises(ValueError, match=message):
        pretrain_gpt.validate_example_args(args)
    args.hybrid_layer_pattern = "**--"
    pretrain_gpt.validate_example_args(args)  # accepted
