"""Phases 1-2 of StarTrail, shared by the forward and the regathering backward: the team
all-gather and the initial send (docs/design.md, "The forward, phase by phase"), and the
rows a team's gathered sequence holds."""

from __future__ import annotations

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
                         gather_q: bool = True, whole: bool = True):
    """Phases 1-2, overlapped. Team all-gather: ``q [n, b, h, dqk]``, ``k [n, b, hkv, dqk]``,
    ``v [n, b, hkv, dv]`` -> ``q_team [C*n, b, h, dqk]``, ``kv_team [C*n, b, hkv, dqk + dv]``;
    initial send (paper Alg. 2) of ``kv_team`` to ``init_send_dst``, in ``C`` pieces. Returns
    ``q_team`` and ``kv_init``, what this rank starts the sub-ring with, still landing (a
    :class:`PieceTransfer`; ``kv_team`` itself when the send maps the rank to itself).

    Both gathers start at once, K, V first: the initial send needs only them, so it goes
    out while Q is still being gathered. K and V travel side by side in the last dim, so
    V keeps its own head dim (MLA). ``gather_q=False`` (the backward with rotation "q",
    which takes the team's queries member by member) gathers K, V only; ``q_team`` is None.
    ``whole=False``: K, V land in a buffer per piece (:func:`streamed_team_send`)."""
    c, topo, pos = groups.team_size, groups.topology, groups.startrail_rank
    if c > 1:  # Note [streamed initial send]
        kv_init = streamed_team_send(comm, groups, k, v, gather_op=gather_op, send_op=send_op, whole=whole)
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


def streamed_team_send(comm: Communicator, groups: StarTrailGroups, k, v, *, gather_op: str, send_op: str,
                       whole: bool = True) -> PieceTransfer:
    """Phases 1-2 for K, V one piece at a time (Note [streamed initial send]): piece ``j``,
    member ``j``'s ``k | v [n, b, hkv, dqk + dv]``, is broadcast in the team and sent to
    ``init_send_dst``; what lands from ``init_send_src`` is piece ``j`` of the initial send.
    ``whole=True`` lands the pieces in one ``[C*n, b, hkv, dqk + dv]`` tensor (``tensor``,
    what the forward keeps); ``whole=False`` in a buffer per piece, freed by ``release``
    (the piece-major backward, Note [piece-major rotation q] in backward.py)."""
    c, topo, pos = groups.team_size, groups.topology, groups.startrail_rank
    member, dst, src = topo.member_of(pos), topo.init_send_dst(pos), topo.init_send_src(pos)
    local = dst == pos  # the initial send maps this rank to itself: the broadcast is what lands
    n, piece_shape = k.shape[0], tuple(k.shape[:-1]) + (k.shape[-1] + v.shape[-1],)
    tensor = k.new_empty((c * n,) + piece_shape[1:]) if whole else None

    def post_piece(j: int):
        mine = member == j
        landing = tensor[j * n:(j + 1) * n] if tensor is not None else k.new_empty(piece_shape)
        rows = landing if local else k.new_empty(piece_shape)  # what is broadcast (and sent on)
        if mine:  # this member's piece is made (k | v side by side) when it is its turn
            torch.cat([k, v], dim=-1, out=rows)
        comm.broadcast(rows, groups.team_group, c, src=j, mine=mine, op=gather_op)
        if local:
            return None, landing
        # The transfer keeps ``rows`` alive until it is done; the C pieces are one round.
        return comm.post([(rows, dst)], [(landing, src)], op=send_op, channel="side", counts_as_step=j == 0), landing

    # K, V first: piece 0 goes out before anything else of the layer, each next piece when
    # this rank starts waiting for the one before.
    return PieceTransfer([(j * n, (j + 1) * n) for j in range(c)], post_piece, ahead=1, tensor=tensor)
