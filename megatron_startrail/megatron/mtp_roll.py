"""Multi-token prediction (``--mtp-num-layers``) under StarTrail context parallelism, trained as at CP = 1.

Megatron rolls the labels, the loss mask, the input ids and the position ids one token left for
each MTP depth (``multi_token_prediction.roll_tensor``). megatron-core 0.19.2 gets two things
different from CP = 1 here, whatever the attention; :func:`install_startrail_mtp_roll` (called
when StarTrail's groups are built for a model with MTP) replaces ``roll_tensor`` with
:func:`startrail_roll_tensor`, which fixes both:

- **The target count.** Each CP rank divides its MTP loss by its *own* count of rolled targets,
  then DDP averages over DP x CP: the CP rank holding the sequence's last token (rolled out)
  weighs its tokens more. The count of the loss mask (the one floating-point tensor Megatron
  rolls) is replaced by the CP group's mean count -- one scalar all-reduce over the CP group
  per MTP depth -- so that every rank's share is its sum over the whole sequence's count, as at
  CP = 1 (Megatron-LM PR #7498 reduces the counts over the CP group the same way).
- **Packed documents in StarTrail's sample layout** (``--dataloader-inter-document-masking``
  without padded spans: the whole packed sample zigzagged). Megatron's packed roll
  (``_roll_tensor_packed_seq``) assumes every document zigzagged on its own (the document
  layout), so it mixes documents or raises IndexError there. In the sample layout a roll inside
  every document is the whole sample's roll (Megatron's dense CP roll, across the zigzag
  chunks) with each document's last token zeroed, as Megatron's packed roll zeroes it at CP = 1.

Packed documents in the document layout (``cu_seqlens_*_padded``) keep Megatron's packed roll.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .packed_rope import is_sample_layout, sample_layout_rows


def _megatron_mtp():
    from megatron.core.transformer import multi_token_prediction  # noqa: PLC0415

    return multi_token_prediction


def startrail_roll_tensor(tensor, shifts=-1, dims=-1, cp_group=None, packed_seq_params=None):
    """``roll_tensor`` with StarTrail's layout of packed documents and the CP group's target
    count: ``(rolled, count)`` as Megatron returns them (see the module docstring)."""
    megatron_roll = _megatron_mtp()._startrail_megatron_roll_tensor
    cp = cp_group.size() if cp_group is not None else 1
    if tensor is None or cp == 1:
        return megatron_roll(tensor, shifts, dims, cp_group, packed_seq_params)
    if packed_seq_params is not None and is_sample_layout(packed_seq_params):
        if shifts != -1:
            raise ValueError(f"StarTrail's packed sample layout rolls MTP tensors by -1 only, got shifts={shifts}")
        rolled, _ = megatron_roll(tensor, shifts, dims, cp_group, None)  # the whole sample, across the chunks
        # [..., t/CP]: the sample rows held here; a document's last token has nothing to predict.
        held = sample_layout_rows(tensor.shape[dims] * cp, cp, cp_group.rank(), tensor.device)
        ends = packed_seq_params.cu_seqlens_q[1:].to(device=tensor.device, dtype=torch.int64) - 1
        last_of_document = torch.isin(held, ends)
        shape = [1] * tensor.dim()
        shape[dims] = -1
        rolled = rolled.masked_fill(last_of_document.view(shape), 0)
        count = rolled.sum()
    else:
        rolled, count = megatron_roll(tensor, shifts, dims, cp_group, packed_seq_params)
    if tensor.is_floating_point():  # the loss mask: the CP group's mean count of targets
        count = count.clone()
        dist.all_reduce(count, group=cp_group)
        count = count / cp
    return rolled, count


def install_startrail_mtp_roll() -> None:
    """Replace megatron-core's ``multi_token_prediction.roll_tensor`` with
    :func:`startrail_roll_tensor` (idempotent; Megatron's is kept as ``_startrail_megatron_roll_tensor``)."""
    mtp = _megatron_mtp()
    if getattr(mtp, "_startrail_megatron_roll_tensor", None) is None:
        mtp._startrail_megatron_roll_tensor = mtp.roll_tensor
        mtp.roll_tensor = startrail_roll_tensor
