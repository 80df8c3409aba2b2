"""Megatron-Bridge's own ``vanilla_gpt`` recipe, trained by Bridge's own ``pretrain`` on one
forked CPU rank (gloo, mock data), recording what the CP = 1 comparison needs.

Imported in the pytest process (after the CPU import shims and the stand-ins) so that forked
ranks inherit Bridge instead of importing it again (~10 s of CPU per rank on 2 cores).
What Bridge needs on a CPU beyond megatron_startrail's ``cpu_patches`` is patched here, in the
forked rank only (:func:`patch_bridge_for_cpu`); the run itself is Bridge's.
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import warnings

from tests.megatron.utils import cpu_patches  # noqa: F401  (import shims before megatron)
from tests.bridge.standins import import_with_standins  # noqa: E402

import torch  # noqa: E402
from megatron.core import tensor_parallel  # noqa: E402

(vanilla_gpt, bridge_pretrain, gpt_step, gpt_provider, bridge_initialize, bridge_setup, bridge_train,
 bridge_callbacks) = import_with_standins(
    "megatron.bridge.recipes.gpt.vanilla_gpt", "megatron.bridge.training.pretrain",
    "megatron.bridge.training.gpt_step", "megatron.bridge.models.gpt_provider",
    "megatron.bridge.training.initialize", "megatron.bridge.training.setup", "megatron.bridge.training.train",
    "megatron.bridge.training.callbacks",
    # imported inside the data-loader builder at run time (it reaches datasets, a stand-in)
    "megatron.bridge.data.megatron_mimo.base_provider")[:8]

from megatron_startrail.bridge import startrail_layer_spec  # noqa: E402

# The tiny model and run: 2 layers, 8 heads of 8, 256-token samples (64 per rank at CP 4).
SEQ, LAYERS, HIDDEN, HEADS, ITERS, GLOBAL_BATCH = 256, 2, 64, 8, 4, 2


def patch_bridge_for_cpu() -> None:
    """Bridge 0.6.2 on a CPU, in this (forked) rank: megatron_startrail's cpu_patches, and
    the four places Bridge itself assumes a GPU or a build tool."""
    cpu_patches.apply()
    # 1. initialize_megatron asserts CUDA unless told allow_no_cuda.
    bridge_setup.initialize_megatron = functools.partial(bridge_initialize.initialize_megatron, allow_no_cuda=True)
    # 2. The model-parallel RNG tracker is seeded only when a GPU is counted (cpu_patches
    #    counts none); Megatron's layers draw their init and dropout from it.
    set_seed = bridge_initialize._set_random_seed

    def set_seed_on_cpu(seed_, *args, pg_collection, **kwargs):
        set_seed(seed_, *args, pg_collection=pg_collection, **kwargs)
        pp_rank = torch.distributed.get_group_rank(pg_collection.pp, torch.distributed.get_rank())
        tensor_parallel.model_parallel_cuda_manual_seed(seed_ + 100 * pp_rank)  # Bridge's seed for this stage

    bridge_initialize._set_random_seed = set_seed_on_cpu
    # 3. The megatron-core wheel ships its dataset helpers built, without their Makefile.
    bridge_initialize.compile_helpers = lambda: None
    # 4. ModelOpt's distillation hook (a stand-in here) shapes pipeline tensors only for distillation.
    bridge_train.get_tensor_shapes_adjust_fn_for_distillation = lambda *args, **kwargs: None
    # The JIT warm-up runs fused GPU kernels; the fusions are off on the CPU.
    bridge_setup.set_jit_fusion_options = lambda *args, **kwargs: None


def recipe(cp: int, team_size: int | None):
    """Bridge's ``vanilla_gpt`` recipe made tiny, float32, on the CPU; StarTrail when ``team_size``."""
    cfg = vanilla_gpt.vanilla_gpt_pretrain_config()
    model = cfg.model
    model.num_layers, model.hidden_size, model.num_attention_heads = LAYERS, HIDDEN, HEADS
    model.ffn_hidden_size, model.seq_length, model.max_position_embeddings = 4 * HIDDEN, SEQ, SEQ
    model.context_parallel_size = cp
    model.attention_dropout = model.hidden_dropout = 0.0
    model.use_cpu_initialization = True
    model.bf16, model.params_dtype, model.pipeline_dtype = False, torch.float32, torch.float32
    cpu_patches.adapt_config(model)  # the fused GPU kernels off
    # CPU: Megatron's local spec (no Transformer Engine); StarTrail wraps it.
    local = gpt_provider.local_layer_spec
    model.transformer_layer_spec = startrail_layer_spec(team_size=team_size, base=local) if team_size else local
    cfg.mixed_precision = None
    cfg.train.train_iters, cfg.train.global_batch_size, cfg.train.micro_batch_size = ITERS, GLOBAL_BATCH, 1
    cfg.validation.eval_iters, cfg.validation.eval_interval = 0, None
    cfg.scheduler.lr_warmup_iters, cfg.scheduler.lr_decay_iters = 1, ITERS
    cfg.optimizer.lr = 3e-3
    cfg.optimizer.bf16 = False
    cfg.optimizer.use_distributed_optimizer = False
    cfg.dataset.seq_length = SEQ
    cfg.dataset.num_workers = 0  # the rank is a forked daemon process: no loader workers
    cfg.tokenizer.vocab_size = 1024  # NullTokenizer (mock data); the recipe's 32K vocabulary only slows a CPU
    cfg.checkpoint.save = cfg.checkpoint.save_interval = None
    cfg.logger.tensorboard_dir, cfg.logger.log_interval = None, 1
    cfg.dist.distributed_backend = "gloo"
    return cfg


class Recorder(bridge_callbacks.Callback):
    """Every step's lm loss, and the first step's gradient of every parameter (``main_grad``:
    reduced over DP x CP by Bridge's DDP, as the optimizer takes it)."""

    def __init__(self):
        self.losses: list[float] = []
        self.grads: dict | None = None
        self.core_attention: set[str] = set()  # the core attention classes of the model Bridge built

    def on_train_start(self, context):
        self.core_attention = {type(m.core_attention).__name__ for m in context.model[0].modules()
                               if hasattr(m, "core_attention")}

    def on_train_step_end(self, context):
        self.losses.append(float(context.loss_dict["lm loss"]))
        if self.grads is None:
            self.grads = {name: p.main_grad.detach().double().clone() for name, p in context.model[0].named_parameters()}


def run_recipe_rank(rank: int, world_size: int, cp: int, team_size: int | None) -> dict:
    """One rank of Bridge's pretrain of :func:`recipe`: its losses, first-step gradients, core
    attention classes and output."""
    patch_bridge_for_cpu()
    logging.disable(logging.WARNING)
    warnings.simplefilter("ignore")  # Bridge's and Megatron's CPU warnings, once per rank
    recorder = Recorder()
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        bridge_pretrain.pretrain(recipe(cp, team_size), gpt_step.forward_step, callbacks=[recorder])
    return dict(losses=recorder.losses, grads=recorder.grads, core_attention=recorder.core_attention,
                log=out.getvalue())
