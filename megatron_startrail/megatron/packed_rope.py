"""RoPE for packed documents in Megatron's sample layout under context parallelism.

With ``--dataloader-inter-document-masking`` Megatron zigzags the WHOLE packed sample
(``get_batch_on_this_cp_rank(..., use_per_sequence_balancing=True)``: CP rank r holds
chunks r and 2*CP-1-r of the sample, ``cu_seqlens`` stay global) and hands attention
``PackedSeqParams(qkv_format="thd")`` without ``cu_seqlens_*_padded``. Megatron's THD RoPE
(``rope_utils._apply_rotary_pos_emb_thd``) assumes the other, per-document layout: it cuts
this rank's tokens into pieces of ``document length / CP`` and rotates each piece by the
front/back chunk positions of its document. For the sample layout that is the wrong
position for nearly every token (and a split error when a document length is not a
multiple of CP). docs/design.md, "RoPE with packed documents", describes the pitfall.

:class:`PackedRopeSelfAttention` is Megatron's ``SelfAttention`` with one change: in the
sample layout with CP > 1 it rotates query and key itself, every held token by its
per-document position (the ``position_ids`` that ``GPTDataset`` writes: global index minus
the start of its document), with the frequencies GPTModel computed, and gives Megatron's
own RoPE nothing to do. Every other case (no packing, CP = 1, the per-document layout with
``cu_seqlens_*_padded``, which Megatron rotates correctly) is Megatron's code unchanged.

:func:`held_rope_positions` gives the per-document positions of the held rows in either
layout (:func:`sample_layout_positions`, :func:`document_layout_positions`) for Multi-Latent
Attention, which computes its own RoPE table (``packed_mla.py``).
"""

from __future__ import annotations

import torch
from megatron.core.models.common.embeddings.rope_utils import apply_rotary_pos_emb
from megatron.core.transformer.attention import SelfAttention

from .core_attention import packed_documents


def sample_layout_positions(cu_seqlens: torch.Tensor, cp_size: int, cp_rank: int,
                            total: int | None = None) -> torch.Tensor:
    """Per-document positions of the tokens CP rank ``cp_rank`` holds in the sample layout.

    ``cu_seqlens``: int32 ``[n_docs + 1]``, global, ``cu_seqlens[-1] = S`` (a multiple of
    2*CP). Returns int64 ``[S / CP]``: chunk ``cp_rank`` then chunk ``2*CP-1-cp_rank``.
    E.g. cu_seqlens [0, 3, 8], CP 2, rank 0 holds tokens [0, 1, 6, 7] -> positions [0, 1, 3, 4].
    ``total`` = S when the caller knows it from a shape (no host sync); else it is read
    from ``cu_seqlens[-1]`` (one host sync). The attention's agreement checks the two match.
    """
    cu_seqlens = cu_seqlens.to(torch.int64)
    total = int(cu_seqlens[-1]) if total is None else total
    if total % (2 * cp_size) != 0:
        raise ValueError(
            f"packed sample of {total} tokens is not divisible by 2 * --context-parallel-size = {2 * cp_size}"
        )
    held = sample_layout_rows(total, cp_size, cp_rank, cu_seqlens.device)
    document = torch.searchsorted(cu_seqlens[1:], held, right=True)  # index of the document holding each token
    return held - cu_seqlens[document]


def sample_layout_rows(total: int, cp_size: int, cp_rank: int, device) -> torch.Tensor:
    """int64 ``[total / CP]``: the sample rows CP rank ``cp_rank`` holds in the sample layout,
    chunk ``cp_rank`` then chunk ``2*CP-1-cp_rank`` of ``2*CP`` (built on ``device``, no copy)."""
    chunk = total // (2 * cp_size)
    return torch.cat([
        torch.arange(cp_rank * chunk, (cp_rank + 1) * chunk, device=device),
        torch.arange((2 * cp_size - 1 - cp_rank) * chunk, (2 * cp_size - cp_rank) * chunk, device=device),
    ])


