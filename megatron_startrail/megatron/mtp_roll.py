"""Multi-token prediction (``--mtp-num-layers``) under StarTrail context parallelism, trained as at CP = 1.

Megatron rolls the labels, the loss mask, the input ids and the position ids one token left for
each MTP depth (``multi_token_prediction.roll_tensor``). megatron-core 0.19.2 gets two things
different from CP = 1 here, whatever the attention; :func:`install_startrail_mtp_roll` (through
mtp.py's ``install_startrail_mtp``, when StarTrail's groups are built for a model with MTP)
replaces ``roll_tensor`` with :func:`startrail_roll_tensor`, which fixes both:

- **The target count.** Each CP rank divides its MTP loss by its *own* count of rolled targets,
  then DDP averages over DP x CP: the CP rank holding the sequence's last token (rolled out)
  weighs its tokens more. The count of the loss mask (the one floating-point tensor Megatron
  rolls) is replaced by the CP group's mean count ``N / CP`` -- one scalar all-reduce over the
  CP group per MTP depth -- so that every rank's share is its sum over the whole sequence's
  count, as at CP = 1 (Megatron-LM PR #7498 reduces the counts over the CP group the same way).
  Where ``N / CP`` is below one (fewer targets than CP ranks) Megatron would clamp it to one:
  the rolled mask is then weighted by ``CP / N`` instead. With ``--calculate-per-token-loss``
  Megatron also multiplies by the rank's own count of loss tokens: mtp_loss.py hands it the
  group's mean count instead, through a stand-in mask this roll rolls as the real one
  (:func:`rolls_as`).
- **Packed documents.** Megatron's packed roll (``_roll_tensor_packed_seq``) assumes every
  document zigzagged on its own (the document layout) and places the documents by their real
  boundaries over CP: in StarTrail's sample layout (``--dataloader-inter-document-masking``
  without padded spans: the whole packed sample zigzagged) it mixes documents or raises
  IndexError, and in the document layout it is wrong wherever a document has padding. In the
  sample layout a roll inside every document is the whole sample's roll (Megatron's dense CP
  roll, across the zigzag chunks) with each document's last token zeroed, as Megatron's packed
  roll zeroes it at CP = 1; the document layout (``cu_seqlens_*_padded``) is rolled by
  document_roll.py, all documents at once. Megatron-Bridge cuts its packed batches in the
  document layout but hands parameters without padded boundaries: its spec's attention records
  their document-layout copy on them (:func:`set_layout_as_cut`), which the roll then takes.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .document_roll import document_layout_roll
from .packed_rope import sample_layout_rows


def _megatron_mtp():
    from megatron.core.transformer import multi_token_prediction  # noqa: PLC0415

    return multi_token_prediction


_ROLLS_AS = "_startrail_mtp_rolls_as"  # the attribute of a stand-in naming the tensor it rolls as


def rolls_as(stand_in: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """Mark ``stand_in`` (returned) to be rolled as ``real``: the roll of a weighted mask, or
    mtp_loss.py's mask whose sum is the group's mean count. Held by the tensor itself, so it
    lives exactly as long as Megatron holds the stand-in."""
    setattr(stand_in, _ROLLS_AS, real)
    return stand_in


def real_tensor(tensor):
    """The tensor ``tensor`` stands in for (:func:`rolls_as`), or ``tensor`` itself."""
    return getattr(tensor, _ROLLS_AS, tensor)


_AS_CUT = "_startrail_as_cut"  # the attribute of a PackedSeqParams naming its copy in the layout the batch was cut in


def set_layout_as_cut(packed_seq_params, as_cut) -> None:
    """Record, on ``packed_seq_params`` itself, ``as_cut``: the same documents in the layout
    the batch was really cut in (Megatron-Bridge's parameters lack the padded boundaries of
    its per-document cut: bridge/packed_layout.py). The roll of every MTP tensor of this
    micro-batch then takes ``as_cut``."""
    setattr(packed_seq_params, _AS_CUT, as_cut)


def layout_as_cut(packed_seq_params):
    """``packed_seq_params`` in the layout the batch was cut in (:func:`set_layout_as_cut`)."""
    return getattr(packed_seq_params, _AS_CUT, packed_seq_params)


def _as_row(cu_seqlens):
    """``[n_docs + 1]`` boundaries (a ``[1, n_docs + 1]`` batch row squeezed; None stays None). The query
    side's only: the core attention checks that the key/value side's are the same."""
    return cu_seqlens.squeeze(0) if cu_seqlens is not None and cu_seqlens.dim() == 2 else cu_seqlens


def _roll(tensor, shifts, dims, cp_group, packed_seq_params):
    """``(rolled, count)``: Megatron's dense roll, or a roll inside every packed document in
    StarTrail's sample layout or in the document layout (see the module docstring)."""
    megatron_roll = _megatron_mtp()._startrail_megatron_roll_tensor
    params = layout_as_cut(packed_seq_params)
    if params is None or params.qkv_format != "thd":
        return megatron_roll(tensor, shifts, dims, cp_group, params)
    if shifts != -1 or dims not in (-1, tensor.dim() - 1):
        raise ValueError(f"packed documents roll MTP tensors by -1 along the last dimension only, got "
                         f"shifts={shifts}, dims={dims}")
    cu_seqlens, cu_seqlens_padded = (_as_row(params.cu_seqlens_q), _as_row(params.cu_seqlens_q_padded))
    if cu_seqlens_padded is not None:
        rolled = document_layout_roll(tensor, cp_group, cu_seqlens, cu_seqlens_padded)
        return rolled, rolled.sum()
    cp = cp_group.size()
    rolled, _ = megatron_roll(tensor, shifts, dims, cp_group, None)  # the whole sample, across the chunks
    # [..., t/CP]: the sample rows held here; a document's last token has nothing to predict.
    held = sample_layout_rows(tensor.shape[-1] * cp, cp, cp_group.rank(), tensor.device)
    ends = cu_seqlens[1:].to(device=tensor.device, dtype=torch.int64) - 1
    rolled = rolled.masked_fill(torch.isin(held, ends), 0)
    return rolled, rolled.sum()


