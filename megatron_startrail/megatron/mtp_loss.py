"""Megatron's MTP loss (``process_mtp_loss``) under context parallelism, with CP = 1's weights
under any loss mask.

With ``--calculate-per-token-loss`` megatron-core 0.19.2 weighs each CP rank's MTP loss by
``original_num_tokens / num_tokens``: the rank's OWN count of loss tokens ``O_r`` over the
count that the roll returns (``mtp_roll.py``: the CP group's mean rolled count ``N / CP``).
At CP = 1 the weight is the sequence's ``O / N``; the two agree only when every CP rank holds
``O / CP`` loss tokens -- not with ``--eod-mask-loss``, masked prompts or padding (7.6e-3 on
the MTP gradients at CP2, example, short documents). No count the roll returns fixes it on its
own: a rank that holds no loss token (``O_r = 0``: a long masked prompt) but a rolled target
from its neighbour gets the weight 0 whatever the count.

:func:`startrail_process_mtp_loss` therefore hands Megatron, in place of the loss mask, a
stand-in whose sum is the CP group's mean ``O / CP`` (one scalar all-reduce over the CP
group) and which the roll rolls as the real mask (``mtp_roll.rolls_as``): every rank's weight
is then ``(O / CP) / (N / CP) = O / N``, as at CP = 1, and the logged MTP loss stays CP = 1's.
It also gives Megatron's two other paths the same inputs: no loss mask (a float mask of ones,
so the roll counts it) and no labels (labels and mask rolled here first, as Megatron's
derived-label path does before it counts). CP = 1 and models without MTP: Megatron's code.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .mtp_roll import real_tensor, rolls_as, startrail_roll_tensor


def _megatron_process_mtp_loss():
    from megatron.core.transformer import multi_token_prediction  # noqa: PLC0415

    return multi_token_prediction._startrail_megatron_process_mtp_loss


def mean_count_stand_in(loss_mask: torch.Tensor, cp_group) -> torch.Tensor:
    """A tensor shaped like ``loss_mask`` whose sum is the CP group's mean count of loss
    tokens (zeros and that mean in its first element; exact for integer counts below 2**24
    in float32), rolled by the roll as ``loss_mask`` itself. Device ops only: no host sync."""
    total = loss_mask.sum(dtype=torch.float32)
    dist.all_reduce(total, group=cp_group)  # O: the sequence's loss tokens, as CP = 1 counts them
    stand_in = torch.zeros(loss_mask.shape, dtype=loss_mask.dtype, device=loss_mask.device)
    stand_in.view(-1)[0] = (total / cp_group.size()).to(loss_mask.dtype)
    return rolls_as(stand_in, loss_mask)


def startrail_process_mtp_loss(hidden_states, labels, loss_mask, *args, config, cp_group=None,
                               packed_seq_params=None, input_ids=None, **kwargs):
    """megatron-core's ``process_mtp_loss`` (same arguments) with CP = 1's per-rank weights
    under any loss mask (see the module docstring)."""
    megatron_loss = _megatron_process_mtp_loss()
    if cp_group is None or cp_group.size() == 1 or not config.mtp_num_layers:
        return megatron_loss(hidden_states, labels, loss_mask, *args, config=config, cp_group=cp_group,
                             packed_seq_params=packed_seq_params, input_ids=input_ids, **kwargs)
    if labels is None and input_ids is not None:
        # Megatron's derived labels (RL): label[i] = input_id[i + 1], the mask rolled with them
        # BEFORE its count is taken. Done here, so that the count below is of that rolled mask.
        labels, _ = startrail_roll_tensor(input_ids, -1, -1, cp_group, packed_seq_params)
        mask = torch.ones_like(labels, dtype=torch.float32) if loss_mask is None else loss_mask
        loss_mask = real_tensor(startrail_roll_tensor(mask, -1, -1, cp_group, packed_seq_params)[0])
    elif labels is not None and loss_mask is None:
        # Megatron's ones_like(labels) is an integer mask, which the roll does not count.
        loss_mask = torch.ones_like(labels, dtype=torch.float32)
    elif labels is not None and not loss_mask.is_floating_point():
        loss_mask = loss_mask.float()  # the roll counts floating-point masks (a bool or integer one: as Megatron weighs it)
    if labels is not None and config.calculate_per_token_loss:
        loss_mask = mean_count_stand_in(loss_mask, cp_group)
    return megatron_loss(hidden_states, labels, loss_mask, *args, config=config, cp_group=cp_group,
                         packed_seq_params=packed_seq_params, input_ids=input_ids, **kwargs)


def install_startrail_mtp_loss() -> None:
    """Replace megatron-core's ``process_mtp_loss`` where GPTModel and HybridModel call it
    (idempotent; Megatron's is kept as ``multi_token_prediction._startrail_megatron_process_mtp_loss``)."""
    from megatron.core.models.gpt import gpt_model  # noqa: PLC0415
    from megatron.core.transformer import multi_token_prediction as mtp  # noqa: PLC0415

    if getattr(mtp, "_startrail_megatron_process_mtp_loss", None) is None:
        mtp._startrail_megatron_process_mtp_loss = mtp.process_mtp_loss
    modules = [mtp, gpt_model]
    try:
        from megatron.core.models.hybrid import hybrid_model  # noqa: PLC0415
        modules.append(hybrid_model)
    except ImportError:  # a megatron-core without HybridModel (or without its Mamba dependencies)
        pass
    for module in modules:
        if getattr(module, "process_mtp_loss", None) is mtp._startrail_megatron_process_mtp_loss:
            module.process_mtp_loss = startrail_process_mtp_loss
