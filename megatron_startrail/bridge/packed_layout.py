"""Packed documents through Megatron-Bridge: the layout Bridge cuts them in, told to StarTrail.

StarTrail reads which packed layout a batch is in from ``PackedSeqParams``
(``docs/packed-documents.md``): without ``cu_seqlens_q_padded`` the whole sample is
zigzagged over the CP ranks (the "sample" layout), with it every document's span is (the
"document" layout).

Bridge (0.6.2, ``gpt_step.get_batch``) cuts EVERY packed batch per document:
``_partition_packed_batch_for_cp`` hands megatron-core's per-document balancing the padded
boundaries when the batch has them and the real ones otherwise, so CP rank r holds chunks r
and 2*CP-1-r of every document's span. But the ``PackedSeqParams`` it builds carry
``cu_seqlens_q_padded`` only when the dataset gave padded boundaries
(``get_packed_seq_params``): a batch with real boundaries alone reaches the attention
looking like the sample layout while its tokens are in the document layout, and StarTrail
(and the per-document RoPE) would compute the wrong attention.

So the attention modules of the Bridge spec say what Bridge did: a THD ``PackedSeqParams``
without padded boundaries gets its real ones as padded boundaries (spans with no padding,
each a document; Bridge's partition already required each to be a multiple of 2*CP).
Everything downstream then sees the document layout: Megatron's THD RoPE, the MLA
per-document RoPE, StarTrail's core attention. The other consumer of the layout, the MTP roll
of labels, loss mask, input and position ids (``--mtp-num-layers``; GPTModel hands it Bridge's
parameters, not the attention's), takes the copy the attention recorded on Bridge's
parameters (``megatron/mtp_roll.py``): the decoder's attention runs before every MTP roll of
the micro-batch (the Bridge spec refuses an MTP stage without a decoder layer).
"""

from __future__ import annotations

import dataclasses

from ..megatron.layer_specs import PACKED_DOCUMENT_ATTENTION
from ..megatron.mtp_roll import layout_as_cut, set_layout_as_cut


def as_document_layout(packed_seq_params):
    """``packed_seq_params`` in the document layout Bridge cut the batch in: unchanged when it
    is None, not THD, or already has padded boundaries; else a copy whose padded boundaries are
    its real ones (``cu_seqlens_q_padded = cu_seqlens_q``, the same for kv), recorded on
    ``packed_seq_params`` (``mtp_roll.set_layout_as_cut``) so that the MTP roll of the same
    micro-batch takes it too."""
    if packed_seq_params is None or packed_seq_params.qkv_format != "thd":
        return packed_seq_params
    if packed_seq_params.cu_seqlens_q_padded is not None or packed_seq_params.cu_seqlens_kv_padded is not None:
        return packed_seq_params
    as_cut = layout_as_cut(packed_seq_params)
    if as_cut is packed_seq_params:  # the first layer of this micro-batch: made once, kept on Bridge's params
        as_cut = dataclasses.replace(packed_seq_params, cu_seqlens_q_padded=packed_seq_params.cu_seqlens_q,
                                     cu_seqlens_kv_padded=packed_seq_params.cu_seqlens_kv)
        set_layout_as_cut(packed_seq_params, as_cut)
    return as_cut


class BridgeDocumentLayout:
    """Mixin for a self-attention module: its ``packed_seq_params`` (a keyword, as Megatron's
    ``TransformerLayer`` passes it) go through :func:`as_document_layout` first."""

    def forward(self, *args, packed_seq_params=None, **kwargs):
        return super().forward(*args, packed_seq_params=as_document_layout(packed_seq_params), **kwargs)


def _bridge_version(attention: type) -> type:
    return type(f"Bridge{attention.__name__}", (BridgeDocumentLayout, attention),
                {"__module__": __name__, "__doc__": f"{attention.__name__} on Bridge's per-document packed layout."})


# Megatron's self-attention modules -> the StarTrail spec's version of each (packed_rope.py,
# packed_mla.py) on Bridge's layout.
BRIDGE_ATTENTION = {megatron: _bridge_version(startrail) for megatron, startrail in PACKED_DOCUMENT_ATTENTION.items()}
