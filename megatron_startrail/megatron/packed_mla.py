"""Multi-Latent Attention with packed documents under StarTrail context parallelism.

Megatron's ``MLASelfAttention`` (megatron-core 0.19.2) makes q, k, v in
``get_query_key_value_tensors`` and rotates there, with its own ``RotaryEmbedding`` (GPTModel
gives MLA no table), only the last ``qk_pos_emb_head_dim`` channels of q and k::

    query [t/CP, np, qk_head_dim + qk_pos_emb_head_dim], key the same (its rotary part is one
    per token, shared by the heads), value [t/CP, np, v_head_dim]        (THD, packed documents)

For packed documents at CP > 1 two of its steps do not fit StarTrail:

- RoPE: it passes ``cu_seqlens_q(_padded)`` to Megatron's THD RoPE, which assumes the
  document layout (every padded span zigzagged on its own) and runs ``.tolist()`` and
  ``.item()`` in every layer. In the sample layout (``--dataloader-inter-document-masking``:
  the whole sample zigzagged) nearly every position it uses is wrong.
- V: ``_run_core_attention`` zero-pads V to the q/k head dim for THD input (for Transformer
  Engine's kernels) and cuts the output back; StarTrail takes V at its own head dim.

:class:`PerDocumentRopeMLA` changes exactly these two steps. While
``get_query_key_value_tensors`` runs on packed input at CP > 1, the layer's
``rotary_pos_emb`` is a table whose row ``i`` is the embedding of held row ``i``'s position
in its document (``packed_rope.held_rope_positions``, computed once per micro-batch), and
Megatron's code runs as for one unpacked sequence on this rank, which rotates row ``i`` by
row ``i`` of the table. ``_run_core_attention`` hands V to StarTrail unpadded. Unpacked
input, CP = 1 and inference are Megatron's code unchanged.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.multi_latent_attention import MLASelfAttention

try:  # megatron-core >= 0.19 (not in 0.16.1)
    from megatron.core.transformer.multi_latent_attention import FusedMLASelfAttention
except ImportError:
    FusedMLASelfAttention = None

from .core_attention import StarTrailCoreAttention
from .packed_rope import held_rope_positions, is_sample_layout, packed_sample_tokens


class HeldRowsRotary:
    """Stands in for MLA's rotary embedding during one ``get_query_key_value_tensors`` call.

    Called as Megatron calls its rotary embedding, it returns the wrapped one's table of
    positions ``0 .. total-1`` (``packed_seq=True``: not cut for CP) at ``positions``:
    ``[t/CP, 1, 1, qk_pos_emb_head_dim]`` (with YaRN, ``(table, mscale)`` as YaRN returns).
    """

    def __init__(self, rotary: torch.nn.Module, positions: torch.Tensor, total: int):
        self.rotary = rotary
        # Inconsistent cu_seqlens can give positions outside the table; the core attention's
        # agreement check raises for them on every rank, after this lookup (no device assert).
        self.positions = positions.clamp(0, total - 1)
        self.total = total

    def get_rotary_seq_len(self, *args, **kwargs) -> int:
        return self.positions.numel()  # the rows rotated here; __call__ ignores it

    def __call__(self, seq_len=None, packed_seq=False):
        table = self.rotary(self.total, packed_seq=True)
        if isinstance(table, tuple):  # YarnRotaryEmbedding: (table, mscale)
            return (table[0][self.positions], *table[1:])
        return table[self.positions]


class PerDocumentRopeMLA:
    """Mixin for Megatron's MLA self-attention: per-document RoPE and unpadded V for packed
    documents at CP > 1 (module docstring). Put it before the Megatron class."""

    _held_rows_rotary: HeldRowsRotary | None = None  # set only inside get_query_key_value_tensors

    @property
    def rotary_pos_emb(self):
        # MultiLatentAttention.__init__ registers its RotaryEmbedding as a submodule
        # (nn.Module.__setattr__ puts it in _modules, not through this property); Megatron's
        # code reads it back here. The state dict and parameters see only the submodule.
        if self._held_rows_rotary is not None:
            return self._held_rows_rotary
        return self._modules["rotary_pos_emb"]

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None, position_ids=None,
                                    packed_seq_params=None, inference_context=None, *, inference_params=None):
        total = packed_sample_tokens(hidden_states, self.config, self.pg_collection.cp.size())
        inference = inference_context if inference_context is not None else inference_params
        positions = self._per_document_positions(packed_seq_params, total, inference)
        if positions is None:
            return super().get_query_key_value_tensors(hidden_states, key_value_states, position_ids,
                                                       packed_seq_params, inference_context,
                                                       inference_params=inference_params)
        self._held_rows_rotary = HeldRowsRotary(self._modules["rotary_pos_emb"], positions, total)
        try:
            # hidden_states [t/CP, 1, h] as one unpacked sequence of this rank (batch 1):
            # q, k, v, q_compressed, kv_compressed come back as [t/CP, 1, ...].
            tensors = super().get_query_key_value_tensors(hidden_states, key_value_states, position_ids, None)
        finally:
            self._held_rows_rotary = None
        return tuple(x.squeeze(1) for x in tensors)  # Megatron's THD shapes: [t/CP, ...]

    def _per_document_positions(self, packed_seq_params, total: int, inference_context):
        """``[t/CP]`` int64 positions within their documents of the rows this rank holds, or
        None where Megatron's RoPE is used unchanged."""
        cp_group = self.pg_collection.cp
        if (packed_seq_params is None or packed_seq_params.qkv_format != "thd" or cp_group.size() == 1
                or inference_context is not None):
            return None
        if self.config.apply_rope_fusion:
            if is_sample_layout(packed_seq_params):
                # The fused MLA RoPE kernel (YaRN) computes document-layout positions itself.
                raise ValueError(
                    "--multi-latent-attention with --dataloader-inter-document-masking at "
                    "--context-parallel-size > 1: Megatron's fused MLA RoPE assumes each document "
                    "zigzagged on its own, not the whole sample; add --no-rope-fusion"
                )
            return None  # document layout: the fused kernel is written for it
        groups = getattr(self.core_attention, "startrail_groups", None)
        return held_rope_positions(packed_seq_params, cp_group, total,
                                   cache=None if groups is None else groups.documents_cache)

    def _run_core_attention(self, query, key, value, attention_mask, packed_seq_params=None,
                            attn_mask_type=None, **extra_kwargs):
        if not isinstance(self.core_attention, StarTrailCoreAttention):
            return super()._run_core_attention(query, key, value, attention_mask, packed_seq_params=packed_seq_params,
                                               attn_mask_type=attn_mask_type, **extra_kwargs)
        # query/key [t/CP, np, dqk], value [t/CP, np, v_head_dim] -> [t/CP, np * v_head_dim]:
        # StarTrail takes V at its own head dim, so no padding to dqk and no trimming.
        return self.core_attention(
            query, key, value, attention_mask, packed_seq_params=packed_seq_params,
            attn_mask_type=self.attn_mask_type if attn_mask_type is None else attn_mask_type, **extra_kwargs,
        )


class PackedRopeMLASelfAttention(PerDocumentRopeMLA, MLASelfAttention):
    """Megatron's ``MLASelfAttention`` (local and Transformer Engine specs) with
    :class:`PerDocumentRopeMLA`."""


if FusedMLASelfAttention is not None:
    class PackedRopeFusedMLASelfAttention(PerDocumentRopeMLA, FusedMLASelfAttention):
        """Megatron's ``FusedMLASelfAttention`` (TE spec, fused q/kv down projection) with
        :class:`PerDocumentRopeMLA`."""
else:  # megatron-core 0.16.x
    PackedRopeFusedMLASelfAttention = None
