"""Pretrain a small GPT with megatron-core and StarTrail context parallelism.

    torchrun --nproc-per-node 8 examples/pretrain_gpt.py \
        --tensor-model-parallel-size 2 --context-parallel-size 4 \
        --context-parallel-algo startrail --startrail-team-size 2 \
        --num-layers 2 --hidden-size 128 --num-attention-heads 8 --seq-length 2048 \
        --max-position-embeddings 2048 --micro-batch-size 1 --global-batch-size 4 \
        --train-iters 30 --lr 3e-3 --seed 1234 --log-interval 1

Megatron's own argument parser (``megatron.training``) with the StarTrail flags added
through ``extra_args_provider``; a compact training loop on megatron-core: DDP, the
Megatron optimizer, the pipeline schedules, ``get_batch_on_this_cp_rank``. It runs on
CPU (gloo, with ``megatron_startrail.megatron.cpu_patches``) and on GPUs (nccl).

Data: a byte-level language model over ``examples/data/licenses.txt`` (see its README),
windows of ``--seq-length + 1`` bytes drawn from a fixed seed, so every parallel layout
sees the same tokens and its losses can be compared with ``--context-parallel-size 1``.
"""

from __future__ import annotations

import datetime
import os
import sys
import time

import torch

CPU_ONLY = not torch.cuda.is_available()
if CPU_ONLY:
    from megatron_startrail.megatron import cpu_patches

    cpu_patches.install_import_shims()

import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig  # noqa: E402
from megatron.core.distributed.finalize_model_grads import finalize_model_grads  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec  # noqa: E402
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: E402
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed  # noqa: E402
from megatron.core.utils import get_batch_on_this_cp_rank  # noqa: E402
from megatron.training.argument_utils import core_transformer_config_from_args  # noqa: E402
from megatron.training.arguments import parse_args, validate_args  # noqa: E402

from megatron_startrail.megatron.arguments import add_startrail_args, validate_startrail_args  # noqa: E402
from megatron_startrail.megatron.layer_specs import to_startrail_spec  # noqa: E402
from megatron_startrail.megatron.parallel_state import initialize_startrail  # noqa: E402

DATA = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "licenses.txt")
VOCAB = 256  # bytes


def log0(msg: str) -> None:
    if dist.get_rank() == 0:
        print(msg, flush=True)


def initialize(args) -> None:
    backend = "gloo" if CPU_ONLY else "nccl"
    if not CPU_ONLY:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=args.distributed_timeout_minutes * 60))
    if CPU_ONLY:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1))))
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
    )
    torch.manual_seed(args.seed)
    model_parallel_cuda_manual_seed(args.seed)


def resolve_team_size(args) -> int:
    if args.startrail_team_size != "auto":
        return args.startrail_team_size
    from megatron_startrail.planner import choose_team_size  # noqa: PLC0415

    tp = args.tensor_model_parallel_size
    return choose_team_size(
        cp_size=args.context_parallel_size, ulysses_size=args.ulysses_degree_in_cp,
        gpus_per_node=int(os.environ.get("LOCAL_WORLD_SIZE", 8)), seq_length=args.seq_length,
        num_heads=args.num_attention_heads // tp,
        num_kv_heads=max(1, (args.num_query_groups or args.num_attention_heads) // tp),
        head_dim=args.kv_channels, micro_batch_size=args.micro_batch_size,
        dtype_bytes=2 if (args.bf16 or args.fp16) else 4,
    )


def build_model(args, config):
    spec = get_gpt_layer_local_spec()
    if args.context_parallel_algo != "megatron":
        team_size = resolve_team_size(args)
        groups = initialize_startrail(
            team_size, args.ulysses_degree_in_cp, backward_rotation=args.startrail_backward_rotation
        )
        log0(f"> {groups.describe()}; transfer {args.startrail_transfer}")
        spec = to_startrail_spec(spec, groups, transfer=args.startrail_transfer)
    model = GPTModel(
        config=config, transformer_layer_spec=spec, vocab_size=VOCAB,
        max_sequence_length=args.max_position_embeddings,
        pre_process=parallel_state.is_pipeline_first_stage(), post_process=parallel_state.is_pipeline_last_stage(),
        position_embedding_type=args.position_embedding_type, rotary_percent=args.rotary_percent,
    )
    if not CPU_ONLY:
        model.cuda()
    ddp_config = DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False)
    return DistributedDataParallel(config=config, ddp_config=ddp_config, module=model)


def lr_scheduler(optimizer, args) -> OptimizerParamScheduler:
    """Megatron's iteration-based schedule (--lr, --min-lr, --lr-warmup-iters, --lr-decay-style)."""
    decay_steps = (args.lr_decay_iters or args.train_iters) * args.global_batch_size
    warmup_steps = (
        args.lr_warmup_fraction * decay_steps if args.lr_warmup_fraction is not None
        else args.lr_warmup_iters * args.global_batch_size
    )
    return OptimizerParamScheduler(
        optimizer, init_lr=args.lr_warmup_init, max_lr=args.lr, min_lr=args.min_lr,
        lr_warmup_steps=warmup_steps, lr_decay_steps=decay_steps, lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay, end_wd=args.weight_decay,
        wd_incr_steps=args.train_iters * args.global_batch_size, wd_incr_style="constant",
    )


