"""Communication on explicit process groups, with byte accounting.

Every collective and point-to-point transfer of the attention goes through
:class:`Communicator`, which records what this rank sent and received in a
:class:`CommStats`. Collective bytes are the *logical* per-rank volume of a
bandwidth-optimal algorithm, the quantity of the paper's eq. 2 (for a group of ``n``
ranks: all-gather of ``N`` bytes per rank moves ``(n-1) N``; reduce-scatter and
all-to-all of ``N`` bytes per rank move ``(n-1)/n N``). P2P bytes are exact tensor sizes.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

# torch >= 2.9 names these *_single; keep working on older releases.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


@dataclass
class CommStats:
    """Bytes and steps of one forward or one backward of the attention, on one rank."""

    p2p_bytes_sent: int = 0
    p2p_bytes_recv: int = 0
    collective_bytes_sent: int = 0
    collective_bytes_recv: int = 0
    # Sequential P2P rounds: transfers that wait on the previous round.
    p2p_steps: int = 0
    # Per destination/source *global* rank (for counting what crosses node boundaries).
    p2p_bytes_sent_to: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    p2p_bytes_recv_from: dict[int, int] = field(default_factory=lambda: defaultdict(int))
    # Bytes sent per operation name ("team_all_gather", "init_send", "sub_ring", ...).
    bytes_sent_by_op: dict[str, int] = field(default_factory=lambda: defaultdict(int))

    def as_dict(self) -> dict:
        return {
            "p2p_bytes_sent": self.p2p_bytes_sent,
            "p2p_bytes_recv": self.p2p_bytes_recv,
            "collective_bytes_sent": self.collective_bytes_sent,
            "collective_bytes_recv": self.collective_bytes_recv,
            "p2p_steps": self.p2p_steps,
            "p2p_bytes_sent_to": dict(self.p2p_bytes_sent_to),
            "p2p_bytes_recv_from": dict(self.p2p_bytes_recv_from),
            "bytes_sent_by_op": dict(self.bytes_sent_by_op),
        }


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class PendingP2P:
    """Works of one posted batch of sends/receives; ``wait()`` completes all of them through
    the transport (host-blocking on gloo, a stream dependency on NCCL; the wait goes to
    ``timeline`` under ``op``). Until then it keeps the batch's tensors alive: a caller may
    drop a tensor it is sending (e.g. a piece of the initial send) before the transfer is done."""

    def __init__(self, transport, works: list, timeline=None, op: str = "", tensors: list | None = None) -> None:
        self._transport, self._works, self._tensors = transport, works, tensors
        self._timeline, self._op = timeline, op

    def wait(self) -> None:
        if self._works:
            self._transport.wait(self._works, self._timeline, self._op)
        self._works, self._tensors = [], None


class PendingCollective:
    """A collective started with ``wait=False``: ``wait()`` completes it through the transport
    (recorded in ``timeline`` under ``op``) and returns its output."""

    def __init__(self, transport, work, out: torch.Tensor, timeline=None, op: str = "") -> None:
        self._transport, self._work, self._out = transport, work, out
        self._timeline, self._op = timeline, op

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            self._transport.wait([self._work], self._timeline, self._op)
            self._work = None
        return self._out


class Communicator:
    """The attention's communication through one :class:`~megatron_startrail.transport.Transport`,
    recording into ``stats``.

    P2P peers are positions in the transport's StarTrail group; collectives name their group.
    ``timeline`` (a :class:`~megatron_startrail.timeline.Timeline`, optional) records every
    wait: host time on gloo, CUDA events on NCCL.
    """

    def __init__(self, stats: CommStats, transport, timeline=None) -> None:
        self.stats = stats
        self.transport = transport
        self.timeline = timeline

    def _run(self, name: str, fn, out: torch.Tensor, *args, group, wait: bool, **kwargs):
        """Start collective ``fn`` writing ``out`` on ``group``: waited for (``wait=True``,
        returns ``out``) or left running (returns a :class:`PendingCollective`)."""
        pending = PendingCollective(self.transport, self.transport.collective(fn, *args, group=group, label=name,
                                                                              **kwargs),
                                    out, self.timeline, name)
        return pending.wait() if wait else pending

    def _done(self, out: torch.Tensor, wait: bool):
        """The result of a collective that moves nothing (a group of one)."""
        return out if wait else PendingCollective(self.transport, None, out)

    # -- point to point --------------------------------------------------------------
    def post(
        self,
        sends: list[tuple[torch.Tensor, int]],
        recvs: list[tuple[torch.Tensor, int]],
        *,
        op: str,
        channel: str = "ring",
        counts_as_step: bool = True,
    ) -> PendingP2P:
        """Post async sends ``(tensor, dst position)`` and receives ``(buffer, src position)``.

        ``channel`` is ``"ring"`` for the sub-ring's hops and ``"side"`` for what runs beside
        them (initial send, its reverse, gradient accumulators): on NCCL they use separate
        communicators so that they progress together. ``counts_as_step=False`` marks a
        transfer that runs concurrently with another chain of rounds (so it adds no
        sequential step of its own). Messages carry no tag: peers match them in posting order.
        """
        # NCCL and gloo move a tensor's storage as one dense block: a strided view (q of a
        # fused QKV, a transposed dO) is sent as a dense copy, and a receive must land in a
        # dense buffer (the schedule allocates every buffer, so one that is not is a bug).
        sends = [(t.contiguous(), peer) for t, peer in sends]
        for t, _ in recvs:
            if not t.is_contiguous():
                raise ValueError(f"{op}: a receive buffer of shape {tuple(t.shape)} is not contiguous")
        ranks = self.transport.p2p_ranks
        for t, peer in sends:
            nbytes = _nbytes(t)
            self.stats.p2p_bytes_sent += nbytes
            self.stats.p2p_bytes_sent_to[ranks[peer]] += nbytes
            self.stats.bytes_sent_by_op[op] += nbytes
        for t, peer in recvs:
            nbytes = _nbytes(t)
            self.stats.p2p_bytes_recv += nbytes
            self.stats.p2p_bytes_recv_from[ranks[peer]] += nbytes
        if (sends or recvs) and counts_as_step:
            self.stats.p2p_steps += 1
        works = self.transport.post(sends, recvs, channel=channel, label=op) if sends or recvs else []
        return PendingP2P(self.transport, works, self.timeline, op, tensors=[t for t, _ in sends + recvs])

    # -- collectives -----------------------------------------------------------------
    def _count_collective(self, op: str, moved: int) -> None:
        self.stats.collective_bytes_sent += moved
        self.stats.collective_bytes_recv += moved
        self.stats.bytes_sent_by_op[op] += moved

    # ``wait=False`` starts the collective and returns a PendingCollective instead of
    # the output, so that compute or other transfers can run while it flies.
    def all_gather(self, x: torch.Tensor, group, group_size: int, *, op: str, wait: bool = True):
        """``[n, ...]`` on each rank -> ``[group_size * n, ...]``, concatenated in rank order."""
        if group_size == 1:
            return self._done(x, wait)
        x = x.contiguous()
        out = x.new_empty((group_size * x.shape[0],) + tuple(x.shape[1:]))
        self._count_collective(op, (group_size - 1) * _nbytes(x))
        return self._run(op, _all_gather, out, out, x, group=group, wait=wait)

    def reduce_scatter(self, x: torch.Tensor, group, group_size: int, *, op: str, wait: bool = True):
        """Sum of ``[group_size * n, ...]`` over the group; this rank keeps its ``[n, ...]`` slice."""
        if group_size == 1:
            return self._done(x, wait)
        x = x.contiguous()
        out = x.new_empty((x.shape[0] // group_size,) + tuple(x.shape[1:]))
        self._count_collective(op, (group_size - 1) * _nbytes(out))
        return self._run(op, _reduce_scatter, out, out, x, group=group, wait=wait)

    def broadcast(self, x: torch.Tensor, group, group_size: int, *, src: int, mine: bool, op: str,
                  wait: bool = True):
        """``x`` of group rank ``src`` to every rank of the group (``mine``: this rank is ``src``),
        in place when ``x`` is contiguous, else through a dense copy (on the source) or a dense
        buffer (elsewhere); use the returned tensor. Counted as a bandwidth-optimal broadcast:
        the source sends ``(n-1) N``, every other rank receives ``N``; a round of ``n``
        broadcasts, one from each rank, then counts what one all-gather of ``N`` per rank does."""
        if group_size == 1:
            return self._done(x, wait)
        if not x.is_contiguous():
            x = x.contiguous() if mine else torch.empty(x.shape, dtype=x.dtype, device=x.device)
        if mine:
            moved = (group_size - 1) * _nbytes(x)
            self.stats.collective_bytes_sent += moved
            self.stats.bytes_sent_by_op[op] += moved
        else:
            self.stats.collective_bytes_recv += _nbytes(x)
        return self._run(op, dist.broadcast, x, x, group=group, wait=wait, group_src=src)

    def reduce(self, x: torch.Tensor, group, group_size: int, *, dst: int, mine: bool, op: str):
        """Sum of ``x`` over the group, into ``x`` of group rank ``dst`` (``mine``: this rank is
        ``dst``; elsewhere ``x`` is left undefined). Counted as every other rank sending ``N``
        and ``dst`` receiving ``(n-1) N``: a round of ``n`` reduces, one to each rank, counts
        what one reduce-scatter to ``N`` per rank does."""
        if group_size == 1:
            return x
        x = x.contiguous()
        if mine:
            self.stats.collective_bytes_recv += (group_size - 1) * _nbytes(x)
        else:
            self.stats.collective_bytes_sent += _nbytes(x)
            self.stats.bytes_sent_by_op[op] += _nbytes(x)
        return self._run(op, dist.reduce, x, x, group=group, wait=True, group_dst=dst)

    def all_to_all(self, x: torch.Tensor, group, group_size: int, *, op: str, wait: bool = True):
        """``[group_size, ...]``: slice ``i`` goes to rank ``i``; returns slices by source."""
        if group_size == 1:
            return self._done(x, wait)
        x = x.contiguous()
        out = torch.empty_like(x)
        self._count_collective(op, (group_size - 1) * _nbytes(x) // group_size)
        return self._run(op, dist.all_to_all_single, out, out, x, group=group, wait=wait)

    def all_reduce_max(self, x: torch.Tensor, group, group_size: int, *, op: str) -> torch.Tensor:
        """Element-wise maximum of ``x`` over the group (a new tensor)."""
        if group_size == 1:
            return x
        x = x.clone()
        self._run(op, dist.all_reduce, x, x, op=dist.ReduceOp.MAX, group=group, wait=True)
        self._count_collective(op, 2 * (group_size - 1) * _nbytes(x) // group_size)
        return x
