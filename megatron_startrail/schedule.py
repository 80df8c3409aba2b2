"""The sub-ring rotation: one schedule for the forward and both backward variants.

The payload travels over one or more *lanes*, rings through the same ``G`` positions in
different orders. StarTrail's sub-ring is one lane; TASP's multi-ring transfer splits the
payload in ``G - 1`` parts, one per arc-disjoint Hamiltonian cycle, so that every link
of a fully connected node carries a part at every step.

:func:`rotate` runs ``compute(step, payloads, rows)`` for ``step = 0 .. G-1`` while every
lane's payload moves one hop per step (double-buffered: the next step's payload is in
flight while this step computes). If ``compute`` returns gradient contributions for the
payloads, they travel with them as accumulators and come home after ``G`` hops::

    step i on position x, per lane:  holds the payload of origin prev^i(x)
        post  send(payload -> next), recv(next payload <- prev)     [if i < G-1]
        contrib = compute(i, payloads)
        wait  accumulator from prev (posted at step i-1), add contrib
        post  send(accumulator -> next), recv(accumulator <- prev)   [if G > 1]
    after the last step the accumulator received is the one for x's own payload.

Step 0 may start before its payload is all here (``pieces``: the initial send lands in
``C`` row pieces, one per team member's rows). Then, for each piece in order::

    wait  the piece                                                  ["init_send"]
    post  send(piece -> next), recv(same rows <- prev)               [if G > 1]
    compute on the piece's rows

and the hops of the pieces together are step 0's one round; later steps are unchanged.

Forward: payload = K, V; compute merges into the fixed query-side output. Backward
"kv": payload = K, V with dK, dV accumulators, dQ fixed. Backward "q" (the paper's):
payload = Q, dO, out, lse with a dQ accumulator, dK, dV fixed; there the initial send's
pieces are the fixed side, which ``compute`` itself takes as they land at step 0 (and
whose dK, dV it sends back piece by piece at the last step).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from .comm import Communicator, PendingP2P

Payloads = Sequence[Sequence[torch.Tensor]]  # per lane, a list of tensors


@dataclass(frozen=True)
class Lane:
    """A ring over positions, in ring order (the next of ``order[i]`` is ``order[i+1]``)."""

    order: tuple[int, ...]

    def next(self, pos: int) -> int:
        return self.order[(self.order.index(pos) + 1) % len(self.order)]

    def prev(self, pos: int) -> int:
        return self.order[(self.order.index(pos) - 1) % len(self.order)]

    def origin(self, pos: int, step: int) -> int:
        """Whose step-0 payload ``pos`` holds at ``step`` (payloads move to ``next``)."""
        return self.order[(self.order.index(pos) - step) % len(self.order)]


@dataclass(frozen=True)
class Piece:
    """Rows of the step-0 payload that land together: rows ``rows[k] = (a, b)`` of every
    tensor of lane ``k`` (``a == b``: none of that lane). ``landed()`` returns once they are
    here (``None``: they already are)."""

    rows: tuple[tuple[int, int], ...]
    landed: Callable[[], object] | None = None


def _whole(payloads: Payloads) -> list[Piece]:
    """The payload as one piece that is already here."""
    return [Piece(tuple((0, lane[0].shape[0]) for lane in payloads))]


def _rows(payloads: Payloads, rows: Sequence[tuple[int, int]]) -> list[list[torch.Tensor]]:
    """Per lane, rows ``[a, b)`` of each of its tensors (views)."""
    return [[t[a:b] for t in ts] for ts, (a, b) in zip(payloads, rows)]


def _exchange(comm, lanes, position, tensors, incoming, *, op, channel, counts_as_step) -> PendingP2P:
    """Post every lane's send of ``tensors`` to next and receive of ``incoming`` from prev
    (empty tensors skipped: both sides of a hop cut the payload the same way). No tags:
    every position runs this same program, so a pair's sends and receives are posted in
    the same order (what NCCL matches by; see :mod:`megatron_startrail.transport`)."""
    sends = [(t, lane.next(position)) for lane, ts in zip(lanes, tensors) for t in ts if t.numel()]
    recvs = [(t, lane.prev(position)) for lane, ts in zip(lanes, incoming) for t in ts if t.numel()]
    return comm.post(sends, recvs, op=op, channel=channel, counts_as_step=counts_as_step)


class _Contributions:
    """The gradients of one step's pieces, written into one tensor per lane and payload
    tensor as they come (not kept per piece and concatenated: that would hold the step's
    gradients twice at the end of the step)."""

    def __init__(self, payloads: Payloads) -> None:
        self._rows = [lane[0].shape[0] for lane in payloads]
        self.tensors: list[list[torch.Tensor]] | None = None

    def add(self, contrib: Payloads, rows: Sequence[tuple[int, int]], whole: bool) -> None:
        if whole:  # the step's payload in one piece: its gradients as they are
            self.tensors = [list(c) for c in contrib]
            return
        if self.tensors is None:
            self.tensors = [[c.new_empty((n,) + tuple(c.shape[1:])) for c in lane]
                            for lane, n in zip(contrib, self._rows)]
        for lane_full, lane_c, (a, b) in zip(self.tensors, contrib, rows):
            for full, c in zip(lane_full, lane_c):
                full[a:b].copy_(c)


def _add_received(contrib: list[list[torch.Tensor]], received: list[list[torch.Tensor]],
                  rows: Sequence[Sequence[tuple[int, int]] | None] | None = None) -> None:
    """``contrib += received``, tensor by tensor (a function of its own: a loop variable left
    bound in :func:`rotate` would hold the received buffer through the next step); with
    ``rows``, per lane, only those row runs of it (None: all)."""
    for index, (lane_c, lane_r) in enumerate(zip(contrib, received)):
        runs = rows[index] if rows is not None else None
        for c, r in zip(lane_c, lane_r):
            if runs is None:
                c.add_(r)
            else:
                for a, b in runs:
                    c[a:b].add_(r[a:b])


def rotate(
    comm: Communicator,
    lanes: Sequence[Lane],
    position: int,
    payloads: Payloads,
    compute: Callable[[int, Payloads, Sequence[tuple[int, int]]], Payloads | None],
    *,
    op: str,
    accumulate: bool = False,
    pieces: Sequence[Piece] | None = None,
    received_rows: Callable[[int], Sequence[Sequence[tuple[int, int]] | None] | None] | None = None,
) -> list[list[torch.Tensor]] | None:
    """Run the rotation over ``lanes`` (all of the same length ``G``).

    ``compute(step, payloads, rows)`` gets, per lane, rows ``rows[k] = (a, b)`` of the
    payload held at ``step``: all of them, except at step 0 when ``pieces`` says the
    step-0 payload is still landing (the initial send); then it runs once per piece, in
    order, as soon as that piece is here, and the piece's hop to next goes out at once.
    Every position of a lane must cut its step-0 payload into the same pieces.

    With ``accumulate``, ``compute`` returns, per lane, fresh gradient tensors for the
    rows it was given, and the accumulated gradients of this position's own (step-0)
    payloads are returned, per lane; without, ``compute`` returns None and so does this.
    ``received_rows(step)``: per lane, the row runs of the accumulator received at ``step``
    that hold gradients (None: all of them); only those are added in.
    """
    steps = len(lanes[0].order)
    assert all(len(lane.order) == steps for lane in lanes)
    acc_in = acc_pending = home = None
    for step in range(steps):
        hops, incoming = [], None
        if step < steps - 1:
            incoming = [[torch.empty_like(t) for t in lane_tensors] for lane_tensors in payloads]
        contribs = _Contributions(payloads)
        step_pieces = pieces if step == 0 and pieces is not None else _whole(payloads)
        for index, piece in enumerate(step_pieces):
            if piece.landed is not None:
                piece.landed()
            held = _rows(payloads, piece.rows)
            if incoming is not None:
                # The pieces of one hop are one round. With accumulators the gradient chain
                # sets the pace; the payload transfer overlaps it and adds no step of its own.
                hops.append(_exchange(comm, lanes, position, held, _rows(incoming, piece.rows), op=op,
                                      channel="ring", counts_as_step=index == 0 and not accumulate))
            contrib = compute(step, held, piece.rows)
            if accumulate:
                contribs.add(contrib, piece.rows, whole=len(step_pieces) == 1)
            del contrib, held  # this step's payload: held by ``payloads`` only, until the next has landed
        if accumulate:
            contrib = contribs.tensors
            if acc_pending is not None:
                acc_pending.wait()
                _add_received(contrib, acc_in, received_rows(step) if received_rows is not None else None)
                acc_in = home = None  # added in: free it before the next buffer is made
            if steps > 1:
                acc_in = [[torch.empty_like(c) for c in lane_c] for lane_c in contrib]
                acc_pending = _exchange(comm, lanes, position, contrib, acc_in, op=op + "_grad",
                                        channel="side", counts_as_step=True)
                home = acc_in
            else:
                home = contrib
        for hop in hops:
            hop.wait()
        if incoming is not None:
            payloads = incoming
    if acc_pending is not None:
        acc_pending.wait()
    return home
