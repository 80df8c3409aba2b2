"""Megatron's MTP loss (``process_mtp_loss``) and roll at CP2 and CP4 against CP = 1, in float64,
under masks that hold different numbers of loss tokens on the CP ranks: the per-token scale
(megatron/mtp_loss.py), the count (mtp_roll.py) and the packed rolls (sample layout, and the
document layout with padded spans: document_roll.py).

The masks: EOD-like random zeros; a masked prompt over the first 3/4 of the sequence (a CP rank
then holds no loss token but a rolled target from its neighbour: no count alone can weigh it as
CP = 1 does); one loss token (fewer rolled targets than CP ranks: Megatron clamps the count to
one). Two MTP depths, with and without ``--calculate-per-token-loss``. Compared: the output
weight's gradient (summed over the CP ranks with per-token loss, averaged without, as DDP
does), every held row's hidden-state gradient and the logged MTP losses; and that the package's
roll and loss make no host sync.
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from tests.megatron.utils import Utils, parallel_state  # noqa: F401 (import shims first)
from tests.megatron.test_host_syncs import HostSyncCounter
from tests.multiproc import run_ranks
from tests.packed_cases import PAD, document_of_positions, held_positions

from megatron.core.packed_seq_params import PackedSeqParams  # noqa: E402
from megatron.core.transformer import multi_token_prediction as mtp  # noqa: E402

from megatron_startrail.megatron.mtp import install_startrail_mtp  # noqa: E402

HIDDEN, VOCAB, DEPTHS = 8, 16, 2
LENGTHS = [5, 9, 0, 7, 11]  # 32 tokens; an empty document; position 20 ends the fourth
MASKS = ["eod", "prompt", "one"]
LAYOUTS = ["dense", "sample", "document"]


def boundaries(layout: str, cp: int):
    """``(cu_seqlens, cu_seqlens_padded | None)``, int32, of the packed layouts (None, None: dense)."""
    if layout == "dense":
        return None, None
    cu = torch.tensor([0, *LENGTHS]).cumsum(0).to(torch.int32)
    if layout == "sample":
        return cu, None
    spans = [-(-n // (2 * cp)) * 2 * cp for n in LENGTHS]
    return cu, torch.tensor([0, *spans]).cumsum(0).to(torch.int32)


def loss_mask(kind: str, batch: int, total: int, gen) -> torch.Tensor:
    mask = torch.zeros(batch, total, dtype=torch.float64)
    if kind == "eod":
        mask = (torch.rand(batch, total, generator=gen) > 0.2).double()
    elif kind == "prompt":
        mask[:, 3 * total // 4:] = 1
    else:
        mask[:, 20] = 1
    return mask


def sample(layout: str, mask_kind: str, cp: int, seed: int):
    """The CP = 1 sample (real tokens) and the map from the (padded) sample's rows to it:
    ``(tensors, real_row)``, ``real_row[p]`` = the real row of padded row p, or -1 (padding)."""
    gen = torch.Generator().manual_seed(seed)
    batch = 2 if layout == "dense" else 1
    total = sum(LENGTHS)
    tensors = dict(
        hidden=torch.randn((1 + DEPTHS) * total, batch, HIDDEN, generator=gen, dtype=torch.float64),
        labels=torch.randint(0, VOCAB, (batch, total), generator=gen),
        ids=torch.randint(0, VOCAB, (batch, total), generator=gen),
        mask=loss_mask(mask_kind, batch, total, gen),
    )
    cu, padded = boundaries(layout, cp)
    if padded is None:
        return tensors, torch.arange(total)
    doc = document_of_positions(cu, padded)
    rows = torch.arange(int(padded[-1]))
    real_row = torch.where(doc == PAD, -1, cu.long()[doc.clamp(min=0)] + rows - padded.long()[doc.clamp(min=0)])
    return tensors, real_row


def on_rank(tensors, real_row, held, seed):
    """This rank's rows (padding rows: random tokens, hidden states and labels, mask 0)."""
    gen = torch.Generator().manual_seed(seed + 1)
    rows = real_row[held]
    pad = rows < 0

    def take(t, dim):  # t's rows along dim, padding poisoned
        picked = t.index_select(dim, rows.clamp(min=0))
        junk = torch.randint(0, VOCAB, picked.shape, generator=gen).to(t.dtype) if not t.is_floating_point() \
            else torch.randn(picked.shape, generator=gen, dtype=t.dtype)
        shape = [1] * t.dim()
        shape[dim] = -1
        return torch.where(pad.view(shape), junk, picked)

    total = tensors["labels"].shape[1]
    hidden = torch.cat([take(h, 0) for h in tensors["hidden"].split(total)])
    out = dict(hidden=hidden, labels=take(tensors["labels"], 1), ids=take(tensors["ids"], 1),
               mask=take(tensors["mask"], 1).masked_fill(pad, 0))
    return out, rows


class OutputLayer(torch.nn.Module):
    gather_output = True  # full-vocabulary logits (Megatron's acceptance counts then need no TP group)

    def __init__(self, seed):
        super().__init__()
        gen = torch.Generator().manual_seed(seed)
        self.weight = torch.nn.Parameter(torch.randn(VOCAB, HIDDEN, generator=gen, dtype=torch.float64))

    def forward(self, x, weight=None, runtime_gather_output=None):
        return x @ self.weight.t(), None  # [s, b, V]


def token_losses(labels, logits):  # GPTModel.compute_language_model_loss: [b, s]
    return F.cross_entropy(logits.permute(1, 2, 0), labels, reduction="none")


