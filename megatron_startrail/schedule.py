"""The sub-ring rotation: one schedule for the forward and both backward variants.

:func:`rotate` runs ``compute(step, payload)`` for ``step = 0 .. G-1`` while the payload
moves one hop along the sub-ring per step (double-buffered: the next step's payload is
in flight while this step computes). If ``compute`` returns gradient contributions for
the payload, they travel with it as accumulators and come home after ``G`` hops::

    step i on position x:  holds payload of origin x-i
        post  send(payload -> next), recv(next payload <- prev)     [if i < G-1]
        contrib = compute(i, payload)
        wait  accumulator of origin x-i from prev (posted at step i-1), add contrib
        post  send(accumulator -> next), recv(accumulator <- prev)   [if G > 1]
    after the last step the accumulator received is the one for x's own payload.

Forward: payload = K, V; compute merges into the fixed query-side output. Backward
"kv": payload = K, V with dK, dV accumulators, dQ fixed. Backward "q" (the paper's):
payload = Q, dO, out, lse with a dQ accumulator, dK, dV fixed.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from .comm import Communicator
from .topology import StarTrailTopology

PAYLOAD_TAG = 11
ACCUMULATOR_TAG = 12


def rotate(
    comm: Communicator,
    topo: StarTrailTopology,
    position: int,
    payload: Sequence[torch.Tensor],
    compute: Callable[[int, Sequence[torch.Tensor]], Sequence[torch.Tensor] | None],
    *,
    op: str,
    accumulate: bool = False,
) -> list[torch.Tensor] | None:
    """Run the sub-ring loop.

    With ``accumulate``, ``compute`` returns fresh gradient tensors for the payload it
    was given, and the accumulated gradients of this position's own (step-0) payload are
    returned; without, ``compute`` returns None and so does this.
    """
    steps = topo.sub_ring_size
    nxt, prv = topo.ring_next(position), topo.ring_prev(position)
    acc_in: list[torch.Tensor] | None = None  # accumulators received from prev
    acc_pending = None
    home: list[torch.Tensor] | None = None
    for step in range(steps):
        payload_pending = None
        if step < steps - 1:
            incoming = [torch.empty_like(t) for t in payload]
            payload_pending = comm.post(
                [(t, nxt) for t in payload],
                [(t, prv) for t in incoming],
                op=op,
                tag=PAYLOAD_TAG,
                # With accumulators the gradient chain sets the pace; the payload
                # transfer overlaps it and adds no sequential step.
                counts_as_step=not accumulate,
            )
        contrib = compute(step, payload)
        if accumulate:
            contrib = list(contrib)
            if acc_pending is not None:
                acc_pending.wait()
                for c, r in zip(contrib, acc_in):
                    c.add_(r)
            if steps > 1:
                acc_in = [torch.empty_like(c) for c in contrib]
                acc_pending = comm.post(
                    [(c, nxt) for c in contrib],
                    [(r, prv) for r in acc_in],
                    op=op + "_grad",
                    tag=ACCUMULATOR_TAG,
                )
                home = acc_in
            else:
                home = contrib
        if payload_pending is not None:
            payload_pending.wait()
            payload = incoming
    if acc_pending is not None:
        acc_pending.wait()
    return home
