"""A core-attention module for Megatron's ``self_attention.submodules.core_attention``.

Same constructor keywords and forward signature as Megatron's ``DotProductAttention``
(megatron-core 0.16.1 through 0.19.2), so it drops into the local and the Transformer
Engine GPT layer specs. Inputs are this rank's CP shard in Megatron's layout (what
``get_batch_on_this_cp_rank`` gives), heads already split by tensor parallelism::

    query [s/CP, b, np, hn], key/value [s/CP, b, ng, hn]  ->  [s/CP, b, np * hn]

Multi-Latent Attention (``MLASelfAttention``, ``--multi-latent-attention``) builds it with
``k_channels`` = q/k head dim (``--qk-head-dim + --qk-pos-emb-head-dim``) and
``v_channels`` = ``--v-head-dim``; value and output then have the V head dim::

    query/key [s/CP, b, np, k_channels], value [s/CP, b, np, v_channels] -> [s/CP, b, np * v_channels]

Packed documents (``PackedSeqParams(qkv_format="thd")``, Megatron's
``--dataloader-inter-document-masking`` and ``--sft``) come as one flattened sample::

    query [t/CP, np, hn], key/value [t/CP, ng, hn]          ->  [t/CP, np * hn]

with global ``cu_seqlens_q/kv``; without ``cu_seqlens_q/kv_padded`` the whole sample is
zigzagged (``get_batch_on_this_cp_rank(..., use_per_sequence_balancing=True)``), with
them every document's padded span is (per-document balancing, SFT). See
``startrail_attn`` and Note [documents] in ``megatron_startrail.layout``.

The StarTrail groups are passed in explicitly (``ModuleSpec.params``), never looked up; their
``config`` (:class:`~megatron_startrail.config.StarTrailConfig`) is every StarTrail setting
of the run (transfer, regathering, backward rotation, kernel). With Megatron's hybrid
(dynamic) CP they are a :class:`~megatron_startrail.megatron.dynamic_cp.DynamicCPGroups`,
and each call runs on the set of its sub-sample's CP size (``PackedSeqParams.local_cp_size``,
``cp_group``): the sub-sample, zigzagged over that group, is one packed sample.

QK-clip and ``--log-max-attention-logit`` (``config.qk_clip`` / ``log_max_attention_logit``):
like Megatron's Transformer Engine attention (``TEDotProductAttention``, TE >= 2.9's
``return_max_logit``), every forward that computes the attention raises
``current_max_attn_logits`` (``[heads of this TP partition]``, no gradient) to the largest
scaled logit per head this rank's attention saw; Megatron's ``clip_qk`` all-reduces it with MAX
over DP x CP after the optimizer step, clips, and sets it back to None. A recomputation that
takes the kept attention computes nothing and leaves it as the first pass set it; one that
recomputes the attention sees the same logits again (a max: unchanged).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from megatron.core.transformer.enums import AttnMaskType
from megatron.core.transformer.module import MegatronModule
from megatron.core.transformer.utils import is_layer_window_attention

from ..attention import startrail_attn
from ..compile_boundary import compile_boundary
from ..groups import StarTrailGroups
from ..layout import normalize_window
from .attention_options import check_attention_options
from .dynamic_cp import DynamicCPGroups
from .kept_attention import KeptAttention
from .softmax_offset import make_softmax_offset, softmax_offset_sharded_state_dict, tp_group_of

# Causal masks are applied by the schedule (the mask tensor, if any, is not needed);
# "no mask" / "padding" mean full attention and work only without an actual mask tensor.
_CAUSAL = (AttnMaskType.causal,)
_NO_MASK = (AttnMaskType.no_mask, AttnMaskType.padding)


def _same(name: str, q_side, kv_side):
    """Self-attention: the query and key/value sides must describe the same documents."""
    if kv_side is not None and q_side is not None and kv_side is not q_side and not torch.equal(q_side, kv_side):
        raise ValueError(f"{name}_q and {name}_kv differ; StarTrail supports self-attention on one packed sample")
    return q_side if q_side is not None else kv_side


def packed_documents(packed_seq_params) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(cu_seqlens, cu_seqlens_padded or None)`` of Megatron's ``PackedSeqParams``."""
    if packed_seq_params.qkv_format != "thd":
        raise ValueError(
            f"packed_seq_params.qkv_format={packed_seq_params.qkv_format!r}: StarTrail takes packed "
            "sequences in the 'thd' format only"
        )
    cu = _same("cu_seqlens", packed_seq_params.cu_seqlens_q, packed_seq_params.cu_seqlens_kv)
    padded = _same("cu_seqlens_padded", packed_seq_params.cu_seqlens_q_padded, packed_seq_params.cu_seqlens_kv_padded)
    if cu is None:
        raise ValueError("packed_seq_params needs cu_seqlens_q (global document boundaries)")
    # A [1, n_docs + 1] batch row (as flatten_batch_for_packed_sequences leaves it) -> [n_docs + 1]
    cu, padded = (t.squeeze(0) if t is not None and t.dim() == 2 and t.shape[0] == 1 else t for t in (cu, padded))
    return cu, padded


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
        startrail_groups: StarTrailGroups | DynamicCPGroups,
    ):
        super().__init__(config=config)
        if attention_type != "self":
            raise ValueError("StarTrail context parallelism supports self-attention only")
        check_attention_options(config)  # what would change the mask or the softmax: refused
        if attention_dropout:
            raise ValueError(
                f"attention dropout {attention_dropout} is not supported with --context-parallel-algo startrail: "
                "set --attention-dropout 0"
            )
        dynamic = isinstance(startrail_groups, DynamicCPGroups)
        if getattr(config, "hybrid_context_parallel", False) and not dynamic:
            raise ValueError(
                "--hybrid-context-parallel runs every sub-sample on a CP group of its own size: build the StarTrail "
                "groups for it (startrail_spec_from_args with the flag; megatron/dynamic_cp.py), not for the fixed "
                "CP group"
            )
        if not dynamic and startrail_groups.cp_size != config.context_parallel_size:
            raise ValueError(
                f"StarTrail groups were built for CP={startrail_groups.cp_size}, "
                f"but --context-parallel-size is {config.context_parallel_size}"
            )
        # Megatron hands modules their process groups in pg_collection: the CP group there must
        # be the one the StarTrail groups were built in, and the packed-document check runs on it.
        self.cp_group = getattr(pg_collection, "cp", None) if pg_collection is not None else None
        if self.cp_group is not None and not dynamic:
            cp_ranks = tuple(dist.get_process_group_ranks(self.cp_group))
            if cp_ranks != tuple(startrail_groups.cp_global_ranks):
                raise ValueError(
                    f"pg_collection.cp holds ranks {list(cp_ranks)}, but the StarTrail groups were built for the "
                    f"CP group {list(startrail_groups.cp_global_ranks)}: build them with initialize_startrail "
                    "after the parallel state that made pg_collection (same --context-parallel-size and order)"
                )
        self.layer_number = max(1, layer_number)
        # --window-size / --window-attn-skip-freq: this layer's sliding window, by Megatron's own
        # rule (None: a full-attention layer); StarTrail applies it (startrail_attn window_size).
        self.window_size = tuple(config.window_size) if is_layer_window_attention(
            config.window_size, config.window_attn_skip_freq, self.layer_number) else None
        self.attn_mask_type = attn_mask_type
        head_dim = k_channels or config.kv_channels
        self.softmax_scale = softmax_scale if softmax_scale is not None else 1.0 / math.sqrt(head_dim)
        self.startrail_groups = startrail_groups
        self.v_channels = v_channels  # None: value's head dim is the query's
        # --softmax-type (attention sinks): Megatron's own softmax_offset, one per head of the TP partition
        self.tp_group = tp_group_of(pg_collection)
        self.kept = KeptAttention()  # attention graphs kept through recomputation, oldest first
        # --qk-clip / --log-max-attention-logit: Megatron reads and resets current_max_attn_logits
        self.reports_max_logit = bool(getattr(config, "qk_clip", False)
                                      or getattr(config, "log_max_attention_logit", False))
        self.current_max_attn_logits = None
        make_softmax_offset(self, config, config.num_attention_heads // self.tp_group.size())

    @compile_boundary  # host checks, kept attention, StarTrail: eager (Note [graph break at the attention])
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
        cu_seqlens = cu_seqlens_padded = None
        groups, cp_group = self._groups_for(packed_seq_params)
        if packed_seq_params is not None:
            cu_seqlens, cu_seqlens_padded = packed_documents(packed_seq_params)
        if attention_bias is not None:
            raise ValueError("attention bias is not supported with StarTrail")
        mask_type = attn_mask_type if attn_mask_type is not None else self.attn_mask_type
        if mask_type in _CAUSAL or (cu_seqlens is not None and mask_type == AttnMaskType.padding_causal):
            causal = True  # a causal mask tensor, if given, is the default one: not needed
        elif mask_type in _NO_MASK and attention_mask is None:
            causal = False  # full attention (e.g. DiT)
        else:
            raise ValueError(
                f"attention mask type {mask_type} with a mask tensor is not supported with StarTrail "
                "(causal, or no mask)"
            )
        if self.v_channels is not None and value.shape[-1] != self.v_channels:
            raise ValueError(
                f"value head dim {value.shape[-1]} != v_channels {self.v_channels} (--v-head-dim); "
                "StarTrail takes V at its own head dim, unpadded"
            )
        def attend(q, k, v):  # [s/CP, b, np, hn] -> [s/CP, b, np, hv]   (THD: [t/CP, np, hn] -> [t/CP, np, hv])
            out = startrail_attn(q, k, v, groups, causal=causal, softmax_scale=self.softmax_scale,
                                 cu_seqlens=cu_seqlens, cu_seqlens_padded=cu_seqlens_padded, cp_group=cp_group,
                                 window_size=self.window_size, softmax_offset=self.softmax_offset,
                                 return_max_logit=self.reports_max_logit)
            if self.reports_max_logit:  # only where the attention is computed (not a kept graph's replay)
                out, max_logit = out
                self._raise_max_logit(max_logit)
            return out

        # Under Megatron's recomputation the attention runs once (Note [attention kept through recomputation])
        out = self.kept.run(attend, query, key, value, training=self.training,
                            enabled=not self.startrail_groups.config.recompute_attention)
        # [s/CP, b, np, hv] -> [s/CP, b, np * hv]   (THD: -> [t/CP, np * hv])
        return out.reshape(*out.shape[:-2], -1)

    def _raise_max_logit(self, max_logit: torch.Tensor) -> None:
        """``current_max_attn_logits`` = max(itself, ``max_logit [np]``), as Megatron's TE attention
        accumulates it (a new tensor each time; detached: a statistic, no graph kept alive)."""
        max_logit = max_logit.detach()
        current = self.current_max_attn_logits
        self.current_max_attn_logits = max_logit if current is None else torch.max(current, max_logit)

    def sharded_state_dict(self, prefix: str = "", sharded_offsets=(), metadata: dict | None = None):
        """The learnable sinks as Megatron's ``DotProductAttention`` checkpoints them."""
        return softmax_offset_sharded_state_dict(self, self.tp_group, prefix, sharded_offsets, metadata)

    def _groups_for(self, packed_seq_params) -> tuple[StarTrailGroups, object]:
        """The StarTrail groups of this call and the process group of its CP ranks: fixed, or,
        with hybrid CP, those of the sub-sample's CP size (Megatron's ``local_cp_size``)."""
        local_cp_size = getattr(packed_seq_params, "local_cp_size", None)
        if not isinstance(self.startrail_groups, DynamicCPGroups):
            if local_cp_size is not None:
                raise ValueError(
                    f"PackedSeqParams.local_cp_size={local_cp_size} (hybrid context parallelism), but these "
                    "StarTrail groups were built for the fixed CP group: build them with --hybrid-context-parallel"
                )
            return self.startrail_groups, self.cp_group
        if local_cp_size is None:
            raise ValueError("--hybrid-context-parallel: StarTrail needs PackedSeqParams.local_cp_size on every call")
        groups = self.startrail_groups.for_call(local_cp_size, getattr(packed_seq_params, "cp_group", None))
        return groups, groups.cp_group


class LocalMLACoreAttention(MegatronModule):
    """Plain causal softmax attention that takes MLA's ``k_channels``/``v_channels``, for
    runs without context parallelism on the local spec: Megatron's local
    ``DotProductAttention`` takes neither (megatron-core 0.19.2), so ``--multi-latent-attention``
    without Transformer Engine (e.g. on a CPU) has no core attention otherwise::

        query/key [s, b, np, k_channels], value [s, b, np, v_channels] -> [s, b, np * v_channels]

    Packed documents (``PackedSeqParams(qkv_format="thd")``, CP = 1, either layout: the CP = 1
    twin of a StarTrail run) are one sample, and a token sees the earlier real tokens of its
    own document; padding rows of the document layout see nothing and give 0::

        query/key [t, np, k_channels], value [t, np, hv] -> [t, np * hv]

    (hv: Megatron's MLA pads V to k_channels for THD input and trims the output itself.)
    Written for clarity, not speed: it builds the ``[s, s]`` mask.
    """

    def __init__(self, config, layer_number: int, attn_mask_type: AttnMaskType, attention_type: str = "self",
                 attention_dropout: float | None = None, softmax_scale: float | None = None,
                 cp_comm_type: str | None = None, pg_collection=None, k_channels: int | None = None,
                 v_channels: int | None = None):
        super().__init__(config=config)
        if config.context_parallel_size != 1:
            raise ValueError("LocalMLACoreAttention has no context parallelism: use --context-parallel-algo startrail")
        dropout = config.attention_dropout if attention_dropout is None else attention_dropout
        if attn_mask_type not in _CAUSAL or dropout != 0.0:
            raise ValueError("LocalMLACoreAttention is causal self-attention without dropout (--attention-dropout 0)")
        if getattr(config, "softmax_type", "vanilla") not in (None, "vanilla"):
            raise ValueError("LocalMLACoreAttention (CP = 1, MLA on CPU) has no attention sinks: use --softmax-type "
                             "vanilla, or --context-parallel-algo startrail")
        self.softmax_scale = softmax_scale if softmax_scale is not None else (k_channels or config.kv_channels) ** -0.5
        # --window-size / --window-attn-skip-freq: this layer's window by Megatron's rule, as
        # StarTrailCoreAttention and Megatron's DotProductAttention apply it (None: full layer).
        self.window_size = tuple(config.window_size) if is_layer_window_attention(
            config.window_size, config.window_attn_skip_freq, layer_number) else None

    def _causal(self, tokens: int, device) -> torch.Tensor:
        """``[t, t]`` bool: key j <= query i, inside this layer's window if any (the bounds of key
        minus query position StarTrail's kernel calls use, ``layout.normalize_window``)."""
        allowed = torch.ones(tokens, tokens, dtype=torch.bool, device=device).tril()
        bounds = normalize_window(self.window_size, causal=True)
        if bounds is not None:
            row = torch.arange(tokens, device=device)
            delta = row[None, :] - row[:, None]  # [i, j]: key j minus query i
            allowed &= (delta >= bounds[0]) & (delta <= bounds[1])
        return allowed

    def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                packed_seq_params=None):
        if attention_bias is not None:
            raise ValueError("LocalMLACoreAttention takes no attention bias")
        if packed_seq_params is None:
            # [s, b, np, hn] -> [b, np, s, hn]; causal over the whole sequence
            q, k, v = (t.permute(1, 2, 0, 3) for t in (query, key, value))
            out = _masked_attention(q, k, v, self._causal(q.shape[-2], q.device), self.softmax_scale)
            # [b, np, s, hv] -> [s, b, np * hv]
            return out.permute(2, 0, 1, 3).reshape(q.shape[-2], out.shape[0], -1)
        if query.dim() != 3:
            raise ValueError("LocalMLACoreAttention takes packed documents as [t, np, hn] (THD)")
        # [t, np, hn] -> [1, np, t, hn]; causal inside each document
        q, k, v = (t.permute(1, 0, 2).unsqueeze(0) for t in (query, key, value))
        # Inside a document the packed rows are consecutive: the window's distance is the rows'.
        allowed = _document_mask(packed_seq_params, query.shape[0], query.device) & self._causal(query.shape[0],
                                                                                                  query.device)
        out = _masked_attention(q, k, v, allowed, self.softmax_scale)
        # [1, np, t, hv] -> [t, np * hv]
        return out[0].permute(1, 0, 2).reshape(query.shape[0], -1)


