"""QK-clip (``--qk-clip``) and ``--log-max-attention-logit`` on StarTrail GPTs, against CP = 1.

A GQA GPT and an MLA GPT, each with ``qk_clip`` and a ``qk_clip_threshold`` far below the
logits of step 1 (so clipping rescales the query and key weights from the first step on),
train three steps at CP4 C2 with StarTrail and at CP = 1 with StarTrail (one rank). At CP4 the GQA
GPT runs twice under ``--recompute-granularity full``: with the attention kept through the
recomputation (it must report its logits, not drop them) and with
``--startrail-recompute-attention`` (computed twice: the same logits again, not counted apart). Each step is what megatron.training runs: the
forward/backward schedule, an optimizer step on the gradients summed over DP x CP, then
megatron-core's own ``clip_qk`` (MAX all-reduce of ``current_max_attn_logits`` over DP x CP,
the clipping, the reset) whose return value is the logged ``max_attention_logit``.

Muon itself: megatron-core 0.19.2's ``--optimizer muon`` takes its optimizer from the
``emerging_optimizers`` package (megatron/core/optimizer/emerging_optimizers.py), whose one
release on PyPI (0.3.0) requires Python >= 3.12: this environment's Python is 3.11, so Muon
cannot be installed here, CPU or not. So the optimizer step here is plain SGD on the summed gradients (tests/megatron/utils.py),
and what is tested is ``clip_qk``'s effect after it, which Megatron applies after any optimizer.
"""

import dataclasses

import torch

from tests.megatron.utils import (VOCAB, SEQ, Utils, forward_backward, parallel_state, sample_batch,
                                  sgd_step_on_summed_grads)  # first: the CPU import shims

from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.optimizer.qk_clip import clip_qk  # noqa: E402
from megatron.core.transformer.transformer_config import MLATransformerConfig, TransformerConfig  # noqa: E402

from megatron_startrail.megatron.core_attention import StarTrailCoreAttention  # noqa: E402
from megatron_startrail.megatron.layer_specs import to_startrail_spec  # noqa: E402
from megatron_startrail.megatron.parallel_state import initialize_startrail  # noqa: E402
from tests.multiproc import run_ranks  # noqa: E402

STEPS, LR, THRESHOLD = 3, 1e-2, 0.5
COMMON = dict(num_layers=2, hidden_size=64, num_attention_heads=4, use_cpu_initialization=True, hidden_dropout=0.0,
              attention_dropout=0.0, bias_dropout_fusion=False, calculate_per_token_loss=True, init_method_std=0.1,
              qk_clip=True, qk_clip_threshold=THRESHOLD, log_max_attention_logit=True)
RECOMPUTE = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)


class _Wrapped(torch.nn.Module):
    """What ``clip_qk`` walks: ``chunk.module.module.decoder`` (DDP around Float16Module around the GPT)."""

    def __init__(self, model):
        super().__init__()
        self.module = torch.nn.Module()
        self.module.module = model


def build(kind: str, cp: int, groups):
    torch.manual_seed(1234)
    if kind == "gqa_recomputed":  # --startrail-recompute-attention: Megatron's replay runs the attention again
        groups = dataclasses.replace(groups, config=dataclasses.replace(groups.config, recompute_attention=True))
    if kind == "mla":
        config = MLATransformerConfig(**COMMON, context_parallel_size=cp, q_lora_rank=None, kv_lora_rank=32,
                                      qk_head_dim=16, qk_pos_emb_head_dim=8, v_head_dim=16, rope_type="rope")
    else:  # GQA: 4 query heads in 2 groups; the CP run recomputes its layers (kept attention)
        config = TransformerConfig(**COMMON, context_parallel_size=cp, num_query_groups=2,
                                   **(RECOMPUTE if cp > 1 else {}))
    spec = to_startrail_spec(get_gpt_layer_local_spec(multi_latent_attention=kind == "mla"), groups)
    return GPTModel(config=config, transformer_layer_spec=spec, vocab_size=VOCAB, max_sequence_length=SEQ,
                    position_embedding_type="rope")


def worker(rank, world_size, cp, team):
    Utils.initialize_model_parallel(context_parallel_size=cp)
    groups = initialize_startrail(team)
    dp_cp = parallel_state.get_data_parallel_group(with_context_parallel=True)
    results, reports = {}, []
    raise_max_logit = StarTrailCoreAttention._raise_max_logit  # counted (in this forked rank only)

    def counted(self, max_logit):
        reports.append(self)
        raise_max_logit(self, max_logit)

    StarTrailCoreAttention._raise_max_logit = counted
    for kind in ("gqa", "mla") + (("gqa_recomputed",) if cp > 1 else ()):
        model = build(kind, cp, groups)
        logged, fired = [], []
        for step in range(STEPS):
            model.zero_grad(set_to_none=False)
            forward_backward(model, sample_batch(step))
            sgd_step_on_summed_grads(model, dp_cp, LR)
            # megatron.training's train_step after optimizer.step(): clip (and log) the max logit
            logged.append(clip_qk([_Wrapped(model)], log_max_only=False))
            layers = model.decoder.layers
            fired.append(min(float(layer.self_attention.qk_clip_balancing_eta.min()) for layer in layers))
            assert all(layer.self_attention.core_attention.current_max_attn_logits is None for layer in layers)
        params = {n: p.detach().double().clone() for n, p in model.named_parameters()}
        results[kind] = (logged, fired, params, len(reports))  # forwards that computed the attention
        reports.clear()
    Utils.destroy_model_parallel()
    return results if rank == 0 else None


def test_qk_clip_at_cp4_c2_is_cp1():
    got = run_ranks(worker, 4, args=(4, 2), timeout=600)[0]
    ref = run_ranks(worker, 1, args=(1, 1), timeout=600)[0]
    for kind in ("gqa", "mla", "gqa_recomputed"):
        (logged, fired, params, reports), (ref_logged, ref_fired, ref_params, _) = got[kind], ref[kind.split("_")[0]]
        # 2 layers x 3 steps; the kept attention's replay computes nothing, the recomputed one again
        assert reports == 2 * STEPS * (2 if kind == "gqa_recomputed" else 1), (kind, reports)
        assert ref_logged[0] > THRESHOLD and ref_fired[0] < 1, (kind, ref_logged, ref_fired)  # clipped in step 1
        for step, (a, b) in enumerate(zip(logged, ref_logged)):  # --log-max-attention-logit's value
            assert abs(a - b) <= 1e-5 * abs(b), f"{kind} step {step + 1}: max logit {a} != CP=1's {b}"
        worst = max(((params[n] - ref_params[n]).abs().max() / ref_params[n].abs().max().clamp_min(1e-30)).item()
                    for n in ref_params)
        print(f"{kind}: logged {logged}, worst relative parameter error after {STEPS} steps {worst:.2e}")
        assert set(params) == set(ref_params) and worst <= 1e-5, (kind, worst)
