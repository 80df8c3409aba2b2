"""Phases 1-2 of StarTrail, shared by the forward and the regathering backward: the team
all-gather and the initial send (docs/design.md, "The forward, phase by phase"), and the
rows a team's gathered sequence holds."""

from __future__ import annotations

import weakref

import torch

from .comm import Communicator
from .groups import StarTrailGroups
from .initial_send import PieceTransfer, post_initial_send
from .layout import Documents, Segment, rows_of_cp_ranks


def team_segments(groups: StarTrailGroups, docs: Documents, team: int) -> tuple[Segment, ...]:
    """The rows of a team's gathered sequence as segments (members in order, each member
    holding the CP ranks of its Ulysses group in order)."""
    u = groups.ulysses_size
    cp_ranks = tuple(p * u + i for p in groups.topology.team_positions(team) for i in range(u))
    return rows_of_cp_ranks(docs, cp_ranks)


def gather_team_and_send(comm: Communicator, groups: StarTrailGroups, q, k, v, *, gather_op: str, send_op: str,
                         gather_q: bool = True):
    """Phases 1-2, overlapped. Team all-gather: ``q [n, b, h, dqk]``, ``k [n, b, hkv, dqk]``,
    ``v [n, b, hkv, dv]`` -> ``q_team [C*n, b, h, dqk]``, ``kv_team [C*n, b, hkv, dqk + dv]``;
    initial send (paper Alg. 2) of ``kv_team`` to ``init_send_dst``, in ``C`` pieces. Returns
    ``q_team`` and ``kv_init``, what this rank starts the sub-ring with, still landing (a
    :class:`PieceTransfer`; ``kv_team`` itself when the send maps the rank to itself).

    Both gathers start at once, K, V first: the initial send needs only them, so it goes
    out while Q is still being gathered. K and V travel side by side in the last dim, so
    V keeps its own head dim (MLA). ``gather_q=False`` (the backward with rotation "q",
    which takes the team's queries member by member) gathers K, V only; ``q_team`` is None."""
    c, topo, pos = groups.team_size, groups.topology, groups.startrail_rank
    if c > 1:  # Note [streamed initial send]
        kv_init = StreamedTeamSend(comm, groups, k, v, gather_op=gather_op, send_op=send_op)
        q_gather = comm.all_gather(q, groups.team_group, c, op=gather_op, wait=False) if gather_q else None
        return (q_gather.wait() if gather_q else None), kv_init
    kv_gather = comm.all_gather(torch.cat([k, v], dim=-1), groups.team_group, c, op=gather_op, wait=False)
    q_gather = comm.all_gather(q, groups.team_group, c, op=gather_op, wait=False) if gather_q else None
    kv_init = post_initial_send(comm, topo, pos, kv_gather.wait(), op=send_op)
    return (q_gather.wait() if gather_q else None), kv_init


# Note [streamed initial send]
# ----------------------------
# The team's K, V (C pieces of n rows, one per member) are only a send buffer on this rank:
# the initial send takes them to init_send_dst, and this rank attends to what lands from
# init_send_src. Gathered whole, C pieces are live at once on the sending side beside the
# C pieces landing. Instead piece j is broadcast in the team from member j (the all-gather,
# one source at a time: the same bytes) and sent on at once; the next piece is broadcast
# when this rank starts waiting for the previous one to land, so at most two pieces are
# held for sending. Every rank runs the same sequence (broadcast j, post send j / receive
# j, ..., wait j-1), so the team's collectives and each pair's transfers are posted in the
# same order everywhere (what NCCL matches by), and a rank blocked in broadcast j waits
# only for team members that have all posted piece j-1's transfers.


class _LandingPiece:
    """Piece ``j`` of a :class:`StreamedTeamSend` as a pending transfer (``wait()``). It holds
    its owner weakly: a reference cycle would keep the owner's buffers alive until the
    garbage collector runs, not until the layer lets go of them (peak memory)."""

    def __init__(self, owner: StreamedTeamSend, j: int) -> None:
        self._owner, self._j = weakref.ref(owner), j

    def wait(self) -> None:
        self._owner().piece(self._j)


class StreamedTeamSend(PieceTransfer):
    """Phases 1-2 for K, V one piece at a time (Note [streamed initial send]): piece ``j``,
    member ``j``'s ``k | v [n, b, hkv, dqk + dv]``, is broadcast in the team and sent to
    ``init_send_dst``; what lands from ``init_send_src`` is piece ``j`` of the initial send.
    ``whole=True`` lands the pieces in one ``[C*n, b, hkv, dqk + dv]`` tensor (``tensor``,
    what the forward keeps); ``whole=False`` in a buffer per piece, freed by
    :meth:`release` (the piece-major backward, Note [piece-major rotation q] in backward.py)."""

    def __init__(self, comm: Communicator, groups: StarTrailGroups, k, v, *, gather_op: str, send_op: str,
                 whole: bool = True):
        c, topo, pos = groups.team_size, groups.topology, groups.startrail_rank
        self._k, self._v = k, v  # this member's piece is made (k | v side by side) when it is its turn
        n, piece_shape = k.shape[0], tuple(k.shape[:-1]) + (k.shape[-1] + v.shape[-1],)
        self._empty_piece = lambda: k.new_empty(piece_shape)  # [n, b, hkv, dqk + dv]
        tensor = k.new_empty((c * n,) + piece_shape[1:]) if whole else None
        super().__init__(tensor, [(j * n, (j + 1) * n) for j in range(c)], [_LandingPiece(self, j) for j in range(c)])
        self._comm, self._groups, self._gather_op, self._send_op = comm, groups, gather_op, send_op
        self._member, self._dst, self._src = topo.member_of(pos), topo.init_send_dst(pos), topo.init_send_src(pos)
        self._local = self._dst == pos  # the initial send maps this rank to itself: the broadcast is what lands
        self._pending: dict[int, tuple[object, torch.Tensor | None]] = {}
        self._post(0)  # K, V first: the send goes out before anything else of the layer

    def _post(self, j: int) -> None:
        c = self._groups.team_size
        if j in self._pending or j >= c:
            return
        mine, (a, b) = self._member == j, self.bounds[j]
        landing = self.tensor[a:b] if self.tensor is not None else self._empty_piece()
        rows = landing if self._local else self._empty_piece()  # what is broadcast (and sent on)
        if mine:
            torch.cat([self._k, self._v], dim=-1, out=rows)
        self._comm.broadcast(rows, self._groups.team_group, c, src=j, mine=mine, op=self._gather_op)
        if self._local:
            self._pending[j] = (None, landing)
            return
        pending = self._comm.post([(rows, self._dst)], [(landing, self._src)], op=self._send_op, channel="side",
                                  counts_as_step=j == 0)  # the C pieces are one round
        self._pending[j] = (pending, landing)  # the transfer keeps ``rows`` alive until it is done

    def piece(self, j: int) -> torch.Tensor:
        """Piece ``j`` once landed (pieces are waited for in order); the next is posted first."""
        self._post(j)
        self._post(j + 1)
        pending, landing = self._pending[j]
        if pending is not None:
            pending.wait()
        return landing

    def release(self, j: int) -> None:
        if self.tensor is None:
            self._pending[j] = (self._pending[j][0], None)

