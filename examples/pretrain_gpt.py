"""Pretrain a small GPT (or a HybridModel) with Megatron and StarTrail context parallelism.

    torchrun --nproc-per-node 8 examples/pretrain_gpt.py \
        --tensor-model-parallel-size 2 --context-parallel-size 4 \
        --context-parallel-algo startrail --startrail-team-size 2 \
        --num-layers 2 --hidden-size 128 --num-attention-heads 8 --seq-length 2048 \
        --micro-batch-size 1 --global-batch-size 4 --train-iters 30 --lr 2e-3 --log-interval 1 \
        --dataloader-inter-document-masking

Megatron's own training program: ``megatron.training.arguments.parse_args`` with the
StarTrail flags added through ``extra_args_provider``, then ``megatron.training.pretrain``
(DDP, the Megatron optimizer and LR schedule, the pipeline schedules, its data loader and
its ``training_log`` lines, plus tokens/s). The only StarTrail-specific step is in
:func:`model_provider`: ``startrail_spec_from_args`` (shared with the Megatron-LM patch in
``patches/``) builds the StarTrail groups once and returns the layer spec with StarTrail core
attention and, for packed documents, the sample-layout RoPE of
``megatron_startrail.megatron.packed_rope`` (Multi-Latent Attention: per-document RoPE and
unpadded V, ``megatron_startrail.megatron.packed_mla``).

Runs on GPUs (nccl, Transformer Engine spec when ``--transformer-impl
transformer_engine``) and on CPU-only machines (gloo, local spec, with
``megatron_startrail.megatron.cpu_patches``).

Megatron's sharded data parallelism composes with StarTrail as Megatron passes it:
``--use-megatron-fsdp --ckpt-format fsdp_dtensor`` (``--data-parallel-sharding-strategy
optim_grads_params`` or ``optim_grads``) and ``--use-torch-fsdp2
--untie-embeddings-and-output-weights`` (docs/composition.md: what is tested, and what
megatron-core 0.19.2 cannot resume).

``--hybrid-layer-pattern`` (megatron.training's flag, "the sole indicator that a hybrid model
is being run") builds megatron-core's ``HybridModel`` instead of ``GPTModel``: one layer per
symbol, e.g. ``"*-*-"`` (attention, MLP, attention, MLP); with StarTrail its attention layers
get StarTrail core attention (``startrail_hybrid_spec_from_args``). Megatron's Transformer
Engine hybrid stack with ``--transformer-impl transformer_engine``; on the CPU the local one,
which has attention ('*'), MLP ('-') and MoE ('E') layers only (Mamba needs GPU kernels).

Data: Megatron's own pipeline, as in Megatron-LM's ``pretrain_gpt.py``:
``BlendedMegatronDatasetBuilder`` over ``GPTDataset`` (``--data-path``, ``--split``) or
``MockGPTDataset`` (``--mock-data``), ``--tokenizer-type``, ``--reset-position-ids``,
``--reset-attention-mask``, ``--eod-mask-loss`` and ``--dataloader-inter-document-masking``
(packed documents: ``cu_seqlens`` reach the core attention as ``PackedSeqParams``), and
Megatron's batch steps (:func:`get_batch`). With no data flag the example trains a
byte-level GPT (``NullTokenizer``, ``--vocab-size 257``: bytes and EOD) on the thirteen
license texts of examples/data/, one document each, converted on first use into Megatron's
indexed format by examples/data/make_indexed_dataset.py (``--split 12,1,0``: the Python
license is the validation document). Dropout is off by default so that every parallel
layout gives the losses of ``--context-parallel-size 1`` (``--attention-dropout`` /
``--hidden-dropout`` still override it).
"""

from __future__ import annotations

import datetime
import functools
import importlib.util
import os
import sys
import types

from megatron_startrail.megatron.rank_output import (
    bad_flags_reported_once,
    quiet_repeated_warnings,
    raise_flag_error,
)

# Before torch and Megatron are imported: their import-time warnings would come once per rank.
quiet_repeated_warnings()

import torch  # noqa: E402

CPU_ONLY = not torch.cuda.is_available()
if CPU_ONLY:
    from megatron_startrail.megatron import cpu_patches

    cpu_patches.install_import_shims()

