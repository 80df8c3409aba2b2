"""StarTrail's backward, both rotations (docs/design.md, "The backward").

Rotation "kv" (:func:`backward_kv`): the team's query side (Q, dO, out, lse) is gathered
and stays; K, V circulate over the sub-ring with their dK, dV accumulators. Rotation "q"
(:func:`backward_q`, paper 3.2.1): K, V of the initial send stay with their dK, dV; the
team's queries circulate, one member's rows at a time (Note [streamed rotation q]). Both
re-run phases 1-2 first when the forward kept only ring attention's tensors
(``regather``), and both send dK, dV back along the reverse of the initial send, reduced in
the team piece by piece. ``ctx`` is the autograd context :class:`attention._StarTrailAttention`
filled in its forward.
"""

from __future__ import annotations

import torch

from . import blocks
from .comm import Communicator
from .initial_send import PieceTransfer, ReverseInitialSend
from .layout import segment_rows
from .schedule import rotate
from .team import StreamedTeamSend, gather_team_and_send, team_segments
from .transfer import LaneSplit, sub_ring_lanes


def backward_kv(ctx, dout):
    """The backward with rotation "kv": the team's query side fixed, K, V and dK, dV
    circulating; returns ``dq, dk, dv`` of this rank (the inputs' dtype)."""
    groups, docs = ctx.groups, ctx.docs
    comm = Communicator(ctx.bwd_stats, groups.transport, ctx.timeline)
    if ctx.regather:  # phases 1-2 again, on this rank's q, k, v
        q, k, v, out, lse = ctx.saved_tensors
        q_team, kv_init = gather_team_and_send(comm, groups, q, k, v, gather_op="regather_team_all_gather",
                                                send_op="regather_init_send")
    else:
        q_team, kv_team, out, lse = ctx.saved_tensors
        kv_init = PieceTransfer.local(kv_team, groups.team_size)
    dtype = q_team.dtype
    do_out, lse_team = _gather_query_side(comm, groups, dout, out, lse)
    # dK, dV go back along the reverse of the initial send while dQ is reduce-scattered
    # in the team (float32): every member keeps its own rows.
    dq_team, dkv_back = _sub_ring_backward_kv(comm, groups, docs, ctx.kernel, ctx.transfer, q_team, do_out,
                                              lse_team, kv_init, causal=ctx.causal, scale=ctx.scale,
                                              window=ctx.window, max_rows=q_team.shape[0] // groups.team_size)
    # The team's buffers are done with: free them before the reductions (peak memory;
    # what the forward saved stays alive in ctx until the backward returns).
    del q_team, do_out, lse_team, kv_init
    dqk = dq_team.shape[-1]
    dq = comm.reduce_scatter(dq_team, groups.team_group, groups.team_size, op="team_reduce_scatter")
    del dq_team
    dkv = _reduce_reverse_pieces(comm, groups, dkv_back)
    return (dq.to(dtype), *blocks.split_kv(dkv, dqk, dtype))


def backward_q(ctx, dout):
    """The backward with rotation "q" (paper 3.2.1: K, V fixed; Q, dO, out, lse and dQ
    circulate), streamed member by member (Note [streamed rotation q]); returns ``dq, dk, dv``
    of this rank (the inputs' dtype)."""
    groups = ctx.groups
    comm = Communicator(ctx.bwd_stats, groups.transport, ctx.timeline)
    if groups.topology.one_position_sub_rings:
        return _backward_q_piece_major(ctx, comm, dout)
    if ctx.regather:  # phase 2 again (K, V only: the queries come member by member)
        q, k, v, out, lse = ctx.saved_tensors
        _, kv_init = gather_team_and_send(comm, groups, q, k, v, gather_op="regather_team_all_gather",
                                           send_op="regather_init_send", gather_q=False)
    else:
        q, kv_team, out, lse = ctx.saved_tensors
        kv_init = PieceTransfer.local(kv_team, groups.team_size)
    dtype, dqk = q.dtype, q.shape[-1]
    dq, dkv = _sub_ring_backward_q(comm, groups, ctx.docs, ctx.kernel, ctx.transfer, q, dout, out, lse,
                                   kv_init, causal=ctx.causal, scale=ctx.scale, window=ctx.window)
    del kv_init
    return (dq.to(dtype), *blocks.split_kv(dkv, dqk, dtype))


def _member_side(comm, groups, own_side: list[torch.Tensor], i: int) -> list[torch.Tensor]:
    """Member ``i``'s ``q, dO, out, lse`` (``own_side`` on member ``i`` itself), team-broadcast
    from it, the four at once."""
    c, mine = groups.team_size, groups.topology.member_of(groups.startrail_rank) == i
    side = own_side if mine else [torch.empty_like(t) for t in own_side]
    if c == 1:
        return side
    pending = [comm.broadcast(t, groups.team_group, c, src=i, mine=mine, op="team_broadcast", wait=False)
               for t in side]
    return [p.wait() for p in pending]


class _ReverseReduce:
    """This rank's ``dkv [n, b, hkv, dqk + dv]``: piece ``j`` of what the reverse initial send
    brings (member ``j``'s rows, from this rank's sub-ring), summed over the team into member
    ``j`` -- a reduce-scatter done piece by piece (:meth:`through`, in piece order on every
    member), so that the team's dK, dV never land here all at once."""

    def __init__(self, comm, groups, reverse: ReverseInitialSend) -> None:
        self._comm, self._groups, self._reverse = comm, groups, reverse
        self._member = groups.topology.member_of(groups.startrail_rank)
        self._next, self.mine = 0, None

    def through(self, last: int) -> None:
        """Reduce pieces up to ``last`` (those before are done)."""
        c = self._groups.team_size
        while self._next <= last:
            j = self._next
            piece = self._comm.reduce(self._reverse.piece(j), self._groups.team_group, c, dst=j,
                                      mine=self._member == j, op="team_reduce")
            if self._member == j:
                self.mine = piece
            del piece
            self._reverse.release(j)
            self._next += 1


def _reduce_reverse_pieces(comm, groups, reverse: ReverseInitialSend) -> torch.Tensor:
    """All of :class:`_ReverseReduce` at once: this rank's dK, dV rows."""
    reducer = _ReverseReduce(comm, groups, reverse)
    reducer.through(groups.team_size - 1)
    return reducer.mine


# Note [streamed rotation q]
# --------------------------
# With rotation "q" every position circulates its team's query side (Q, dO, out, lse of
# the team's C*n rows) around its sub-ring, against the fixed K, V of the initial send.
# Gathering the whole query side at once would hold C times a ring rank's buffers (the
# side, its copy in flight, dQ accumulators) on top of the fixed K, V and their float32
# gradients. Instead the backward makes C passes, one per team member i:
#
#     team broadcast from member i    q_i, dO_i, out_i, lse_i        (n rows)
#     rotate over the sub-ring         the n rows and their dQ accumulator, G steps,
#                                      each position adding into its fixed dK, dV
#     team reduce to member i          dQ of member i's rows, summed over the team
#
# The bytes are those of the unstreamed schedule: over the C passes each rank is the
# broadcast's source once, as in an all-gather, and the reduce's destination once, as in
# a reduce-scatter; the sub-ring moves C payloads of n rows instead of one of C*n rows.
# What grows is the number of sequential steps (C G instead of G) and of collectives. The
# initial send's pieces are attended as they land in pass 0; dK, dV go back piece by piece
# at the last step of the last pass.


def _sub_ring_backward_q(comm, groups, docs, kernel, transfer, q, dout, out, lse, kv_init: PieceTransfer, *,
                         causal, scale, window=None):
    """Note [streamed rotation q]. ``q [n, b, h, dqk]``, ``dout``, ``out [n, b, h, dv]``,
    ``lse [n, b, h]`` of this rank. Returns this rank's ``dq [n, b, h, dqk]`` (accumulator
    dtype) and ``dkv [n, b, hkv, dqk + dv]``, this rank's rows of dK, dV summed over the team
    (the reverse initial send reduced piece by piece, each piece while the next is computed)."""
    topo, pos, c = groups.topology, groups.startrail_rank, groups.team_size
    member, n = topo.member_of(pos), q.shape[0]
    acc_dtype = blocks.acc_dtype(q.dtype)
    own_side = [q, dout.contiguous(), out, lse]  # [n, b, h, dqk], [n, b, h, dv] x 2, [n, b, h]
    own_kv_segments = team_segments(groups, docs, topo.kv_team_at_step(pos, 0))
    dkv_init = kv_init.tensor.new_zeros(kv_init.tensor.shape, dtype=acc_dtype)
    reverse = ReverseInitialSend(comm, topo, pos, dkv_init, kv_init.bounds)
    reducer = _ReverseReduce(comm, groups, reverse)
    lanes = sub_ring_lanes(topo, pos, transfer)
    dq = None
    for i in range(c):
        side = _member_side(comm, groups, own_side, i)
        # The rows of member i of the team at ``origin`` (Note [documents]: members in order).
        q_rot = LaneSplit(lanes, n, lambda origin, i=i: segment_rows(
            team_segments(groups, docs, topo.team_of(origin)), i * n, (i + 1) * n))
        last = (i == c - 1, len(q_rot.lanes[0].order) - 1)

        def step_q(step, payloads, _rows, q_rot=q_rot, last=last):
            dqs = [held[0].new_zeros(held[0].shape, dtype=acc_dtype) for held in payloads]
            for piece, (a, b) in enumerate(kv_init.bounds):  # K, V pieces, as they land (pass 0, step 0)
                kv, kv_segments = kv_init.piece(piece), segment_rows(own_kv_segments, a, b)
                for lane_index, (lane, (q_part, dout_part, out_part, lse_rows), dq_part) in enumerate(
                        zip(q_rot.lanes, payloads, dqs)):
                    q_segments = q_rot.part_segments(lane.origin(pos, step), lane_index)
                    blocks.backward_step(kernel, q_part, dout_part, out_part, lse_rows, kv, q_segments, kv_segments,
                                         dq_part, dkv_init[a:b], causal=causal, scale=scale, window=window,
                                         max_rows=n)
                if last == (True, step):
                    reverse.send(piece)  # these rows of dK, dV are final
                    reducer.through(piece - 1)  # the previous piece has had a piece's compute to land
            return [[dq_part] for dq_part in dqs]

        home = rotate(comm, q_rot.lanes, pos, q_rot.split(side), step_q, op="sub_ring", accumulate=True)
        del side
        dq_i = q_rot.join([lane_acc[0] for lane_acc in home])  # [n, b, h, dqk]: member i's rows
        del home
        if c > 1:
            dq_i = comm.reduce(dq_i, groups.team_group, c, dst=i, mine=member == i, op="team_reduce")
        if member == i:
            dq = dq_i
        del dq_i
    reducer.through(c - 1)
    return dq, reducer.mine


# Note [piece-major rotation q]
# -----------------------------
# When the sub-ring has one position (P = C^2 StarTrail ranks: G = 1), nothing circulates:
# each position pairs the team's queries with the C pieces of K, V its initial send
# delivered. Streaming the queries member by member (Note [streamed rotation q]) still
# holds all C pieces and their float32 dK, dV (4 C shares of a rank's q with MHA). The
# loops swap instead: pieces outside, members inside,
#
#     piece j of K, V (n rows)          kept, or with regathering: team broadcast from
#                                       member j, sent on to init_send_dst while piece j-1
#                                       computes (team.StreamedTeamSend)
#       team broadcast from member i    q_i, dO_i, out_i, lse_i, for i = 0 .. C-1
#       team reduce to member i         dQ_i of (i, j), added into member i's dQ
#       dK, dV of piece j accumulate
#     reverse initial send of piece j   as soon as its C members are done; reduced in the
#                                       team one piece behind, while piece j+1 computes
#                                       (serial_reverse_send: before it, so that piece j's
#                                       buffers are gone first; the transfer, which may
#                                       cross nodes, is then no longer hidden)
#
# and each block's dQ is reduced to its member at once, so that one piece of K, V and its
# dK, dV and one member's dQ are live at a time (with regathering; without, the forward kept
# the C pieces). What it costs: the query side is broadcast and dQ reduced C times per
# backward instead of once, (C-1)^2 ((Eq + 2 Eo) e + El a + Eq a) more bytes inside the
# team (accounting.expected_comm); the inter-node bytes and steps are unchanged.


def _backward_q_piece_major(ctx, comm, dout):
    """Rotation "q" on a sub-ring of one position (Note [piece-major rotation q]); returns
    ``dq, dk, dv`` of this rank (the inputs' dtype)."""
    groups, docs = ctx.groups, ctx.docs
    topo, pos, c = groups.topology, groups.startrail_rank, groups.team_size
    if ctx.regather:
        q, k, v, out, lse = ctx.saved_tensors
        # Phase 2 again, one piece at a time, each freed once its members are done.
        kv_pieces = StreamedTeamSend(comm, groups, k, v, gather_op="regather_team_all_gather",
                                     send_op="regather_init_send", whole=False)
    else:
        q, kv_team, out, lse = ctx.saved_tensors
        kv_pieces = PieceTransfer.local(kv_team, c)
    member, n, dtype, dqk = topo.member_of(pos), q.shape[0], q.dtype, q.shape[-1]
    acc_dtype = blocks.acc_dtype(dtype)
    own_side = [q, dout.contiguous(), out, lse]  # [n, b, h, dqk], [n, b, h, dv] x 2, [n, b, h]
    team_rows = team_segments(groups, docs, topo.team_of(pos))
    kv_rows = team_segments(groups, docs, topo.kv_team_at_step(pos, 0))
    reverse = ReverseInitialSend(comm, topo, pos, None, kv_pieces.bounds)
    reducer = _ReverseReduce(comm, groups, reverse)
    dq = q.new_zeros(q.shape, dtype=acc_dtype)  # [n, b, h, dqk]: this member's, summed over the team
    serial = groups.config.serial_reverse_send
    for j, (a, b) in enumerate(kv_pieces.bounds):
        if serial:  # the previous piece's dK, dV home (and freed) before this piece computes
            reducer.through(j - 1)
        kv = kv_pieces.piece(j)  # [n, b, hkv, dqk + dv]
        dkv = kv.new_zeros(kv.shape, dtype=acc_dtype)
        for i in range(c):
            side = _member_side(comm, groups, own_side, i)
            dq_part = q.new_zeros(q.shape, dtype=acc_dtype)
            blocks.backward_step(ctx.kernel, *side, kv, segment_rows(team_rows, i * n, (i + 1) * n),
                                 segment_rows(kv_rows, a, b), dq_part, dkv, causal=ctx.causal, scale=ctx.scale,
                                 window=ctx.window, max_rows=n)
            del side
            # Reduced to member i at once: one member's dQ buffer live, not C of them.
            dq_part = comm.reduce(dq_part, groups.team_group, c, dst=i, mine=member == i, op="team_reduce")
            if member == i:
                dq.add_(dq_part)
            del dq_part
        kv_pieces.release(j)
        del kv
        reducer.through(j - 1)  # the previous piece has had this piece's compute to land
        reverse.send(j, dkv)  # after: its landing buffer is made once the previous one is freed
        del dkv
    reducer.through(c - 1)
    dkv = reducer.mine
    return (dq.to(dtype), *blocks.split_kv(dkv, dqk, dtype))


# -- the backward's own phases (rotation "kv") ------------------------------------------------


def _gather_query_side(comm, groups, dout, out, lse):
    """Team all-gather of the query-side inputs of the block backward besides Q: returns
    ``do_out [C*n, b, h, 2 dv]`` (dO | out side by side) and ``lse_team [C*n, b, h]``. Q
    stays its own tensor (no copy of the team's Q into a joint buffer: peak memory)."""
    c = groups.team_size
    do_out = comm.all_gather(torch.cat([dout, out], dim=-1), groups.team_group, c, op="team_all_gather", wait=False)
    lse_team = comm.all_gather(lse, groups.team_group, c, op="team_all_gather", wait=False)  # both fly at once
    return do_out.wait(), lse_team.wait()


def _sub_ring_backward_kv(comm, groups, docs, kernel, transfer, q_team, do_out, lse_team, kv_init: PieceTransfer,
                          *, causal, scale, window=None, max_rows=None):
    """Rotation "kv": the forward's sub-ring schedule with the team's query side fixed and
    K, V circulating with their dK, dV accumulators; step 0 uses each piece of ``kv_init``
    as it lands. ``q_team [C*n, b, h, dqk]``, ``do_out [C*n, b, h, 2 dv]`` (dO | out),
    ``lse_team [C*n, b, h]``. Returns ``dq_team [C*n, b, h, dqk]`` and the reverse initial
    send of ``dkv_init [C*n, b, hkv, dqk + dv]`` (accumulator dtype), started once the
    accumulators are home. ``max_rows`` bounds the query and key rows of one kernel call."""
    topo, pos = groups.topology, groups.startrail_rank
    acc_dtype = blocks.acc_dtype(q_team.dtype)
    dv = do_out.shape[-1] // 2
    rows = q_team.shape[0]  # of the team's gathered sequence
    lanes = sub_ring_lanes(topo, pos, transfer)

    def grads(q, do_o, lse_rows, kv, q_segments, kv_segments, dq, dkv):
        blocks.backward_step(kernel, q, do_o[..., :dv], do_o[..., dv:], lse_rows, kv, q_segments, kv_segments, dq,
                             dkv, causal=causal, scale=scale, window=window, max_rows=max_rows)

    own_q_segments = team_segments(groups, docs, topo.team_of(pos))
    dq_team = q_team.new_zeros(q_team.shape, dtype=acc_dtype)
    kv_rot = LaneSplit(lanes, rows, lambda origin: team_segments(groups, docs, topo.kv_team_at_step(origin, 0)))

    def step_kv(step, payloads, part_rows):
        contrib = []
        for lane_index, (lane, (kv,), kv_rows) in enumerate(zip(kv_rot.lanes, payloads, part_rows)):
            dkv = kv.new_zeros(kv.shape, dtype=acc_dtype)
            kv_segments = kv_rot.part_segments(lane.origin(pos, step), lane_index, kv_rows)
            grads(q_team, do_out, lse_team, kv, own_q_segments, kv_segments, dq_team, dkv)
            contrib.append([dkv])
        return contrib

    home = rotate(comm, kv_rot.lanes, pos, kv_rot.split([kv_init.tensor]), step_kv, op="sub_ring", accumulate=True,
                  pieces=kv_rot.pieces(kv_init))
    dkv_init = kv_rot.join([lane_acc[0] for lane_acc in home])
    return dq_team, ReverseInitialSend(comm, topo, pos, dkv_init, kv_init.bounds)