def global_batch(data: torch.Tensor, args, iteration: int) -> list[dict]:
    """This DP rank's microbatches: windows of seq+1 bytes at seeded random offsets."""
    gen = torch.Generator().manual_seed(args.seed * 100003 + iteration)
    starts = torch.randint(0, len(data) - args.seq_length - 1, (args.global_batch_size,), generator=gen)
    dp, dp_rank = parallel_state.get_data_parallel_world_size(), parallel_state.get_data_parallel_rank()
    per_rank = args.global_batch_size // dp
    mine = starts[dp_rank * per_rank : (dp_rank + 1) * per_rank]
    device = "cpu" if CPU_ONLY else "cuda"
    batches = []
    for m in range(0, per_rank, args.micro_batch_size):
        windows = torch.stack([data[s : s + args.seq_length + 1] for s in mine[m : m + args.micro_batch_size]])
        windows = windows.long().to(device)
        batches.append({
            "tokens": windows[:, :-1].contiguous(),
            "labels": windows[:, 1:].contiguous(),
            "loss_mask": torch.ones(windows.shape[0], args.seq_length, device=device),
            "position_ids": torch.arange(args.seq_length, device=device).expand(windows.shape[0], -1).contiguous(),
        })
    return batches


def forward_step(data_iterator, model):
    # Megatron's layout: this CP rank keeps chunks r and 2*CP-1-r of every sequence.
    batch = get_batch_on_this_cp_rank(next(data_iterator), False, parallel_state.get_context_parallel_group())
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])

    def loss_func(output_tensor):
        mask = batch["loss_mask"]
        loss = (output_tensor.float() * mask).sum()
        tokens = mask.sum().to(torch.int)
        # [sum, count]; reduced over DP x CP for the log, like megatron.training's loss_func.
        return loss, tokens, {"lm loss": torch.stack([loss.detach().clone(), tokens.float()])}

    return output, loss_func


def main() -> None:
    if CPU_ONLY:
        cpu_patches.apply()
    args = parse_args(extra_args_provider=add_startrail_args)
    args.padded_vocab_size = VOCAB
    validate_args(args, {})
    validate_startrail_args(args)
    initialize(args)
    config = core_transformer_config_from_args(args)
    config.calculate_per_token_loss = True  # the loss is averaged over all tokens of the step
    config.finalize_model_grads_func = finalize_model_grads
    if CPU_ONLY:
        cpu_patches.adapt_config(config)
    model = build_model(args, config)
    config.no_sync_func = model.no_sync
    optimizer = get_megatron_optimizer(
        OptimizerConfig(optimizer="adam", lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay, clip_grad=args.clip_grad,
                        adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, bf16=args.bf16, fp16=args.fp16,
                        params_dtype=config.params_dtype),
        [model],
    )
    scheduler = lr_scheduler(optimizer, args)
    data = torch.frombuffer(bytearray(open(DATA, "rb").read()), dtype=torch.uint8)
    log0(f"> training on {DATA} ({len(data)} bytes), world size {dist.get_world_size()}: "
         f"TP={args.tensor_model_parallel_size} PP={args.pipeline_model_parallel_size} "
         f"CP={args.context_parallel_size} DP={parallel_state.get_data_parallel_world_size()}, "
         f"context-parallel-algo {args.context_parallel_algo}")

    forward_backward = get_forward_backward_func()
    dp_cp_group = parallel_state.get_data_parallel_group(with_context_parallel=True)
    consumed = 0
    for iteration in range(1, args.train_iters + 1):
        start = time.time()
        model.zero_grad_buffer()
        optimizer.zero_grad()
        microbatches = global_batch(data, args, iteration)
        losses = forward_backward(
            forward_step_func=forward_step, data_iterator=iter(microbatches), model=[model],
            num_microbatches=len(microbatches), seq_length=args.seq_length,
            micro_batch_size=args.micro_batch_size, forward_only=False,
        )
        _, grad_norm, _ = optimizer.step()
        learning_rate = optimizer.param_groups[0]["lr"]
        scheduler.step(increment=args.global_batch_size)
        # The loss lives on the last pipeline stage; sum [loss, tokens] over DP x CP, then
        # share it with the other stages for the log line.
        summed = torch.stack([x["lm loss"] for x in losses]).sum(0) if losses else torch.zeros(2)
        dist.all_reduce(summed, group=dp_cp_group)
        dist.all_reduce(summed, group=parallel_state.get_pipeline_model_parallel_group())
        consumed += args.global_batch_size
        elapsed = time.time() - start
        if iteration % args.log_interval == 0:
            tokens_per_s = args.global_batch_size * args.seq_length / elapsed
            log0(
                f" [{datetime.datetime.now().strftime('%Y-%m-%d %H:%M:%S.%f')}]"
                f" iteration {iteration:8d}/{args.train_iters:8d} |"
                f" consumed samples: {consumed:12d} |"
                f" elapsed time per iteration (ms): {elapsed * 1000.0:.1f} |"
                f" learning rate: {learning_rate:.6E} |"
                f" global batch size: {args.global_batch_size:5d} |"
                f" lm loss: {(summed[0] / summed[1]).item():.6E} |"
                f" loss scale: 1.0 |"
                f" grad norm: {grad_norm:.3f} |"
                f" tokens/s: {tokens_per_s:.1f} |"
            )
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
