"""Communication on explicit process groups, with byte accounting.

Every collective and point-to-point transfer of the attention goes through
:class:`Communicator`, which records what this rank sent and received in a
:class:`CommStats`. Collective bytes are the *logical* per-rank volume of a
bandwidth-optimal algorithm, the quantity of the paper's eq. 2 (for a group of ``n``
ranks: all-gather of ``N`` bytes per rank moves ``(n-1) N``; reduce-scatter and
all-to-all of ``N`` bytes per rank move ``(n-1)/n N``). P2P bytes are exact tensor sizes.
"""

from __future__ import annotations

import time
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


def _timed(timeline, op: str, fn):
    """Run ``fn`` (something that blocks) and return its result; with a ``timeline``, the
    time it blocked is recorded there under ``op``."""
    if timeline is None:
        return fn()
    start = time.perf_counter()
    result = fn()
    timeline.add(op, start, time.perf_counter())
    return result


class PendingP2P:
    """Handles of one posted batch of sends/receives; ``wait()`` completes all of them
    (and records the time blocked in ``timeline`` under ``op``, if one is given). Until
    then it keeps the batch's tensors alive: a caller may drop a tensor it is sending
    (e.g. a piece of the initial send) before the transfer is done."""

    def __init__(self, works: list, timeline=None, op: str = "", tensors: list | None = None) -> None:
        self._works, self._tensors = works, tensors
        self._timeline, self._op = timeline, op

    def wait(self) -> None:
        if self._works:
            _timed(self._timeline, self._op, lambda: [w.wait() for w in self._works])
        self._works, self._tensors = [], None


class PendingCollective:
    """A collective started with ``wait=False``: ``wait()`` blocks until it is done (the
    time blocked goes to ``timeline`` under ``op``) and returns its output."""

    def __init__(self, work, out: torch.Tensor, timeline=None, op: str = "") -> None:
        self._work, self._out = work, out
        self._timeline, self._op = timeline, op

    def wait(self) -> torch.Tensor:
        if self._work is not None:
            _timed(self._timeline, self._op, self._work.wait)
            self._work = None
        return self._out


class Communicator:
    """Collectives on one group and P2P on another, recording into ``stats``.

    ``p2p_group`` is the StarTrail group; peers are given as positions in it.
    ``reverse_group`` (optional) is a second group over the same ranks: transfers to a
    lower position go through it, so the two directions of a rank pair use two
    connections (see ``StarTrailGroups.startrail_reverse_group``).
    ``timeline`` (a :class:`~megatron_startrail.timeline.Timeline`, optional) records
    the time blocked in every collective and every P2P ``wait()``.
    """

    def __init__(self, stats: CommStats, p2p_group, p2p_global_ranks: tuple[int, ...], timeline=None,
                 reverse_group=None) -> None:
        self.stats = stats
        self.p2p_group = p2p_group
        self.p2p_global_ranks = p2p_global_ranks
        self.timeline = timeline
        self.reverse_group = reverse_group
        self._position = p2p_global_ranks.index(dist.get_rank()) if reverse_group is not None else None

    def _group(self, src: int, dst: int):
        """The group carrying a transfer from position ``src`` to ``dst``."""
        return self.reverse_group if self.reverse_group is not None and dst < src else self.p2p_group

    def _run(self, name: str, fn, out: torch.Tensor, *args, wait: bool, **kwargs):
        """Run collective ``name`` writing ``out``: blocking (``wait=True``, returns ``out``, its
        span recorded when a timeline is on) or started (returns a :class:`PendingCollective`)."""
        if not wait:
            return PendingCollective(fn(*args, async_op=True, **kwargs), out, self.timeline, name)
        _timed(self.timeline, name, lambda: fn(*args, **kwargs))
        return out

    @staticmethod
    def _done(out: torch.Tensor, wait: bool):
        """The result of a collective that moves nothing (a group of one)."""
        return out if wait else PendingCollective(None, out)

    # -- point to point --------------------------------------------------------------
    def post(
        self,
        sends: list[tuple[torch.Tensor, int]],
        recvs: list[tuple[torch.Tensor, int]],
        *,
        op: str,
        tag: int = 0,
        counts_as_step: bool = True,
    ) -> PendingP2P:
        """Post async sends ``(tensor, dst position)`` and receives ``(buffer, src position)``.

        ``counts_as_step=False`` marks a transfer that runs concurrently with another
        chain of rounds (so it adds no sequential step of its own).
        """
        me = self._position
        ops: dict = defaultdict(list)  # group -> its P2P ops (a batch takes one group)
        for t, peer in sends:
            group = self._group(me, peer)
            ops[group].append(dist.P2POp(dist.isend, t, group=group, group_peer=peer, tag=tag))
            nbytes = _nbytes(t)
            self.stats.p2p_bytes_sent += nbytes
            self.stats.p2p_bytes_sent_to[self.p2p_global_ranks[peer]] += nbytes
            self.stats.bytes_sent_by_op[op] += nbytes
        for t, peer in recvs:
            group = self._group(peer, me)
            ops[group].append(dist.P2POp(dist.irecv, t, group=group, group_peer=peer, tag=tag))
            nbytes = _nbytes(t)
            self.stats.p2p_bytes_recv += nbytes
            self.stats.p2p_bytes_recv_from[self.p2p_global_ranks[peer]] += nbytes
        if ops and counts_as_step:
            self.stats.p2p_steps += 1
        works = [w for batch in ops.values() for w in dist.batch_isend_irecv(batch)]
        return PendingP2P(works, self.timeline, op, tensors=[t for t, _ in sends + recvs])

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
