"""Turn a GPT layer spec (local or Transformer Engine) into its StarTrail version."""

from __future__ import annotations

import copy
import functools

from megatron.core.transformer.attention import SelfAttention

from ..groups import StarTrailGroups
from .core_attention import StarTrailCoreAttention
from .packed_rope import PackedRopeSelfAttention


def startrail_core_attention(groups: StarTrailGroups, transfer: str = "ring"):
    """The ``core_attention`` builder: Megatron calls it with its usual keywords."""
    return functools.partial(StarTrailCoreAttention, startrail_groups=groups, transfer=transfer)


def to_startrail_spec(spec, groups: StarTrailGroups, transfer: str = "ring"):
    """A copy of ``spec`` whose self-attention uses StarTrail core attention.

    Accepts a transformer-layer ``ModuleSpec`` or a block spec with ``layer_specs``
    (what ``get_gpt_decoder_block_spec`` returns). Megatron's ``SelfAttention`` becomes
    :class:`PackedRopeSelfAttention` (RoPE of packed documents in the sample layout; the
    same module otherwise). Everything else is unchanged.
    """
    spec = copy.copy(spec)
    if hasattr(spec, "layer_specs"):  # TransformerBlockSubmodules
        spec.layer_specs = [to_startrail_spec(s, groups, transfer) for s in spec.layer_specs]
        return spec
    submodules = copy.copy(spec.submodules)
    attention = copy.copy(submodules.self_attention)
    if attention.module is SelfAttention:
        attention.module = PackedRopeSelfAttention
    attention_submodules = copy.copy(attention.submodules)
    attention_submodules.core_attention = startrail_core_attention(groups, transfer)
    attention.submodules = attention_submodules
    submodules.self_attention = attention
    spec.submodules = submodules
    return spec
