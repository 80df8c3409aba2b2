"""A per-rank record of where the attention's time went: which communication it waited on.

A :class:`Timeline` is passed explicitly (``startrail_attn(..., timeline=...)``) and
handed to the :class:`~megatron_startrail.comm.Communicator`, which records one span
per blocking wait: a collective (they block until done), or the ``wait()`` of posted
P2P transfers. Time outside the spans is compute (and posting). Without a timeline
nothing is recorded and the cost is one ``is None`` test per communication call.

On NCCL (:class:`~megatron_startrail.transport.NcclTransport`) a wait does not block the
host: it is recorded as a pair of CUDA events instead, read with :meth:`Timeline.device_spans`.

Spans are ``(op, start, end)`` in :func:`time.perf_counter` seconds, with the op names
of :class:`~megatron_startrail.comm.CommStats` (``team_all_gather``, ``init_send``,
``sub_ring``, ``team_merge``, ...). :data:`PHASES` groups them into the phases of the
schedule for tables and plots.
"""

from __future__ import annotations

# Phase of the schedule -> op names whose waits it covers (forward and backward).
PHASES = {
    "team gather": ("team_all_gather", "regather_team_all_gather", "team_broadcast"),
    "initial send": ("init_send", "init_send_reverse", "regather_init_send"),
    "document check": ("document_check",),
    "ring wait": ("sub_ring", "sub_ring_grad"),
    "merge": ("team_merge", "team_reduce_scatter", "team_reduce"),
    "ulysses": ("ulysses_all_to_all",),
    "halo": ("halo", "halo_grad"),  # a windowed layer's exchange (halo.py), instead of the above
}


def phase_of(op: str) -> str:
    for phase, ops in PHASES.items():
        if op in ops:
            return phase
    return "other comm"


class Timeline:
    """Spans one rank spent blocked on communication, in order."""

    def __init__(self) -> None:
        self.spans: list[tuple[str, float, float]] = []
        # NCCL transport: (op, start event, end event) around each wait on the compute stream
        self.events: list[tuple[str, object, object]] = []

    def add(self, op: str, start: float, end: float) -> None:
        self.spans.append((op, start, end))

    def add_events(self, op: str, start, end) -> None:
        """A wait recorded as two CUDA events on the current stream: the stream stalled from
        ``start`` (wait issued) until ``end`` (the communication it waits for was done)."""
        self.events.append((op, start, end))

    def device_spans(self) -> list[tuple[str, float, float]]:
        """The CUDA-event waits as ``(op, start, end)`` in seconds from the first event
        (synchronizes the device: call it after the step, never inside a layer)."""
        if not self.events:
            return []
        origin = self.events[0][1]
        origin.synchronize()
        self.events[-1][2].synchronize()
        return [(op, origin.elapsed_time(a) / 1e3, origin.elapsed_time(b) / 1e3) for op, a, b in self.events]

    def clear(self) -> None:
        self.spans.clear()
        self.events.clear()

    def phase_seconds(self, start: float, end: float) -> dict[str, float]:
        """Seconds per phase within ``[start, end]``; ``compute`` is the rest of the window."""
        out = {phase: 0.0 for phase in PHASES}
        for op, a, b in self.spans:
            a, b = max(a, start), min(b, end)
            if b > a:
                phase = phase_of(op)
                out[phase] = out.get(phase, 0.0) + (b - a)
        out["compute"] = max(0.0, (end - start) - sum(out.values()))
        return out