import torch.distributed as dist  # noqa: E402
from megatron.core import parallel_state  # noqa: E402
from megatron.core.datasets.blended_megatron_dataset_builder import BlendedMegatronDatasetBuilder  # noqa: E402
from megatron.core.datasets.gpt_dataset import GPTDataset, GPTDatasetConfig, MockGPTDataset  # noqa: E402
from megatron.core.enums import ModelType  # noqa: E402
from megatron.core.models.gpt import GPTModel  # noqa: E402
from megatron.core.models.gpt.gpt_layer_specs import (  # noqa: E402
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
    get_gpt_mtp_block_spec,
)
from megatron.core.models.hybrid.hybrid_layer_specs import hybrid_stack_spec  # noqa: E402
from megatron.core.models.hybrid.hybrid_model import HybridModel  # noqa: E402
from megatron.core.packed_seq_params import PackedSeqParams  # noqa: E402
from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed  # noqa: E402
from megatron.core.transformer.multi_token_prediction import mtp_on_this_rank  # noqa: E402
from megatron.core.utils import (  # noqa: E402
    flatten_batch_for_packed_sequences,
    get_attr_wrapped_model,
    get_batch_on_this_cp_rank,
    get_batch_on_this_tp_rank,
)
from megatron.training import get_args, get_tokenizer, pretrain, print_rank_0  # noqa: E402
from megatron.training.argument_utils import (  # noqa: E402
    core_transformer_config_from_args,
    pretrain_cfg_container_from_args,
)
from megatron.training.arguments import parse_args  # noqa: E402
from megatron.training.global_vars import set_global_variables  # noqa: E402
from megatron.training.utils import get_blend_and_blend_per_split, is_first_or_last_pipeline_stage  # noqa: E402

from megatron_startrail.megatron.arguments import (  # noqa: E402
    add_startrail_args,
    validate_megatron_args,
    validate_startrail_args,
)
from megatron_startrail.megatron.core_attention import LocalMLACoreAttention  # noqa: E402
from megatron_startrail.megatron.dynamic_cp import log_dynamic_cp_schedule  # noqa: E402
from megatron_startrail.megatron.from_args import (  # noqa: E402
    megatron_rank_order,
    startrail_hybrid_spec_from_args,
    startrail_spec_from_args,
)
from megatron_startrail.megatron.hybrid_specs import (  # noqa: E402
    check_startrail_hybrid_pattern,
    hybrid_local_stack_spec,
)
from megatron_startrail.megatron.layer_specs import with_core_attention  # noqa: E402
from megatron_startrail.megatron.training_log import log_tokens_per_second  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location("make_indexed_dataset", os.path.join(HERE, "data", "make_indexed_dataset.py"))
make_indexed_dataset = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(make_indexed_dataset)
DEFAULT_SPLIT = "12,1,0"  # the licenses: 12 documents to train on, the last one to validate


def add_example_args(parser):
    """The StarTrail flags and this example's defaults for Megatron's flags."""
    add_startrail_args(parser)
    # A rejected flag raises (one line, see __main__) instead of printing Megatron's whole usage.
    parser.error = raise_flag_error
    parser.set_defaults(
        tokenizer_type="NullTokenizer", vocab_size=make_indexed_dataset.VOCAB_SIZE, position_embedding_type="rope",
        attention_dropout=0.0, hidden_dropout=0.0, eval_iters=0, eval_interval=1000, num_workers=0,
    )
    return parser


def use_default_data(args) -> None:
    """No data flag: the bundled licenses, built into Megatron's indexed format on first use."""
    data_flags = ("data_path", "train_data_path", "valid_data_path", "test_data_path", "data_args_path",
                  "per_split_data_args_path")
    if args.mock_data or any(getattr(args, name, None) for name in data_flags):
        return
    args.data_path = [make_indexed_dataset.ensure_built()]
    if args.split is None:
        args.split = DEFAULT_SPLIT


