"""Ulysses all-to-all around StarTrail (heads scattered, sequence gathered).

Inside a CP group of ``U * S`` ranks, the ``U`` consecutive CP ranks of a Ulysses group
exchange heads for sequence before StarTrail runs across Ulysses groups, and back after
(the ``a2a+p2p`` hierarchical CP of Megatron, with the ring replaced by StarTrail)::

    before  [n, b, h, d]        CP rank s*U+u holds chunks (c, 2CP-1-c), c = s*U+u
    after   [U*n, b, h/U, d]    StarTrail position s holds the chunks of CP ranks
                                s*U .. s*U+U-1 (in that order) for heads u*h/U ..

GQA: K/V heads go through the same exchange; with fewer K/V heads than ``U`` they are
replicated up to ``U`` first so that Ulysses rank ``u`` receives the K/V head its query
heads use (autograd sums the replicas' gradients).
"""

from __future__ import annotations

import torch

from .comm import CommStats, Communicator


def _seq_gather(x: torch.Tensor, comm: Communicator, group, u: int) -> torch.Tensor:
    # [n, b, h, d] -> [U (dest: head slice), n, b, h/U, d] -> exchange -> [U*n, b, h/U, d]
    n, b, h, d = x.shape
    parts = x.view(n, b, u, h // u, d).permute(2, 0, 1, 3, 4)
    got = comm.all_to_all(parts, group, u, op="ulysses_all_to_all")  # [U (source), n, b, h/U, d]
    return got.reshape(u * n, b, h // u, d)


def _seq_scatter(x: torch.Tensor, comm: Communicator, group, u: int) -> torch.Tensor:
    # [U*n, b, h/U, d] -> [U (dest: sequence slice), n, b, h/U, d] -> exchange -> [n, b, h, d]
    un, b, hu, d = x.shape
    parts = x.view(u, un // u, b, hu, d)
    got = comm.all_to_all(parts, group, u, op="ulysses_all_to_all")  # [U (source: heads), n, b, h/U, d]
    return got.permute(1, 2, 0, 3, 4).reshape(un // u, b, u * hu, d)


class _UlyssesExchange(torch.autograd.Function):
    """Sequence gather (``to_sequence=True``) or scatter; the backward is the other one."""

    @staticmethod
    def forward(ctx, x, groups, to_sequence, fwd_stats, bwd_stats, timeline):
        ctx.groups, ctx.to_sequence, ctx.bwd_stats, ctx.timeline = groups, to_sequence, bwd_stats, timeline
        comm = Communicator(fwd_stats, groups.transports_on(x.device)[0], timeline)
        exchange = _seq_gather if to_sequence else _seq_scatter
        return exchange(x.contiguous(), comm, groups.ulysses_group, groups.ulysses_size)

    @staticmethod
    def backward(ctx, grad):
        groups = ctx.groups
        comm = Communicator(ctx.bwd_stats, groups.transports_on(grad.device)[0], ctx.timeline)
        back = _seq_scatter if ctx.to_sequence else _seq_gather
        return back(grad.contiguous(), comm, groups.ulysses_group, groups.ulysses_size), None, None, None, None, None


def gather_sequence(q, k, v, groups, fwd_stats: CommStats, bwd_stats: CommStats, timeline=None):
    """Ulysses all-to-all of q, k, v before StarTrail (waits recorded in ``timeline``, if given)."""
    u = groups.ulysses_size
    kv_heads = k.shape[2]
    if kv_heads % u != 0:  # u % kv_heads == 0 (checked): replicate K/V heads up to U
        k = k.repeat_interleave(u // kv_heads, dim=2)
        v = v.repeat_interleave(u // kv_heads, dim=2)
    return tuple(
        _UlyssesExchange.apply(t, groups, True, fwd_stats, bwd_stats, timeline) for t in (q, k, v)
    )


def scatter_sequence(out, groups, fwd_stats: CommStats, bwd_stats: CommStats, timeline=None):
    """Ulysses all-to-all of the attention output back to the CP layout."""
    return _UlyssesExchange.apply(out, groups, False, fwd_stats, bwd_stats, timeline)
