"""Block work of one sub-ring step: kernel calls over segment pairs, and the lse merge.

Tensors here are in Megatron's sequence-first layout; the rows are runs of tokens of
one document each, listed alongside as segments (Note [documents] in
:mod:`megatron_startrail.layout`); rows of padding take part in no kernel call::

    q-side   q [Sq, b, h, dqk], dout, out [Sq, b, h, dv]
             lse [b, h, Sq] (forward), [Sq, b, h] (backward)
    kv-side  kv [Sk, b, hkv, dqk + dv]   (K and V side by side in the last dim:
                                          k = kv[..., :dqk], v = kv[..., dqk:])

``dv`` may differ from ``dqk`` (Multi-Latent Attention: dqk 192, dv 128); V is never
padded to K's head dim, in memory or on the wire.

Kernels want ``[b, h, s, d]``; :func:`_bhsd` gives that as a view.
"""

from __future__ import annotations

import torch

from .kernels import BlockKernel, ReferenceKernel
from .layout import Block, Segment, plan_blocks


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """What partial results and gradients accumulate in: float32, float64 for float64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def _bhsd(x: torch.Tensor) -> torch.Tensor:
    # [s, b, h, d] -> [b, h, s, d] (a view)
    return x.permute(1, 2, 0, 3)


def merge_lse_(acc_out: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """In place: fold a partial (out, lse) into the accumulator (out ``[b,h,s,d]``, lse ``[b,h,s]``).

    ``acc_lse = -inf`` marks rows that have seen no key yet; they take zero weight (never
    NaN from ``-inf - -inf``).
    """
    new_lse = torch.logaddexp(acc_lse, lse.to(acc_lse.dtype))
    ref = new_lse.masked_fill(new_lse.isneginf(), 0.0)
    acc_out.mul_(torch.exp(acc_lse - ref).unsqueeze(-1))
    acc_out.add_(out.to(acc_out.dtype) * torch.exp(lse.to(ref.dtype) - ref).unsqueeze(-1))
    acc_lse.copy_(new_lse)


def merge_partials(outs: torch.Tensor, lses: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge ``C`` partial results: outs ``[C, b, h, s, d]``, lses ``[C, b, h, s]`` (acc dtype)."""
    lse = torch.logsumexp(lses, dim=0)
    ref = lse.masked_fill(lse.isneginf(), 0.0)
    weights = torch.exp(lses - ref).unsqueeze(-1)  # rows nobody saw: all weights 0
    # Summed part by part: one part's product at a time, not C of them (peak memory).
    out = outs[0].to(weights.dtype) * weights[0]
    for part, weight in zip(outs[1:], weights[1:]):
        out.add_(part.to(weights.dtype) * weight)
    return out, lse


def take_rows(kv: torch.Tensor, ranges: tuple[tuple[int, int], ...]) -> torch.Tensor:
    """Rows of ``ranges`` as one tensor (a view when there is one range)."""
    if len(ranges) == 1:
        return kv[ranges[0][0] : ranges[0][1]]
    return torch.cat([kv[a:b] for a, b in ranges])


def add_rows(dst: torch.Tensor, src: torch.Tensor, ranges: tuple[tuple[int, int], ...]) -> None:
    """Add ``src`` (the rows of ``ranges``, concatenated) into those rows of ``dst``."""
    pos = 0
    for a, b in ranges:
        dst[a:b].add_(src[pos : pos + b - a])
        pos += b - a


_BAND_KERNEL = ReferenceKernel()  # the band edges of a sliding window: explicit mask


def _call(kernel: BlockKernel, block: Block, device) -> tuple[BlockKernel, dict]:
    """The kernel and keyword arguments of ``block``: its own kernel, or for a band edge
    (Note [window blocks] in :mod:`megatron_startrail.layout`) the reference math with the
    band's mask ``[sq, sk]`` (True: visible)."""
    if block.band is None:
        return kernel, {"causal": block.causal}
    offset, lo, hi = block.band
    sq = block.q_rows[1] - block.q_rows[0]
    sk = sum(b - a for a, b in block.k_rows)
    delta = torch.arange(sk, device=device)[None, :] + offset - torch.arange(sq, device=device)[:, None]
    return _BAND_KERNEL, {"causal": False, "mask": (delta >= lo) & (delta <= hi)}