def validate_example_args(args) -> None:
    """What this example's CPU path cannot run, as ValueErrors that name the flag to change."""
    if args.context_parallel_algo == "megatron" and args.context_parallel_size > 1 \
            and args.transformer_impl != "transformer_engine":
        # Megatron's local DotProductAttention asserts CP == 1.
        raise ValueError(
            "Megatron's own context parallelism needs --transformer-impl transformer_engine (a GPU); "
            "use --context-parallel-algo startrail with the local implementation"
        )
    # LocalMLACoreAttention at CP 1 (callers may pass namespaces without the MLA flags)
    mla_local = getattr(args, "multi_latent_attention", False) and args.transformer_impl == "local"
    if mla_local and args.context_parallel_algo == "megatron" and getattr(args, "reset_attention_mask", False):
        # LocalMLACoreAttention is causal over the sequence (it reads no mask tensor), and MLA
        # rotates by sequence position, not by --reset-position-ids: the dense mask cannot work.
        raise ValueError(
            "--reset-attention-mask with --multi-latent-attention: use --dataloader-inter-document-masking "
            "(packed documents, THD) for document masking with MLA"
        )
    if args.dataloader_inter_document_masking and args.context_parallel_algo == "megatron" \
            and args.transformer_impl != "transformer_engine" and not mla_local:
        # The local DotProductAttention asserts packed_seq_params is None.
        raise ValueError(
            "--dataloader-inter-document-masking (packed documents, THD) needs --context-parallel-algo "
            "startrail or --transformer-impl transformer_engine; with Megatron's local attention use "
            "--reset-attention-mask --reset-position-ids (a dense per-document mask) instead"
        )
    if getattr(args, "reset_attention_mask", False) and args.transformer_impl == "local":
        # The dense per-document mask, twin of packed documents at CP = 1, where it cannot hold:
        if getattr(args, "num_layers_per_virtual_pipeline_stage", None) or \
                getattr(args, "num_virtual_stages_per_pipeline_rank", None):
            # get_batch gives middle virtual stages no data (Megatron builds them no iterator):
            # their layers would attend across documents.
            raise ValueError("--reset-attention-mask with virtual pipeline stages: the middle stages get no "
                             "mask in this example; drop --num-layers-per-virtual-pipeline-stage, or use "
                             "--dataloader-inter-document-masking with --context-parallel-algo startrail")
        if getattr(args, "window_size", None) is not None:
            # megatron-core 0.19.2's local softmax (FusedScaleMaskSoftmax.forward_torch_softmax)
            # replaces a given mask by the sliding window's: the documents would be ignored.
            raise ValueError("--reset-attention-mask with --window-size: Megatron's local attention replaces the "
                             "document mask by the window's; use --dataloader-inter-document-masking with "
                             "--context-parallel-algo startrail")
    if args.sft:
        raise ValueError("--sft is not supported by this example; use Megatron-LM's pretrain_gpt.py (patches/)")
    if getattr(args, "hybrid_context_parallel", False) and args.context_parallel_algo == "megatron" \
            and args.transformer_impl != "transformer_engine":
        # The local DotProductAttention knows no per-sub-sample CP group.
        raise ValueError("--hybrid-context-parallel on the local implementation needs --context-parallel-algo "
                         "startrail (or tasp); Megatron's own needs --transformer-impl transformer_engine")
    if getattr(args, "hybrid_layer_pattern", None) is not None:  # megatron.training's flag
        validate_hybrid_args(args)


# HybridModel layers the local stack spec (hybrid_local_stack_spec) builds, and the pipeline
# separator; Mamba, GDN, MLA and DSA layers exist only as Transformer Engine modules.
LOCAL_HYBRID_SYMBOLS = set("*-E|")


def validate_hybrid_args(args) -> None:
    """--hybrid-layer-pattern: what the local stack and StarTrail cannot build, before any group exists."""
    pattern = args.hybrid_layer_pattern
    if args.transformer_impl != "transformer_engine" and not set(pattern) <= LOCAL_HYBRID_SYMBOLS:
        raise ValueError(
            f"--hybrid-layer-pattern {pattern!r}: without Transformer Engine (--transformer-impl local, the CPU) "
            "a hybrid model has attention ('*'), MLP ('-') and MoE ('E') layers only; Mamba ('M'), GDN ('G'), "
            "MLA ('+'), DSA ('D') and MTP ('/') need --transformer-impl transformer_engine on a GPU"
        )
    if args.context_parallel_algo != "megatron":
        check_startrail_hybrid_pattern(pattern, packed_sample_layout=args.dataloader_inter_document_masking)


