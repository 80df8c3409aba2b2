"""Packed samples for the document-masking tests: documents, who holds what, the reference.

Written independently of ``megatron_startrail.layout``: the positions a CP rank holds
follow the two layouts' definitions directly (Megatron's whole-sample zigzag, and
Transformer Engine's per-document zigzag of padded spans), and the reference is dense
float64 attention with a block-diagonal document mask.
"""

from __future__ import annotations

import torch

from tests.attention_cases import window_mask, zigzag_ranges

PAD = -1


def make_documents(cp: int, chunk: int, layout: str, seed: int):
    """``(cu_seqlens, cu_seqlens_padded | None)`` as int32 tensors.

    Always holds a document of length 1, one shorter than ``2 * cp``, one longer than a
    chunk; the document layout also has a document needing no padding and one with a
    whole extra ``2 * cp`` of padding (some ranks then hold only padding of it).
    """
    gen = torch.Generator().manual_seed(seed)
    short = max(1, 2 * cp - 1)
    if layout == "sample":
        total = 2 * cp * chunk
        lengths = [1, short, chunk + 2]
        while sum(lengths) < total:
            lengths.append(int(torch.randint(1, 2 * chunk, (1,), generator=gen)))
        lengths[-1] -= sum(lengths) - total
        lengths = [n for n in lengths if n > 0]
        cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
        return cu, None
    lengths = [1, short, chunk + 2, 4 * cp, 3]
    spans = [-(-n // (2 * cp)) * 2 * cp for n in lengths]
    spans[-1] += 2 * cp
    cu = torch.tensor([0] + lengths).cumsum(0).to(torch.int32)
    padded = torch.tensor([0] + spans).cumsum(0).to(torch.int32)
    return cu, padded


def document_of_positions(cu, padded):
    """Per position of the (padded) sample: its document, or PAD."""
    if padded is None:
        return torch.repeat_interleave(torch.arange(len(cu) - 1), (cu[1:] - cu[:-1]).long())
    doc = torch.full((int(padded[-1]),), PAD)
    for i in range(len(cu) - 1):
        doc[int(padded[i]) : int(padded[i]) + int(cu[i + 1] - cu[i])] = i
    return doc


def held_positions(cp_rank: int, cp: int, cu, padded) -> torch.Tensor:
    """Positions CP rank ``cp_rank`` holds, in its storage order."""
    spans = [(0, int(cu[-1]))] if padded is None else [(int(a), int(b)) for a, b in zip(padded[:-1], padded[1:])]
    out = []
    for a, b in spans:  # the whole sample, or each padded document span, in Megatron's layout
        out += [torch.arange(a + lo, a + hi) for lo, hi in zigzag_ranges(cp_rank, cp, b - a)]
    return torch.cat(out)


def reference_packed(q, k, v, doc, causal, scale):
    """Float64 attention of ``[s, b, h, d]`` with a dense block-diagonal document mask.

    Padding rows (document PAD) see nothing: their output is 0 (and so are the gradients
    through them).
    """
    heads, kv_heads, s = q.shape[2], k.shape[2], q.shape[0]
    k = k.repeat_interleave(heads // kv_heads, dim=2)
    v = v.repeat_interleave(heads // kv_heads, dim=2)
    mask = (doc[:, None] == doc[None, :]) & (doc[:, None] != PAD)
    if causal:
        mask &= torch.ones(s, s, dtype=torch.bool).tril()
    real = mask.any(dim=1)
    mask |= torch.eye(s, dtype=torch.bool) & ~real[:, None]  # keep softmax finite on padding rows...
    scores = torch.einsum("sbhd,tbhd->bhst", q, k) * scale
    probs = torch.softmax(scores.masked_fill(~mask, float("-inf")), dim=-1)
    out = torch.einsum("bhst,tbhd->sbhd", probs, v)
    return out * real[:, None, None, None]  # ...and give them output 0


def reference_packed_with_grads(q, k, v, dout, doc, causal, scale):
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    out = reference_packed(q, k, v, doc, causal, scale)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def visible_pairs(doc, positions, window, causal):
    """``[s, s]`` bool: query i sees key j iff both are of one document (not padding) and
    ``pos_i - left <= pos_j <= pos_i + right`` (-1: unbounded), j <= i when causal."""
    delta = positions[None, :] - positions[:, None]  # key minus query position
    return (doc[:, None] == doc[None, :]) & (doc[:, None] != PAD) & window_mask(delta, window, causal)


def windowed_reference(q, k, v, dout, doc, positions, window, causal, scale, sink=None):
    """Float64 attention on ``[s, b, h, d]`` where query i sees key j iff both are of one
    document (not padding) and ``pos_i - left <= pos_j <= pos_i + right`` (-1: unbounded).

    ``sink [h]``: attention sinks the way Megatron's ``SoftmaxOne`` makes them -- a column
    of logits ``sink[h]`` appended to the scores and dropped after the softmax; then its
    gradient is returned too (out, dq, dk, dv, dsink)."""
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    heads, kv_heads, s = q.shape[2], k.shape[2], q.shape[0]
    kk, vv = (t.repeat_interleave(heads // kv_heads, dim=2) for t in (k, v))
    mask = visible_pairs(doc, positions, window, causal)
    real = mask.any(dim=1)
    mask |= torch.eye(s, dtype=torch.bool) & ~real[:, None]
    scores = (torch.einsum("sbhd,tbhd->bhst", q, kk) * scale).masked_fill(~mask, float("-inf"))
    if sink is not None:
        sink = sink.clone().requires_grad_(True)
        column = sink.view(1, -1, 1, 1).expand(scores.shape[0], -1, s, 1)
        probs = torch.softmax(torch.cat([scores, column], dim=-1), -1)[..., :-1]
    else:
        probs = torch.softmax(scores, -1)
    out = torch.einsum("bhst,tbhd->sbhd", probs, vv)
    out = out * real[:, None, None, None]
    out.backward(dout)
    grads = (q.grad, k.grad, v.grad) + ((sink.grad,) if sink is not None else ())
    return (out.detach(), *grads)
