"""PyTorch's fused CPU flash-attention op, which returns the log-sum-exp we need.

``aten::_scaled_dot_product_flash_attention_for_cpu`` takes ``[b, h, s, d]`` (strided
views are fine), accepts GQA directly, and returns lse ``[b, h, sq]`` in float32 (float64
for float64 inputs). Its backward takes the final out and lse. It wants one head dim for
q, k and v ("Q/K/V should have the same head size"), so MLA shapes (v head dim != q/k's)
are padded inside the call (:class:`~megatron_startrail.kernels.padding.EqualHeadDimsKernel`).
"""

from __future__ import annotations

import torch

from .padding import EqualHeadDimsKernel

_fwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_bwd = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward


class TorchCPUFlashKernel(EqualHeadDimsKernel):
    name = "torch_cpu_flash"

    def _forward(self, q, k, v, *, causal, scale):
        out, lse = _fwd(q, k, v, 0.0, causal, attn_mask=None, scale=scale)
        return out, lse

    def _backward(self, dout, q, k, v, out, lse, *, causal, scale):
        # The op wants out/lse laid out as it produced them; dout in out's layout.
        return _bwd(dout, q, k, v, out, lse, 0.0, causal, attn_mask=None, scale=scale)