def parse_arguments():
    """Megatron's parse/validate with the StarTrail flags (``parse_and_validate_args`` split up
    so the CPU values can go in before Megatron's validation)."""
    args = parse_args(extra_args_provider=add_example_args)
    if CPU_ONLY:
        cpu_patches.adapt_args(args)
    if args.max_position_embeddings is None:
        args.max_position_embeddings = args.seq_length
    use_default_data(args)
    if args.context_parallel_algo != "megatron" and not args.reset_attention_mask:
        # StarTrail applies the causal (or per-document) mask itself: no [s, s] mask per sample.
        args.create_attention_mask_in_dataloader = False
    validate_megatron_args(args)  # (--qk-clip, --log-max-attention-logit: StarTrail reports the max logits)
    validate_startrail_args(args)
    validate_example_args(args)
    set_global_variables(args)
    return args


def initialize_parallel(args) -> None:
    """torch.distributed and Megatron's grid (the StarTrail groups come with the layer spec)."""
    if not dist.is_initialized():
        if not CPU_ONLY:
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(
            args.distributed_backend, world_size=args.world_size, rank=args.rank,
            timeout=datetime.timedelta(minutes=args.distributed_timeout_minutes),
        )
    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        context_parallel_size=args.context_parallel_size,
        hierarchical_context_parallel_sizes=args.hierarchical_context_parallel_sizes,
        expert_model_parallel_size=args.expert_model_parallel_size,
        expert_tensor_parallel_size=args.expert_tensor_parallel_size,
        distributed_timeout_minutes=args.distributed_timeout_minutes,
        order=megatron_rank_order(args),
        create_gloo_process_groups=args.use_gloo_process_groups,
        hybrid_context_parallel=args.hybrid_context_parallel,  # a CP group of every size (dynamic CP)
    )
    # pretrain() seeds this too, but only when it finds a GPU.
    model_parallel_cuda_manual_seed(args.seed + 100 * parallel_state.get_pipeline_model_parallel_rank())


def model_provider(pre_process=True, post_process=True, vp_stage=None, config=None, pg_collection=None):
    """GPTModel with Megatron's layer spec, its core attention swapped for StarTrail's
    (a HybridModel with --hybrid-layer-pattern)."""
    args = get_args()
    config = config or core_transformer_config_from_args(args)
    if args.hybrid_layer_pattern is not None:
        return hybrid_model_provider(args, config, pre_process, post_process, vp_stage, pg_collection)
    mla = args.multi_latent_attention  # MLASelfAttention: core attention gets k_channels != v_channels
    if args.transformer_impl == "transformer_engine":
        spec = get_gpt_layer_with_transformer_engine_spec(
            num_experts=args.num_experts, moe_grouped_gemm=args.moe_grouped_gemm, qk_layernorm=args.qk_layernorm,
            multi_latent_attention=mla)
    else:
        spec = get_gpt_layer_local_spec(
            num_experts=args.num_experts, moe_grouped_gemm=args.moe_grouped_gemm, qk_layernorm=args.qk_layernorm,
            normalization=args.normalization, multi_latent_attention=mla)
    # --mtp-num-layers: Megatron builds the MTP layers from the decoder's layer spec, apart
    # from the decoder (GPTModel without it still splits the hidden states for the MTP loss).
    mtp_spec = None if args.mtp_num_layers is None else get_gpt_mtp_block_spec(
        config, spec, use_transformer_engine=args.transformer_impl == "transformer_engine", vp_stage=vp_stage)
    if args.context_parallel_algo != "megatron":
        # Every StarTrail flag reaches the model through this one call, shared with patches/
        # (the StarTrail groups are built on the first call, on every rank, in the same order).
        spec = startrail_spec_from_args(spec, args)
        mtp_spec = mtp_spec and startrail_spec_from_args(mtp_spec, args)  # the MTP layers' attention too
    elif mla and args.transformer_impl == "local":  # Megatron's local core attention takes no MLA head dims
        spec = with_core_attention(spec, LocalMLACoreAttention)  # (nor packed documents; this one does)
        mtp_spec = mtp_spec and with_core_attention(mtp_spec, LocalMLACoreAttention)
    return GPTModel(
        config=config, transformer_layer_spec=spec, mtp_block_spec=mtp_spec, vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings, pre_process=pre_process, post_process=post_process,
        fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type, rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base, pg_collection=pg_collection, vp_stage=vp_stage,
    )


