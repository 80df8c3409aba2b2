"""The StarTrail paper's checkpoint placement under Megatron's recomputation (appendix A.3,
after DistFlashAttn): the attention is never recomputed.

Note [attention kept through recomputation]
-------------------------------------------
With ``--recompute-granularity full`` (uniform or block) or ``selective`` with ``core_attn``,
Megatron's ``tensor_parallel.checkpoint`` runs a layer (or its core attention) twice: once
without autograd in the forward, and again with it in the backward, before back-propagating
through the recomputed graph. A plain core attention would run its whole forward twice,
every team all-gather, initial send and sub-ring hop included (measured: 1.50x the P2P
bytes of the run without recomputation at TP1 x CP4 C2).

Instead, per core-attention module (so per layer and per virtual pipeline stage):

    first pass    (Megatron's checkpoint forward: ``is_checkpointing()``, grad disabled)
                  the attention runs with autograd on detached q, k, v, so its graph --
                  what its backward needs, as in a run without recomputation -- is kept,
                  in order; the layer gets the output, detached.
    recompute     (the checkpoint's backward: ``is_checkpointing()``, grad enabled)
                  the oldest kept graph is taken (:class:`_KeptOutput`): its output is
                  returned without any communication, and the backward of the recomputed
                  graph runs the kept graph's backward, unchanged (its gradients for q,
                  k, v go on to the recomputed QKV projection; the sinks' parameter
                  gradient accumulates as usual).

Oldest first is the right pairing: one module sees its micro-batches' backwards in the order
of their forwards, without pipelining, with 1F1B and with interleaved stages (one module per
virtual stage). Evaluation (``module.training`` False: Megatron's ``evaluate``) keeps
nothing. What is kept per layer is what the attention keeps without recomputation
(``accounting.kept_for_backward_bytes``); recomputing it (``--startrail-recompute-attention``)
keeps nothing of the attention between the two passes, for its communication again.
Transformer Engine's own checkpoint (Megatron takes it under FP8/FP4) does not flag the
first pass: there the attention is recomputed, communication included, as before.
"""

from __future__ import annotations

import functools
import warnings
from collections import deque
from typing import Callable

import torch
from megatron.core.tensor_parallel.random import is_checkpointing


@functools.cache
def _say_once(message: str) -> None:
    warnings.warn(message, stacklevel=3)


class _KeptOutput(torch.autograd.Function):
    """Recompute pass: the kept output for the recomputed ``q, k, v``; backward through the kept graph."""

    @staticmethod
    def forward(ctx, q, k, v, kept):
        out, leaves = kept.pop()
        ctx.kept = (out, leaves)
        return out.detach()  # the first pass's values, no new tensor

    @staticmethod
    def backward(ctx, dout):
        out, leaves = ctx.kept
        ctx.kept = None
        # The kept graph's own backward (StarTrail's, with its communication), into the leaves
        # that stood for q, k, v in the first pass (and into the sinks' parameter, if learnable).
        torch.autograd.backward(out, dout)
        return leaves[0].grad, leaves[1].grad, leaves[2].grad, None


class _Holder:
    """One kept graph, handed to :class:`_KeptOutput` as a non-tensor argument."""

    def __init__(self, out, leaves):
        self._item = (out, leaves)

    def pop(self):
        item, self._item = self._item, None
        return item


class KeptAttention:
    """The attention graphs that one core-attention module's checkpointed first passes kept,
    oldest first (Note [attention kept through recomputation])."""

    def __init__(self) -> None:
        self._kept: deque = deque()

    def __len__(self) -> int:
        return len(self._kept)

    def run(self, attend: Callable, q, k, v, *, training: bool, enabled: bool = True):
        """``attend(q, k, v)``, kept through Megatron's recomputation when ``enabled``."""
        if not (enabled and training and is_checkpointing()):
            return attend(q, k, v)
        if not torch.is_grad_enabled():  # the checkpoint's first pass
            leaves = [t.detach().requires_grad_(True) for t in (q, k, v)]
            with torch.enable_grad():
                out = attend(*leaves)
            self._kept.append((out, leaves))
            return out.detach()
        if not self._kept:  # a recompute without a kept first pass (e.g. Transformer Engine's checkpoint)
            _say_once("StarTrail: the attention is recomputed with its communication: its first pass was not "
                      "under Megatron's checkpoint (Transformer Engine's checkpoint, taken under FP8/FP4, does not "
                      "mark it); see docs/memory.md, 'Recomputation'")
            return attend(q, k, v)
        out, leaves = self._kept.popleft()
        if leaves[0].shape != q.shape:
            raise RuntimeError(
                f"the kept attention of a checkpointed first pass has shape {tuple(out.shape)} (q "
                f"{tuple(leaves[0].shape)}), but its recomputation has q {tuple(q.shape)}: the passes are out of "
                "order; set --startrail-recompute-attention to recompute the attention instead")
        return _KeptOutput.apply(q, k, v, _Holder(out, leaves))
