"""Command-line flags for StarTrail, registered through Megatron's ``extra_args_provider``.

An unmodified Megatron accepts them::

    from megatron.training.arguments import parse_args
    args = parse_args(extra_args_provider=add_startrail_args)
    validate_megatron_args(args)           # Megatron's validate_args (QK-clip: see there)
    validate_startrail_args(args)          # after Megatron's own validate_args

``--context-parallel-algo megatron`` (the default) leaves Megatron's own context
parallelism untouched; ``startrail`` swaps the core attention of the GPT layer spec;
``tasp`` is the same module with team size 1 and the multi-ring transfer (TASP).
Validation is a pure function of the parsed namespace: every error is a ValueError that
names the flag to change.
"""

from __future__ import annotations

import argparse
import re
import os

from ..config import BACKWARD_ROTATIONS
from ..kernels.selection import KERNELS
from ..topology import team_size_for, valid_team_sizes
from ..transfer import TRANSFERS
from .attention_options import check_attention_options
from .recompute_checks import check_mtp_recompute, check_recompute_modules

ALGOS = ("megatron", "startrail", "tasp")
AUTO = "auto"


def _team_size(value: str):
    if value == AUTO:
        return AUTO
    try:
        size = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer or '{AUTO}', got {value!r}") from None
    if size < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer or '{AUTO}', got {value!r}")
    return size


