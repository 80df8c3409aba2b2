"""The StarTrail paper's checkpoint placement under Megatron's recomputation (appendix A.3,
after DistFlashAttn): the attention is never recomputed.

Note [attention kept through recomputation]
-------------------------------------------
With ``--recompute-granularity full`` (uniform or block) or ``selective`` with ``core_attn``,
Megatron's ``tensor_parallel.checkpoint`` runs a layer (or its core attention) twice: once
without autograd in the forward (``CheckpointFunction.forward``), and again with it in the
backward (``CheckpointFunction.backward``), before back-propagating through the recomputed
graph. A plain core attention would run its whole forward twice, every team all-gather,
initial send and sub-ring hop included (measured: 1.50x the P2P bytes of the run without
recomputation at TP1 x CP4 C2).

Instead the attention's graph is kept, and it is kept **on the checkpoint that made it**:

    first pass    (``is_checkpointing()``, grad disabled) the innermost ``CheckpointFunction``
                  being run is found on the call stack: its ``ctx``, the autograd node whose
                  backward will recompute this call. The attention runs with autograd on dense,
                  detached q, k, v behind a gate (:class:`_InputGate`: one 0-element leaf, the
                  gradients for q, k, v caught in a box), and its output and graph are stored on
                  that ``ctx``, under this module, in call order; the layer gets the output,
                  detached.
    recompute     (``is_checkpointing()``, grad enabled: inside ``CheckpointFunction.backward``)
                  the node being run (``torch._C._current_autograd_node()``) is that same
                  ``ctx``: the graph kept on it for this module, n-th call for the n-th call,
                  is taken (:class:`_KeptOutput`). Its output is returned without any
                  communication, and the backward of the recomputed graph runs the kept
                  graph's backward, unchanged (the gate hands dq, dk, dv on to the recomputed
                  QKV projection; the sinks' parameter gradient accumulates as usual).

So a kept graph is found by identity -- the checkpoint (one micro-batch's one checkpointed
region: one layer, one MTP depth, one virtual stage) and this module's call within it, which
the recomputation replays in the same order -- never by the order of backwards. A module called
several times per forward (a repeated MTP layer, a shared module) takes each call's own graph.
Its lifetime is the checkpoint's: a forward with no backward (``forward_only`` in train mode, an
abandoned step, an exception) drops the checkpoint's node and the kept graph with it; nothing
waits for a later step to take. Evaluation (``module.training`` False) keeps nothing.

What is kept per layer is what the attention keeps without recomputation
(``accounting.kept_for_backward_bytes``) plus nothing: the gate holds no tensor, and strided
q, k, v (views of Megatron's fused QKV) are made dense before the first pass, so the fused
QKV output is not held through them. Recomputing the attention instead
(``--startrail-recompute-attention``) keeps nothing between the two passes, for its
communication again. Where no checkpoint is found -- Transformer Engine's checkpoint (Megatron
takes it under FP8/FP4) does not set Megatron's flag, another checkpoint implementation -- the
attention is recomputed, communication included, with a one-time warning: slower, never wrong.

Wrappers: keeping is right only where Megatron's replay is the recomputation. A wrapper that
saves or recomputes the layer's tensors itself makes it wrong:

- torch's non-reentrant checkpoint inside Megatron's (a framework wrapping each layer, under
  ``--recompute-granularity full``): its first pass runs without grad, so it records nothing
  then; in Megatron's recomputation it records what the layer saves, and in the backward it
  runs the layer once more and expects the same saved tensors. A kept graph taken there saves
  nothing; the attention run again saves its own: on 9ee7a82 ``CheckpointError: Recomputed
  values ... different metadata``.
- torch's non-reentrant checkpoint outside Megatron's (``selective`` ``core_attn`` inside a
  wrapped layer): the kept graph's saved tensors go through its hooks, so the kept graph's own
  backward runs the layer again to get them back, and what that extra run keeps stays alive
  after the step's backward (on 9ee7a82: exact, two graphs left after two layers' backward).
- any other saved-tensor hooks (``save_on_cpu``, Megatron's fine-grained activation
  offloading, a framework's own): the kept graph's tensors would be packed in the first pass
  and unpacked in another graph task (the recomputation's), which hooks written for one
  forward and its backward need not allow (``save_on_cpu`` does: exact on 9ee7a82).
- torch's reentrant checkpoint inside Megatron's: its first pass runs without grad inside
  Megatron's recomputation, so a graph kept in Megatron's first pass is never taken.

So the first pass keeps nothing when torch's checkpoint runs between it and Megatron's
checkpoint (its ``checkpoint`` frame on the stack, by code object) or saved-tensor hooks are set
(the top of autograd's hooks stack); it leaves a mark in the call's place, so that later calls
still take their own graphs. The recomputation recomputes under hooks, under torch's reentrant
checkpoint's node, or where the mark is. The attention then runs as with
``--startrail-recompute-attention``, its communication included (the gradients are the run's
without keeping), with one warning per wrapper naming it (:mod:`.checkpoint_wrappers`).
torch's reentrant checkpoint outside Megatron's is Megatron's replay inside its own: kept.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from typing import Callable

import torch
from megatron.core.tensor_parallel.random import is_checkpointing

from .checkpoint_wrappers import node_wrapper_name, running_checkpoints, saved_tensors_hooks_name

_KEPT_ATTRIBUTE = "_startrail_kept"  # on a CheckpointFunction ctx: {KeptAttention: [_KeptGraph | _RECOMPUTED, ...]}
# In a checkpoint's list in place of a kept graph: this call's first pass ran under a wrapper
# and kept nothing; its recomputation recomputes (the n-th call still takes the n-th entry).
_RECOMPUTED = object()


@functools.cache
def _say_once(message: str) -> None:
    warnings.warn(message, stacklevel=4)


def _say_recomputed_under(wrapper: str) -> None:
    """Once per wrapper and process: the attention is recomputed because of ``wrapper``."""
    _say_once(f"StarTrail: the attention is recomputed with its communication under {wrapper}: that wrapper "
              "saves or recomputes the layer's tensors itself, so the attention's graph cannot be kept through "
              "Megatron's recomputation; --startrail-recompute-attention makes that the rule and silences this; "
              "see docs/memory.md, 'Recomputation'")


class _InputGrads:
    """The gradients the kept graph's backward gives its q, k, v (filled by :class:`_InputGate`)."""

    __slots__ = ("grads",)

    def __init__(self) -> None:
        self.grads = (None, None, None)