def hybrid_model_provider(args, config, pre_process, post_process, vp_stage, pg_collection):
    """megatron-core's HybridModel for --hybrid-layer-pattern, its attention layers StarTrail's."""
    if args.transformer_impl == "transformer_engine":
        stack = hybrid_stack_spec  # Megatron's own (what megatron.training's HybridModelBuilder uses)
    else:
        stack = hybrid_local_stack_spec(normalization=args.normalization, qk_layernorm=args.qk_layernorm,
                                        num_experts=args.num_experts, moe_grouped_gemm=args.moe_grouped_gemm)
    if args.context_parallel_algo != "megatron":
        stack = startrail_hybrid_spec_from_args(stack, args)
    return HybridModel(
        config=config, hybrid_stack_spec=stack, vocab_size=args.padded_vocab_size,
        max_sequence_length=args.max_position_embeddings, hybrid_layer_pattern=args.hybrid_layer_pattern,
        pre_process=pre_process, post_process=post_process, fp16_lm_cross_entropy=args.fp16_lm_cross_entropy,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type, rotary_percent=args.rotary_percent,
        rotary_base=args.rotary_base, pg_collection=pg_collection, vp_stage=vp_stage,
    )


def is_dataset_built_on_rank(vp_stage=None):
    """Megatron's rule: TP rank 0 of the stages that read data (with packed documents every
    stage, because each needs the document boundaries)."""
    args = get_args()
    if parallel_state.get_tensor_model_parallel_rank() != 0:
        return False
    return args.dataloader_inter_document_masking or is_first_or_last_pipeline_stage(vp_stage)


def gpt_dataset_config(args) -> GPTDatasetConfig:
    """Megatron's GPTDatasetConfig from the parsed flags (--data-path, --split, --reset-*, ...)."""
    blend, blend_per_split = get_blend_and_blend_per_split(args)
    return GPTDatasetConfig(
        random_seed=args.seed,
        sequence_length=args.seq_length,
        blend=blend,
        blend_per_split=blend_per_split,
        split=args.split,
        multiple_validation_sets=args.multiple_validation_sets,
        full_validation=args.full_validation,
        num_dataset_builder_threads=args.num_dataset_builder_threads,
        path_to_cache=args.data_cache_path,
        mmap_bin_files=args.mmap_bin_files,
        tokenizer=get_tokenizer(),
        reset_position_ids=args.reset_position_ids,
        reset_attention_mask=args.reset_attention_mask,
        eod_mask_loss=args.eod_mask_loss,
        create_attention_mask=args.create_attention_mask_in_dataloader,
        mid_level_dataset_surplus=args.mid_level_dataset_surplus,
        allow_ambiguous_pad_tokens=args.allow_ambiguous_pad_tokens,
        context_parallel_size=args.context_parallel_size,
        data_parallel_size=args.data_parallel_size,
        sequence_parallel_size=args.tensor_model_parallel_size * args.sequence_parallel,
        inter_document_masking=args.dataloader_inter_document_masking,
    )


def datasets_provider(train_val_test_num_samples, vp_stage=None):
    """Megatron's BlendedMegatronDatasetBuilder over GPTDataset (MockGPTDataset with --mock-data)."""
    args = get_args()
    dataset_type = MockGPTDataset if args.mock_data else GPTDataset
    print_rank_0(f"> building train, validation, and test datasets ({dataset_type.__name__}) ...")
    return BlendedMegatronDatasetBuilder(
        dataset_type, train_val_test_num_samples,
        functools.partial(is_dataset_built_on_rank, vp_stage=vp_stage), gpt_dataset_config(args),
    ).build()


# Megatron's datasets coordinate the ranks themselves (built on rank 0 first, then read).
datasets_provider.is_distributed = True

# What get_batch returns, in this order (the keys of Megatron's batch dict this example uses).
BATCH_KEYS = ("tokens", "labels", "loss_mask", "position_ids", "attention_mask", "cu_seqlens", "max_seqlen")