def add_startrail_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The ``extra_args_provider``: adds the StarTrail flags and returns the parser."""
    group = parser.add_argument_group(title="StarTrail context parallelism")
    group.add_argument(
        "--context-parallel-algo", choices=ALGOS, default="megatron",
        help="Attention across the context-parallel group: 'megatron' (Megatron's own CP, "
        "the default), 'startrail' (concentric rings) or 'tasp' (StarTrail with team size 1 "
        "and the multi-ring transfer); the last two need --context-parallel-size > 1.",
    )
    group.add_argument(
        "--startrail-team-size", type=_team_size, default=AUTO, metavar="C",
        help="StarTrail team size C (C*C must divide CP / U; C=1 is ring attention), or "
        "'auto' to let megatron_startrail.planning.planner choose it.",
    )
    group.add_argument(
        "--ulysses-degree-in-cp", type=int, default=1, metavar="U",
        help="Split every CP group into Ulysses all-to-all groups of U consecutive ranks and a "
        "StarTrail group of CP / U ranks across them (default 1: StarTrail only).",
    )
    group.add_argument(
        "--startrail-transfer", choices=TRANSFERS, default="ring",
        help="How a sub-ring step moves data: 'ring' (StarTrail) or 'multiring' (TASP: spread "
        "over the arc-disjoint rings of the sub-ring's ranks).",
    )
    group.add_argument(
        "--startrail-backward-rotation", choices=BACKWARD_ROTATIONS, default="auto",
        help="What circulates in the backward sub-ring: 'q' (Q, dO, out, lse, dQ; the paper's "
        "choice), 'kv' (K, V, dK, dV), or 'auto' (whichever moves fewer bytes for these shapes).",
    )
    group.add_argument(
        "--startrail-kernel", choices=KERNELS, default="auto",
        help="Block kernel of the StarTrail schedule: 'auto' (chosen from device, dtype, head dims "
        "and installed libraries; see docs/block-kernels.md) or one forced by name; a forced kernel "
        "that cannot take the attention inputs stops the run with an error naming this flag.",
    )
    group.add_argument(
        "--startrail-regather-in-backward", action="store_true",
        help="Keep only what ring attention keeps for the backward (this rank's q, k, v, out, lse) "
        "and redo the team all-gather and the initial send in the backward: ring attention's "
        "activation memory for one more team all-gather (inside a node) and initial send per layer.",
    )
    group.add_argument(
        "--startrail-no-reverse-overlap", action="store_false", dest="startrail_reverse_overlap",
        help="Rotation q on sub-rings of one position (CP / U = C*C): send each piece's dK, dV back and "
        "reduce them in the team before the next piece computes, except where the pieces freed by then "
        "make room: a lower backward peak (one piece of K, V's dK, dV and their landing less), the reverse "
        "sends no longer hidden behind the compute. Default: overlapped; --startrail-memory-limit-gb "
        "turns the overlap off where only that fits.",
    )
    group.add_argument(
        "--startrail-recompute-attention", action="store_true",
        help="Under --recompute-granularity full, or selective with core_attn: recompute the attention "
        "too, communication included, and keep nothing of it between the passes. Default: the StarTrail "
        "paper's checkpoint placement -- the recomputation takes the attention's output and graph kept "
        "from the first forward and communicates nothing (it keeps what the attention keeps without "
        "recomputation).",
    )
    group.add_argument(
        "--startrail-memory-limit-gb", type=float, default=None, metavar="GB",
        help="Per-rank limit (1e9 bytes) for the attention layers of a pipeline stage: what they keep for "
        "the backward of ONE micro-batch plus one layer's transient buffers while it runs (with 1F1B a "
        "stage holds up to --pipeline-model-parallel-size micro-batches: divide your budget "
        "accordingly): --startrail-team-size auto leaves out team sizes over it; where only that makes "
        "a team size fit, the streamed backward rotation q (if --startrail-backward-rotation is auto) "
        "and then regathering in the backward are switched on.",
    )
    _escape_stray_percent(parser)
    return parser


def _escape_stray_percent(parser: argparse.ArgumentParser) -> None:
    """argparse formats help strings with ``%``; megatron-core 0.19.2's
    ``--moe-paged-stash-buffer-size-factor-cuda`` help says "10%)", so ``--help`` raised
    "unsupported format character". A ``%`` that starts no format is escaped, so that
    ``pretrain_gpt.py --help`` lists every flag (tests/test_docs.py reads it)."""
    for action in parser._actions:  # noqa: SLF001 - argparse keeps them here; there is no public list
        if isinstance(action.help, str):
            action.help = re.sub(r"%%|%(?!\()", "%%", action.help)  # "%%" stays, a lone "%" doubles


def _kv_heads_per_tp_rank(args) -> int:
    groups = args.num_query_groups if getattr(args, "group_query_attention", False) else None
    groups = groups or args.num_attention_heads
    # Megatron keeps one K/V head per TP rank when there are fewer groups than TP ranks.
    return max(1, groups // args.tensor_model_parallel_size)


def _resolve_tasp(args, algo: str) -> None:
    """``--context-parallel-algo tasp`` is StarTrail with teams of 1 and the multi-ring transfer."""
    if algo != "tasp":
        return
    if args.startrail_team_size not in (AUTO, 1):
        raise ValueError(
            f"--context-parallel-algo tasp is StarTrail with --startrail-team-size 1 "
            f"(got {args.startrail_team_size}); for larger teams use --context-parallel-algo startrail"
        )
    args.startrail_team_size, args.startrail_transfer = 1, "multiring"


def validate_megatron_args(args, defaults=None, *, startrail_attention: bool | None = None):
    """Megatron's ``validate_args``, except its Transformer Engine >= 2.9 requirement for
    ``--qk-clip`` and ``--log-max-attention-logit`` when StarTrail's core attention is the
    model's (``startrail_attention``, by default ``--context-parallel-algo`` other than megatron).

    Megatron asks for TE because only TE's attention reports ``current_max_attn_logits``;
    StarTrail's core attention reports them itself (core_attention.py, max_logit.py), so
    the requirement does not apply to it. Megatron's other checks of those flags are made
    here (as ValueErrors naming the flag); every other spec keeps Megatron's behaviour.
    """
    from megatron.training.arguments import validate_args  # noqa: PLC0415  (megatron.training only here)

    check_torch_fsdp2_per_token_loss(args)
    if startrail_attention is None:
        startrail_attention = args.context_parallel_algo != "megatron"
    flags = ("qk_clip", "log_max_attention_logit")
    asked = {f: getattr(args, f, False) for f in flags}
    if not (startrail_attention and any(asked.values())):
        return validate_args(args, defaults or {})
    if asked["qk_clip"]:
        if not 0.0 < args.qk_clip_alpha < 1.0:
            raise ValueError(f"--qk-clip-alpha {args.qk_clip_alpha} must be between 0.0 and 1.0 with --qk-clip")
        if not args.qk_clip_threshold > 0:
            raise ValueError(f"--qk-clip-threshold {args.qk_clip_threshold} must be greater than 0 with --qk-clip")
    for f in flags:  # hidden from Megatron's check (its only use there), restored after
        setattr(args, f, False)
    try:
        return validate_args(args, defaults or {})
    finally:
        for f, value in asked.items():
            setattr(args, f, value)


def check_torch_fsdp2_per_token_loss(args) -> None:
    """Refuse ``--use-torch-fsdp2`` with ``--calculate-per-token-loss`` (any CP algorithm, CP = 1 too).

    megatron-core 0.19.2's ``TorchFullyShardedDataParallel`` keeps ``_BaseDataParallel``'s no-op
    ``scale_gradients``, so ``finalize_model_grads`` never divides its gradients by the global
    count of loss tokens, and torch FSDP2's reduce-scatter averages over DP x CP (Megatron's DDP
    and Megatron-FSDP sum there with per-token loss). Every gradient comes out (loss tokens) /
    (DP x CP) times DDP's: measured, CP = 1, 2 x 256 tokens, 512x at DP1 and 256x at DP2, every
    parameter alike. Adam with clipping hides most of it in the loss; the logged grad norm, SGD
    and the clipping threshold do not. Nothing device-specific: GPUs too. Checked on the class,
    so a Megatron that implements the method passes."""
    if not (getattr(args, "use_torch_fsdp2", False) and getattr(args, "calculate_per_token_loss", False)):
        return
    try:
        from megatron.core.distributed.data_parallel_base import _BaseDataParallel  # noqa: PLC0415
        from megatron.core.distributed.torch_fully_sharded_data_parallel import (  # noqa: PLC0415
            TorchFullyShardedDataParallel,
        )
    except ImportError:  # no FSDP2 in this megatron-core: Megatron's own checks refuse the flag
        return
    if TorchFullyShardedDataParallel.scale_gradients is _BaseDataParallel.scale_gradients:
        raise ValueError(
            "--use-torch-fsdp2 with --calculate-per-token-loss: Megatron's torch FSDP2 wrapper never divides the "
            "gradients by the global number of loss tokens (its scale_gradients does nothing) and FSDP2 averages "
            "them over DP x CP, so every gradient is (loss tokens / DP x CP) times DDP's; drop "
            "--calculate-per-token-loss, or use Megatron's DDP or --use-megatron-fsdp")


def validate_startrail_args(args) -> None:
    """Check the StarTrail flags against the parallel layout; resolve ``--startrail-team-size auto``.

    Call after Megatron's ``validate_args``. Raises ValueError naming the flag to change.
    """
    cp, u, algo = args.context_parallel_size, args.ulysses_degree_in_cp, args.context_parallel_algo
    check_recompute_modules(args)  # Megatron's own, any algorithm and CP size
    check_mtp_recompute(args)
    if algo == "megatron":
        if u != 1:
            raise ValueError("--ulysses-degree-in-cp applies to --context-parallel-algo startrail only; drop it")
        return
    if getattr(args, "hybrid_context_parallel", False):
        return _validate_dynamic_cp(args)
    if cp < 2:
        raise ValueError(
            f"--context-parallel-algo {algo} needs --context-parallel-size > 1 "
            f"(got {cp}); for a run without context parallelism use --context-parallel-algo megatron"
        )
    if (getattr(args, "multi_latent_attention", False) and getattr(args, "dataloader_inter_document_masking", False)
            and getattr(args, "apply_rope_fusion", False)):
        # StarTrail's MLA layer (megatron/packed_mla.py) rotates by per-document position in
        # the sample layout unfused; Megatron's fused MLA RoPE kernel (YaRN) computes positions
        # of the other, per-document zigzag itself.
        raise ValueError(
            f"--multi-latent-attention with --dataloader-inter-document-masking and --context-parallel-algo "
            f"{algo}: Megatron's fused MLA RoPE assumes each document zigzagged on its own, not the whole "
            "packed sample; add --no-rope-fusion"
        )
    _resolve_tasp(args, algo)
    if u < 1 or cp % u != 0:
        raise ValueError(f"--ulysses-degree-in-cp {u} must divide --context-parallel-size {cp}")
    tp = args.tensor_model_parallel_size
    heads, kv_heads = args.num_attention_heads // tp, _kv_heads_per_tp_rank(args)
    if heads % u != 0:
        raise ValueError(
            f"--ulysses-degree-in-cp {u} must divide the attention heads of a tensor-parallel rank: "
            f"--num-attention-heads {args.num_attention_heads} / --tensor-model-parallel-size {tp} = {heads}"
        )
    if kv_heads % u != 0:
        raise ValueError(
            f"--ulysses-degree-in-cp {u} must divide the query groups (K/V heads) of a tensor-parallel "
            f"rank: --num-query-groups {args.num_query_groups} / --tensor-model-parallel-size {tp} "
            f"gives {kv_heads}"
        )
    if args.seq_length % (2 * cp) != 0:
        raise ValueError(
            f"--seq-length {args.seq_length} must be divisible by 2 * --context-parallel-size = {2 * cp} "
            "(Megatron's CP layout cuts the sequence into 2*CP chunks)"
        )
    if getattr(args, "hierarchical_context_parallel_sizes", None):
        raise ValueError(
            "--hierarchical-context-parallel-sizes configures Megatron's own a2a+p2p context "
            f"parallelism; with --context-parallel-algo {algo} use --ulysses-degree-in-cp U instead"
        )
    check_attention_options(args, algo)  # window, softmax type, dropout, ...: refused, never ignored
    if getattr(args, "reset_attention_mask", False):
        raise ValueError(
            f"--reset-attention-mask (a dense [s, s] document mask) is not supported with "
            f"--context-parallel-algo {algo}: use --dataloader-inter-document-masking for document "
            f"masking with context parallelism (documents reach attention as cu_seqlens)"
        )
    if args.startrail_team_size == AUTO:
        _auto_plan(args, heads, kv_heads)
    elif getattr(args, "startrail_memory_limit_gb", None) is not None:
        _fit_memory_limit(args, heads, kv_heads)
    size = cp // u
    valid = valid_team_sizes(size)
    if args.startrail_team_size not in valid:
        raise ValueError(
            f"--startrail-team-size {args.startrail_team_size} does not fit a StarTrail group of "
            f"{size} ranks (--context-parallel-size {cp} / --ulysses-degree-in-cp {u}): C*C must "
            f"divide {size}; valid values: {valid}"
        )
    if getattr(args, "startrail_kernel", "auto") != "auto":
        _check_forced_kernel(args, heads, kv_heads)


def _validate_dynamic_cp(args) -> None:
    """--hybrid-context-parallel (Megatron's dynamic CP, megatron/dynamic_cp.py): what StarTrail
    and Megatron's hybrid data path need beyond Megatron's own checks (which ran first: no
    pipeline parallelism, no CUDA graphs, no Megatron-FSDP, --calculate-per-token-loss); the
    team size of every CP size (``args.startrail_dynamic_team_sizes``)."""
    algo, tp = args.context_parallel_algo, args.tensor_model_parallel_size
    dp_cp = args.world_size // (tp * getattr(args, "pipeline_model_parallel_size", 1))
    rules = [
        (args.context_parallel_size == 1, f"--hybrid-context-parallel runs with --context-parallel-size 1 (every "
         f"sub-sample gets its own CP group over the data-parallel ranks), got {args.context_parallel_size}"),
        (args.ulysses_degree_in_cp == 1, "--ulysses-degree-in-cp with --hybrid-context-parallel is not built: drop it"),
        (getattr(args, "dataloader_inter_document_masking", False), "--hybrid-context-parallel splits packed "
         "samples at their documents: add --dataloader-inter-document-masking"),
        (getattr(args, "max_seqlen_per_dp_cp_rank", None) is not None,
         "--hybrid-context-parallel needs --max-seqlen-per-dp-cp-rank N (tokens one rank holds)"),
        (getattr(args, "rerun_mode", "disabled") == "disabled", "--hybrid-context-parallel replaces the training "
         "data iterator, which Megatron's rerun machine cannot wrap: add --rerun-mode disabled"),
        (not getattr(args, "eval_iters", 0), "--hybrid-context-parallel wraps only the training data: add "
         "--eval-iters 0"),
        (not getattr(args, "multi_latent_attention", False), "--hybrid-context-parallel: megatron-core 0.19.2 "
         "has no hybrid context parallelism for --multi-latent-attention"),
        (not getattr(args, "reset_attention_mask", False), "--reset-attention-mask (a dense document mask) with "
         "--hybrid-context-parallel: use --dataloader-inter-document-masking"),
        (getattr(args, "startrail_memory_limit_gb", None) is None,
         "--startrail-memory-limit-gb with --hybrid-context-parallel is not built: drop it"),
        (not getattr(args, "mtp_num_layers", None), "--mtp-num-layers with --hybrid-context-parallel: Megatron's "
         "MTP roll runs on the fixed CP group, not on each sub-sample's group; drop one of them"),
    ]
    for holds, message in rules:
        if not holds:
            raise ValueError(message)
    check_attention_options(args, algo)
    _resolve_tasp(args, algo)
    capacity = dp_cp * args.max_seqlen_per_dp_cp_rank
    if args.seq_length > capacity:  # a sample that is one document needs more than every rank holds
        raise ValueError(
            f"--hybrid-context-parallel: --seq-length {args.seq_length} is more than DP x CP ({dp_cp} ranks) x "
            f"--max-seqlen-per-dp-cp-rank {args.max_seqlen_per_dp_cp_rank} = {capacity} tokens, so a sample "
            "that is one document fits no CP group (Megatron's scheduler would stop at that batch): raise "
            "--max-seqlen-per-dp-cp-rank or lower --seq-length")
    heads, kv_heads = args.num_attention_heads // tp, _kv_heads_per_tp_rank(args)
    from .dynamic_cp import dynamic_cp_sizes  # noqa: PLC0415 - megatron-core is loaded by now

    sizes = dynamic_cp_sizes(dp_cp)  # (a power of two of DP x CP ranks, or an error naming the flags)
    if args.startrail_team_size == AUTO:
        from ..planning.planner import choose_plan  # noqa: PLC0415 - only for auto

        inputs = _planner_inputs(args, heads, kv_heads)

        def planned(k: int) -> int:  # a sub-sample on k ranks holds up to k x --max-seqlen-per-dp-cp-rank tokens
            tokens = min(args.seq_length, k * args.max_seqlen_per_dp_cp_rank)
            return choose_plan(**{**inputs, "cp_size": k, "gpus_per_node": min(k, inputs["gpus_per_node"]),
                                  "seq_length": max(2 * k, tokens - tokens % (2 * k))}).team_size

        args.startrail_dynamic_team_sizes = {k: planned(k) if k > 1 else 1 for k in sizes}
        args.startrail_dynamic_team_sizes_by = "the planner (--startrail-team-size auto)"
        args.startrail_team_size = max(args.startrail_dynamic_team_sizes.values())
    else:
        args.startrail_dynamic_team_sizes = {k: team_size_for(k, args.startrail_team_size) for k in sizes}
        args.startrail_dynamic_team_sizes_by = f"the largest C <= {args.startrail_team_size} with C*C dividing the size"
    if getattr(args, "startrail_kernel", "auto") != "auto":
        _check_forced_kernel(args, heads, kv_heads)


def _check_forced_kernel(args, heads: int, kv_heads: int) -> None:
    """A forced --startrail-kernel that cannot take this model's attention inputs fails here,
    at start-up, with the constraint (startrail_attn checks the real tensors again)."""
    import torch  # noqa: PLC0415

    from ..kernels import KernelRequest, choose_kernel, usable_backends  # noqa: PLC0415

    dtype = getattr(torch, _attention_dtype(args))
    qk_dim, v_dim = _head_dims(args)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    choose_kernel(KernelRequest(device.type, dtype, qk_dim, v_dim, max(1, heads // kv_heads),
                                usable_backends(device)), args.startrail_kernel)


def _attention_dtype(args) -> str:
    """The torch dtype name of the attention inputs under Megatron's precision flags."""
    if getattr(args, "bf16", False):
        return "bfloat16"
    return "float16" if getattr(args, "fp16", False) else "float32"


def _head_dims(args) -> tuple[int, int]:
    """(q/k head dim, v head dim) of the attention, MLA included."""
    if getattr(args, "multi_latent_attention", False):  # MLA: q/k = nope + rope dims, v its own
        return args.qk_head_dim + args.qk_pos_emb_head_dim, args.v_head_dim
    dim = args.kv_channels or args.hidden_size // args.num_attention_heads
    return dim, dim


def _planner_inputs(args, heads: int, kv_heads: int) -> dict:
    tp = args.tensor_model_parallel_size
    local_ranks = int(os.environ.get("LOCAL_WORLD_SIZE", args.world_size))
    # Ranks are ordered tp-cp-...: a node of N ranks holds N / TP consecutive positions of a CP group.
    cp_ranks_per_node = max(1, local_ranks // tp)
    dtype_bytes = 4 if _attention_dtype(args) == "float32" else 2
    qk_dim, v_dim = _head_dims(args)
    limit = getattr(args, "startrail_memory_limit_gb", None)
    return dict(
        cp_size=args.context_parallel_size,
        ulysses_size=args.ulysses_degree_in_cp,
        gpus_per_node=cp_ranks_per_node,
        seq_length=args.seq_length,
        num_heads=heads,
        num_kv_heads=kv_heads,
        head_dim=qk_dim,
        v_head_dim=v_dim,
        micro_batch_size=args.micro_batch_size,
        dtype_bytes=dtype_bytes,
        layers=_layers_keeping_attention(args),
        memory_limit_bytes=None if limit is None else int(limit * 1e9),
    )


def _layers_keeping_attention(args) -> int:
    """The attention layers of a pipeline stage that keep their tensors for the backward. Under
    Megatron's recomputation they all do (StarTrail keeps the attention through it, Note
    [attention kept through recomputation]), unless --startrail-recompute-attention: then the
    recomputed layers keep nothing between the passes (block: the first --recompute-num-layers
    of the stage; uniform and selective core_attn: every layer), and the peak is the others'
    plus one layer's while it is recomputed and back-propagated."""
    layers = max(1, args.num_layers // getattr(args, "pipeline_model_parallel_size", 1))
    if not getattr(args, "startrail_recompute_attention", False):
        return layers
    granularity = getattr(args, "recompute_granularity", None)
    if granularity == "full" and getattr(args, "recompute_method", None) == "block":
        return max(1, layers - (getattr(args, "recompute_num_layers", None) or 0))
    if granularity == "full" or (granularity == "selective"
                                 and "core_attn" in (getattr(args, "recompute_modules", None) or ["core_attn"])):
        return 1
    return layers


def _window_inputs(args) -> dict:
    """--window-size / --window-attn-skip-freq for the planner, when the model has windows:
    it prices the windowed layers (a halo exchange, or the schedule with the window's
    compute) and the full ones in Megatron's mix over the stage's layers."""
    if not getattr(args, "window_size", None):
        return {}
    return dict(window_size=tuple(args.window_size), window_skip_freq=getattr(args, "window_attn_skip_freq", None))


def _auto_plan(args, heads: int, kv_heads: int) -> None:
    """--startrail-team-size auto: the planner's fastest team size within the memory limit,
    priced on its default cluster (cluster.DEFAULT_CLUSTER: H100 nodes, 8 x 400 Gbit/s
    InfiniBand each) with this job's CP ranks per node; regathering on when it needs it to fit."""
    from ..planning.planner import choose_plan  # noqa: PLC0415 - only for auto

    best = choose_plan(**_planner_inputs(args, heads, kv_heads), **_window_inputs(args),
                       backward_rotation=getattr(args, "startrail_backward_rotation", "auto"))
    args.startrail_team_size = best.team_size
    args.startrail_regather_in_backward = getattr(args, "startrail_regather_in_backward", False) or \
        best.regather_in_backward
    if best.rotation != "auto":  # the streamed rotation "q" is what made it fit
        args.startrail_backward_rotation = best.rotation
    if not best.reverse_overlap:  # and, on sub-rings of one position, its reverse sends one piece at a time
        args.startrail_reverse_overlap = False


def _fit_memory_limit(args, heads: int, kv_heads: int) -> None:
    """A given team size under --startrail-memory-limit-gb: the streamed backward rotation
    "q" and/or regathering where only that fits."""
    from ..accounting import AttentionShape  # noqa: PLC0415
    from ..planning.memory_model import activation_peak_bytes, memory_fallbacks  # noqa: PLC0415

    inputs = _planner_inputs(args, heads, kv_heads)
    shape = AttentionShape(args.seq_length // args.context_parallel_size, args.micro_batch_size, heads, kv_heads,
                           inputs["head_dim"], inputs["dtype_bytes"], v_head_dim=inputs["v_head_dim"])
    limit, c = inputs["memory_limit_bytes"], args.startrail_team_size
    if args.context_parallel_size % args.ulysses_degree_in_cp or c not in valid_team_sizes(
            args.context_parallel_size // args.ulysses_degree_in_cp):
        return  # the team-size check below names the problem

    def peak(regather: bool, rotation: str, overlap: bool = True) -> int:
        return activation_peak_bytes(shape, layers=inputs["layers"], cp_size=args.context_parallel_size,
                                     team_size=c, ulysses_size=args.ulysses_degree_in_cp,
                                     regather_in_backward=regather, rotation=rotation, reverse_overlap=overlap)

    # As given; else the streamed rotation "q" (if the rotation was left to auto); else, on
    # sub-rings of one position, that without its reverse sends' overlap; else regathering; else those together.
    given = getattr(args, "startrail_backward_rotation", "auto")
    rotations = ("auto", "q") if given == "auto" else (given,)
    options = memory_fallbacks(args.context_parallel_size // args.ulysses_degree_in_cp, c, rotations,
                               (True,) if args.startrail_regather_in_backward else (False, True),
                               getattr(args, "startrail_reverse_overlap", True))
    for regather, rotation, overlap in options:
        if peak(regather, rotation, overlap) <= limit:
            args.startrail_regather_in_backward = regather
            if rotation != "auto":
                args.startrail_backward_rotation = rotation
            args.startrail_reverse_overlap = overlap
            return
    least = min(peak(True, r, o) for _, r, o in options)
    raise ValueError(
        f"--startrail-team-size {c} peaks at {least / 1e9:.3g} GB per rank in the attention of "
        f"{inputs['layers']} layers even with --startrail-regather-in-backward"
        f"{' and --startrail-backward-rotation q' if 'q' in rotations else ''}"
        f"{' and --startrail-no-reverse-overlap' if any(not o for _, _, o in options) else ''}, over "
        f"--startrail-memory-limit-gb {args.startrail_memory_limit_gb:g}: raise the limit or "
        "--context-parallel-size"
    )