def startrail_roll_tensor(tensor, shifts=-1, dims=-1, cp_group=None, packed_seq_params=None):
    """``roll_tensor`` with StarTrail's layout of packed documents and the CP group's target
    count: ``(rolled, count)`` as Megatron returns them (see the module docstring)."""
    cp = cp_group.size() if cp_group is not None else 1
    if tensor is None or cp == 1:
        return _megatron_mtp()._startrail_megatron_roll_tensor(tensor, shifts, dims, cp_group, packed_seq_params)
    rolled, count = _roll(real_tensor(tensor), shifts, dims, cp_group, packed_seq_params)
    if not tensor.is_floating_point():
        return rolled, count
    # The loss mask: the CP group's mean count of targets, N / CP.
    count = count.clone()
    dist.all_reduce(count, group=cp_group)
    count = count / cp
    # Megatron divides by count.clamp(min=1): below one (0 < N < CP targets in the sequence) the
    # mask is weighted by 1 / count instead, so that every use of it is as if it were divided by
    # N / CP. Above, the weight is exactly 1. The next depth rolls the unweighted mask.
    weight = 1 / count.clamp(min=1 / cp, max=1)
    return rolls_as(rolled * weight, rolled), count


def install_startrail_mtp_roll() -> None:
    """Replace megatron-core's ``multi_token_prediction.roll_tensor`` with
    :func:`startrail_roll_tensor` (Megatron's is kept as ``_startrail_megatron_roll_tensor``;
    idempotent). The roll alone: mtp.py's ``install_startrail_mtp`` installs it with the loss
    (mtp_loss.py), which hands the roll the stand-ins it needs."""
    mtp = _megatron_mtp()
    if getattr(mtp, "_startrail_megatron_roll_tensor", None) is None:
        mtp._startrail_megatron_roll_tensor = mtp.roll_tensor
        mtp.roll_tensor = startrail_roll_tensor
