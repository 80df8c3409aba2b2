"""PyTorch's fused CPU flash-attention op, which returns the log-sum-exp we need.

``aten::_scaled_dot_product_flash_attention_for_cpu`` takes ``[b, h, s, d]`` (strided
views are fine), accepts GQA directly, and returns lse ``[b, h, sq]`` in float32 (float64
for float64 inputs). Its backward takes the final out and lse. It wants one head dim for
q, k and v ("Q/K/V should have the same head size"), so MLA shapes (v head dim != q/k's)
are padded inside the call (:class:`~megatron_startrail.kernels.padding.EqualHeadDimsKernel`).
"""

from __future__ import annotations

import torch

from .call_check import CheckedKernel
from .padding import EqualHeadDimsKernel
from .varlen import PerSequenceKernel

_fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


def additive(mask: torch.Tensor | None, dtype) -> torch.Tensor | None:
    """A bool mask ``[sq, sk]`` (True: visible) as the additive float mask the ops take."""
    if mask is None:
        return None
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))


class TorchCPUFlashKernel(CheckedKernel, EqualHeadDimsKernel, PerSequenceKernel):
    """flash-attn's variable-length semantics on CPU: the op per sequence, windows and
    bottom-right causal sequences through an explicit mask. A row with no visible key
    comes back from the op with lse 0; it is set to -inf (out is 0 already)."""

    name = "torch_cpu_flash"
    workspace_grows_with_keys = False  # fused: out and lse of the query rows (Note [whole key runs])

    def _attend(self, q, k, v, *, causal, mask, scale):
        out, lse = _fwd(q, k, v, 0.0, causal, attn_mask=additive(mask, q.dtype), scale=scale)
        if mask is not None:
            lse = lse.masked_fill(~mask.any(dim=-1), float("-inf"))
        return out, lse

    def _attend_backward(self, dout, q, k, v, out, lse, *, causal, mask, scale):
        # The op wants out/lse laid out as it produced them; dout in out's layout.
        return _bwd(dout, q, k, v, out, lse.contiguous(), 0.0, causal, attn_mask=additive(mask, q.dtype),
                    scale=scale)
