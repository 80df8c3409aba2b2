"""Turn a GPT layer spec (local or Transformer Engine) into its StarTrail version."""

from __future__ import annotations

import copy
import functools

from ..groups import StarTrailGroups
from .core_attention import StarTrailCoreAttention


def startrail_core_attention(groups: StarTrailGroups, transfer: str = "ring", regather_in_backward: bool = False):
    """The ``core_attention`` builder: Megatron calls it with its usual keywords."""
    return functools.partial(StarTrailCoreAttention, startrail_groups=groups, transfer=transfer,
                             regather_in_backward=regather_in_backward)


def to_startrail_spec(spec, groups: StarTrailGroups, transfer: str = "ring", regather_in_backward: bool = False):
    """A copy of ``spec`` whose self-attention uses StarTrail core attention.

    Accepts a transformer-layer ``ModuleSpec`` or a block spec with ``layer_specs``
    (what ``get_gpt_decoder_block_spec`` returns), with ``SelfAttention`` or Multi-Latent
    Attention (``MLASelfAttention``). Everything else is unchanged.
    """
    spec = copy.copy(spec)
    if hasattr(spec, "layer_specs"):  # TransformerBlockSubmodules
        spec.layer_specs = [to_startrail_spec(s, groups, transfer, regather_in_backward) for s in spec.layer_specs]
        return spec
    submodules = copy.copy(spec.submodules)
    attention = copy.copy(submodules.self_attention)
    attention_submodules = copy.copy(attention.submodules)
    attention_submodules.core_attention = startrail_core_attention(groups, transfer, regather_in_backward)
    attention.submodules = attention_submodules
    submodules.self_attention = attention
    spec.submodules = submodules
    return spec
