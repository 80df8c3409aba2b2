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
from .initial_send import PieceTransfer, ReverseInitialSend, reverse_overlaps
from .layout import coalesce, plan_calls, segment_rows
from .schedule import rotate
from .team import gather_team_and_send, team_segments
from .transfer import LaneSplit, sub_ring_lanes


def backward_kv(ctx, dout, saved: list):
    """The backward with rotation "kv": the team's query side fixed, K, V and dK, dV
    circulating; returns ``dq, dk, dv`` of this rank (the inputs' dtype). ``saved``: ``ctx.saved_tensors``,
    unpacked once by the caller (a list, emptied here)."""
    groups, docs = ctx.groups, ctx.docs
    comm = Communicator(ctx.bwd_stats, groups.transports_on(dout.device)[0], ctx.timeline)
    if ctx.regather:  # phases 1-2 again, on this rank's q, k, v
        q, k, v, out, lse = saved
        q_team, kv_init = gather_team_and_send(comm, groups, q, k, v, gather_op="regather_team_all_gather",
                                                send_op="regather_init_send")
    else:
        q_team, kv_team, out, lse = saved
        kv_init = PieceTransfer.local(kv_team, groups.team_size)
    saved.clear()  # the caller's references: what saved-tensor hooks unpacked is freed as this goes
    dtype = q_team.dtype
    dout_team, out_team, lse_team = _gather_query_side(comm, groups, dout, out, lse)
    # dK, dV go back along the reverse of the initial send while dQ is reduce-scattered
    # in the team (float32): every member keeps its own rows.
    dq_team, dkv_back = _sub_ring_backward_kv(comm, groups, docs, ctx.kernel, ctx.transfer, q_team, dout_team,
                                              out_team, lse_team, kv_init, causal=ctx.causal, scale=ctx.scale,
                                              window=ctx.window, max_rows=q_team.shape[0] // groups.team_size)
    # The team's buffers are done with: free them before the reductions (peak memory;
    # what the forward saved stays alive in ctx until the backward returns).
    del q_team, dout_team, out_team, lse_team, kv_init
    dqk = dq_team.shape[-1]
    dq = comm.reduce_scatter(dq_team, groups.team_group, groups.team_size, op="team_reduce_scatter")
    del dq_team
    dkv = _reduce_reverse_pieces(comm, groups, dkv_back)
    return (dq.to(dtype), *blocks.split_kv(dkv, dqk, dtype))


def _member_side(comm, groups, own_side: list[torch.Tensor], i: int) -> list[torch.Tensor]:
    """Member ``i``'s ``q, dO, out, lse`` (``own_side`` on member ``i`` itself), team-broadcast
    from it, the four at once."""
    c, mine = groups.team_size, groups.topology.member_of(groups.startrail_rank) == i
    side = own_side if mine else [torch.empty_like(t, memory_format=torch.contiguous_format) for t in own_side]
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
        self._comm, self._groups, self.reverse = comm, groups, reverse
        self._member = groups.topology.member_of(groups.startrail_rank)
        self._next, self.mine = 0, None

    def through(self, last: int) -> None:
        """Reduce pieces up to ``last`` (those before are done)."""
        c = self._groups.team_size
        while self._next <= last:
            j = self._next
            piece = self._comm.reduce(self.reverse.piece(j), self._groups.team_group, c, dst=j,
                                      mine=self._member == j, op="team_reduce")
            if self._member == j:
                self.mine = piece
            del piece
            self.reverse.release(j)
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


# Note [piece-major rotation q]
# -----------------------------
# When the sub-ring has one position (P = C^2 StarTrail ranks: G = 1), nothing circulates:
# each position pairs the team's queries with the C pieces of K, V its initial send
# delivered. Streaming the queries member by member (Note [streamed rotation q]) would still
# hold all C pieces and their float32 dK, dV (4 C shares of a rank's q with MHA). The
# same passes run piece by piece instead, pieces outside, members inside:
#
#     piece j of K, V (n rows)          kept, or with regathering: team broadcast from
#                                       member j, sent on to init_send_dst while piece j-1
#                                       computes (team.streamed_team_send, whole=False)
#       C passes of Note [streamed     q_i, dO_i, out_i, lse_i broadcast from member i, dQ_i
#       rotation q], on piece j only   of (i, j) reduced to member i, dK, dV of j accumulate
#     reverse initial send of piece j   as soon as its C passes are done, once piece j-1's
#                                       dK, dV are reduced in the team (and freed)
#
# so that one piece of K, V and its dK, dV and one member's dQ are live at a time (with
# regathering; without, the forward kept the C pieces). What it costs: the query side is
# broadcast and dQ reduced C times per backward instead of once, (C-1)^2 ((Eq + 2 Eo) e +
# El a + Eq a) more bytes inside the team (accounting.expected_comm); the inter-node bytes
# and steps are unchanged.


# Note [kept pieces]
# ------------------
# Without regathering the forward keeps the initial send's K, V for the backward: C pieces of
# n rows. Piece-major rotation q (one position per sub-ring) is done with piece j once its C
# passes are computed and its dK, dV sent back, but autograd holds every saved tensor until
# the backward returns: kept as one [C*n] tensor, all C pieces stay to the end (2 C shares of
# a rank's k with MHA, the largest term at the backward's peak). So there the forward lands
# the pieces in a buffer each (team.streamed_team_send(whole=False), as the regathering
# backward does; with one position nothing circulates, so the forward attends to each piece as
# it lands: attention._sub_ring_forward), saves them apart, and the backward frees piece j's
# storage (``untyped_storage().resize_(0)``) when it sends piece j's dK, dV back. The storages
# are the forward's own landings (or what saved-tensor hooks unpacked), read by nothing after.
# A second backward through the same graph (retain_graph=True) would find them empty: it is
# refused by name. Measured, CPU heap harness (benchmarks/counters/peak_memory.py), P16 C4,
# float32 MHA: peak 25.1 -> 21.1 shares of a rank's q (ring 17.0).


# Note [step-0 rows]
# ------------------
# With rotation "q" a position's step-0 dQ is the first contribution to its payload's
# accumulator. Its rows that no step-0 call reaches (at P8 C2, causal: a member's early zigzag
# half, 8192 of 16384 rows) used to be zeroed, sent, and added in by the next position: 0.27 +
# 0.40 GB a layer at 128K, MHA 16 x 128. Which rows a step-0 contribution holds follows from
# the planner alone (position o's step-0 calls are plan_calls of o's payload against o's K, V
# pieces, and every call writes all its query rows), so every position can tell it for any
# other: the sender leaves the other rows unwritten and the next position adds only the rows
# that hold gradients. Where those are more than a few runs (packed documents), the zeros are
# written and added as before: an add per run would cost more launches than the bytes save.

_STEP0_MAX_RUNS = 4


def _step0_rows(q_rot: LaneSplit, lane_index: int, origin: int, kv_segments, bounds, *, causal, window,
                max_rows) -> tuple[tuple[int, int], ...] | None:
    """The rows of lane ``lane_index``'s part of ``origin``'s payload that ``origin``'s step-0
    calls write against its K, V pieces (``kv_segments``, cut at ``bounds``): host runs, the same
    on every position; None when they are more than :data:`_STEP0_MAX_RUNS` runs (Note [step-0
    rows])."""
    q_segments = q_rot.part_segments(origin, lane_index)
    runs = coalesce([r for a, b in bounds
                     for call in plan_calls(q_segments, segment_rows(kv_segments, a, b), causal, window, max_rows)
                     for r in call.q_rows])
    return runs if len(runs) <= _STEP0_MAX_RUNS else None


def backward_q(ctx, dout, saved: list):
    """The backward with rotation "q" (paper 3.2.1: K, V fixed; Q, dO, out, lse and dQ
    circulate), streamed member by member (Note [streamed rotation q]), and piece by piece
    on sub-rings of one position (Note [piece-major rotation q]); returns ``dq, dk, dv`` of
    this rank (the inputs' dtype). ``saved``: as :func:`backward_kv`'s."""
    groups, docs = ctx.groups, ctx.docs
    comm = Communicator(ctx.bwd_stats, groups.transports_on(dout.device)[0], ctx.timeline)
    topo, pos, c = groups.topology, groups.startrail_rank, groups.team_size
    piece_major = topo.one_position_sub_rings
    kept = None  # the forward's K, V pieces, freed here one by one (Note [kept pieces])
    if ctx.regather:  # phase 2 again (K, V only: the queries come member by member)
        q, k, v, out, lse = saved
        _, kv_init = gather_team_and_send(comm, groups, q, k, v, gather_op="regather_team_all_gather",
                                           send_op="regather_init_send", gather_q=False, whole=not piece_major)
    elif ctx.kept_pieces:
        if ctx.kept_pieces_freed:
            raise RuntimeError(
                "StarTrail's backward with rotation q freed the K, V pieces its forward kept (peak memory): "
                "a second backward through the same graph (retain_graph=True) needs "
                "--startrail-regather-in-backward or --startrail-backward-rotation kv")
        q, *kept, out, lse = saved
        kv_init = PieceTransfer.kept(kept)
        ctx.kept_pieces_freed = True
    else:
        q, kv_team, out, lse = saved
        kv_init = PieceTransfer.local(kv_team, c)
    saved.clear()  # the caller's references: what saved-tensor hooks unpacked is freed as this goes
    member, n, dtype, dqk = topo.member_of(pos), q.shape[0], q.dtype, q.shape[-1]
    acc_dtype = blocks.acc_dtype(dtype)
    # [n, b, h, dqk], [n, b, h, dv] x 2, [n, b, h]. q (the forward's input: possibly a view of
    # Megatron's fused QKV) and dO (autograd's, any strides) are broadcast and sent around
    # the sub-ring: dense once here, not at every send.
    own_side = [q.contiguous(), dout.contiguous(), out, lse]
    kv_segments = team_segments(groups, docs, topo.kv_team_at_step(pos, 0))
    reducer = _ReverseReduce(comm, groups, ReverseInitialSend(comm, topo, pos, None, kv_init.bounds))
    lanes = sub_ring_lanes(topo, pos, ctx.transfer)
    # Note [step-0 rows]: the K, V rows each lane's previous position attends at step 0 (this
    # position's own are kv_segments); the same for every pass
    prev_kv_segments = {} if len(lanes[0].order) == 1 else {
        lane.prev(pos): team_segments(groups, docs, topo.kv_team_at_step(lane.prev(pos), 0)) for lane in lanes}
    dkv: dict[int, torch.Tensor] = {}  # piece j's dK, dV [n, b, hkv, dqk + dv], until it is sent back
    fresh_kv: dict[int, blocks.FreshRows] = {}  # their rows no call has written yet (Note [fresh rows])
    # Note [reverse overlap]: per piece j, whether piece j-1's dK, dV fly back while j computes; from
    # the bytes of a piece [n, b, hkv, dqk + dv] (piece 0: the first the loop below waits for anyway)
    flies: tuple[bool, ...] = ()
    if piece_major:
        piece = kv_init.piece(0)
        flies = reverse_overlaps(c, piece.numel() * piece.element_size(),
                                 piece.numel() * torch.finfo(acc_dtype).bits // 8, regathered=ctx.regather,
                                 overlap=groups.config.reverse_overlap)
        del piece

    def send_back(j: int) -> None:  # piece j's rows of dK, dV are final
        fresh_kv.pop(j).fill(lambda a, b: dkv[j][a:b].zero_())
        kv_init.release(j)
        if kept is not None:  # its storage goes now, though autograd holds the saved tensor to the end
            kept[j].untyped_storage().resize_(0)
        reducer.through(j - 1)  # the previous piece has had this one's compute to land
        reducer.reverse.send(j, dkv.pop(j))  # its landing made once the previous one is freed
        if j + 1 < len(flies) and not flies[j + 1]:
            reducer.through(j)  # landed and reduced before the next piece computes

    dq = None
    for pieces in ([[j] for j in range(c)] if piece_major else [list(range(c))]):
        first = kv_init.piece(pieces[0])  # [n, b, hkv, dqk + dv], landed before the round's passes
        dkv.update((j, first.new_empty(first.shape, dtype=acc_dtype)) for j in pieces)
        fresh_kv.update((j, blocks.FreshRows(first.shape[0])) for j in pieces)
        del first
        for i in range(c):
            # In a box: rotate takes the member's side out of it and holds its only reference, so
            # the step-0 payload is freed once it has moved on, not held to the last step.
            side = [_member_side(comm, groups, own_side, i)]
            # The rows of member i of the team at ``origin`` (Note [documents]: members in order).
            q_rot = LaneSplit(lanes, n, lambda origin, i=i: segment_rows(
                team_segments(groups, docs, topo.team_of(origin)), i * n, (i + 1) * n))
            final = (i == c - 1, len(q_rot.lanes[0].order) - 1)  # the last pass's last step
            # Note [step-0 rows]: per lane, the rows this position's step-0 dQ holds and those of
            # the one that arrives at step 1 (None: all rows, zeros included)
            sent, arriving = [None] * len(q_rot.lanes), None
            if len(q_rot.lanes[0].order) > 1:
                plan = dict(bounds=kv_init.bounds, causal=ctx.causal, window=ctx.window, max_rows=n)
                sent = [_step0_rows(q_rot, k, pos, kv_segments, **plan) for k in range(len(sent))]
                arriving = [_step0_rows(q_rot, k, lane.prev(pos), prev_kv_segments[lane.prev(pos)], **plan)
                            for k, lane in enumerate(q_rot.lanes)]

            def step_q(step, payloads, _rows, q_rot=q_rot, pieces=pieces, final=final, sent=sent):
                dqs = [held[0].new_empty(held[0].shape, dtype=acc_dtype) for held in payloads]
                fresh_q = [blocks.FreshRows(held[0].shape[0]) for held in payloads]
                for j in pieces:  # K, V pieces, as they land (the first pass's step 0)
                    kv, (a, b) = kv_init.piece(j), kv_init.bounds[j]
                    for lane_index, (lane, (q_part, dout_part, out_part, lse_rows), dq_part, fresh) in enumerate(
                            zip(q_rot.lanes, payloads, dqs, fresh_q)):
                        q_segments = q_rot.part_segments(lane.origin(pos, step), lane_index)
                        blocks.backward_step(ctx.kernel, q_part, dout_part, out_part, lse_rows, kv, q_segments,
                                             segment_rows(kv_segments, a, b), dq_part, dkv[j], causal=ctx.causal,
                                             scale=ctx.scale, window=ctx.window, max_rows=n, fresh_q=fresh,
                                             fresh_kv=fresh_kv[j])
                    del kv
                    if final == (True, step) and j != pieces[-1]:
                        send_back(j)  # flies while the round's later pieces compute
                for dq_part, fresh, rows in zip(dqs, fresh_q, sent):
                    if step == 0 and rows is not None:  # Note [step-0 rows]: the next position adds only `rows`
                        continue
                    fresh.fill(lambda x, y, dq_part=dq_part: dq_part[x:y].zero_())
                return [[dq_part] for dq_part in dqs]

            home = rotate(comm, q_rot.lanes, pos, q_rot.split(side.pop()), step_q, op="sub_ring", accumulate=True,
                          received_rows=lambda step, arriving=arriving: arriving if step == 1 else None)
            dq_i = q_rot.join([lane_acc[0] for lane_acc in home])  # [n, b, h, dqk]: member i's rows
            del home
            if c > 1:  # reduced to member i at once: one member's dQ buffer live, not C of them
                dq_i = comm.reduce(dq_i, groups.team_group, c, dst=i, mine=member == i, op="team_reduce")
            if member == i:
                dq = dq_i if dq is None else dq.add_(dq_i)
            del dq_i
        send_back(pieces[-1])  # after the last pass's dQ is reduced: its buffers are gone first
    reducer.through(c - 1)
    return (dq.to(dtype), *blocks.split_kv(reducer.mine, dqk, dtype))


# -- the backward's own phases (rotation "kv") ------------------------------------------------


def _gather_query_side(comm, groups, dout, out, lse):
    """Team all-gather of the query-side inputs of the block backward besides Q: returns
    ``dout_team``, ``out_team [C*n, b, h, dv]`` and ``lse_team [C*n, b, h]``, all three in flight
    at once. Each its own dense tensor, not dO | out side by side in one: a call's rows of each
    are then dense views, which the kernels take as they are (the fused backward ops copy a
    strided dO or out into a dense one first: 2.2 GB a layer at P8 C2, GQA 32/8, 128K), and
    no concatenated copy is made to send. Q stays its own tensor (no copy of the team's Q into a
    joint buffer: peak memory)."""
    c = groups.team_size
    pending = [comm.all_gather(t, groups.team_group, c, op="team_all_gather", wait=False) for t in (dout, out, lse)]
    return tuple(p.wait() for p in pending)


def _sub_ring_backward_kv(comm, groups, docs, kernel, transfer, q_team, dout_team, out_team, lse_team,
                          kv_init: PieceTransfer, *, causal, scale, window=None, max_rows=None):
    """Rotation "kv": the forward's sub-ring schedule with the team's query side fixed and
    K, V circulating with their dK, dV accumulators; step 0 uses each piece of ``kv_init``
    as it lands. ``q_team [C*n, b, h, dqk]``, ``dout_team``, ``out_team [C*n, b, h, dv]``,
    ``lse_team [C*n, b, h]``. Returns ``dq_team [C*n, b, h, dqk]`` and the reverse initial
    send of ``dkv_init [C*n, b, hkv, dqk + dv]`` (accumulator dtype), started once the
    accumulators are home. ``max_rows`` bounds the query and key rows of one kernel call."""
    topo, pos = groups.topology, groups.startrail_rank
    acc_dtype = blocks.acc_dtype(q_team.dtype)
    rows = q_team.shape[0]  # of the team's gathered sequence
    lanes = sub_ring_lanes(topo, pos, transfer)

    own_q_segments = team_segments(groups, docs, topo.team_of(pos))
    # Note [fresh rows] in blocks.py: the accumulators start unwritten, the first call writes.
    dq_team, fresh_q = q_team.new_empty(q_team.shape, dtype=acc_dtype), blocks.FreshRows(rows)
    kv_rot = LaneSplit(lanes, rows, lambda origin: team_segments(groups, docs, topo.kv_team_at_step(origin, 0)))

    def step_kv(step, payloads, part_rows):
        contrib = []
        for lane_index, (lane, (kv,), kv_rows) in enumerate(zip(kv_rot.lanes, payloads, part_rows)):
            dkv, fresh_kv = kv.new_empty(kv.shape, dtype=acc_dtype), blocks.FreshRows(kv.shape[0])
            kv_segments = kv_rot.part_segments(lane.origin(pos, step), lane_index, kv_rows)
            blocks.backward_step(kernel, q_team, dout_team, out_team, lse_team, kv, own_q_segments,
                                 kv_segments, dq_team, dkv, causal=causal, scale=scale, window=window,
                                 max_rows=max_rows, fresh_q=fresh_q, fresh_kv=fresh_kv)
            fresh_kv.fill(lambda a, b, dkv=dkv: dkv[a:b].zero_())
            contrib.append([dkv])
        return contrib

    home = rotate(comm, kv_rot.lanes, pos, kv_rot.split([kv_init.tensor]), step_kv, op="sub_ring", accumulate=True,
                  pieces=kv_rot.pieces(kv_init))
    fresh_q.fill(lambda a, b: dq_team[a:b].zero_())
    dkv_init = kv_rot.join([lane_acc[0] for lane_acc in home])
    return dq_team, ReverseInitialSend(comm, topo, pos, dkv_init, kv_init.bounds)
