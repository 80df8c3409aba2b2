"""Kernel-call metadata to the device in one copy (Note [device metadata] in
:mod:`megatron_startrail.microbatch`): the one place the attention's integers go from the
host to the device. Calls are duck-typed (``call.values(what, batch)``:
:class:`~megatron_startrail.layout.KernelCall`), so that layout.py (the planning of calls) and
microbatch.py (per micro-batch) both use it without importing each other."""

from __future__ import annotations

import torch


def to_device(host: torch.Tensor, device) -> torch.Tensor:
    """``host`` (a CPU tensor) on ``device`` in one non-blocking copy, from pinned memory when the
    device is CUDA (a copy from pageable memory would block the host). The tensors' device
    decides, not whether this process sees a GPU."""
    device = torch.device(device)
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def pack_on_device(items, device) -> dict:
    """``{(call, what, batch): tensor}`` for ``items`` (``KernelCall.values``: int64 indices,
    int32 ``cu_seqlens``), all views of ONE device tensor made by one copy (non-blocking and
    from pinned memory when the device is CUDA)."""
    items = list(dict.fromkeys(items))
    wide = [i for i in items if not i[1].startswith("cu_")]  # int64: the gather indices
    narrow = [i for i in items if i[1].startswith("cu_")]  # int32: cu_seqlens
    wide_values = [x for call, what, batch in wide for x in call.values(what, batch)]
    narrow_values = [x for call, what, batch in narrow for x in call.values(what, batch)]
    host = torch.cat([torch.tensor(wide_values, dtype=torch.int64).view(torch.int32),
                      torch.tensor(narrow_values, dtype=torch.int32)])  # [2 * n64 + n32] int32
    buffer = to_device(host, device)
    out, wide_buffer, offset = {}, buffer[: 2 * len(wide_values)].view(torch.int64), 0
    for item in wide:
        n = len(item[0].values(item[1], item[2]))
        out[item], offset = wide_buffer[offset : offset + n], offset + n
    offset = 2 * len(wide_values)
    for item in narrow:
        n = len(item[0].values(item[1], item[2]))
        out[item], offset = buffer[offset : offset + n], offset + n
    return out