def get_batch(data_iterator, vp_stage=None):
    """This rank's micro-batch, through Megatron's own steps: TP rank 0 reads and broadcasts
    to its TP group (``get_batch_on_this_tp_rank``), packed samples are flattened
    (``flatten_batch_for_packed_sequences``), then this CP rank keeps its zigzag chunks
    (``get_batch_on_this_cp_rank``; with --dataloader-inter-document-masking the whole
    packed sample is zigzagged and ``cu_seqlens`` stays global)."""
    args = get_args()
    packed = args.dataloader_inter_document_masking
    if not is_first_or_last_pipeline_stage(vp_stage) and not packed:
        return dict.fromkeys(BATCH_KEYS)  # a middle pipeline stage reads no data
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    batch = {}
    if tp_rank == 0:
        device = torch.device("cpu") if CPU_ONLY else torch.device("cuda", torch.cuda.current_device())
        batch = {k: (v.to(device, non_blocking=True) if isinstance(v, torch.Tensor) else v)
                 for k, v in next(data_iterator).items()}
        batch.setdefault("attention_mask", None)
        batch.setdefault("cu_seqlens_padded", None)
    batch = get_batch_on_this_tp_rank(
        batch,
        has_cu_seqlens=packed,
        is_hybrid_cp=False,
        create_attention_mask_in_dataloader=args.create_attention_mask_in_dataloader,
        broadcast_src_rank=parallel_state.get_tensor_model_parallel_src_rank(),
        broadcast_group=parallel_state.get_tensor_model_parallel_group(),
        cp_size=args.context_parallel_size,
        tp_rank=tp_rank,
        micro_batch_size=args.micro_batch_size,
        seq_length=args.seq_length,
        # The MTP layers (on the last stage) embed the tokens shifted, so that stage gets them too.
        mtp_on_this_rank=mtp_on_this_rank(mtp_num_layers=args.mtp_num_layers, ignore_virtual=False,
                                          vp_stage=vp_stage),
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        is_pipeline_first_stage=parallel_state.is_pipeline_first_stage(),
        is_pipeline_last_stage=parallel_state.is_pipeline_last_stage(),
    )
    batch = flatten_batch_for_packed_sequences(batch)  # [mbs, s] -> [1, mbs * s] when packed
    batch = get_batch_on_this_cp_rank(
        batch, is_hybrid_cp=False, cp_group=parallel_state.get_context_parallel_group(),
        use_per_sequence_balancing=packed,
    )
    return {k: batch.get(k) for k in BATCH_KEYS}


def get_dynamic_cp_batch(data_iterator):
    """One sub-sample of Megatron's hybrid (dynamic) CP schedule on this rank: TP rank 0 takes
    it (one document, 1-D tensors, and ``local_cp_size`` k) and pads it to a multiple of 2k
    (padding is masked out of the loss, and a causal token never sees the padding after it);
    then Megatron's own steps: the TP broadcast and the zigzag over the sub-sample's CP group
    (``get_batch_on_this_cp_rank(is_hybrid_cp=True)``). Returns the batch and its THD
    ``PackedSeqParams`` with ``local_cp_size`` and ``cp_group``: one packed sample of one
    document, which StarTrail runs on its groups of size k."""
    args = get_args()
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    batch = {}
    if tp_rank == 0:
        sample = next(data_iterator)
        k = int(sample["local_cp_size"])
        pad = -sample["tokens"].numel() % (2 * k)
        length = sample["tokens"].numel() + pad

        def padded(t, fill=0):  # [L] -> [1, L + pad]
            return torch.cat([t, t.new_full((pad,), fill)]).unsqueeze(0)

        batch = dict(tokens=padded(sample["tokens"]), labels=padded(sample["labels"]),
                     loss_mask=padded(sample["loss_mask"]), position_ids=torch.arange(length).unsqueeze(0),
                     attention_mask=None, cu_seqlens=torch.tensor([[0, length]], dtype=torch.int32),
                     cu_seqlens_padded=None, max_seqlen=torch.tensor([length], dtype=torch.int32),
                     local_cp_size=torch.tensor([k], dtype=torch.int32))
        if not CPU_ONLY:
            batch = {key: v.cuda(non_blocking=True) if isinstance(v, torch.Tensor) else v for key, v in batch.items()}
    batch = get_batch_on_this_tp_rank(
        batch, has_cu_seqlens=True, is_hybrid_cp=True, create_attention_mask_in_dataloader=False,
        broadcast_src_rank=parallel_state.get_tensor_model_parallel_src_rank(),
        broadcast_group=parallel_state.get_tensor_model_parallel_group(), cp_size=args.context_parallel_size,
        tp_rank=tp_rank, micro_batch_size=1, seq_length=args.seq_length, mtp_on_this_rank=False,
    )
    batch = get_batch_on_this_cp_rank(
        batch, is_hybrid_cp=True, hybrid_cp_group_func=parallel_state.get_hybrid_data_context_parallel_groups,
    )
    cu_seqlens = batch["cu_seqlens"][0]  # [0, length], int32
    length = int(batch["max_seqlen"].max().item())
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
                             max_seqlen_q=length, max_seqlen_kv=length, local_cp_size=int(batch["local_cp_size"]),
                             cp_group=batch.get("hybrid_cp_group"))  # no group for a sub-sample of CP 1
    return batch, params


