"""megatron-core's ``HybridModel`` with StarTrail: its stack spec's attention layers get
StarTrail core attention, every other layer stays Megatron's.

``HybridModel`` (megatron-core 0.19.2; ``GPTModel`` is marked deprecated in its favour) builds
a ``HybridStack`` from ``--hybrid-layer-pattern``, one symbol per layer, each from its own
slot of ``HybridStackSubmodules``::

    *  attention_layer   SelfAttention (softmax attention)    -> StarTrail core attention
    +  mla_layer         MLASelfAttention (softmax attention) -> StarTrail core attention
    D  dsa_layer         DeepSeek sparse attention            -> refused with StarTrail
    M  mamba_layer       Mamba mixer                          } keep Megatron's own CP: an all-to-all
    G  gdn_layer         gated delta net (linear attention)   } over the same CP group (see below)
    -  mlp_layer, E moe_layer                                 -> unchanged (no sequence mixing)

The attention layers are transformer layers whose ``self_attention`` has a
``core_attention`` slot: the same seam as the GPT layer spec, converted by the same
:func:`~megatron_startrail.megatron.layer_specs.to_startrail_spec`.

Mamba and GDN layers with CP > 1 run Megatron's own context parallelism
(``megatron/core/ssm/mamba_context_parallel.py``): an all-to-all over ``pg_collection.cp``
from sequence shards to head shards, then ``_undo_attention_load_balancing`` puts the 2*CP
zigzag chunks back in order. StarTrail keeps Megatron's CP group and that dense layout
(chunks r and 2*CP-1-r on CP rank r), so those layers compose unchanged; they need GPU
kernels (mamba_ssm, causal_conv1d; flash-linear-attention for GDN) and are not run here.
With packed documents in the *sample* layout (``--dataloader-inter-document-masking``: the
whole packed sample zigzagged) they would reorder tokens by Transformer Engine's
per-document layout instead, so that combination is refused (:func:`check_startrail_hybrid_pattern`).

:func:`hybrid_local_stack_spec` is the stack spec from megatron-core's local modules (torch
norms, no Transformer Engine), for the CPU: megatron-core 0.19.2 ships the hybrid stack only
with Transformer Engine modules. It has attention, MLP and MoE layers; the other symbols
stop the build with an error naming ``--hybrid-layer-pattern``.

megatron-core 0.19 or newer (0.16.1 has no ``megatron.core.models.hybrid``): on an older one
this module imports, and each function here raises :class:`~.versions.MegatronCoreTooOld`.
"""

from __future__ import annotations

import copy

import torch
from megatron.core.transformer.spec_utils import ModuleSpec
from megatron.core.transformer.transformer_layer import (
    MoETransformerLayer,
    TransformerLayer,
    TransformerLayerSubmodules,
)

from ..groups import StarTrailGroups
from .layer_specs import to_startrail_spec
from .versions import require_full_support

try:  # megatron-core >= 0.19; 0.16.1 has neither the hybrid stack nor the local GPT submodules
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_submodules
    from megatron.core.models.hybrid.hybrid_block import HybridStack, HybridStackSubmodules
    from megatron.core.models.hybrid.hybrid_layer_allocation import Symbols
    from megatron.core.ssm.mlp_layer import MLPLayer
except ImportError:
    HybridStack = Symbols = None

if Symbols is not None:
    # Slots whose layers are softmax attention with a core_attention seam, by pattern symbol.
    ATTENTION_SLOTS = {Symbols.ATTENTION: "attention_layer", Symbols.MLA: "mla_layer"}
    # Megatron's own CP (all-to-all over the CP group) in these layers: the dense layout only.
    OWN_CP_SYMBOLS = {Symbols.MAMBA: "Mamba", Symbols.GDN: "gated delta net"}
else:
    ATTENTION_SLOTS, OWN_CP_SYMBOLS = {}, {}


def _require_hybrid() -> None:
    """:class:`~.versions.MegatronCoreTooOld` where megatron-core has no ``HybridModel`` (0.16.1)."""
    if HybridStack is None:
        require_full_support("HybridModel (--hybrid-layer-pattern)", "no megatron.core.models.hybrid")


class UnavailableLayer(torch.nn.Module):
    """Stands in a ``HybridStackSubmodules`` slot that cannot be built: building it raises."""

    def __init__(self, *args, reason: str, **kwargs):
        super().__init__()
        raise ValueError(reason)


def _unavailable(reason: str) -> ModuleSpec:
    return ModuleSpec(module=UnavailableLayer, params={"reason": reason})


