"""The block kernel interface: attention of one query block against one key block.

Every kernel takes ``[b, heads, s, dim]`` tensors (strided views are fine), supports
GQA (``k``/``v`` with fewer heads than ``q``, a divisor of them) and returns the
log-sum-exp of each query row so that partial results can be merged exactly. The
StarTrail schedule is the same for every kernel; only this object differs.
"""

from __future__ import annotations

from typing import Protocol

import torch


class BlockKernel(Protocol):
    name: str

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q ``[b, h, sq, d]``, k ``[b, hkv, sk, d]``, v ``[b, hkv, sk, dv]`` -> out ``[b, h, sq, dv]``
        (q's dtype), lse ``[b, h, sq]`` (float32, or float64 for float64 inputs; natural log).
        ``dv`` may differ from ``d`` (MLA); kernels that need one head dim pad inside the call.

        ``causal`` masks key ``j > i`` for query ``i`` (top-left aligned); callers only
        use it on square diagonal blocks.
        """

    def backward(
        self,
        dout: torch.Tensor,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        out: torch.Tensor,
        lse: torch.Tensor,
        *,
        causal: bool,
        scale: float,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Gradients of one block given the *final* (merged) ``out`` and ``lse`` of its
        query rows: with those, each block's gradients are exact on their own, so no
        other block is recomputed. Returns dq ``[b, h, sq, d]``, dk ``[b, hkv, sk, d]``, dv ``[b, hkv, sk, dv]``.
        """
