"""Turn a GPT layer spec (local or Transformer Engine) into its StarTrail version."""

from __future__ import annotations

import copy

from megatron.core.transformer.attention import SelfAttention
from megatron.core.transformer.multi_latent_attention import MultiLatentAttention
from megatron.core.transformer.spec_utils import ModuleSpec

from ..groups import StarTrailGroups
from .core_attention import StarTrailCoreAttention
from .packed_mla import FusedMLASelfAttention, MLASelfAttention, PackedRopeFusedMLASelfAttention, PackedRopeMLASelfAttention
from .packed_rope import PackedRopeSelfAttention
from .versions import has_full_support, require_full_support

# Megatron's self-attention modules -> the same with RoPE (and, for MLA, V) fixed for packed documents.
PACKED_DOCUMENT_ATTENTION = {
    SelfAttention: PackedRopeSelfAttention,
    MLASelfAttention: PackedRopeMLASelfAttention,
}
if FusedMLASelfAttention is not None:  # megatron-core >= 0.19
    PACKED_DOCUMENT_ATTENTION[FusedMLASelfAttention] = PackedRopeFusedMLASelfAttention


class CallableModuleSpec(ModuleSpec):
    """A ``ModuleSpec`` that can also be called: ``SelfAttention`` calls its
    ``core_attention`` with Megatron's keywords, ``MLASelfAttention`` builds it with
    ``build_module`` (which reads ``module`` and ``params``)."""

    def __call__(self, *args, **kwargs):
        return self.module(*args, **self.params, **kwargs)


def startrail_core_attention(groups: StarTrailGroups):
    """The ``core_attention`` builder: Megatron calls it with its usual keywords. Every
    StarTrail setting comes with ``groups`` (``groups.config``)."""
    return CallableModuleSpec(module=StarTrailCoreAttention, params=dict(startrail_groups=groups))


def to_startrail_spec(spec, groups: StarTrailGroups, attention_modules: dict | None = None):
    """A copy of ``spec`` whose self-attention uses StarTrail core attention, configured by
    ``groups.config`` (a :class:`~megatron_startrail.config.StarTrailConfig`).

    Accepts a transformer-layer ``ModuleSpec`` or a block spec with ``layer_specs``
    (what ``get_gpt_decoder_block_spec`` returns, or ``get_gpt_mtp_block_spec``: then the
    transformer layers inside the multi-token prediction layers, ``--mtp-num-layers``), with
    ``SelfAttention`` or Multi-Latent Attention (``MLASelfAttention``,
    ``FusedMLASelfAttention``). Megatron's ``SelfAttention``
    becomes :class:`PackedRopeSelfAttention` (RoPE of packed documents in the sample layout),
    the MLA ones their :class:`~.packed_mla.PerDocumentRopeMLA` versions (per-document RoPE in
    both packed layouts, V at its own head dim); each is the same module otherwise.
    Everything else is unchanged.

    ``attention_modules``: another map from Megatron's self-attention modules to theirs
    (default :data:`PACKED_DOCUMENT_ATTENTION`; Megatron-Bridge's spec tells them Bridge's
    packed layout, ``megatron_startrail/bridge/packed_layout.py``).

    MLA needs megatron-core 0.19 or newer: on an older one (0.16.1) a spec with an MLA layer
    raises :class:`~.versions.MegatronCoreTooOld` (``versions.py``).
    """
    if not has_full_support() and any(_is_mla(s) for s in _layer_specs(spec)):
        require_full_support("Multi-Latent Attention (--multi-latent-attention)",
                             "its MLASelfAttention has no _run_core_attention to hand V to StarTrail unpadded")
    return with_core_attention(spec, startrail_core_attention(groups),
                               PACKED_DOCUMENT_ATTENTION if attention_modules is None else attention_modules)


def _layer_specs(spec) -> list:
    return list(spec.layer_specs) if hasattr(spec, "layer_specs") else [spec]


def _is_mla(layer_spec) -> bool:
    attention = getattr(getattr(layer_spec, "submodules", None), "self_attention", None)
    module = getattr(attention, "module", None)
    return isinstance(module, type) and issubclass(module, MultiLatentAttention)


def with_core_attention(spec, core_attention, replace_attention: dict | None = None):
    """A copy of a layer or block ``spec`` whose self-attention's core attention is
    ``core_attention`` (a module class or builder), and whose self-attention module is
    ``replace_attention[module]`` where listed."""
    spec = copy.copy(spec)
    if hasattr(spec, "layer_specs"):  # TransformerBlockSubmodules
        spec.layer_specs = [with_core_attention(s, core_attention, replace_attention) for s in spec.layer_specs]
        return spec
    submodules = copy.copy(spec.submodules)
    if hasattr(submodules, "mtp_model_layer"):
        # A MultiTokenPredictionLayer (the layers of get_gpt_mtp_block_spec's block): its
        # attention is that of the transformer layer it wraps, built apart from the decoder's.
        submodules.mtp_model_layer = with_core_attention(submodules.mtp_model_layer, core_attention, replace_attention)
        spec.submodules = submodules
        return spec
    attention = copy.copy(submodules.self_attention)
    attention.module = (replace_attention or {}).get(attention.module, attention.module)
    attention_submodules = copy.copy(attention.submodules)
    attention_submodules.core_attention = core_attention
    attention.submodules = attention_submodules
    submodules.self_attention = attention
    spec.submodules = submodules
    return spec