def hybrid_local_stack_spec(normalization: str | None = None, qk_layernorm: bool = False,
                            num_experts: int | None = None, moe_grouped_gemm: bool = False) -> ModuleSpec:
    """A ``HybridStack`` spec from megatron-core's local modules: attention ('*'), MLP ('-') and,
    with ``num_experts``, MoE ('E') layers, cut from the local GPT layer (Megatron's TE hybrid
    spec is cut from the TE GPT layer the same way: attention without the MLP, MLP alone)."""
    _require_hybrid()
    gpt = get_gpt_layer_local_submodules(normalization=normalization, qk_layernorm=qk_layernorm)
    attention_layer = ModuleSpec(module=TransformerLayer, submodules=TransformerLayerSubmodules(
        input_layernorm=gpt.input_layernorm, self_attention=gpt.self_attention, self_attn_bda=gpt.self_attn_bda))
    mlp_layer = ModuleSpec(module=MLPLayer, submodules=TransformerLayerSubmodules(
        pre_mlp_layernorm=gpt.pre_mlp_layernorm, mlp=gpt.mlp, mlp_bda=gpt.mlp_bda))
    if num_experts:
        moe = get_gpt_layer_local_submodules(num_experts=num_experts, moe_grouped_gemm=moe_grouped_gemm,
                                             normalization=normalization)
        moe_layer = ModuleSpec(module=MoETransformerLayer, submodules=TransformerLayerSubmodules(
            pre_mlp_layernorm=moe.pre_mlp_layernorm, mlp=moe.mlp, mlp_bda=moe.mlp_bda))
    else:
        moe_layer = _unavailable("--hybrid-layer-pattern has MoE layers ('E'): set --num-experts")

    def gpu_only(symbol, what):
        return _unavailable(
            f"--hybrid-layer-pattern has {what} layers ({symbol!r}), which megatron-core builds only from "
            "Transformer Engine modules and GPU kernels: use --transformer-impl transformer_engine on a GPU, "
            "or a pattern of '*', '-' and 'E'"
        )

    return ModuleSpec(module=HybridStack, submodules=HybridStackSubmodules(
        attention_layer=attention_layer, mlp_layer=mlp_layer, moe_layer=moe_layer,
        mamba_layer=gpu_only(Symbols.MAMBA, "Mamba"), gdn_layer=gpu_only(Symbols.GDN, "gated delta net"),
        mla_layer=gpu_only(Symbols.MLA, "MLA"), dsa_layer=gpu_only(Symbols.DS_ATTENTION, "DeepSeek sparse attention"),
    ))


def to_startrail_hybrid_spec(stack_spec: ModuleSpec, groups: StarTrailGroups) -> ModuleSpec:
    """A copy of a ``HybridStack`` spec whose attention layers ('*' and MLA '+') use StarTrail
    core attention (through :func:`to_startrail_spec`, so ``SelfAttention`` becomes
    ``PackedRopeSelfAttention`` as in GPT), and whose DeepSeek sparse attention layers ('D')
    refuse to build. Mamba, GDN, MLP, MoE and the MTP block spec are the same objects: the
    MTP layers are built from these slots too, so their attention is StarTrail's as well."""
    _require_hybrid()
    submodules = copy.copy(stack_spec.submodules)
    for slot in ATTENTION_SLOTS.values():
        layer = getattr(submodules, slot)
        if isinstance(layer, ModuleSpec) and getattr(layer.submodules, "self_attention", None) is not None:
            setattr(submodules, slot, to_startrail_spec(layer, groups))
    submodules.dsa_layer = _unavailable(
        "--hybrid-layer-pattern has DeepSeek sparse attention layers ('D'), which --context-parallel-algo "
        "startrail does not implement: use '*' or '+' layers, or --context-parallel-algo megatron"
    )
    spec = copy.copy(stack_spec)
    spec.submodules = submodules
    return spec


def check_startrail_hybrid_pattern(pattern: str | None, packed_sample_layout: bool) -> None:
    """What a StarTrail run refuses in ``--hybrid-layer-pattern``, as a ValueError naming the
    flag (pure; before any process group exists)."""
    if not pattern:
        return
    _require_hybrid()
    if Symbols.DS_ATTENTION in pattern:
        raise ValueError(
            f"--hybrid-layer-pattern {pattern!r} has DeepSeek sparse attention layers ('D'), which "
            "--context-parallel-algo startrail does not implement: use '*' or '+' layers"
        )
    own_cp = sorted(name for symbol, name in OWN_CP_SYMBOLS.items() if symbol in pattern)
    if own_cp and packed_sample_layout:
        raise ValueError(
            f"--hybrid-layer-pattern {pattern!r} has {' and '.join(own_cp)} layers, whose context parallelism "
            "(Megatron's) orders packed tokens by document, while --dataloader-inter-document-masking zigzags "
            "the whole packed sample (StarTrail's sample layout): drop --dataloader-inter-document-masking "
            "or those layers"
        )
