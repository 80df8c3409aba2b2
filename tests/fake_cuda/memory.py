"""Live and peak bytes of device memory under fake CUDA (child side).

FakeTensors allocate nothing, but each one's storage reports the bytes it would hold on the
device (``untyped_storage().nbytes()``). :class:`StorageBytes` counts every storage an op
hands back, once (views and in-place results share theirs), until the storage dies: the
live bytes a caching allocator would have handed out, without its rounding and fragmentation,
and their peak. torch keeps one Python object per storage while any tensor uses it, so a
weak reference to it dies with the last tensor.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.weak import WeakIdKeyDictionary


class StorageBytes(TorchDispatchMode):
    """Counts the storages on ``device_type`` created while the mode is on. ``live``: bytes
    now; ``peak``: the most since the last :meth:`reset_peak`."""

    def __init__(self, device_type: str = "cuda"):
        super().__init__()
        self.device_type = device_type
        self.live = self.peak = 0
        self._seen = WeakIdKeyDictionary()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and t.device.type == self.device_type:
                self._count(t.untyped_storage(), func)
        return out

    def _count(self, storage, func) -> None:
        if storage in self._seen:
            return
        nbytes = storage.nbytes()
        self._seen[storage] = (nbytes, func.__name__)
        self.live += nbytes
        self.peak = max(self.peak, self.live)
        weakref.finalize(storage, self._free, nbytes)

    def _free(self, nbytes: int) -> None:
        self.live -= nbytes

    def live_by_op(self) -> dict[str, int]:
        """Live bytes by the op that made each storage (``mm.default``: a linear layer's output,
        ``_flash_attention_forward.default``: the kernel's), largest first."""
        by_op: dict[str, int] = {}
        for nbytes, op in list(self._seen.values()):
            by_op[op] = by_op.get(op, 0) + nbytes
        return dict(sorted(by_op.items(), key=lambda kv: -kv[1]))

    def reset_peak(self) -> None:
        self.peak = self.live