class _InputGate(torch.autograd.Function):
    """q, k, v into the kept graph: differentiable through a 0-element ``anchor`` leaf, so the
    graph holds no leaf tensor of their size; the backward puts dq, dk, dv into the box."""

    @staticmethod
    def forward(ctx, anchor, box, q, k, v):
        ctx.box = box
        return q.detach(), k.detach(), v.detach()

    @staticmethod
    def backward(ctx, dq, dk, dv):
        ctx.box.grads = (dq, dk, dv)
        ctx.box = None
        return None, None, None, None, None


class _KeptGraph:
    """One first pass's attention: its output (with its graph) and the box of its input gradients."""

    __slots__ = ("out", "box", "q_shape", "__weakref__")

    def __init__(self, out, box, q_shape) -> None:
        self.out, self.box, self.q_shape = out, box, q_shape


class _KeptOutput(torch.autograd.Function):
    """Recompute pass: the kept output for the recomputed ``q, k, v``; backward through the kept graph."""

    @staticmethod
    def forward(ctx, q, k, v, kept: _KeptGraph):
        ctx.kept = kept
        return kept.out.detach()  # the first pass's values, no new tensor

    @staticmethod
    def backward(ctx, dout):
        kept, ctx.kept = ctx.kept, None
        # The kept graph's own backward (StarTrail's, with its communication), through the gate
        # (dq, dk, dv into the box) and into the sinks' parameter, if learnable.
        torch.autograd.backward(kept.out, dout)
        kept.out = None
        return (*kept.box.grads, None)


