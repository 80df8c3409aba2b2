"""Pure-PyTorch block kernel: readable math, any device and dtype (float64 included).

Slow (materializes the ``[sq, sk]`` score matrix of each sequence) but obviously right;
used as the reference in tests and as the fallback when no fused kernel is available.
"""

from __future__ import annotations

import torch

from .call_check import CheckedKernel
from .varlen import PerSequenceKernel


def expand_kv_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    # [b, hkv, s, d] -> [b, h, s, d]: query head i uses kv head i // (h // hkv).
    if x.shape[1] == heads:
        return x
    return x.repeat_interleave(heads // x.shape[1], dim=1)


def sum_kv_head_groups(x: torch.Tensor, kv_heads: int) -> torch.Tensor:
    # [b, h, s, d] -> [b, hkv, s, d]: the adjoint of expand_kv_heads. A group's h / hkv query
    # heads' dK (dV) are summed in float32 at least, then rounded once to x's dtype: a bf16 sum
    # rounds after every add (h / hkv - 1 roundings: 7 for GQA 32/4).
    b, h, s, d = x.shape
    if h == kv_heads:
        return x
    grouped = x.view(b, kv_heads, h // kv_heads, s, d)
    if x.dtype in (torch.float16, torch.bfloat16):
        return grouped.sum(dim=2, dtype=torch.float32).to(x.dtype)
    return grouped.sum(dim=2)


def _causal_mask(sq: int, sk: int, device) -> torch.Tensor:
    # True where key j is visible to query i (top-left aligned).
    return torch.ones(sq, sk, dtype=torch.bool, device=device).tril()


def _masked(scores: torch.Tensor, causal: bool, mask: torch.Tensor | None) -> torch.Tensor:
    """``scores [b, h, sq, sk]`` with invisible keys at -inf (causal and/or ``mask``)."""
    if causal:
        scores = scores.masked_fill(~_causal_mask(scores.shape[-2], scores.shape[-1], scores.device), float("-inf"))
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores


class ReferenceKernel(CheckedKernel, PerSequenceKernel):
    name = "reference"
    workspace_grows_with_keys = True  # each sequence's [b, h, sq, sk] scores

    # One sequence on [b, h, s, d]; ``mask`` (bool [sq, sk], True = visible) from the call's window.
    def _attend(self, q, k, v, *, causal, mask, scale):
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        qa, ka, va = q.to(acc), expand_kv_heads(k, q.shape[1]).to(acc), expand_kv_heads(v, q.shape[1]).to(acc)
        # 1. scores S = scale * Q K^T                                  [b, h, sq, sk]
        scores = _masked(torch.matmul(qa, ka.transpose(-1, -2)) * scale, causal, mask)
        # 2. lse = log sum_j exp(S_ij)                                  [b, h, sq]
        lse = torch.logsumexp(scores, dim=-1)
        # 3. P = exp(S - lse) (rows with no visible key get P = 0), O = P V
        probs = torch.exp(scores - lse.masked_fill(lse.isneginf(), 0).unsqueeze(-1))
        out = torch.matmul(probs, va)
        return out.to(q.dtype), lse

    def _attend_backward(self, dout, q, k, v, out, lse, *, causal, mask, scale):
        acc = torch.float64 if q.dtype == torch.float64 else torch.float32
        heads, kv_heads = q.shape[1], k.shape[1]
        qa, ka, va = q.to(acc), expand_kv_heads(k, heads).to(acc), expand_kv_heads(v, heads).to(acc)
        doa, oa, lsea = dout.to(acc), out.to(acc), lse.to(acc)
        # 1. recompute P from the final lse                             [b, h, sq, sk]
        scores = _masked(torch.matmul(qa, ka.transpose(-1, -2)) * scale, causal, mask)
        probs = torch.exp(scores - lsea.masked_fill(lsea.isneginf(), 0).unsqueeze(-1))
        # 2. dV = P^T dO
        dv = torch.matmul(probs.transpose(-1, -2), doa)
        # 3. dP = dO V^T;  D_i = sum_d dO_id O_id  (= sum_j P_ij dP_ij over *all* keys)
        dprobs = torch.matmul(doa, va.transpose(-1, -2))
        delta = (doa * oa).sum(dim=-1, keepdim=True)
        # 4. dS = P * (dP - D)
        dscores = probs * (dprobs - delta)
        # 5. dQ = scale * dS K;  dK = scale * dS^T Q
        dq = torch.matmul(dscores, ka) * scale
        dk = torch.matmul(dscores.transpose(-1, -2), qa) * scale
        return (
            dq.to(q.dtype),
            sum_kv_head_groups(dk, kv_heads).to(k.dtype),
            sum_kv_head_groups(dv, kv_heads).to(v.dtype),
        )
