"""A model-level differential fuzzer: Megatron configurations drawn from a seed, each trained
through examples/pretrain_gpt.py with StarTrail context parallelism and at CP = 1 (same TP,
PP, EP), compared on every parameter's first-step gradient (per TP / PP / EP rank, relative
1e-5, ``_compare``) and four iterations of losses (relative 1e-5), in fp32 on gloo.

Each draw ends as one of:

    exact     every gradient and loss within tolerance
    DIFFERS   a silent wrong result: the one outcome that must never appear
    refused   StarTrail's (or the example's) start-up check refused the configuration with an
              error naming a flag (a ``--`` in the message) before step 1; also when the same
              check refuses it at CP = 1 (a setting Megatron itself cannot run:
              ``--recompute-modules mlp`` with biases)
    skipped   the CP = 1 reference cannot run it (Megatron refuses it there, or it has no
              CP = 1 twin: sharded runs that differ from DDP without StarTrail,
              ``_fsdp_without_twin``); the StarTrail run still runs: refused if a check stops
              it by name, else skipped with how it ended
    error     anything else (a crash after step 1, an unnamed refusal): a failure too

Packed documents (sample layout) without MLA are compared with Megatron's dense per-document
mask at CP = 1 (``--reset-attention-mask``), except where that twin cannot hold: with MTP
(Megatron's dense roll crosses documents), virtual pipeline stages (the middle stages get no
mask) and sliding windows (the local softmax replaces the mask by the window's). There the
reference is the same packed sample at CP = 1 through StarTrail's attention
(``--dataloader-inter-document-masking``, tests/megatron/example_hooks.startrail_attention_at_cp1;
Megatron's own MTP roll at CP = 1), marked "reference: StarTrail at CP = 1" in the table.

The draw space (``draw``): TP 1/2, PP 1/2 with virtual stages, sequence parallel; MHA / GQA;
RoPE, learned absolute, no position embedding, NoPE layers; recomputation full (uniform /
block, 1..L layers) and selective (Megatron's module lists: core_attn, layernorm, mlp,
mla_up_proj, moe, moe_act), with sequence parallelism and MoE too; per-token loss
(--calculate-per-token-loss), with --eod-mask-loss over short documents (uneven loss masks);
MTP 1/2 layers, repeated or not; sliding windows (halo and schedule paths), sinks (off-by-one,
learnable), packed documents (sample layout; the document layout, --sft, which the example
refuses), MLA, MoE with EP2 at TP 1 and at TP 2 with sequence parallelism; QK-layernorm,
SwiGLU, RMSNorm, untied embeddings, linear biases off, gradient accumulation; team sizes
1/2/4/auto, Ulysses, both backward rotations, regathering, hybrid (dynamic) CP; Megatron-FSDP
(optim_grads_params, optim_grads) and torch FSDP2 at TP1 x PP1 (``_draw_fsdp``; never with the
resume protocol); from a stream of their own (``_draw_wrappers``): ``--qk-clip`` (TP 1, a
threshold that fires in step 1) or ``--log-max-attention-logit``, each step's logged max logit
compared with a CP = 1 run with StarTrail's attention; every layer in torch's checkpoint
(non-reentrant, reentrant); every training step inside saved-tensor hooks (``save_on_cpu``, a
pack/unpack pair of its own): tests/megatron/example_hooks.py. Call
protocols (``PROTOCOLS``): plain, evaluation passes, a forward-only pass of Megatron's schedule
in train mode before every step, an abandoned forward before every step, save at iteration 2
and resume, and a second model in the same processes running a forward before every step.

Usage::

    python -m benchmarks.accuracy.model_fuzz --seed 7 --draws 25            # appends to benchmarks/results/model_fuzz.*
    python -m benchmarks.accuracy.model_fuzz --seed 7 --draws 1 --first 12   # reproduce draw 12 of seed 7

A draw is named ``seed:index``; ``--first`` skips to an index. tests/megatron/test_model_fuzz.py
runs a fixed slice and draws from a seed derived from the commit.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import random
import re
import shutil
import tempfile
import time

from benchmarks import RESULTS
from tests.megatron.example import pretrain_gpt, run_example_rank  # the CPU shims, megatron.training
from tests.multiproc import run_ranks

TOLERANCE = 1e-5
ITERS = 4
SEQ = 256
LOSS = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.* lm loss: ([0-9.E+-]+) \|")
MLA = ["--multi-latent-attention", "--qk-head-dim", "32", "--qk-pos-emb-head-dim", "16", "--v-head-dim", "16",
       "--kv-lora-rank", "32", "--rope-type", "rope"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--expert-model-parallel-size", "2",
       "--moe-aux-loss-coeff", "1e-2", "--moe-token-dispatcher-type", "alltoall",
       "--disable-bias-linear"]  # (Megatron: bias in MoE only with expert TP 1)
PROTOCOLS = ["plain", "evaluation", "forward_only", "abandoned", "resume", "two_models"]


@dataclasses.dataclass
class Draw:
    """One configuration: the flags both runs share, the StarTrail run's own, the reference's own."""

    name: str
    features: list[str]
    shared: list[str]
    startrail: list[str]
    reference: list[str]
    startrail_ranks: int
    reference_ranks: int
    protocol: str
    skip_reason: str | None = None  # set when the CP = 1 reference has no twin of this run
    wrap: str = "none"  # every layer in torch's checkpoint (tests/megatron/example_hooks.WRAPS)
    saved_tensor_hooks: str = "none"  # every step inside saved-tensor hooks (example_hooks.SAVED_TENSOR_HOOKS)
    max_logit: bool = False  # --qk-clip / --log-max-attention-logit: the reference has StarTrail attention
    startrail_reference: bool = False  # packed documents with no dense-mask twin: StarTrail at CP = 1 (draw)


def _pick(rng: random.Random, *options):
    return options[rng.randrange(len(options))]


def draw(seed: int, index: int, data_prefix: str) -> Draw:
    """Draw configuration ``index`` of ``seed`` (the same draw on every machine)."""
    rng = random.Random(f"{seed}:{index}")
    features: list[str] = []
    shared = ["--hidden-size", "64", "--num-attention-heads", "8", "--seq-length", str(SEQ),
              "--micro-batch-size", "1", "--train-iters", str(ITERS), "--lr", "3e-3", "--lr-warmup-iters", "1",
              "--seed", str(1000 + index), "--log-interval", "1", "--distributed-timeout-minutes", "2"]
    hybrid = rng.random() < 0.08
    mla = not hybrid and rng.random() < 0.2
    moe = not hybrid and rng.random() < 0.15
    tp = _pick(rng, 1, 2)
    dp = 2 if moe else 1  # (EP2 takes two data-parallel ranks in both runs)
    pp = 1 if hybrid or tp * dp * 2 * 2 > 8 else _pick(rng, 1, 1, 2)  # (room for CP >= 2 in 8 ranks)
    layers = 2
    # (MoE at TP 2 needs sequence parallelism, Megatron says; its uneven token all-gather runs
    # on gloo padded, cpu_patches)
    sequence_parallel = tp == 2 and (moe or rng.random() < 0.5)
    if sequence_parallel:
        shared += ["--sequence-parallel"]
        features.append("SP")
    if pp == 2:
        if rng.random() < 0.5:
            layers = 4
            shared += ["--num-layers-per-virtual-pipeline-stage", "1"]
            features.append("VPP")
    shared += ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)]
    if mla:
        shared += MLA
        features.append("MLA")
    if moe:
        shared += MOE
        features.append("MoE EP2")
    heads_kv = 8
    if not mla and rng.random() < 0.5:
        heads_kv = _pick(rng, 2, 4)
        shared += ["--group-query-attention", "--num-query-groups", str(heads_kv)]
        features.append(f"GQA 8/{heads_kv}")
    if not mla:
        position = _pick(rng, "rope", "learned_absolute", "none", "nope_layers")
        if position == "nope_layers":
            shared += ["--position-embedding-type", "rope", "--no-rope-freq", "2"]
        else:
            shared += ["--position-embedding-type", position]
        features.append(position)
    for flag, p in (("--qk-layernorm", 0.2), ("--swiglu", 0.3), ("--untie-embeddings-and-output-weights", 0.3)):
        if rng.random() < p and not (mla and flag == "--qk-layernorm"):  # (MLA: Megatron's needs q_lora_rank)
            shared.append(flag)
            features.append(flag[2:])
    if rng.random() < 0.3:
        shared += ["--normalization", "RMSNorm"]
        features.append("RMSNorm")
    accumulation = 2 if "VPP" in features else _pick(rng, 1, 1, 2)  # (interleaving needs micro-batches >= PP)
    if accumulation > 1:
        features.append("grad accumulation 2")

    # Recomputation, with sequence parallelism and MoE too (the recomputed SP gather and MoE
    # all-to-all run under the CPU patches' device mode, cpu_patches).
    recompute = _pick(rng, "none", "none", "full_uniform", "full_block", "selective")
    chosen: list[str] = []
    if recompute.startswith("full"):
        n = rng.randint(1, layers // pp)
        shared += ["--recompute-granularity", "full", "--recompute-method", recompute[5:], "--recompute-num-layers",
                   str(n)]
        features.append(f"recompute {recompute} {n}")
    elif recompute == "selective":
        # Megatron's lists. "mlp" with the linear biases on is refused by name (Megatron's
        # checkpoint returns the bias parameter and recurses: megatron/recompute_checks.py);
        # "moe_act" needs --moe-grouped-gemm, whose check asks the GPU's compute capability
        # (and the CPU's local spec has no grouped MLP): the CP = 1 reference cannot run it.
        modules = ["core_attn", "layernorm", "mlp"] + (["mla_up_proj"] if mla else []) + (
            ["moe", "moe_act"] if moe else [])
        chosen = sorted(rng.sample(modules, rng.randint(1, min(3, len(modules)))))
        shared += ["--recompute-granularity", "selective", "--recompute-modules", *chosen]
        features.append(f"selective {'+'.join(chosen)}")
        if "moe_act" in chosen:
            shared.append("--moe-grouped-gemm")
    if not moe and rng.random() < (0.5 if "mlp" in chosen else 0.15):
        shared.append("--disable-bias-linear")
        features.append("disable-bias-linear")

    # Per-token loss (--calculate-per-token-loss): each CP rank's loss sums its tokens, Megatron
    # divides by the global count. With --eod-mask-loss over short documents the ranks hold
    # uneven numbers of loss tokens. (Not --eod-mask-loss alone: without per-token loss
    # Megatron divides each CP rank's loss by its own count, which no CP size > 1 matches.)
    per_token = not hybrid and rng.random() < 0.3
    eod_mask = per_token and rng.random() < 0.7
    if per_token:
        shared.append("--calculate-per-token-loss")
        features.append("per-token loss")
    if eod_mask:
        shared.append("--eod-mask-loss")
        features.append("eod-mask-loss")

    # Attention variants.
    packed = hybrid or rng.random() < 0.25
    document_layout = packed and not hybrid and rng.random() < 0.1
    cp = 1 if hybrid else _pick(rng, 2, 4, 4, 8)
    while tp * pp * cp * dp > 8:
        cp //= 2
    if not hybrid and tp * pp * dp == 1 and rng.random() < 0.2:
        cp = 16  # 16 ranks: the one size here where team size 4 fits (C*C divides the group)
    window = None
    if not hybrid and rng.random() < 0.2:
        chunk = SEQ // (2 * cp)
        window = _pick(rng, max(1, chunk // 2), chunk * 3)  # halo, schedule
        shared += ["--window-size", f"{window},0", "--window-attn-skip-freq", "2"]
        features.append(f"window {window} ({'halo' if window < chunk else 'schedule'})")
    if not mla and rng.random() < 0.15:
        softmax = _pick(rng, "off-by-one", "learnable")
        shared += ["--softmax-type", softmax]
        features.append(f"sinks {softmax}")
    # (Megatron refuses MTP with learned absolute position embeddings)
    mtp = 0 if hybrid or "learned_absolute" in features else _pick(rng, 0, 0, 1, 2)
    if mtp:
        shared += ["--mtp-num-layers", str(mtp)]
        if mtp == 2 and rng.random() < 0.5:
            shared.append("--mtp-use-repeated-layer")
            features.append("MTP 2 repeated")
        else:
            features.append(f"MTP {mtp}")
    skip = None
    startrail_reference = False  # the CP = 1 run with StarTrail's attention (no Megatron twin)
    reference: list[str] = []
    startrail: list[str] = []
    if packed or eod_mask:  # (the short documents: EOD tokens all through every sample)
        shared += ["--data-path", data_prefix, "--split", "90,10,0"]  # (a validation split for evaluation)
    if packed:
        if document_layout:
            startrail += ["--sft"]
            features.append("packed document layout")
        else:
            startrail += ["--dataloader-inter-document-masking"]
            features.append("packed sample layout")
        if mla:
            reference += ["--dataloader-inter-document-masking"]
            shared += ["--no-rope-fusion"]
        elif mtp or "VPP" in features or any(f.startswith("window") for f in features):
            # Megatron's dense per-document mask cannot be the twin here: MTP would roll across
            # documents, middle virtual stages get no mask, the local softmax replaces the mask by
            # the window's (examples/pretrain_gpt.validate_example_args). The reference is then
            # StarTrail's attention at CP = 1 on the same packed sample (THD, Megatron's own MTP
            # roll at CP = 1); that attention equals the dense twin in every packed draw without
            # these features.
            reference += ["--dataloader-inter-document-masking"]
            startrail_reference = True
            features.append("reference: StarTrail at CP = 1")
        else:  # Megatron's local attention has no THD: its dense per-document mask is the twin
            reference += ["--reset-attention-mask", "--reset-position-ids"]

    # StarTrail's own settings.
    if hybrid:
        ranks = _pick(rng, 4, 8) // tp
        shared += ["--calculate-per-token-loss", "--eval-iters", "0", "--rerun-mode", "disabled",
                   "--global-batch-size", str(ranks * 2)]
        startrail += ["--context-parallel-size", "1", "--context-parallel-algo", "startrail",
                      "--hybrid-context-parallel", "--max-seqlen-per-dp-cp-rank", str(SEQ // ranks),
                      "--startrail-team-size", str(_pick(rng, 1, 2, 4))]
        features.append(f"hybrid CP over {ranks}")
        return _finish(seed, index, rng, features, shared, startrail, reference, tp * ranks, tp, layers, skip,
                       hybrid=True)
    u = 1
    kv_per_tp = heads_kv // tp if not mla else 8 // tp
    if rng.random() < 0.25 and cp >= 4 and (8 // tp) % 2 == 0 and kv_per_tp % 2 == 0:
        u = 2
        startrail += ["--ulysses-degree-in-cp", "2"]
        features.append("Ulysses 2")
    size = cp // u
    teams = [c for c in (1, 2, 4) if size % (c * c) == 0]
    team = _pick(rng, *teams, "auto") if 4 not in teams else _pick(rng, 4, *teams, "auto")
    startrail += ["--context-parallel-size", str(cp), "--context-parallel-algo", "startrail",
                  "--startrail-team-size", str(team)]
    features.append(f"CP{cp} C{team}")
    if rng.random() < 0.4:
        rotation = _pick(rng, "q", "kv")
        startrail += ["--startrail-backward-rotation", rotation]
        features.append(f"rotation {rotation}")
    if rng.random() < 0.2:
        startrail.append("--startrail-regather-in-backward")
        features.append("regather")
    shared += ["--global-batch-size", str(dp * accumulation)]
    _draw_fsdp(seed, index, features, shared, tp, pp, moe)
    d = _finish(seed, index, rng, features, shared, startrail, reference, tp * pp * cp * dp, tp * pp * dp,
                layers, skip)
    d.startrail_reference = startrail_reference
    return d


# Megatron's two sharded data-parallel paths, drawn from their own stream so that adding them
# left every other draw of a seed as it was.
FSDP = {
    "megatron-fsdp optim_grads_params": ["--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor",
                                         "--data-parallel-sharding-strategy", "optim_grads_params"],
    "megatron-fsdp optim_grads": ["--use-megatron-fsdp", "--ckpt-format", "fsdp_dtensor",
                                  "--data-parallel-sharding-strategy", "optim_grads"],
    "torch-fsdp2": ["--use-torch-fsdp2"],
}


def _draw_fsdp(seed, index, features, shared, tp, pp, moe) -> None:
    """Megatron-FSDP (both sharding strategies) or torch FSDP2 in both runs, on draws at TP1 and
    PP1 without MoE (FSDP2: Megatron refuses PP and EP; TP with either FSDP has not run on gloo
    here). The first-step gradients are gathered whole from their shards on every rank
    (tests/megatron/utils.unsharded_grads), so ``_compare`` sees whole gradients as with DDP."""
    rng = random.Random(f"{seed}:{index}:fsdp")
    if tp != 1 or pp != 1 or moe or rng.random() >= 0.4:
        return
    kind = _pick(rng, *FSDP)
    shared += FSDP[kind]
    if kind == "torch-fsdp2" and "--untie-embeddings-and-output-weights" not in shared:
        shared.append("--untie-embeddings-and-output-weights")  # (Megatron's rule for FSDP2)
    features.append(kind)


def _finish(seed, index, rng, features, shared, startrail, reference, startrail_ranks, reference_ranks, layers, skip,
            hybrid=False):
    protocol = _pick(rng, *(["plain"] * 4), *PROTOCOLS[1:])
    if hybrid and protocol not in ("plain", "forward_only"):
        # hybrid CP: evaluation is refused (it wraps only the training data), and its data
        # iterator yields whole scheduled global batches, which a lone forward cannot take
        protocol = "plain"
    if protocol == "resume" and ("--use-torch-fsdp2" in shared or "--use-megatron-fsdp" in shared):
        # megatron-core 0.19.2 cannot resume FSDP2 (its torch_dist save and its torch_dcp load
        # both stop), nor save Megatron-FSDP's fsdp_dtensor on gloo, at CP = 1 as well
        # (docs/composition.md)
        protocol = "plain"
    if protocol == "evaluation":
        shared += ["--eval-interval", "2", "--eval-iters", "1"]
    if protocol != "plain":
        features.append(protocol)
    shared = ["--num-layers", str(layers), *shared]
    d = Draw(f"{seed}:{index}", features, shared, startrail, reference, startrail_ranks, reference_ranks,
             protocol, skip)
    return _draw_wrappers(d, seed, index, hybrid)


def _draw_wrappers(d: Draw, seed: int, index: int, hybrid: bool) -> Draw:
    """The dimensions added after the rest, from their own stream (so every earlier draw keeps
    its configuration and gains these): QK-clip / the max-logit log, torch's checkpoint around
    every layer, saved-tensor hooks around every step."""
    rng = random.Random(f"{seed}:{index}:wrappers")
    packed = "--reset-attention-mask" in d.reference or "--dataloader-inter-document-masking" in d.reference
    # (the CP = 1 twin of packed documents is Megatron's dense mask, which StarTrail's attention
    # at CP = 1 does not read; hybrid CP has no CP = 1 StarTrail twin)
    tp = int(d.shared[d.shared.index("--tensor-model-parallel-size") + 1]) if not hybrid else 0
    if not hybrid and not packed and rng.random() < 0.25:
        d.max_logit = True
        # (megatron-core 0.19.2's SelfAttention._clip_linear_qkv reshapes the TP-partitioned
        # weight by the unpartitioned projection sizes: it fails at TP > 1, StarTrail or not)
        if rng.random() < 0.5 and tp == 1:  # a threshold under the logits of step 1: the clipping fires
            d.shared += ["--qk-clip", "--qk-clip-threshold", "0.05", "--qk-clip-alpha", "0.5"]
            d.features.append("qk-clip")
        else:
            d.shared.append("--log-max-attention-logit")
            d.features.append("log-max-attention-logit")
    d.wrap = _pick(rng, *(["none"] * 6), "nonreentrant", "reentrant")
    if d.wrap != "none":
        d.features.append(f"torch checkpoint {d.wrap}")
    d.saved_tensor_hooks = _pick(rng, *(["none"] * 6), "save_on_cpu", "pack_clone")
    if d.saved_tensor_hooks != "none":
        d.features.append(f"saved-tensor hooks {d.saved_tensor_hooks}")
    d.skip_reason = d.skip_reason or _fsdp_without_twin(d.shared)
    return d


def _fsdp_without_twin(shared: list[str]) -> str | None:
    """Sharded runs that differ from DDP without StarTrail (DP2 at CP = 1, Megatron's own
    attention, gloo): the CP = 1 reference (one rank, nothing sharded) is no twin of them."""
    # (FSDP2 with --calculate-per-token-loss, which 20261128:17 showed as DIFFERS and was put down
    # to MTP, is refused by name in both runs: arguments.check_torch_fsdp2_per_token_loss; FSDP2
    # with MTP, repeated or not, equals DDP at DP2 without it)
    if "--use-megatron-fsdp" in shared and "--mtp-use-repeated-layer" in shared:
        return ("Megatron-FSDP with --mtp-use-repeated-layer: sharded, the repeated layer's gradients differ from "
                "DDP at DP2, CP = 1 (no StarTrail)")
    if "--use-megatron-fsdp" in shared and "--qk-clip" in shared:
        return ("Megatron-FSDP with --qk-clip: clip_qk on sharded weights, the max logit after step 1 differs from "
                "DDP at DP2, CP = 1 (no StarTrail); optim_grads fails at CP = 1 (torch.Tensor mixed with DTensor)")
    return None


# --- one rank of one run --------------------------------------------------------------------

def _train_step_with(extra_before_step):
    """Patch this forked rank's megatron.training.train_step: ``extra_before_step(forward_step_func,
    data_iterator, model)`` runs first, the model in train mode."""
    from megatron.training import training  # noqa: PLC0415

    train_step = training.train_step

    def patched(forward_step_func, data_iterator, model, *args, **kwargs):
        extra_before_step(forward_step_func, data_iterator, model)
        return train_step(forward_step_func, data_iterator, model, *args, **kwargs)

    training.train_step = patched


def _forward_only(forward_step_func, data_iterator, model):
    from megatron.core.num_microbatches_calculator import get_num_microbatches  # noqa: PLC0415
    from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: PLC0415
    from megatron.training import get_args  # noqa: PLC0415

    args = get_args()
    get_forward_backward_func()(forward_step_func=forward_step_func, data_iterator=data_iterator, model=model,
                                num_microbatches=get_num_microbatches(), seq_length=args.seq_length,
                                micro_batch_size=args.micro_batch_size, forward_only=True)


def _install_protocol(protocol: str) -> None:
    if protocol == "forward_only":  # RL frameworks scoring log-probs between steps, model left in train mode
        _train_step_with(_forward_only)
    elif protocol == "abandoned":  # a step's forward whose backward never runs (dropped, e.g. a skipped batch)
        def abandoned(forward_step_func, data_iterator, model):
            from megatron.core import parallel_state  # noqa: PLC0415

            if parallel_state.get_pipeline_model_parallel_world_size() > 1:
                return _forward_only(forward_step_func, data_iterator, model)  # a lone stage cannot run alone
            output, _ = forward_step_func(data_iterator, model[0])
            del output  # the graph, with whatever it kept, is dropped

        _train_step_with(abandoned)
    elif protocol == "two_models":  # a second model (its own StarTrail layers) in the same processes
        from megatron.training import training  # noqa: PLC0415

        get_model, second = training.get_model, []

        def two_models(*args, **kwargs):
            model = get_model(*args, **kwargs)
            second.append(get_model(*args, **kwargs))
            return model

        training.get_model = two_models
        _train_step_with(lambda step, data, model: _forward_only(step, data, second[0]))


def fuzz_worker(rank, world_size, argv, protocol, hooks=None):
    """One rank of one run: its logged losses, and (on DP x CP rank 0 of each TP / PP / EP
    rank) the first step's gradients by (tp, pp, ep, name) and the max attention logit of each
    step by (tp, pp, ep, "max logit", iteration). ``hooks``: {"wrap", "saved_tensor_hooks",
    "startrail_at_cp1", "max_logit"} (tests/megatron/example_hooks.py)."""
    import queue  # noqa: PLC0415

    import torch  # noqa: PLC0415
    from megatron.core import parallel_state  # noqa: PLC0415
    from megatron.core.dist_checkpointing.strategies import filesystem_async  # noqa: PLC0415

    from tests.megatron import example_hooks  # noqa: PLC0415
    from tests.megatron.utils import record_first_step_grads  # noqa: PLC0415

    hooks = hooks or {}
    filesystem_async._results_queue = queue.Queue()  # (tests/megatron/test_resume.py: no Manager in a daemon)
    _install_protocol(protocol)
    example_hooks.wrap_layers_in_torch_checkpoint(hooks.get("wrap", "none"))
    example_hooks.saved_tensor_hooks_around_step(hooks.get("saved_tensor_hooks", "none"))
    if hooks.get("startrail_at_cp1"):
        example_hooks.startrail_attention_at_cp1()
    logits = example_hooks.record_max_logits() if hooks.get("max_logit") else {}
    recorded = record_first_step_grads(every_chunk=True)  # the first step's reduced gradients, every chunk
    log = run_example_rank(rank, world_size, argv)
    losses = {int(i): float(x) for i, x in LOSS.findall(log)}
    grads = None
    if "grads" in recorded:
        if parallel_state.get_data_parallel_rank(with_context_parallel=True) == 0:
            where = (parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pipeline_model_parallel_rank(),
                     parallel_state.get_expert_model_parallel_rank())
            grads = {(*where, name): g for name, g in recorded["grads"].items()}
            # (the logged max logit: MAX over DP x CP of this TP rank's heads in this stage's layers)
            grads.update({(*where, "max logit", i): torch.tensor(x, dtype=torch.float64) for i, x in logits.items()})
    return losses, grads


def _train(ranks: int, argv: list[str], protocol: str, hooks: dict | None = None):
    """(losses by iteration, grads by (tp, pp, ep, name)) of one run, or raise what a rank raised.
    ``resume``: to iteration 2, saved (torch_dist); then new processes load it and go on to the end."""
    parts = [argv]
    save_dir = tempfile.mkdtemp(prefix="fuzz_ckpt_")
    if protocol == "resume":
        parts = [[*argv, "--save", save_dir, "--save-interval", "2", "--exit-interval", "2"],
                 [*argv, "--load", save_dir]]
    losses: dict[int, float] = {}
    grads: dict = {}
    try:
        for part in parts:
            for rank_losses, rank_grads in run_ranks(fuzz_worker, ranks, args=(part, protocol, hooks), timeout=240):
                losses.update(rank_losses)
                # the first step's gradients: the first part's; the max logits: every part's
                grads.update({k: g for k, g in (rank_grads or {}).items() if part is parts[0] or "max logit" in k})
    finally:
        shutil.rmtree(save_dir, ignore_errors=True)
    return losses, grads


def _compare(got, want) -> tuple[float, float, str]:
    """(worst relative loss error, worst relative gradient error, the parameter)."""
    (losses, grads), (ref_losses, ref_grads) = got, want
    if sorted(losses) != list(range(1, ITERS + 1)) or sorted(ref_losses) != list(range(1, ITERS + 1)):
        return math.inf, math.inf, f"iterations logged {sorted(losses)} / {sorted(ref_losses)}"
    loss_err = max(abs(losses[i] - ref_losses[i]) / abs(ref_losses[i]) for i in losses)
    if set(grads) != set(ref_grads) or not grads:
        return loss_err, math.inf, f"parameters differ: {len(grads)} vs {len(ref_grads)}"
    # Per parameter: max|g - g_ref| / max|g_ref|, the denominator floored at 1e-3 of the model's
    # largest gradient entry: a gradient that is zero in exact arithmetic (the K layer norm's
    # bias: a shift of every key leaves each softmax row unchanged) is fp32 noise, 1e-9 of the
    # largest, in both runs. A wrong gradient 1e-8 of the largest or more still shows.
    # The logged max attention logits (--qk-clip, --log-max-attention-logit), relative, apart
    # from the gradients' floor.
    floor = 1e-3 * max(float(r.abs().max()) for k, r in ref_grads.items() if "max logit" not in k)
    worst, where = 0.0, ""
    for key, ref in ref_grads.items():
        scale = float(ref.abs().max()) if "max logit" in key else max(float(ref.abs().max()), floor)
        err = float((grads[key] - ref).abs().max() / scale)
        if not math.isfinite(err) or err > worst:
            worst, where = (err if math.isfinite(err) else math.inf), "/".join(map(str, key))
    return loss_err, worst, where


def _startup_refusal(error: Exception) -> str | None:
    """The error that stopped a run before its first training step (argument checks, model
    building), if that is what stopped it: its last ``XError: message`` line."""
    text = str(error)
    if "in train_step" in text or "in forward_backward" in text:
        return None
    return _last_error(error)


def _last_error(error: Exception) -> str | None:
    messages = re.findall(r"^\s*(\w+(?:Error|Exception)): (.+)$", str(error), re.M)
    return f"{messages[-1][0]}: {messages[-1][1]}"[:300] if messages else None


def run_draw(d: Draw) -> dict:
    started = time.time()
    result = {"name": d.name, "features": d.features, "protocol": d.protocol,
              "startrail": d.startrail, "startrail_ranks": d.startrail_ranks, "reference_ranks": d.reference_ranks}

    def done(**fields):
        result.update(fields, seconds=round(time.time() - started, 1))
        return result

    hooks = dict(wrap=d.wrap, saved_tensor_hooks=d.saved_tensor_hooks, max_logit=d.max_logit)
    if d.skip_reason:  # no CP = 1 twin: the StarTrail run alone, which may still be refused by name
        try:
            _train(d.startrail_ranks, [*d.shared, *d.startrail], d.protocol, hooks)
        except AssertionError as error:
            refusal = _startup_refusal(error)
            if refusal and "--" in refusal:
                return done(status="refused", reason=refusal)
            # (Megatron's own failure of the combination, at CP = 1 too: Megatron-FSDP optim_grads
            # with --qk-clip mixes torch.Tensor and DTensor, _fsdp_without_twin)
            return done(status="skipped", reason=f"{d.skip_reason}; the StarTrail run failed as well: "
                                                 f"{_last_error(error) or str(error)[-300:]}")
        return done(status="skipped", reason=d.skip_reason + "; the StarTrail run itself ran")
    reference = lambda: _train(d.reference_ranks, [*d.shared, "--context-parallel-size", "1", *d.reference],  # noqa: E731
                               d.protocol, dict(hooks, startrail_at_cp1=d.max_logit or d.startrail_reference))
    try:
        got = _train(d.startrail_ranks, [*d.shared, *d.startrail], d.protocol, hooks)
    except AssertionError as error:
        refusal = _startup_refusal(error)
        try:
            reference()
        except AssertionError as ref_error:  # Megatron refuses the configuration itself
            ref_refusal = _startup_refusal(ref_error)
            if ref_refusal and ref_refusal == refusal and "--" in refusal:
                # the package's own check, which refuses it at CP = 1 as well (a setting that
                # cannot run in Megatron itself, refused before it hangs or fails)
                return done(status="refused", reason=refusal)
            if ref_refusal:
                return done(status="skipped", reason="Megatron refuses it at CP = 1 too: " + ref_refusal)
            return done(status="skipped", reason="the CP = 1 reference fails on this machine too: " +
                        (_last_error(ref_error) or str(ref_error)[-300:]))
        if refusal and "--" in refusal:
            return done(status="refused", reason=refusal)
        return done(status="error", reason=str(error)[-1500:])
    try:
        want = reference()
    except AssertionError as error:
        refusal = _startup_refusal(error)
        if refusal:
            return done(status="skipped", reason="the CP = 1 reference refuses it: " + refusal)
        return done(status="error", reason="the CP = 1 reference failed: " + str(error)[-1500:])
    if "--qk-layernorm" in d.shared:
        # The K layer norm's bias has no gradient in exact arithmetic (_compare), so Adam turns
        # its fp32 noise into updates that shift each query's raw logits by q . db: the loss
        # stays, the logged raw max moves. Only step 1's max logit (before any update) is fixed.
        got, want = ((run[0], {k: v for k, v in run[1].items() if "max logit" not in k or k[-1] == 1})
                     for run in (got, want))
    loss_err, grad_err, where = _compare(got, want)
    exact = loss_err <= TOLERANCE and grad_err <= TOLERANCE
    if d.max_logit:  # (compared with the gradients, _compare); logged every step, never zero
        logits = [float(v) for k, v in want[1].items() if "max logit" in k]
        result["max_logits"] = f"{len(logits)} logged, {min(logits, default=0):.3g}..{max(logits, default=0):.3g}"
        if not logits or min(logits) <= 0:
            return done(status="error", reason=f"max attention logits missing: {result['max_logits']}")
    return done(status="exact" if exact else "DIFFERS", loss_error=loss_err, grad_error=grad_err, worst=where)


def documents(directory: str) -> str:
    """The short packed documents (examples/data/make_indexed_dataset.short_documents) as an indexed dataset."""
    prefix = os.path.join(directory, "docs")
    if not os.path.exists(prefix + ".bin"):
        make = pretrain_gpt.make_indexed_dataset
        make.write_indexed_dataset(make.short_documents(), prefix)
    return prefix


def table(rows: list[dict]) -> str:
    counts = {s: sum(r["status"] == s for r in rows) for s in ("exact", "DIFFERS", "refused", "skipped", "error")}
    timed = [r["seconds"] for r in rows if r["status"] == "exact"]
    seeds = sorted({r["name"].split(":")[0] for r in rows}, key=int)
    indices = sorted(int(r["name"].split(":")[1]) for r in rows)
    lines = [
        "# Model-level differential fuzz: StarTrail CP against CP = 1 (benchmarks/accuracy/model_fuzz.py)",
        "",
        f"Seed {', '.join(seeds)}, draws {indices[0]}..{indices[-1]} ({len(rows)} run).",
        "",
        f"{len(rows)} draws: " + ", ".join(f"{n} {s}" for s, n in counts.items()) +
        (f"; {sum(timed) / len(timed):.0f} s per compared draw on average (two runs), 2-core CPU, gloo" if timed else ""),
        "",
        f"Tolerance {TOLERANCE:g} relative, every parameter's first-step gradient (per TP / PP / EP rank) and "
        f"{ITERS} iterations of lm loss, fp32. Reproduce a draw `seed:i` with "
        "`python -m benchmarks.accuracy.model_fuzz --seed SEED --first I --draws 1`.",
        "",
        "| draw | configuration | ranks | status | loss err | grad err | s | note |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        note = r.get("reason") or (r.get("worst") if r["status"] != "exact" else "")
        if r.get("max_logits"):  # (--qk-clip, --log-max-attention-logit: compared with the gradients)
            note = f"max logits {r['max_logits']}" + (f"; {note}" if note else "")
        note = (note or "").replace("|", "/").replace("\n", " ")[:160]
        fmt = lambda x: "" if x is None else f"{x:.1e}"  # noqa: E731
        lines.append(f"| {r['name']} | {', '.join(r['features'])} | {r['startrail_ranks']} vs "
                     f"{r['reference_ranks']} | {r['status']} | {fmt(r.get('loss_error'))} | "
                     f"{fmt(r.get('grad_error'))} | {r.get('seconds', '')} | {note} |")
    return "\n".join(lines + closing_note(rows)) + "\n"


def closing_note(rows: list[dict]) -> list[str]:
    """The time per draw, and every refusal and skip counted by its reason (markdown lines)."""
    timed = sorted(r["seconds"] for r in rows if r["status"] == "exact")
    lines = ["", "## Closing note", ""]
    if timed:
        lines.append(f"Time per compared draw (both runs, wall clock, as measured on the machine of the run): mean "
                     f"{sum(timed) / len(timed):.1f} s, median {timed[len(timed) // 2]:.1f} s, longest {timed[-1]:.1f} s.")
    for status in ("refused", "skipped", "DIFFERS", "error"):
        reasons: dict[str, list[str]] = {}
        for r in rows:
            if r["status"] == status:
                reason = (r.get("reason") or r.get("worst") or "").replace("|", "/").replace("\n", " ")[:200]
                reasons.setdefault(reason, []).append(r["name"].split(":")[-1])
        if reasons:
            lines += ["", f"{status}: {sum(map(len, reasons.values()))}", ""]
            lines += [f"- {len(names)} x {reason} (draws {', '.join(names)})" for reason, names in reasons.items()]
    return lines


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--draws", type=int, default=10)
    p.add_argument("--first", type=int, default=0, help="index of the first draw")
    p.add_argument("--out", default=os.path.join(RESULTS, "model_fuzz"),
                   help="results path without extension: appends each draw to its .jsonl, rewrites its markdown table from all rows")
    p.add_argument("--no-write", action="store_true", help="print only")
    args = p.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        prefix = documents(tmp)
        rows = []
        for i in range(args.first, args.first + args.draws):
            d = draw(args.seed, i, prefix)
            r = run_draw(d)
            rows.append(r)
            errors = (f"loss {r['loss_error']:.1e} grad {r['grad_error']:.1e}  " if "grad_error" in r else "")
            errors += f"max logits {r['max_logits']}  " if "max_logits" in r else ""
            print(f"{r['name']:>8} {r['status']:>8} {r.get('seconds', 0):6.1f}s  {', '.join(d.features)}  {errors}"
                  f"{r.get('reason') or (r.get('worst') if r['status'] != 'exact' else '') or ''}"[:600], flush=True)
            if not args.no_write:
                with open(args.out + ".jsonl", "a") as f:
                    f.write(json.dumps(r) + "\n")
    if not args.no_write:
        with open(args.out + ".jsonl") as f:  # a draw run again (after a fix) replaces its row, in its place
            every = list({r["name"]: r for r in map(json.loads, filter(str.strip, f))}.values())
        with open(args.out + ".md", "w") as f:
            f.write(table(every))
    bad = [r for r in rows if r["status"] in ("DIFFERS", "error")]
    return 1 if bad else 0


if __name__ == "__main__":
    raise SystemExit(main())
