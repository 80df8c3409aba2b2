"""Attention options of megatron-core 0.19.2 that StarTrail does not implement: refused.

StarTrail computes exact softmax attention, causal or full, with a sliding window when
``--window-size`` / ``--window-attn-skip-freq`` ask for one (the core attention applies
Megatron's per-layer rule), inside packed documents when given. An option that changes
the mask or the softmax and that StarTrail ignored would train a different model without
a word (``--window-size`` once did). So each such option is refused, with the flag named,
in two places that read the same table:

- :func:`check_attention_options` on Megatron's parsed args (``validate_startrail_args``,
  before any process group exists, on every rank);
- the same function on the ``TransformerConfig`` that reaches
  :class:`~megatron_startrail.megatron.core_attention.StarTrailCoreAttention`, for users
  who build the config themselves.

Megatron's args and ``TransformerConfig`` use the same attribute names for all of these.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


@dataclass(frozen=True)
class AttentionOption:
    attribute: str  # the name on Megatron's args and on TransformerConfig
    flag: str
    changes_attention: Callable[[Any], bool]  # the value asks for something StarTrail does not compute
    why: str  # what the option does that StarTrail does not
    fix: str  # what to change


# Why capture stays refused: a CUDA graph replays one fixed sequence of launches on fixed
# addresses, but StarTrail decides its schedule on the host every micro-batch (packed documents:
# one read of cu_seqlens and a small collective, the kernel calls planned from them) and posts
# P2P on NCCL communicators that capture would have to record; none of it has run under capture.
CUDA_GRAPH_WHY = ("capturing StarTrail's layers is not supported: a CUDA graph replays fixed launches on fixed "
                  "addresses, while StarTrail plans each micro-batch's kernel calls and P2P on the host (packed "
                  "documents: a host read of cu_seqlens and a small collective), and capture has never run on a "
                  "GPU here")
FP8_WHY = ("StarTrail's block kernels take bf16/fp16/fp32 Q, K, V and merge the ranks' partial results in float32; "
           "no FP8 attention kernel (with its per-tensor scales agreed across the CP ranks) is wired in")

UNSUPPORTED = (
    AttentionOption(
        "apply_query_key_layer_scaling", "--apply-query-key-layer-scaling",
        bool,
        "StarTrail scales scores by the softmax scale only, not by the layer number",
        "drop --apply-query-key-layer-scaling",
    ),
    AttentionOption(
        "attention_dropout", "--attention-dropout",
        lambda v: bool(v),
        "StarTrail has no dropout on the attention probabilities",
        "set --attention-dropout 0",
    ),
    # GPU-only options: accepted and then ignored or broken would be worse than refused. Each
    # names what to do instead (docs/composition.md, "What stays refused").
    AttentionOption(
        "cuda_graph_impl", "--cuda-graph-impl",
        lambda v: v not in (None, "none"),
        CUDA_GRAPH_WHY,
        "use --cuda-graph-impl none; instead, to cut launch overhead, torch.compile the model (StarTrail's "
        "attention is a graph break, the rest is compiled: docs/composition.md)",
    ),
    AttentionOption(
        "enable_cuda_graph", "--enable-cuda-graph",
        bool,
        CUDA_GRAPH_WHY,
        "drop --enable-cuda-graph; instead torch.compile the model (docs/composition.md)",
    ),
    AttentionOption(
        "external_cuda_graph", "--external-cuda-graph",
        bool,
        CUDA_GRAPH_WHY,
        "drop --external-cuda-graph; instead torch.compile the model (docs/composition.md)",
    ),
    AttentionOption(
        "fp8_dot_product_attention", "TransformerConfig.fp8_dot_product_attention",
        bool,
        FP8_WHY,
        "set fp8_dot_product_attention=False and keep FP8 where it pays, in the linear layers (--fp8-format "
        "with Transformer Engine; the attention's Q, K, V then reach StarTrail in bf16)",
    ),
    AttentionOption(
        "fp8_multi_head_attention", "TransformerConfig.fp8_multi_head_attention",
        bool,
        FP8_WHY,
        "set fp8_multi_head_attention=False and keep FP8 in the linear layers (--fp8-format with Transformer "
        "Engine; the attention's Q, K, V then reach StarTrail in bf16)",
    ),
    AttentionOption(
        "cp_comm_type", "--cp-comm-type",
        lambda v: any(t != "p2p" for t in ([v] if isinstance(v, str) else v)),  # Megatron's default: p2p (a list per layer too)
        "it picks how Megatron's own context parallelism communicates (all-gather, all-to-all, "
        "hierarchical); StarTrail replaces that attention and would ignore it",
        "drop --cp-comm-type (keep its default p2p) and use --ulysses-degree-in-cp U for the all-to-all part",
    ),
    AttentionOption(
        "experimental_attention_variant", "--experimental-attention-variant",
        lambda v: v is not None,
        "DSA sparse attention and gated delta-net linear attention are other attentions than softmax "
        "attention over all keys",
        "drop --experimental-attention-variant",
    ),
)


def unsupported_attention_options(source) -> list[tuple[AttentionOption, Any]]:
    """The options set on ``source`` (Megatron's args or a ``TransformerConfig``) that StarTrail
    does not implement, with their values; attributes ``source`` lacks count as unset."""
    found = []
    for option in UNSUPPORTED:
        value = getattr(source, option.attribute, None)
        if value is not None and option.changes_attention(value):
            found.append((option, value))
    return found


def check_attention_options(source, algo: str = "startrail") -> None:
    """Raise ValueError naming every unsupported attention option set on ``source``."""
    found = unsupported_attention_options(source)
    if not found:
        return
    lines = [f"  {option.flag}{'' if value is True else ' ' + _shown(value)}: {option.why}; {option.fix}"
             for option, value in found]
    raise ValueError(
        f"--context-parallel-algo {algo} does not implement these options (refused rather than "
        "ignored: the run would otherwise compute or do something else than asked for):\n" + "\n".join(lines)
    )


def _shown(value) -> str:
    if isinstance(value, (tuple, list)):
        return ",".join(str(v) for v in value)
    return str(value)
