"""Pretrain a small GPT with Megatron and StarTrail context parallelism.

    torchrun --nproc-per-node 8 examples/pretrain_gpt.py \
        --tensor-model-parallel-size 2 --context-parallel-size 4 \
        --context-parallel-algo startrail --startrail-team-size 2 \
        --num-layers 2 --hidden-size 128 --num-attention-heads 8 --seq-length 2048 \
        --micro-batch-size 1 --global-batch-size 4 --train-iters 30 --lr 2e-3 --log-interval 1

Megatron's own training program: ``megatron.training.arguments.parse_args`` with the
StarTrail flags added through ``extra_args_provider``, then ``megatron.training.pretrain``
(DDP, the Megatron optimizer and LR schedule, the pipeline schedules, its data loader and
its ``training_log`` lines, plus tokens/s). The only StarTrail-specific steps are here in
:func:`initialize_parallel` (groups built once, right after ``initialize_model_parallel``)
and :func:`model_provider` (the layer spec with StarTrail core attention). Batches go
through ``get_batch_on_this_cp_rank`` unchanged.

Runs on GPUs (nccl, Transformer Engine spec when ``--transformer-impl
transformer_engine``) and on CPU-only machines (gloo, local spec, with
``megatron_startrail.megatron.cpu_patches``).

Data: a byte-level language model (vocabulary 256, Megatron's ``NullTokenizer``) over
``examples/data/licenses.txt`` (``--text-file``; see examples/data/README.md): sample
``i`` is the window of ``--seq-length + 1`` bytes at an offset drawn from ``--seed``, so
every parallel layout sees the same tokens and its losses can be compared with
``--context-parallel-size 1``. This example turns dropout off by default for the same
reason (``--attention-dropout``/``--hidden-dropout`` still override it).
"""

from __future__ import annotations

import datetime
import functools
import os
import sys

import numpy as np
import torch

CPU_ONLY = not torch.cuda.is_available()
if CPU_ONLY:
    from megatron_startrail.megatron import cpu_patches

    cpu_patches.install_import_shims()

import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.core.enums import ModelType  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import (  # noqa: E402
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed  # noqa: E402
from megatron.core.utils import get_batch_on_this_cp_rank  # noqa: E402
from megatron.training import get_args, pretrain  # noqa: E402
from megatron.training.argument_utils import (  # noqa: E402
    core_transformer_config_from_args,
    pretrain_cfg_container_from_args,
)
from megatron.training.arguments import parse_args, validate_args  # noqa: E402
from megatron.training.global_vars import set_global_variables  # noqa: E402

from megatron_startrail.megatron.arguments import add_startrail_args, validate_startrail_args  # noqa: E402
from megatron_startrail.megatron.core_attention import LocalMLACoreAttention  # noqa: E402
from megatron_startrail.megatron.layer_specs import to_startrail_spec, with_core_attention  # noqa: E402
from megatron_startrail.megatron.parallel_state import initialize_startrail  # noqa: E402
from megatron_startrail.megatron.training_log import log_tokens_per_second  # noqa: E402

TEXT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "data", "licenses.txt")
VALID_FRACTION = 0.1  # the end of the text is held out for --eval-iters


def add_example_args(parser):
    """The StarTrail flags, this example's data flag, and its defaults for Megatron's flags."""
    add_startrail_args(parser)
    parser.add_argument_group(title="pretrain_gpt example").add_argument(
        "--text-file", default=TEXT, help="Plain text to train a byte-level GPT on."
    )
    parser.set_defaults(
        tokenizer_type="NullTokenizer", vocab_size=256, position_embedding_type="rope",
        attention_dropout=0.0, hidden_dropout=0.0, eval_iters=0, eval_interval=1000, num_workers=0,
    )
    return parser


def parse_arguments():
    """Megatron's parse/validate with the StarTrail flags (``parse_and_validate_args`` split up
    so the CPU values can go in before Megatron's validation)."""
    args = parse_args(extra_args_provider=add_example_args)
    if CPU_ONLY:
        cpu_patches.adapt_args(args)
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    validate_args(args, {})
    validate_startrail_args(args)
    if args.context_parallel_algo == "megatron" and args.context_parallel_size > 1 \
            and args.transformer_impl != "transformer_engine":
        # Megatron's local DotProductAttention asserts CP == 1.
        raise ValueError(
            "Megatron's own context parallelism needs --transformer-impl transformer_engine (a GPU); "
            "use --context-parallel-algo startrail with the local implementation"
        )
    set_global_variables(args)
    return args