def mtp_loss_and_grads(t, per_token, cp_group, params, seed, inputs="labels"):
    """Megatron's process_mtp_loss (the package's where installed): the output weight's and
    hidden states' gradients, and the logged loss per depth. ``inputs``: "labels" and the loss
    mask; "input ids" and the mask (RL: Megatron derives the labels); "no mask" (labels only)."""
    config = types.SimpleNamespace(mtp_num_layers=DEPTHS, mtp_detach_heads=False, mtp_loss_scaling_factor=0.3,
                                   calculate_per_token_loss=per_token)
    layer = OutputLayer(seed)
    hidden = t["hidden"].clone().requires_grad_()
    mtp.MTPLossLoggingHelper.clean_metrics_in_tracker()
    mtp.MTPLossAutoScaler.set_loss_scale(torch.tensor(1.0, dtype=torch.float64))
    labels = None if inputs == "input ids" else t["labels"]
    mask = None if inputs == "no mask" else t["mask"]
    out = mtp.process_mtp_loss(hidden_states=hidden, labels=labels, loss_mask=mask, output_layer=layer,
                               output_weight=None, runtime_gather_output=None, is_training=True,
                               compute_language_model_loss=token_losses, config=config, cp_group=cp_group,
                               tp_group=None, packed_seq_params=params, input_ids=t["ids"])
    out.sum().backward()
    logged = mtp.MTPLossLoggingHelper.tracker["loss_values"].clone().double()
    return layer.weight.grad, hidden.grad, logged


def packed_params(cu, padded):
    if cu is None:
        return None
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=padded,
                           cu_seqlens_kv_padded=padded)


def case_errors(rank, cp_group, layout, kind, per_token, inputs, seed):
    """One case at this rank's CP size against CP = 1: ``(errors, logged error, host syncs)``."""
    cp = cp_group.size()
    cu, padded = boundaries(layout, cp)
    tensors, real_row = sample(layout, kind, cp, seed)
    held = held_positions(rank, cp, torch.tensor([0, real_row.numel()]), None) if padded is None \
        else held_positions(rank, cp, cu, padded)
    local, rows = on_rank(tensors, real_row, held, seed)
    ref_w, ref_h, ref_logged = mtp_loss_and_grads(tensors, per_token, None, packed_params(cu, None), seed, inputs)
    with HostSyncCounter() as syncs:  # none in the package's roll and loss (test_host_syncs.py)
        w, h, logged = mtp_loss_and_grads(local, per_token, cp_group, packed_params(cu, padded), seed, inputs)
    dist.all_reduce(w, group=cp_group)
    dist.all_reduce(logged, group=cp_group)
    if not per_token:  # DDP averages over the CP ranks
        w, h = w / cp, h / cp
    ref_h = ref_h.view(1 + DEPTHS, sum(LENGTHS), *ref_h.shape[1:])[1:]  # the MTP depths' rows
    h = h.view(1 + DEPTHS, -1, *h.shape[1:])[1:]
    pad = rows < 0
    errors = dict(
        weight=((w - ref_w).abs().max() / ref_w.abs().max()).item(),  # NaN where CP = 1 has no gradient
        hidden=((h[:, ~pad] - ref_h[:, rows[~pad]]).abs().max() / ref_h.abs().max()).item(),
        padding=h[:, pad].abs().max().item() if pad.any() else 0.0,
    )
    return errors, ((logged / cp - ref_logged).abs().max() / ref_logged.abs().max()).item(), syncs.calls


def loss_rank(rank, world_size):
    Utils.initialize_model_parallel(context_parallel_size=world_size)
    install_startrail_mtp()
    cp_group = parallel_state.get_context_parallel_group()
    cases = [(layout, kind, per_token, inputs) for layout in LAYOUTS for per_token in (True, False)
             for kind, inputs in [(kind, "labels") for kind in MASKS] + [("eod", "input ids"), ("prompt", "input ids")]
             + ([("eod", "no mask")] if layout != "document" else [])]  # padding needs its mask
    failures = []
    for seed, case in enumerate(cases):
        errors, logged_error, syncs = case_errors(rank, cp_group, *case, seed)
        # Megatron's MTP loss tracker is float32; NaN fails
        if not (max(errors.values()) <= 1e-12 and logged_error <= 1e-6) or syncs:
            failures.append((*case, errors, logged_error, syncs))
    return failures


@pytest.mark.parametrize("cp", [2, 4])
def test_mtp_loss_gives_cp1s_gradients_and_logs_under_uneven_masks(cp):
    results = run_ranks(loss_rank, cp, timeout=240)
    assert results == [[]] * cp, results


def prompt_mask_rank(rank, world_size):
    """The masked-prompt case at CP2 holds what it is for: a rank with no loss token and a rolled target."""
    Utils.initialize_model_parallel(context_parallel_size=world_size)
    install_startrail_mtp()
    cp_group = parallel_state.get_context_parallel_group()
    tensors, real_row = sample("dense", "prompt", world_size, 1)
    held = held_positions(rank, world_size, torch.tensor([0, real_row.numel()]), None)
    local, _ = on_rank(tensors, real_row, held, 1)
    rolled, _ = mtp._startrail_megatron_roll_tensor(local["mask"], -1, -1, cp_group, None)
    return local["mask"].sum().item(), rolled.sum().item()


def test_the_masked_prompt_leaves_a_rank_without_loss_tokens_but_with_a_target():
    counts = run_ranks(prompt_mask_rank, 2, timeout=120)
    assert any(own == 0 and rolled > 0 for own, rolled in counts), counts