def _document_mask(packed_seq_params, tokens: int, device) -> torch.Tensor:
    """``[t, t]`` bool: query i may see key j (same document, j <= i, both real tokens), for
    packed documents at CP = 1 (the real tokens open each padded span)."""
    cu_seqlens, cu_seqlens_padded = (t.to(device=device, dtype=torch.int64) if t is not None else None
                                     for t in packed_documents(packed_seq_params))
    spans = cu_seqlens if cu_seqlens_padded is None else cu_seqlens_padded
    row = torch.arange(tokens, device=device)
    document = torch.searchsorted(spans[1:], row, right=True)
    real = row - spans[document] < (cu_seqlens[1:] - cu_seqlens[:-1])[document]
    same = document[:, None] == document[None, :]
    return same & real[:, None] & real[None, :] & torch.ones(tokens, tokens, dtype=torch.bool, device=device).tril()


def _masked_attention(q, k, v, allowed, scale):
    """Softmax attention in float32: q/k ``[b, np, s, hn]``, v ``[b, np, s, hv]``, ``allowed``
    ``[s, s]`` -> ``[b, np, s, hv]`` in q's dtype; a row that may see nothing gives 0."""
    seen = allowed.any(dim=-1, keepdim=True)  # [s, 1]
    # A row without keys attends to itself (finite softmax, no NaN in the backward), then is zeroed.
    allowed = allowed | (torch.eye(allowed.shape[0], dtype=torch.bool, device=allowed.device) & ~seen)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    probs = torch.softmax(scores.masked_fill(~allowed, float("-inf")), dim=-1) * seen
    return torch.matmul(probs, v.float()).to(q.dtype)
