"""A core-attention module for Megatron's ``self_attention.submodules.core_attention``.

Same constructor keywords and forward signature as Megatron's ``DotProductAttention``
(megatron-core 0.16.1 through 0.19.2), so it drops into the local and the Transformer
Engine GPT layer specs. Inputs are this rank's CP shard in Megatron's layout (what
``get_batch_on_this_cp_rank`` gives), heads already split by tensor parallelism::

    query [s/CP, b, np, hn], key/value [s/CP, b, ng, hn]  ->  [s/CP, b, np * hn]

The StarTrail groups are passed in explicitly (``ModuleSpec.params``), never looked up.
"""

from __future__ import annotations

import math

from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule

from ..attention import startrail_attn
from ..groups import StarTrailGroups

# Causal masks are applied by the schedule (the mask tensor, if any, is not needed);
# "no mask" / "padding" mean full attention and work only without an actual mask tensor.
_CAUSAL = (AttnMaskType.causal,)
_NO_MASK = (AttnMaskType.no_mask, AttnMaskType.padding)


class StarTrailCoreAttention(MegatronModule):
    """Exact attention across the context-parallel group with StarTrail."""

    def __init__(
        self,
        config,
        layer_number: int,
        attn_mask_type: AttnMaskType,
        attention_type: str = "self",
        attention_dropout: float | None = None,
        softmax_scale: float | None = None,
        cp_comm_type: str | None = None,
        pg_collection=None,
        k_channels: int | None = None,
        v_channels: int | None = None,
        *,
        startrail_groups: StarTrailGroups,
        transfer: str = "ring",
    ):
        super().__init__(config=config)
        if attention_type != "self":
            raise ValueError("StarTrail context parallelism supports self-attention only")
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if dropout != 0.0:
            raise ValueError(
                f"attention dropout {dropout} is not supported with --context-parallel-algo startrail: "
                "set --attention-dropout 0"
            )
        if getattr(config, "apply_query_key_layer_scaling", False):
            raise ValueError("--apply-query-key-layer-scaling is not supported with StarTrail")
        if startrail_groups.cp_size != config.context_parallel_size:
            raise ValueError(
                f"StarTrail groups were built for CP={startrail_groups.cp_size}, "
                f"but --context-parallel-size is {config.context_parallel_size}"
            )
        self.layer_number = max(1, layer_number)
        self.attn_mask_type = attn_mask_type
        head_dim = k_channels or config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        self.startrail_groups = startrail_groups
        self.transfer = transfer

    def forward(
        self,
        query,
        key,
        value,
        attention_mask,
        attn_mask_type: AttnMaskType | None = None,
        attention_bias=None,
        packed_seq_params=None,
    ):
        if packed_seq_params is not None:
            raise ValueError("packed sequences (THD) are not supported with StarTrail")
        if attention_bias is not None:
            raise ValueError("attention bias is not supported with StarTrail")
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        if mask_type in _CAUSAL:
            causal = True  # a causal mask tensor, if given, is the default one: not needed
        elif mask_type in _NO_MASK and attention_mask is None:
            causal = False  # full attention (e.g. DiT)
        else:
            raise ValueError(
                f"attention mask type {mask_type} with a mask tensor is not supported with StarTrail "
                "(causal, or no mask)"
            )
        # [s/CP, b, np, hn] -> [s/CP, b, np, hn]
        out = startrail_attn(
            query, key, value, self.startrail_groups,
            causal=causal, softmax_scale=self.softmax_scale, transfer=self.transfer,
        )
        # [s/CP, b, np, hn] -> [s/CP, b, np * hn]
        return out.reshape(out.shape[0], out.shape[1], -1)