def _split_ranges(ranges: tuple[tuple[int, int], ...], limit: int) -> list[tuple[tuple[int, int], ...]]:
    """``ranges`` cut into consecutive groups of at most ``limit`` rows each."""
    groups: list[tuple[tuple[int, int], ...]] = []
    current: list[tuple[int, int]] = []
    room = limit
    for a, b in ranges:
        while a < b:
            take = min(b - a, room)
            current.append((a, a + take))
            a, room = a + take, room - take
            if room == 0:
                groups.append(tuple(current))
                current, room = [], limit
    if current:
        groups.append(tuple(current))
    return groups


def _tiles(planned: tuple[Block, ...], tile_rows: int | None):
    """The blocks, with full blocks cut into tiles of at most ``tile_rows`` query and key rows.

    Why: the planner merges the full blocks of a query segment (and adjacent segments) into
    one call, which on a team's gathered rows spans up to ``C`` times a rank's rows; a
    kernel's temporaries (gradients of the call's rows, its float32 accumulators, the
    concatenated key rows) grow with the call. Tiles of one rank's rows keep them at ring
    attention's size. Causal and band blocks are one segment or band tile long already."""
    for block in planned:
        if tile_rows is None or block.causal or block.band is not None:
            yield block
            continue
        q0, q1 = block.q_rows
        for qa in range(q0, q1, tile_rows):
            for k_rows in _split_ranges(block.k_rows, tile_rows):
                yield Block((qa, min(q1, qa + tile_rows)), k_rows, False)


def forward_step(
    kernel: BlockKernel,
    q: torch.Tensor,
    kv: torch.Tensor,
    q_segments: tuple[Segment, ...],
    k_segments: tuple[Segment, ...],
    acc_out: torch.Tensor,
    acc_lse: torch.Tensor,
    *,
    causal: bool,
    scale: float,
    window: tuple[int, int] | None = None,
    tile_rows: int | None = None,
) -> None:
    """Attend ``q`` to ``kv`` and merge into ``acc_out [b, h, Sq, dv]`` / ``acc_lse [b, h, Sq]``
    (full blocks in tiles of at most ``tile_rows`` rows a side)."""
    dqk = q.shape[-1]
    for block in _tiles(plan_blocks(q_segments, k_segments, causal, window), tile_rows):
        q0, q1 = block.q_rows
        kvs = take_rows(kv, block.k_rows)
        call, kwargs = _call(kernel, block, q.device)
        out, lse = call.forward(_bhsd(q[q0:q1]), _bhsd(kvs[..., :dqk]), _bhsd(kvs[..., dqk:]), scale=scale, **kwargs)
        merge_lse_(acc_out[:, :, q0:q1], acc_lse[:, :, q0:q1], out, lse)


def backward_step(
    kernel: BlockKernel,
    q: torch.Tensor,
    dout: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,  # [Sq, b, h], sequence first like the other query-side tensors
    kv: torch.Tensor,
    q_segments: tuple[Segment, ...],
    k_segments: tuple[Segment, ...],
    dq: torch.Tensor,
    dkv: torch.Tensor,
    *,
    causal: bool,
    scale: float,
    window: tuple[int, int] | None = None,
    tile_rows: int | None = None,
) -> None:
    """Add this step's gradients into ``dq [Sq, b, h, dqk]`` and ``dkv [Sk, b, hkv, dqk + dv]``
    (full blocks in tiles of at most ``tile_rows`` rows a side)."""
    dqk = q.shape[-1]
    for block in _tiles(plan_blocks(q_segments, k_segments, causal, window), tile_rows):
        q0, q1 = block.q_rows
        kvs = take_rows(kv, block.k_rows)
        call, kwargs = _call(kernel, block, q.device)
        gq, gk, gv = call.backward(
            _bhsd(dout[q0:q1]), _bhsd(q[q0:q1]), _bhsd(kvs[..., :dqk]), _bhsd(kvs[..., dqk:]), _bhsd(out[q0:q1]),
            lse[q0:q1].permute(1, 2, 0).contiguous(), scale=scale, **kwargs,
        )
        _bhsd(dq[q0:q1]).add_(gq)
        # [b, hkv, Sk', dqk] | [b, hkv, Sk', dv] -> [Sk', b, hkv, dqk + dv]
        add_rows(dkv, torch.cat([gk, gv], dim=-1).permute(2, 0, 1, 3), block.k_rows)
