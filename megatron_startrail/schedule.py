"""The sub-ring rotation: one schedule for the forward and both backward variants.

The payload travels over one or more *lanes*, rings through the same ``G`` positions in
different orders. StarTrail's sub-ring is one lane; TASP's multi-ring transfer splits the
payload in ``G - 1`` parts, one per arc-disjoint Hamiltonian cycle, so that every link
of a fully connected node carries a part at every step.

:func:`rotate` runs ``compute(step, payloads)`` for ``step = 0 .. G-1`` while every
lane's payload moves one hop per step (double-buffered: the next step's payload is in
flight while this step computes). If ``compute`` returns gradient contributions for the
payloads, they travel with them as accumulators and come home after ``G`` hops::

    step i on position x, per lane:  holds the payload of origin prev^i(x)
        post  send(payload -> next), recv(next payload <- prev)     [if i < G-1]
        contrib = compute(i, payloads)
        wait  accumulator from prev (posted at step i-1), add contrib
        post  send(accumulator -> next), recv(accumulator <- prev)   [if G > 1]
    after the last step the accumulator received is the one for x's own payload.

Forward: payload = K, V; compute merges into the fixed query-side output. Backward
"kv": payload = K, V with dK, dV accumulators, dQ fixed. Backward "q" (the paper's):
payload = Q, dO, out, lse with a dQ accumulator, dK, dV fixed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from .comm import Communicator

PAYLOAD_TAG = 11
ACCUMULATOR_TAG = 12

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


def _exchange(comm, lanes, position, tensors, *, op, tag, counts_as_step):
    """Post every lane's send to next and receive from prev; return (pending, buffers)."""
    incoming = [[torch.empty_like(t) for t in lane_tensors] for lane_tensors in tensors]
    sends = [(t, lane.next(position)) for lane, ts in zip(lanes, tensors) for t in ts]
    recvs = [(t, lane.prev(position)) for lane, ts in zip(lanes, incoming) for t in ts]
    return comm.post(sends, recvs, op=op, tag=tag, counts_as_step=counts_as_step), incoming


def rotate(
    comm: Communicator,
    lanes: Sequence[Lane],
    position: int,
    payloads: Payloads,
    compute: Callable[[int, Payloads], Payloads | None],
    *,
    op: str,
    accumulate: bool = False,
) -> list[list[torch.Tensor]] | None:
    """Run the rotation over ``lanes`` (all of the same length ``G``).

    With ``accumulate``, ``compute`` returns, per lane, fresh gradient tensors for the
    payload it was given, and the accumulated gradients of this position's own (step-0)
    payloads are returned, per lane; without, ``compute`` returns None and so does this.
    """
    steps = len(lanes[0].order)
    assert all(len(lane.order) == steps for lane in lanes)
    acc_in = acc_pending = home = None
    for step in range(steps):
        payload_pending = None
        if step < steps - 1:
            # With accumulators the gradient chain sets the pace; the payload transfer
            # overlaps it and adds no sequential step of its own.
            payload_pending, incoming = _exchange(
                comm, lanes, position, payloads, op=op, tag=PAYLOAD_TAG, counts_as_step=not accumulate
            )
        contrib = compute(step, payloads)
        if accumulate:
            if acc_pending is not None:
                acc_pending.wait()
                for lane_c, lane_r in zip(contrib, acc_in):
                    for c, r in zip(lane_c, lane_r):
                        c.add_(r)
            if steps > 1:
                acc_pending, acc_in = _exchange(
                    comm, lanes, position, contrib, op=op + "_grad", tag=ACCUMULATOR_TAG, counts_as_step=True
                )
                home = acc_in
            else:
                home = [list(c) for c in contrib]
        if payload_pending is not None:
            payload_pending.wait()
            payloads = incoming
    if acc_pending is not None:
        acc_pending.wait()
    return home