def packed_seq_params_of(batch) -> PackedSeqParams | None:
    """PackedSeqParams (THD) for a batch with document boundaries, as Megatron's pretrain_gpt.py
    builds them: ``cu_seqlens`` global over the packed sample, no padded layout."""
    if batch["cu_seqlens"] is None:
        return None
    cu_seqlens = batch["cu_seqlens"].squeeze(0)  # [1, n_docs + 1] -> [n_docs + 1], int32
    max_seqlen = int(batch["max_seqlen"].max().item())
    return PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu_seqlens, cu_seqlens_kv=cu_seqlens,
        max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen,
    )


def loss_func(loss_mask, output_tensor):
    """Summed masked loss, token count, and [sum, count] for Megatron's DP x CP reduction."""
    losses = output_tensor.float().view(-1)
    loss_mask = loss_mask.view(-1).float()
    loss = torch.sum(losses * loss_mask)
    num_tokens = loss_mask.sum().clone().detach().to(torch.int)
    return loss, num_tokens, {"lm loss": torch.cat([loss.clone().detach().view(1), num_tokens.view(1)])}


def forward_step(data_iterator, model):
    if get_args().hybrid_context_parallel:
        batch, packed_seq_params = get_dynamic_cp_batch(data_iterator)
    else:
        batch = get_batch(data_iterator, get_attr_wrapped_model(model, "vp_stage"))
        packed_seq_params = packed_seq_params_of(batch)
    output = model(
        batch["tokens"], batch["position_ids"], batch.get("attention_mask"), labels=batch["labels"],
        loss_mask=batch["loss_mask"], packed_seq_params=packed_seq_params,
    )
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


def parse_command_line(argv=None):
    """The parsed and validated flags (``argv`` replaces the command line's)."""
    if argv is not None:
        sys.argv = [sys.argv[0], *argv]
    if CPU_ONLY:
        cpu_patches.apply()
    return parse_arguments()


def clip_qk_reaches_fp32_models() -> None:
    """megatron-core 0.19.2's ``clip_qk`` (run by train_step for --qk-clip and
    --log-max-attention-logit) walks ``chunk.module.module.decoder``: DDP around Float16Module
    around the GPT. An fp32 model (no --bf16 / --fp16: the CPU runs) has no Float16Module, one
    ``.module`` less; each such chunk is handed to it with that level added, nothing else changed."""
    from megatron.training import training  # noqa: PLC0415

    clip_qk = training.clip_qk

    def clip_qk_any_precision(model, *args, **kwargs):
        chunks = [c if hasattr(c.module, "module") else types.SimpleNamespace(module=types.SimpleNamespace(
            module=c.module)) for c in model]
        return clip_qk(chunks, *args, **kwargs)

    training.clip_qk = clip_qk_any_precision


def train(args) -> None:
    initialize_parallel(args)
    if (args.qk_clip or args.log_max_attention_logit) and not (args.fp16 or args.bf16):
        clip_qk_reaches_fp32_models()
    _use_prebuilt_dataset_helpers()
    log_tokens_per_second(args.seq_length)
    if args.hybrid_context_parallel and args.context_parallel_algo != "megatron":
        log_dynamic_cp_schedule(args.startrail_dynamic_team_sizes)
    pretrain(
        pretrain_cfg_container_from_args(args), datasets_provider, ModelType.encoder_or_decoder, forward_step,
        model_provider=model_provider,
        skip_model_parallel_init=True,  # done above
    )


def main(argv=None) -> None:
    """Parse and train; a bad flag raises on every rank (what tests call)."""
    train(parse_command_line(argv))


if __name__ == "__main__":
    # From the command line a bad flag is one line from rank 0, not a traceback or usage per rank.
    with bad_flags_reported_once():
        parsed = parse_command_line()
    train(parsed)
