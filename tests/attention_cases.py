"""Shared pieces of the distributed attention tests: inputs, the float64 reference, errors.

Every rank builds the same full-sequence tensors from a seed, takes its own chunks in
Megatron's CP layout, and compares against float64 attention on the whole sequence.
"""

from __future__ import annotations

import itertools

import torch
import torch.distributed as dist

from megatron_startrail.layout import plan_calls

# Max |error| / max |reference| allowed per input dtype (the output and each gradient).
TOLERANCE = {torch.float64: 1e-12, torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}


def full_inputs(seed, seq, batch, heads, kv_heads, dim, dtype):
    """q, k, v, dout ``[seq, b, heads|kv_heads, dim]``, rounded to ``dtype``, held in float64."""
    gen = torch.Generator().manual_seed(seed)
    shapes = [(seq, batch, heads, dim), (seq, batch, kv_heads, dim), (seq, batch, kv_heads, dim), (seq, batch, heads, dim)]
    return [torch.randn(s, generator=gen, dtype=torch.float64).to(dtype).to(torch.float64) for s in shapes]


def reference_attention(q, k, v, causal, scale):
    """Plain float64 softmax attention on ``[s, b, h, d]`` (GQA by head groups)."""
    heads, kv_heads = q.shape[2], k.shape[2]
    k = k.repeat_interleave(heads // kv_heads, dim=2)
    v = v.repeat_interleave(heads // kv_heads, dim=2)
    scores = torch.einsum("sbhd,tbhd->bhst", q, k) * scale
    if causal:
        s = q.shape[0]
        scores = scores.masked_fill(~torch.ones(s, s, dtype=torch.bool).tril(), float("-inf"))
    return torch.einsum("bhst,tbhd->sbhd", torch.softmax(scores, dim=-1), v)


def causal_pairs(seq: int) -> torch.Tensor:
    """``[seq, seq]`` bool: query i sees key j iff j <= i."""
    return torch.ones(seq, seq, dtype=torch.bool).tril()


def reference_max_logit(q, k, visible, scale):
    """Megatron's ``current_max_attn_logits`` of the whole sequence in float64: per head, the
    largest ``scale * q . k`` over the pairs ``visible [s, s]`` lets through (None: all);
    q ``[s, b, h, d]``, k ``[s, b, hkv, d]`` -> ``[h]``."""
    k = k.repeat_interleave(q.shape[2] // k.shape[2], dim=2)
    scores = torch.einsum("sbhd,tbhd->bhst", q.double(), k.double()) * scale
    if visible is not None:
        scores = scores.masked_fill(~visible, float("-inf"))
    return scores.amax(dim=(0, 2, 3))


def max_logit_error(local, want, group=None):
    """Relative error of this rank's ``max_logit [h]`` after the MAX over the CP group (what
    Megatron's ``clip_qk`` all-reduces) against :func:`reference_max_logit`; the same on every rank."""
    got = local.detach().clone()
    dist.all_reduce(got, op=dist.ReduceOp.MAX, group=group)
    return relative_error(got, want)


def reference_with_grads(q, k, v, dout, causal, scale):
    q, k, v = (t.clone().requires_grad_(True) for t in (q, k, v))
    out = reference_attention(q, k, v, causal, scale)
    out.backward(dout)
    return out.detach(), q.grad, k.grad, v.grad


def zigzag_ranges(cp_rank, cp_size, seq_len):
    """The rows ``[start, stop)`` CP rank ``cp_rank`` holds of a ``seq_len``-token sequence in
    Megatron's CP layout (``megatron.core.utils.get_batch_on_this_cp_rank``): the sequence
    is cut into ``2 * cp_size`` equal chunks and rank ``r`` holds chunks ``r`` and
    ``2 * cp_size - 1 - r``, in that order.

    The one copy of this layout for tests and benchmarks. It is written from Megatron's
    definition rather than with :mod:`megatron_startrail.layout`, so that inputs laid out
    with it check the package's layout math instead of sharing it.
    """
    if seq_len % (2 * cp_size):
        raise ValueError(f"{seq_len} tokens do not cut into 2 * {cp_size} equal chunks")
    chunk = seq_len // (2 * cp_size)
    return [(c * chunk, (c + 1) * chunk) for c in (cp_rank, 2 * cp_size - 1 - cp_rank)]


def local_rows(x, cp_rank, cp_size):
    """This CP rank's rows of a ``[seq, ...]`` tensor, in Megatron's layout (:func:`zigzag_ranges`)."""
    return torch.cat([x[a:b] for a, b in zigzag_ranges(cp_rank, cp_size, x.shape[0])])


def relative_error(got, want):
    return ((got.double() - want).abs().max() / want.abs().max().clamp_min(1e-30)).item()


def flash_rule(sq, sk, window):
    """flash-attn's variable-length mask of one sequence, written out from its documentation:
    query r sees key c iff r + sk - sq - left <= c <= r + sk - sq + right (-1: unbounded)."""
    left, right = window
    r, c = torch.arange(sq)[:, None], torch.arange(sk)[None, :]
    mask = torch.ones(sq, sk, dtype=torch.bool)
    if left >= 0:
        mask &= c >= r + sk - sq - left
    if right >= 0:
        mask &= c <= r + sk - sq + right
    return mask


def plan_coverage(q_segments, k_segments, causal, window=None, max_rows=None, whole_key_runs=False):
    """How many times each (query row, key row) pair of local storage is computed by the
    planned kernel calls, each sequence read with :func:`flash_rule` (not taken from the
    kernels). Also checks what the merge relies on:
    no two sequences of a call share a query row, and every query row sees a key."""
    q_total = sum(b - a for _, a, b in q_segments)
    k_total = sum(b - a for _, a, b in k_segments)
    count = torch.zeros(q_total, k_total, dtype=torch.int64)
    for call in plan_calls(q_segments, k_segments, causal, window, max_rows, whole_key_runs):
        rows = torch.cat([torch.arange(a, b) for a, b in call.q_rows])
        assert len(set(rows.tolist())) == len(rows), "sequences of one call share a query row"
        if max_rows is not None:
            assert len(rows) <= max_rows or len(call.q_rows) == 1
            keys = sum(b - a for ranges in call.k_rows for a, b in ranges)
            assert keys <= max_rows or len(call.q_rows) == 1
            if call.window == (-1, -1) and keys > max_rows:  # full keys are tiled, except (Note [whole
                assert whole_key_runs and call.k_slice is not None  # key runs]) one run of them: a view
        for (q0, q1), k_rows in zip(call.q_rows, call.k_rows):
            cols = torch.cat([torch.arange(a, b) for a, b in k_rows])
            sub = flash_rule(q1 - q0, len(cols), call.window)
            assert sub.any(dim=1).all(), "a query row of a sequence sees no key"
            count[q0:q1][:, cols] += sub.long()
    return count


def window_mask(delta: torch.Tensor, window: tuple[int, int], causal: bool) -> torch.Tensor:
    """Where key minus query position ``delta`` is inside a sliding ``window`` (left, right),
    -1 unbounded, the way Megatron and flash-attn define it (True: visible)."""
    left, right = window
    mask = torch.ones_like(delta, dtype=torch.bool)
    if causal:
        mask &= delta <= 0
    if left >= 0:
        mask &= delta >= -left
    if right >= 0:
        mask &= delta <= right
    return mask


def pairs_not_run(cases, values) -> list:
    """``(i, a, j, b)`` for every pair of settings ``i < j`` and values ``a`` of ``values[i]``, ``b``
    of ``values[j]`` that no case of ``cases`` (tuples, one value per setting) runs together: the
    test of a case list cut from a full product to every pair of settings."""
    return [(i, a, j, b) for i, j in itertools.combinations(range(len(values)), 2)
            for a, b in itertools.product(values[i], values[j])
            if not any(case[i] == a and case[j] == b for case in cases)]
