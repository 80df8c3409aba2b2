"""Live and peak bytes of device memory under fake CUDA (child side).

FakeTensors allocate nothing, but each one's storage reports the bytes it would hold on the
device (``untyped_storage().nbytes()``). :class:`LiveStorages` counts every storage an op
creates while the mode is on, once, until the storage dies: the live bytes a caching allocator
would have handed out, without its rounding or fragmentation. A view or an
in-place result shares a storage it was given: nothing new (so a view of the caller's q, made
before, is not counted). A fused attention op's workspace -- what the kernel allocates for
itself and frees before it returns (the meta kernels allocate none) -- is charged for the op's
duration, beside its outputs: :func:`workspace_bytes`, the memory model's own figures
(``megatron_startrail/planning/workspace.py``) for the op's real call shape. torch keeps one Python object per storage while any tensor uses it,
so a weak reference to it dies with the last tensor (autograd's saved tensors, a pending P2P's
buffer and the like hold it as long as they should). A storage resized while it lives
(``untyped_storage().resize_(0)``: the backward freeing the forward's kept K, V pieces though
autograd holds them to its end, Note [kept pieces] in backward.py) is not an op the mode sees:
``UntypedStorage.resize_`` is wrapped while the mode is on, and the live bytes follow it.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_startrail.planning.workspace import KernelCallShape, backward_workspace_bytes, forward_workspace_bytes

_aten = torch.ops.aten
# The fused attention ops: (kernel, backward?). Query / key as the ops take them: flash folds
# the batch into the rows, [total, h, d] (or [b, s, h, d]); cuDNN and efficient take [b, h, s, d].
_ATTENTION_OPS = {
    _aten._flash_attention_forward.default: ("torch_cuda_flash", False),
    _aten._flash_attention_backward.default: ("torch_cuda_flash", True),
    _aten._scaled_dot_product_efficient_attention.default: ("torch_cuda_efficient", False),
    _aten._scaled_dot_product_efficient_attention_backward.default: ("torch_cuda_efficient", True),
    _aten._scaled_dot_product_cudnn_attention.default: ("torch_cuda_cudnn", False),
    _aten._scaled_dot_product_cudnn_attention_backward.default: ("torch_cuda_cudnn", True),
}


def workspace_bytes(func, args) -> int:
    """The workspace of one call of a fused attention op (0 for any other op)."""
    if func not in _ATTENTION_OPS:
        return 0
    kernel, backward = _ATTENTION_OPS[func]
    q, k = args[1:3] if backward else args[0:2]
    if kernel == "torch_cuda_flash":  # [.., rows, h, d]; the runs: cum_seq_q's entries - 1, else the batch
        cum = args[6] if backward else args[3]
        heads, kv_heads, sequences = q.shape[-2], k.shape[-2], (cum.numel() - 1 if cum is not None else
                                                                 (q.shape[0] if q.dim() == 4 else 1))
    else:  # [b, h, s, d]
        heads, kv_heads, sequences = q.shape[1], k.shape[1], q.shape[0]
    call = KernelCallShape(q.numel() // (heads * q.shape[-1]), k.numel() // (kv_heads * k.shape[-1]), heads, kv_heads,
                           q.shape[-1], q.element_size(), sequences)
    return (backward_workspace_bytes if backward else forward_workspace_bytes)(kernel, call)


class LiveStorages(TorchDispatchMode):
    """``live``: bytes now; ``peaks``: the most per ``phase`` (set it as the program moves on:
    "forward", "backward", ...); ``peak``: the most of all since the last :meth:`reset_peak`.
    ``device_type`` (default: every device) limits what is counted. With ``explain``, the live
    set at each phase's peak, each storage with its op and package frame (a stack per storage)."""

    def __init__(self, explain: bool = False, device_type: str | None = None) -> None:
        super().__init__()
        self.live, self.phase, self.peaks = 0, "forward", {}
        self.device_type, self.explain = device_type, explain
        self._storages: dict[int, tuple[weakref.ref, int, str]] = {}  # id -> (ref, bytes, what made it)
        self.at_peak: dict[str, list[tuple[str, int]]] = {}

    @property
    def peak(self) -> int:
        return max(self.peaks.values(), default=self.live)

    def __enter__(self):
        resize, tracker = torch.UntypedStorage.resize_, self

        def resize_tracked(storage, nbytes):
            result = resize(storage, nbytes)
            tracker._resized(storage)
            return result

        self._resize, torch.UntypedStorage.resize_ = resize, resize_tracked
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._resize
        return super().__exit__(*exc)

    def _resized(self, storage) -> None:
        key = id(storage)
        if key in self._storages:
            ref, old, what = self._storages[key]
            self._storages[key] = (ref, storage.nbytes(), what)
            self.live += storage.nbytes() - old

    def reset_peak(self) -> None:
        self.peaks = {self.phase: self.live}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        given = {id(a.untyped_storage()) for a in torch.utils._pytree.tree_leaves((args, kwargs))
                 if isinstance(a, torch.Tensor)}
        for t in torch.utils._pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor) and id(t.untyped_storage()) not in given and (
                    self.device_type is None or t.device.type == self.device_type):
                self._add(t.untyped_storage(), func)
        if (workspace := workspace_bytes(func, args)) > 0:  # live for the op's duration, beside its outputs
            self._transient(workspace, func)
        return out

    def _add(self, storage, func) -> None:
        key = id(storage)
        if key in self._storages:
            return
        what = func.__name__
        if self.explain:
            from tests.fake_cuda.rank import package_frame  # noqa: PLC0415 - a stack per storage: only when asked
            what = f"{func} at {package_frame()}"
        self._storages[key] = (weakref.ref(storage, lambda _, key=key: self._remove(key)), storage.nbytes(), what)
        self.live += storage.nbytes()
        if self.live > self.peaks.get(self.phase, -1):
            self.peaks[self.phase] = self.live
            if self.explain:
                self.at_peak[self.phase] = [(w, n) for _, n, w in self._storages.values()]

    def _transient(self, nbytes: int, func) -> None:
        if self.live + nbytes > self.peaks.get(self.phase, -1):
            self.peaks[self.phase] = self.live + nbytes
            if self.explain:
                self.at_peak[self.phase] = [(w, n) for _, n, w in self._storages.values()] + [
                    (f"workspace of {func}", nbytes)]

    def _remove(self, key: int) -> None:
        self.live -= self._storages.pop(key)[1]

    def live_by_op(self) -> dict[str, int]:
        """Live bytes by the op that made each storage (``mm.default``: a linear layer's output,
        ``_flash_attention_forward.default``: the kernel's), largest first."""
        by_op: dict[str, int] = {}
        for _, nbytes, what in list(self._storages.values()):
            by_op[what] = by_op.get(what, 0) + nbytes
        return dict(sorted(by_op.items(), key=lambda kv: -kv[1]))