def initialize_parallel(args):
    """torch.distributed, Megatron's grid, then the StarTrail groups of every CP group, once."""
    if not dist.is_initialized():
        if not CPU_ONLY:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(
            args.distributed_backend, world_size=args.world_size, rank=args.rank,
            timeout=datetime.timedelta(minutes=args.distributed_timeout_minutes),
        )
    order = "tp-cp-ep-pp-dp" if args.use_tp_pp_dp_mapping else "tp-cp-ep-dp-pp"
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        hierarchical_context_parallel_sizes=args.hierarchical_context_parallel_sizes,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
        distributed_timeout_minutes=args.distributed_timeout_minutes,
        order=order,
        create_gloo_process_groups=args.use_gloo_process_groups,
    )
    # pretrain() seeds this too, but only when it finds a GPU.
    model_parallel_cuda_manual_seed(args.seed + 100 * parallel_state.get_pipeline_model_parallel_rank())
    if args.context_parallel_algo == "megatron":
        return None
    groups = initialize_startrail(
        args.startrail_team_size, args.ulysses_degree_in_cp, order=order,
        backward_rotation=args.startrail_backward_rotation, kernel=args.startrail_kernel,
    )
    if dist.get_rank() == 0:
        print(f"> {args.context_parallel_algo}: {groups.describe()}, transfer {args.startrail_transfer}", flush=True)
    return groups


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None,
                   *, startrail_groups=None):
    """GPTModel with Megatron's layer spec, its core attention swapped for StarTrail's."""
    args = get_args()
    config = config or core_transformer_config_from_args(args)
    mla = args.multi_latent_attention  # MLASelfAttention: core attention gets k_channels != v_channels
    if args.transformer_impl == "transformer_engine":
        spec = get_gpt_layer_with_transformer_engine_spec(qk_layernorm=args.qk_layernorm, multi_latent_attention=mla)
    else:
        spec = get_gpt_layer_local_spec(qk_layernorm=args.qk_layernorm, normalization=args.normalization,
                                        multi_latent_attention=mla)
    if startrail_groups is not None:
        spec = to_startrail_spec(spec, startrail_groups, transfer=args.startrail_transfer,
                                 regather_in_backward=args.startrail_regather_in_backward)
    elif mla and args.transformer_impl == "local":  # Megatron's local core attention takes no MLA head dims
        spec = with_core_attention(spec, LocalMLACoreAttention)
    return GPTModel(
        config=config, transformer_layer_spec=spec, vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings, pre_process=pre_process, post_process=post_process,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type, rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base, pg_collection=pg_collection, vp_stage=vp_stage,
    )


class ByteWindows(torch.utils.data.Dataset):
    """``num_samples`` windows of ``seq_length + 1`` bytes of ``text`` at seeded offsets."""

    def __init__(self, text: np.ndarray, num_samples: int, seq_length: int, seed: int):
        if len(text) <= seq_length + 1:
            raise ValueError(f"--text-file has {len(text)} bytes, fewer than --seq-length {seq_length} + 2")
        rng = np.random.default_rng(seed)
        self.text, self.seq_length = text, seq_length
        self.starts = rng.integers(0, len(text) - seq_length - 1, size=num_samples)

    def __len__(self):
        return len(self.starts)

    def __getitem__(self, i):
        window = torch.from_numpy(self.text[self.starts[i] : self.starts[i] + self.seq_length + 1].astype(np.int64))
        return {
            "tokens": window[:-1],
            "labels": window[1:],
            "loss_mask": torch.ones(self.seq_length),
            "position_ids": torch.arange(self.seq_length),
        }


def datasets_provider(num_samples):
    """Train on the first 90% of the text, validate/test on the rest."""
    args = get_args()
    with open(args.text_file, "rb") as f:
        text = np.frombuffer(f.read(), dtype=np.uint8)
    split = int(len(text) * (1 - VALID_FRACTION))
    parts = (text[:split], text[split:], text[split:])
    # No dataset (None) where Megatron asks for no samples (--eval-iters 0).
    return tuple(
        ByteWindows(part, n, args.seq_length, args.seed + i) if n else None
        for i, (part, n) in enumerate(zip(parts, num_samples))
    )


# Every rank reads its own (tiny, in-memory) copy: no broadcast from TP rank 0 needed.
datasets_provider.is_distributed = True


def loss_func(loss_mask, output_tensor):
    """Summed masked loss, token count, and [sum, count] for Megatron's DP x CP reduction."""
    losses = output_tensor.float().view(-1)
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}


def forward_step(data_iterator, model):
    device = torch.device("cpu") if CPU_ONLY else torch.device("cuda", torch.cuda.current_device())
    batch = {k: v.to(device, non_blocking=True) for k, v in next(data_iterator).items()}
    # Megatron's CP layout: this CP rank keeps chunks r and 2*CP-1-r of every sequence.
    batch = get_batch_on_this_cp_rank(batch, False, parallel_state.get_context_parallel_group())
    output = model(batch["tokens"], batch["position_ids"], None, labels=batch["labels"])
    return output, functools.partial(loss_func, batch["loss_mask"])


def _use_prebuilt_dataset_helpers() -> None:
    """The megatron-core wheel ships its dataset helpers compiled but not their Makefile,
    and ``initialize_megatron`` runs ``make``: skip the build when the module is there."""
    from megatron.core.datasets import utils as dataset_utils  # noqa: PLC0415

    try:
        from megatron.core.datasets import helpers_cpp  # noqa: F401, PLC0415
    except ImportError:
        return
    dataset_utils.compile_helpers = lambda: None


def main(argv=None) -> None:
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    if CPU_ONLY:
        cpu_patches.apply()
    args = parse_arguments()
    groups = initialize_parallel(args)
    _use_prebuilt_dataset_helpers()
    log_tokens_per_second(args.seq_length)
    pretrain(
        pretrain_cfg_container_from_args(args), datasets_provider, ModelType.encoder_or_decoder, forward_step,
        model_provider=functools.partial(model_provider, startrail_groups=groups),
        skip_model_parallel_init=True,  # done above, with the StarTrail groups
    )


if __name__ == "__main__":
    main()
