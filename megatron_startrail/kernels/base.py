"""The block kernel interface: one variable-length attention call with flash-attn's semantics.

A call (:class:`~megatron_startrail.layout.KernelCall`, Note [kernel calls]) packs several
sequences, each a run of query rows against a run of key rows; query row ``r`` of a
sequence with ``sq`` queries and ``sk`` keys sees key ``c`` iff
``r + sk - sq - left <= c <= r + sk - sq + right`` (``call.window = (left, right)``, -1
unbounded; ``(-1, 0)`` is causal with the diagonal aligned bottom-right), exactly
``flash_attn_varlen_func``'s rule, so the calls a GPU makes are the calls the CPU tests
exercise. Tensors are sequence first, the call's rows packed in sequence order::

    q [Tq, b, h, d]   k [Tk, b, hkv, d]   v [Tk, b, hkv, dv]      (strided views are fine)
    out [Tq, b, h, dv] (q's dtype)        lse [b, h, Tq] (float32; float64 for float64)

GQA/MQA: ``hkv`` divides ``h``. ``dv`` may differ from ``d`` (MLA); kernels that need one
head dim pad inside the call. A query row that sees no key gets out 0 and lse -inf (the
planner never makes one, Note [kernel calls]).
"""

from __future__ import annotations

from typing import Protocol

import torch

from ..layout import KernelCall


class BlockKernel(Protocol):
    name: str
    # Whether a call's temporaries grow with its key rows (the reference kernel's [sq, sk] scores):
    # then the planner cuts every call's keys at a rank's rows; a fused kernel (False) takes a
    # full sequence's one run of keys whole in the forward (Note [whole key runs] in layout.py).
    # The schedule reads it with getattr, True when absent.
    workspace_grows_with_keys: bool

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, call: KernelCall, *, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """out ``[Tq, b, h, dv]``, lse ``[b, h, Tq]`` of the call's sequences."""

    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        call: KernelCall,
        *,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Gradients of the call given the *final* (merged) ``out [Tq, b, h, dv]`` and
        ``lse [b, h, Tq]`` of its query rows: with those, each call's gradients are exact on
        their own, so no other call is recomputed. Returns dq ``[Tq, b, h, d]``,
        dk ``[Tk, b, hkv, d]``, dv ``[Tk, b, hkv, dv]``."""
