"""The largest attention logit per head, for Megatron's QK-clip and ``--log-max-attention-logit``.

Megatron (megatron-core 0.19.2) reads ``core_attention.current_max_attn_logits``: per head of
the TP partition, the largest scaled logit ``softmax_scale * q . k`` the attention saw since
the last optimizer step, over the (query, key) pairs the mask lets through (attention sinks
are not logits). Transformer Engine's fused kernels return it (``return_max_logit``); the
block kernels here do not, so the forward's block loop makes one pass of its own per kernel
call (:func:`fold_call_`), on the device, over the rows the call already holds::

    per call, per sequence of the call, per tile of its query rows:
        S = q . k^T          [B, h, rows, keys]   (the tile's keys: those its window reaches)
        S[invisible] = -inf                       (the call's window, flash-attn's rule)
        best = max(best, S.amax over B, rows, keys)           best [h]

and the scale multiplies ``best`` once at the end (:func:`finish`; it is positive). No
communication and no host sync: a rank's value covers the (query, key) pairs its own kernel
calls attend, and the pairs of all CP ranks together are every pair once, so the MAX that
Megatron's ``clip_qk`` all-reduces over DP x CP is the full sequence's. After a Ulysses
all-to-all a rank attends ``h / U`` of the heads: its other heads are -inf, which that MAX
replaces.

Precision: the dot products are computed in the inputs' dtype (the kernels' own matmul;
a float32 copy would cost a pass over Q and K and a slower matmul). In float32 and float64
the value is exact up to summation order; in bf16 / fp16 it is the largest dot product
rounded to that dtype once (relative 2^-9 in bf16), where Transformer Engine keeps float32.

Memory: a tile's scores are at most :data:`TILE_ELEMENTS` elements; a call's query rows
are cut into as many tiles as that takes (each a handful of launches: the matmul, the mask,
the reduction, the running max).
"""

from __future__ import annotations

import torch

from .kernels.varlen import sequence_groups, sequences_in_batch

# At most this many scores per tile (bf16: 256 MiB); a call's query rows are tiled to fit.
TILE_ELEMENTS = 1 << 27


def new_accumulator(q: torch.Tensor) -> torch.Tensor:
    """``[h]`` of ``q [S, b, h, d]``'s heads at -inf (no pair seen yet): float32, float64 for
    float64 inputs (the accumulators' dtypes, ``blocks.acc_dtype``)."""
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32
    return q.new_full((q.shape[2],), float("-inf"), dtype=dtype)


def fold_call_(best: torch.Tensor, q: torch.Tensor, k: torch.Tensor, call) -> None:
    """In place: ``best [h]`` = max(``best``, the largest unscaled ``q . k`` per head over the
    pairs the kernel call lets through). ``q [Tq, b, h, d]`` and ``k [Tk, b, hkv, d]`` are the
    call's rows as its kernel takes them; ``call`` a :class:`~megatron_startrail.layout.KernelCall`
    (or one bound to its micro-batch). Its sequences and window follow flash-attn's rule
    (Note [kernel calls] in :mod:`megatron_startrail.layout`): query ``r`` of a sequence of
    ``sq`` queries and ``sk`` keys sees key ``c`` iff ``-left <= c - r - (sk - sq) <= right``."""
    left, right = call.window
    for (q0, q1), (k0, k1), count in sequence_groups(getattr(call, "call", call)):
        qs = sequences_in_batch(q[q0:q1], count)  # [B, h, sq, d]   (B = sequences x batch)
        ks = sequences_in_batch(k[k0:k1], count)  # [B, hkv, sk, d]
        sq, sk = qs.shape[2], ks.shape[2]
        shift = sk - sq  # bottom-right alignment: row r's window is placed at key r + shift
        rows = max(1, TILE_ELEMENTS // max(1, qs.shape[0] * qs.shape[1] * sk))
        for r0 in range(0, sq, rows):
            r1 = min(sq, r0 + rows)
            # The keys some row of the tile sees (host ints: the tile's window, no sync)
            c0 = 0 if left < 0 else max(0, r0 + shift - left)
            c1 = sk if right < 0 else min(sk, r1 - 1 + shift + right + 1)
            if c0 >= c1:
                continue
            scores = _dots(qs[:, :, r0:r1], ks[:, :, c0:c1])  # [B, h, r1 - r0, c1 - c0]
            _hide_invisible_(scores, r0 + shift - c0, left, right)
            torch.maximum(best, scores.amax(dim=(0, 2, 3)), out=best)
            del scores  # freed before the next tile's


def _dots(q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
    """``q [B, h, r, d] . k [B, hkv, c, d]^T -> [B, h, r, c]``; with GQA the query heads of a
    K head are made rows of one matmul (one copy of the tile's q; K is not replicated)."""
    b, h, r, d = q.shape
    kv_heads, c = k.shape[1], k.shape[2]
    if h == kv_heads:
        return torch.matmul(q, k.transpose(-1, -2))
    grouped = q.reshape(b, kv_heads, (h // kv_heads) * r, d)
    return torch.matmul(grouped, k.transpose(-1, -2)).view(b, h, r, c)


def _hide_invisible_(scores: torch.Tensor, diagonal: int, left: int, right: int) -> None:
    """In place: -inf where key ``j`` is outside row ``i``'s window, i.e. ``j - i - diagonal``
    is above ``right`` or below ``-left`` (-1: unbounded). Masks only what the tile has."""
    r, c = scores.shape[-2:]
    hidden = None
    if right >= 0 and diagonal + right + 1 < c:  # keys after the window: j > i + diagonal + right
        hidden = torch.ones(r, c, dtype=torch.bool, device=scores.device).triu_(diagonal + right + 1)
    if left >= 0 and r - 1 + diagonal - left > 0:  # keys before it: j < i + diagonal - left
        before = torch.ones(r, c, dtype=torch.bool, device=scores.device).tril_(diagonal - left - 1)
        hidden = before if hidden is None else hidden.logical_or_(before)
    if hidden is not None:
        scores.masked_fill_(hidden, float("-inf"))


def finish(best: torch.Tensor, scale: float) -> torch.Tensor:
    """``best`` (unscaled, from :func:`fold_call_`) times the softmax scale, in place (the scale
    is positive: the max of the scaled logits); once per layer, not per call."""
    return best.mul_(scale)


def place_heads(best: torch.Tensor, heads: int, ulysses_size: int, ulysses_rank: int) -> torch.Tensor:
    """``best [heads / U]``, the heads this rank attended after the Ulysses all-to-all (Ulysses
    rank ``u`` takes heads ``u * heads / U ..``, as :func:`~megatron_startrail.sinks.local_sink`),
    as ``[heads]`` in the order of the heads before it; the others are -inf, for the MAX over
    the CP group (Megatron's ``clip_qk``) to fill in from the ranks that attended them."""
    per = heads // ulysses_size
    full = best.new_full((heads,), float("-inf"))
    full[ulysses_rank * per:(ulysses_rank + 1) * per] = best
    return full
