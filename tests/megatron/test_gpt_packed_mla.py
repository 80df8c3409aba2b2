"""A tiny GPT with Multi-Latent Attention trained on packed documents: TP2 x CP4 with StarTrail
(C = 2) logs the losses of the same GPT at CP = 1, and its first-step gradients are
those of CP = 1 (per parameter, relative 1e-5), in both packed layouts.

- sample layout (Megatron's --dataloader-inter-document-masking): the whole packed sample
  zigzagged over CP, ``cu_seqlens`` only.
- document layout (--sft): every document's span, padded to a multiple of 2 * CP,
  zigzagged on its own, ``cu_seqlens_padded`` too; padding tokens carry no loss.

The CP = 1 twin is Megatron's own MLA (its THD RoPE and V padding) with
``LocalMLACoreAttention``'s dense per-document mask, on the same documents. Without
document masking the losses differ, so a run that ignored the documents would fail.
"""

import pytest
import torch
import torch.distributed as dist

from tests.megatron.utils import Utils, parallel_state, sgd_step_on_summed_grads, worst_grad_error

from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.packed_seq_params import PackedSeqParams  # noqa: E402
from megatron.core.transformer.transformer_config import MLATransformerConfig  # noqa: E402

from megatron_startrail.megatron.core_attention import LocalMLACoreAttention  # noqa: E402
from megatron_startrail.megatron.layer_specs import to_startrail_spec, with_core_attention  # noqa: E402
from megatron_startrail.megatron.parallel_state import initialize_startrail  # noqa: E402
from tests.multiproc import run_ranks  # noqa: E402
from tests.packed_cases import PAD, document_of_positions, held_positions, make_documents  # noqa: E402

TP, CP, TEAM, CHUNK, ITERS, LR, VOCAB = 2, 4, 2, 8, 4, 1e-2, 128
MLA = dict(num_layers=2, hidden_size=64, num_attention_heads=4, q_lora_rank=None, kv_lora_rank=32, qk_head_dim=16,
           qk_pos_emb_head_dim=8, v_head_dim=16, rope_type="rope")


def tiny_mla_gpt(tp, cp):
    torch.manual_seed(1234)
    config = MLATransformerConfig(
        **MLA, use_cpu_initialization=True, tensor_model_parallel_size=tp, context_parallel_size=cp, hidden_dropout=0.0, attention_dropout=0.0, bias_dropout_fusion=False,
        calculate_per_token_loss=True, init_method_std=0.1,
    )
    spec = get_gpt_layer_local_spec(multi_latent_attention=True)
    if cp > 1:
        spec = to_startrail_spec(spec, initialize_startrail(TEAM))
    else:  # Megatron's MLA with a plain (THD-aware) core attention
        spec = with_core_attention(spec, LocalMLACoreAttention)
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=256,
                    position_embedding_type="rope")


def packed_batch(step, layout, cp, cp_rank, masked):
    """This CP rank's rows of packed sample ``step`` (documents made for CP4 whatever ``cp``, so
    the CP = 1 twin reads the same ones), and its PackedSeqParams (None: no document masking)."""
    cu, padded = make_documents(CP, CHUNK, layout, seed=step)
    spans = cu if padded is None else padded
    total = int(spans[-1])
    gen = torch.Generator().manual_seed(100 + step)
    tokens = torch.randint(0, VOCAB, (total + 1,), generator=gen)
    loss_mask = ((torch.rand(total, generator=gen) > 0.1) & (document_of_positions(cu, padded) != PAD)).float()
    rows = held_positions(cp_rank, cp, cu, padded) if cp > 1 else torch.arange(total)
    positions = rows - spans[torch.searchsorted(spans[1:], rows, right=True)]  # in its document
    longest = int(spans.diff().max())
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=padded,
                             cu_seqlens_kv_padded=padded, max_seqlen_q=longest, max_seqlen_kv=longest)
    return (tokens[:-1][rows][None], tokens[1:][rows][None], loss_mask[rows][None], positions[None],
            params if masked else None)


def train(layout, cp, masked):
    """ITERS steps of SGD on the gradients summed over CP; the summed loss of every step and
    the first step's summed gradients by name."""
    model = tiny_mla_gpt(TP, cp)
    cp_group = parallel_state.get_context_parallel_group()
    losses, first_grads = [], None
    for step in range(ITERS):
        model.zero_grad(set_to_none=False)
        tokens, labels, loss_mask, positions, params = packed_batch(step, layout, cp, cp_group.rank(), masked)
        loss = (model(tokens, positions, None, labels=labels, packed_seq_params=params) * loss_mask).sum()
        loss.backward()
        total = loss.detach().double().reshape(1)
        dist.all_reduce(total, group=cp_group)
        losses.append(total.item())
        grads = sgd_step_on_summed_grads(model, cp_group, LR)
        first_grads = grads if first_grads is None else first_grads
    return losses, first_grads


def worker(rank, world_size, layout, cp):
    """By masked: (losses, first-step grads); the grads only from CP rank 0 (summed over CP)."""
    Utils.initialize_model_parallel(tensor_model_parallel_size=TP, context_parallel_size=cp)
    runs = {masked: train(layout, cp, masked) for masked in ((True,) if cp > 1 else (True, False))}
    keep = parallel_state.get_context_parallel_rank() == 0
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    Utils.destroy_model_parallel()
    return tp_rank, {masked: (losses, grads if keep else None) for masked, (losses, grads) in runs.items()}


@pytest.mark.parametrize("layout", ["sample", "document"])
def test_mla_packed_documents_startrail_cp4_gives_cp1_losses_and_gradients(layout):
    startrail = run_ranks(worker, TP * CP, args=(layout, CP), timeout=300)
    reference = run_ranks(worker, TP, args=(layout, 1), timeout=300)
    got, want, unmasked = startrail[0][1][True][0], reference[0][1][True][0], reference[0][1][False][0]
    assert all(r[True][0] == got for _, r in startrail)  # every rank logs the same losses
    assert got == pytest.approx(want, rel=1e-5), (got, want)
    # Every parameter's first-step gradient, shard by shard (TP rank), summed over CP (issue 36).
    grads = {tp_rank: r[True][1] for tp_rank, r in startrail if r[True][1] is not None}
    ref = {tp_rank: r[True][1] for tp_rank, r in reference}
    assert set(grads) == set(ref) == set(range(TP))
    for tp_rank in ref:
        err, name = worst_grad_error(grads[tp_rank], ref[tp_rank])
        print(f"packed MLA {layout} TP rank {tp_rank}: worst relative grad error {err:.2e} ({name})")  # with -s
        assert err <= 1e-5, f"{layout} TP rank {tp_rank} {name}: relative grad error {err:.2e}"
    # Document masking changes the losses by far more than the agreement allowed above.
    assert max(abs(a - b) / b for a, b in zip(want, unmasked)) > 1e-3, (want, unmasked)
