"""Part 4 of the GPU kit: the NCCL transport on one GPU, as far as one device allows.

A world of one real process group (``nccl`` on a GPU; ``gloo`` in ``--cpu-selfcheck``):

- ``new_startrail_groups`` picks the transport of the backend and initialises every group
  eagerly (one collective each, on the device);
- a P2P exchange with itself on both channels (the ring's group and the twin) lands the
  data, and a Timeline records the waits (CUDA events on NCCL: ``device_spans``);
- on NCCL, ``wait()`` does not block the host: the host time spent in the waits is compared
  with the device time the stream stalled behind a long matmul queued before the exchange.

What one GPU cannot show: two ranks' P2P matching, real overlap of the ring and side
communicators, the first-batch rule across ranks (the CPU suite's NCCL-rules mode checks those).
"""

from __future__ import annotations

import os
import tempfile
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megatron_startrail import new_startrail_groups
from megatron_startrail.comm import CommStats, Communicator
from megatron_startrail.timeline import Timeline


@dataclass
class TransportRow:
    check: str
    ok: bool
    detail: str


def one_gpu_transport(device: torch.device) -> list[TransportRow]:
    backend = "nccl" if device.type == "cuda" else "gloo"
    if dist.is_initialized():
        dist.destroy_process_group()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        dist.init_process_group(backend, init_method=f"file://{os.path.join(tmp, 'pg')}", rank=0, world_size=1,
                                **({"device_id": device} if device.type == "cuda" else {}))
        try:
            groups = new_startrail_groups(team_size=1)
            transport = groups.transport
            want = "NcclTransport" if backend == "nccl" else "GlooTransport"
            rows.append(TransportRow("transport of the backend", type(transport).__name__.endswith(want),
                                     f"{backend} -> {type(transport).__name__}"))
            timeline = Timeline()
            comm = Communicator(CommStats(), transport, timeline)
            x = torch.randn(1 << 20, device=device)
            for channel in ("ring", "side") if backend == "nccl" else ():  # gloo cannot send to itself
                got = torch.empty_like(x)
                if device.type == "cuda":  # queue ~tens of ms of work first: the exchange waits behind it
                    a = torch.randn(4096, 4096, device=device)
                    for _ in range(20):
                        a = a @ a / 64
                start = time.perf_counter()
                comm.post([(x, 0)], [(got, 0)], op=f"self_{channel}", channel=channel).wait()
                host_s = time.perf_counter() - start
                same = bool(torch.equal(got, x))
                rows.append(TransportRow(f"self exchange, {channel} channel", same,
                                         f"data {'equal' if same else 'DIFFERS'}; host time in post+wait "
                                         f"{host_s * 1e3:.2f} ms"))
            if device.type == "cuda":
                spans = timeline.device_spans()
                stalled = sum(b - a for _, a, b in spans)
                rows.append(TransportRow("timeline from CUDA events", len(spans) == 2,
                                         f"{len(spans)} device spans, stream stalled {stalled * 1e3:.2f} ms"))
            else:
                rows.append(TransportRow("self exchange", True, "skipped: gloo has no P2P to itself (the CPU "
                                         "suite runs the gloo transport on 2 to 16 ranks)"))
        finally:
            dist.destroy_process_group()
    return rows


def transport_table(rows: list[TransportRow]) -> list[str]:
    return ["| check | result | detail |", "|---|---|---|"] + [
        f"| {r.check} | {'ok' if r.ok else 'FAILED'} | {r.detail} |" for r in rows]


def transport_part(items, device: str) -> None:
    """The kit's transport part (child side): one item."""
    items.run([device], lambda d: [vars(r) for r in one_gpu_transport(torch.device(d))],
              lambda d: f"transport on {d}")