def document_layout_positions(cu_seqlens_padded: torch.Tensor, cp_size: int, cp_rank: int,
                              local_tokens: int) -> torch.Tensor:
    """Per-document positions of the rows CP rank ``cp_rank`` holds in the document layout.

    ``cu_seqlens_padded``: int32 ``[n_docs + 1]``, global padded spans, each a multiple of
    2*CP (Transformer Engine's THD CP layout: every span zigzagged on its own, real tokens
    first). ``local_tokens`` = ``cu_seqlens_padded[-1] / CP``, the rows this rank holds
    (from a shape: no host sync). Returns int64 ``[local_tokens]``: for every document in
    order, chunk ``cp_rank`` then chunk ``2*CP-1-cp_rank`` of its span, as positions
    counted from the document's start (padding rows continue past its real end).
    E.g. cu_seqlens_padded [0, 4, 12], CP 2, rank 0 holds sample rows [0, 3, 4, 5, 10, 11]
    -> positions [0, 3, 0, 1, 6, 7]. Inconsistent input gives positions outside
    ``[0, span)``; the core attention's agreement check then raises on every rank.
    """
    return document_layout_rows(cu_seqlens_padded, cp_size, cp_rank, local_tokens)[1]


def document_layout_rows(cu_seqlens_padded: torch.Tensor, cp_size: int, cp_rank: int,
                         local_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(document, position)``, int64 ``[local_tokens]`` each: the document of every row CP
    rank ``cp_rank`` holds in the document layout and its position in it
    (:func:`document_layout_positions`)."""
    padded = cu_seqlens_padded.to(torch.int64)
    local_start = padded // cp_size  # where every document's rows start on each rank: [n_docs + 1]
    row = torch.arange(local_tokens, device=padded.device)
    # The document of each row (right=True skips empty spans); clamped only for bad input.
    document = torch.searchsorted(local_start[1:], row, right=True).clamp_(max=padded.numel() - 2)
    offset = row - local_start[document]  # row within this rank's part of its document
    chunk = (padded[document + 1] - padded[document]) // (2 * cp_size)
    # front chunk: cp_rank * chunk + offset; back chunk: (2CP-1-cp_rank) * chunk + (offset - chunk)
    position = torch.where(offset < chunk, cp_rank * chunk + offset, (2 * cp_size - 2 - cp_rank) * chunk + offset)
    return document, position


def packed_sample_tokens(hidden_states: torch.Tensor, config, cp_size: int) -> int:
    """Tokens of the whole packed sample, from the attention input's shape (no host sync):
    ``hidden_states`` is ``[t / (CP * TP), 1, hidden]`` with --sequence-parallel, else
    ``[t / CP, 1, hidden]`` (the rule of Megatron's ``RotaryEmbedding.get_rotary_seq_len``)."""
    tp = config.tensor_model_parallel_size if config.sequence_parallel else 1
    return hidden_states.shape[0] * tp * cp_size


def held_rope_positions(packed_seq_params, cp_group, total: int, cache=None) -> torch.Tensor:
    """Per-document RoPE positions of the rows this CP rank holds, in either packed layout:
    int64 ``[total / CP]``. Self-attention: the query side's boundaries (the core attention
    checks that the key/value side's are the same). ``cache``: the StarTrail groups'
    :class:`~megatron_startrail.microbatch.MicroBatchCache`, so that the layers of a
    micro-batch compute them once."""
    cu_seqlens, cu_seqlens_padded = packed_documents(packed_seq_params)
    size, rank = cp_group.size(), cp_group.rank()

    def compute():
        if cu_seqlens_padded is None:
            return sample_layout_positions(cu_seqlens, size, rank, total)
        return document_layout_positions(cu_seqlens_padded, size, rank, total // size)

    if cache is None:
        return compute()
    # Keyed by Megatron's own tensors (packed_documents may hand back new squeezed views).
    keys = (packed_seq_params.cu_seqlens_q, packed_seq_params.cu_seqlens_q_padded)
    return cache.get("rope_positions", keys, (total, rank), compute)


def is_sample_layout(packed_seq_params) -> bool:
    """THD packed documents with the whole sample zigzagged (no padded per-document spans)."""
    return (
        packed_seq_params is not None
        and packed_seq_params.qkv_format == "thd"
        and packed_seq_params.cu_seqlens_q_padded is None
        and packed_seq_params.cu_seqlens_kv_padded is None
    )


class PackedRopeSelfAttention(SelfAttention):
    """Megatron's SelfAttention, with RoPE by per-document position in the packed sample layout."""

    _sample_layout_freqs = None  # (q freqs, k freqs) [s/CP, 1, 1, d], set only inside forward
    _rope_cp_group = None  # the CP group the held rows were zigzagged over, set only inside forward

    def forward(self, hidden_states, attention_mask=None, **kwargs):
        rotary_pos_emb = kwargs.get("rotary_pos_emb")
        packed_seq_params = kwargs.get("packed_seq_params")
        cp_group = self.pg_collection.cp
        if getattr(packed_seq_params, "local_cp_size", None) not in (None, 1):
            # Hybrid (dynamic) CP: the sub-sample was zigzagged over its own group, which
            # Megatron's THD RoPE (on the fixed CP group) knows nothing of.
            cp_group = packed_seq_params.cp_group
        if (rotary_pos_emb is None or not is_sample_layout(packed_seq_params) or cp_group.size() == 1
                or self.skips_rope()):
            return super().forward(hidden_states, attention_mask, **kwargs)
        if not isinstance(rotary_pos_emb, tuple):
            rotary_pos_emb = (rotary_pos_emb, rotary_pos_emb)
        # hidden_states [t/CP, 1, hidden] ([t/(CP*TP), ...] with --sequence-parallel): t from the shape.
        total = packed_sample_tokens(hidden_states, self.config, cp_group.size())
        positions_q, positions_kv = (self._positions(cu, cp_group, total) for cu in
                                     (packed_seq_params.cu_seqlens_q, packed_seq_params.cu_seqlens_kv))
        # GPTModel gives the table of positions 0..max_seqlen-1, [max_seqlen, 1, 1, d]
        # (not cut for CP when packed); pick the row of every held token: [s/CP, 1, 1, d].
        self._sample_layout_freqs = (rotary_pos_emb[0][positions_q], rotary_pos_emb[1][positions_kv])
        self._rope_cp_group = cp_group
        try:
            return super().forward(hidden_states, attention_mask, **{**kwargs, "rotary_pos_emb": None})
        finally:
            self._sample_layout_freqs = self._rope_cp_group = None

    def _positions(self, cu_seqlens: torch.Tensor, cp_group, total: int) -> torch.Tensor:
        """This rank's per-document positions: once per micro-batch, in the StarTrail groups'
        :class:`~megatron_startrail.microbatch.MicroBatchCache` that every layer shares (found
        through this layer's StarTrail core attention)."""
        def compute():
            return sample_layout_positions(cu_seqlens, cp_group.size(), cp_group.rank(), total)

        groups = getattr(getattr(self, "core_attention", None), "startrail_groups", None)
        if groups is None or groups.documents_cache is None:
            return compute()
        return groups.documents_cache.get("rope_positions", (cu_seqlens,), (total, cp_group.rank()), compute)

    def skips_rope(self) -> bool:
        """A no-RoPE layer of ``--no-rope-freq`` (Megatron drops its rotary embedding inside
        ``Attention.forward``; rotating here would undo that). ``no_rope_freq`` is the
        per-layer list ``TransformerConfig`` makes of the flag, 1 = no RoPE."""
        pattern = self.config.no_rope_freq
        return bool(pattern[self.layer_number - 1]) if pattern else False

    def get_query_key_value_tensors(self, hidden_states, key_value_states=None, output_gate=False, split_qkv=True):
        qkv = super().get_query_key_value_tensors(
            hidden_states, key_value_states, output_gate=output_gate, split_qkv=split_qkv
        )
        if self._sample_layout_freqs is None:
            return qkv
        if not split_qkv:
            raise ValueError("packed documents with CP need split Q/K/V for RoPE: drop --fused-single-qkv-rope")
        q_freqs, k_freqs = self._sample_layout_freqs
        mscale = getattr(self, "_yarn_concentration_factor", 1.0)
        # query [s/CP, b, np, hn], key [s/CP, b, ng, hn] (b = 1 when packed): rotated as plain sequences.
        cp_group = self._rope_cp_group
        query = apply_rotary_pos_emb(qkv[0], q_freqs, config=self.config, mscale=mscale, cp_group=cp_group)
        key = apply_rotary_pos_emb(qkv[1], k_freqs, config=self.config, mscale=mscale, cp_group=cp_group)
        return (query, key, *qkv[2:])