class KeptAttention:
    """One core-attention module's attention kept through Megatron's recomputation (Note
    [attention kept through recomputation]). It holds no graph itself: those live on the
    checkpoints that made them; ``len()`` counts the ones still alive (weakly)."""

    def __init__(self) -> None:
        self._alive: weakref.WeakSet = weakref.WeakSet()

    def __len__(self) -> int:
        return len(self._alive)

    def run(self, attend: Callable, q, k, v, *, training: bool, enabled: bool = True):
        """``attend(q, k, v)``, kept through Megatron's recomputation when ``enabled``."""
        if not (enabled and training and is_checkpointing()):
            return attend(q, k, v)
        if not torch.is_grad_enabled():  # a checkpoint's first pass
            return self._first_pass(attend, q, k, v)
        return self._recomputation(attend, q, k, v)

    def _first_pass(self, attend: Callable, q, k, v):
        """Inside ``CheckpointFunction.forward``: keep, unless a wrapper runs (Note [attention kept
        through recomputation], 'Wrappers')."""
        checkpoint, wrapper = running_checkpoints()
        wrapper = wrapper or saved_tensors_hooks_name()
        if checkpoint is None or wrapper is not None:  # nothing could find a kept graph again, or it must not
            if wrapper is not None:
                _say_recomputed_under(wrapper)
            if checkpoint is not None:
                self._store(checkpoint, _RECOMPUTED)
            return attend(q, k, v)
        return self._keep(checkpoint, attend, q, k, v)

    def _recomputation(self, attend: Callable, q, k, v):
        """Inside a checkpoint's backward: the node being run is the checkpoint whose first pass kept
        this call's graph (taken in any case, so that later calls take their own)."""
        node = torch._C._current_autograd_node()
        kept = self._take(node)
        wrapper = saved_tensors_hooks_name() or node_wrapper_name(node)
        if wrapper is not None:  # torch's checkpoint inside Megatron's, or hooks: recompute as it does
            _say_recomputed_under(wrapper)
            return attend(q, k, v)
        if kept is _RECOMPUTED:  # said at the first pass
            return attend(q, k, v)
        if kept is None:
            _say_once("StarTrail: the attention is recomputed with its communication: its first pass was not "
                      "kept under Megatron's checkpoint (Transformer Engine's checkpoint, taken under FP8/FP4, "
                      "does not mark it); --startrail-recompute-attention makes that the rule and silences this; "
                      "see docs/memory.md, 'Recomputation'")
            return attend(q, k, v)
        if kept.q_shape != q.shape:
            raise RuntimeError(
                f"the kept attention of this checkpoint's first pass had q {tuple(kept.q_shape)}, its "
                f"recomputation has q {tuple(q.shape)}: the checkpointed function does not replay its calls; "
                "set --startrail-recompute-attention to recompute the attention instead")
        return _KeptOutput.apply(q, k, v, kept)

    def _keep(self, checkpoint, attend, q, k, v):
        box = _InputGrads()
        # Detached: under selective recomputation q, k, v are the checkpoint's inputs, still on the
        # layer's graph (RoPE's nodes); the kept graph must not reach into it. Dense copies of
        # strided inputs (Megatron's views of its fused QKV): what the graph keeps of them is then
        # their own bytes, not the whole fused projection output.
        q, k, v = (t.detach() if t.is_contiguous() else t.detach().contiguous() for t in (q, k, v))
        anchor = torch.empty(0, device=q.device, requires_grad=True)
        with torch.enable_grad():
            out = attend(*_InputGate.apply(anchor, box, q, k, v))
        kept = _KeptGraph(out, box, q.shape)
        self._store(checkpoint, kept)
        self._alive.add(kept)
        return out.detach()

    def _store(self, checkpoint, entry) -> None:
        """``entry`` as this module's next call on the checkpoint's ctx."""
        per_module = getattr(checkpoint, _KEPT_ATTRIBUTE, None)
        if per_module is None:
            per_module = {}
            setattr(checkpoint, _KEPT_ATTRIBUTE, per_module)
        per_module.setdefault(self, []).append(entry)

    def _take(self, node):
        """This module's next entry on ``node`` (a _KeptGraph or _RECOMPUTED), or None."""
        calls = getattr(node, _KEPT_ATTRIBUTE, {}).get(self) if node is not None else None
        return calls.pop(0) if calls else None
