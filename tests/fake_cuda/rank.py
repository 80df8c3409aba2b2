"""One rank of a GPU world inside this process, on fake CUDA (child side; needs the shim).

A process started with ``LD_PRELOAD=libfakecuda.so`` (:mod:`tests.fake_cuda.run`) can hold
``cuda`` FakeTensors and run autograd on them. :func:`fake_cuda_rank` makes it rank ``r`` of
``P``: torch's fake process group (every collective and P2P returns at once, as NCCL would
from the host's view; ``dist.get_backend`` names it, and StarTrail's groups take NCCL's
transport for CUDA tensors), a FakeTensorMode, the kernel choice told the device is an H100
(:func:`megatron_startrail.kernels.assume_cuda_device`), and :class:`DeviceRules` watching
every op for what costs a GPU a host sync or a copy.
"""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
import weakref
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from megatron_startrail import kernels
from tests.fake_cuda.aten_doubles import OpContracts

aten = torch.ops.aten
H100 = kernels.CudaDevice(capability=(9, 0), sdpa_flash=True, cudnn_version=0)

# Ops whose result the host must wait for on a GPU (their output size or value depends on data).
SYNCING = {aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default,
           aten.equal.default, aten.is_nonzero.default, aten.repeat_interleave.Tensor,
           aten._unique2.default, aten.unique_consecutive.default, aten.unique_dim.default}


# Ops whose precision the rehearsal checks: the merges of partial results (blocks.merge_lse_,
# merge_partials, the sinks), the kernels' log-sum-exp, and sums (GQA's dK, dV over head groups).
PRECISION = {
    aten.sigmoid.default: "merge", aten.lerp_.Tensor: "merge", aten.logaddexp.out: "merge",
    aten.logaddexp.default: "merge", aten.logsumexp.default: "merge", aten.exp.default: "merge",
    aten._scaled_dot_product_flash_attention.default: "kernel",
    aten._scaled_dot_product_efficient_attention.default: "kernel",
    aten._efficient_attention_forward.default: "kernel", aten._flash_attention_forward.default: "kernel",
    aten.sum.dim_IntList: "sum",
}


class KnownIntegers:
    """The values of small integer tensors, computed beside the fake ones on the CPU, so that code
    reading them on the host (``.tolist()``: the packed-document agreement, the one host sync of a
    micro-batch) runs under fake CUDA. An op is followed when all its tensor arguments and
    results are integers and every argument's values are known; ``lift_fresh`` (``torch.tensor``)
    brings them in. The read is still recorded as a sync by :class:`DeviceRules`."""

    LIMIT = 1 << 20  # elements: larger integer tensors (gather indices) are not followed

    def __init__(self) -> None:
        # id(fake) -> (weak ref of it, real CPU values); by identity (tensors compare elementwise)
        self._values: dict[int, tuple] = {}

    def get(self, t):
        entry = self._values.get(id(t))
        return entry[1] if entry is not None and entry[0]() is t else None

    def _set(self, t, value) -> None:
        key = id(t)
        self._values[key] = (weakref.ref(t, lambda _, key=key, values=self._values: values.pop(key, None)), value)

    @staticmethod
    def _integral(t) -> bool:
        return isinstance(t, torch.Tensor) and not t.is_floating_point() and not t.is_complex()

    def follow(self, func, args, kwargs, out) -> None:
        leaves = torch.utils._pytree.tree_leaves((args, kwargs))
        tensors = [a for a in leaves if isinstance(a, torch.Tensor)]
        outs = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
        if not outs or not all(self._integral(t) and t.numel() <= self.LIMIT for t in tensors + outs):
            return
        from torch._subclasses.fake_tensor import FakeTensor  # noqa: PLC0415

        def real(a):
            if isinstance(a, FakeTensor):
                return self.get(a)
            if isinstance(a, torch.Tensor):
                return a  # a real tensor (torch.tensor's data, before lift_fresh)
            if isinstance(a, torch.device):
                return torch.device("cpu")
            return a

        real_args, real_kwargs = torch.utils._pytree.tree_map(real, (args, kwargs))
        if any(r is None for r, t in zip(torch.utils._pytree.tree_leaves((real_args, real_kwargs)), leaves)
               if isinstance(t, torch.Tensor)):
            return
        real_kwargs = {k: (torch.device("cpu") if k == "device" and v is not None else v)
                       for k, v in real_kwargs.items()}
        with torch.utils._python_dispatch._disable_current_modes():
            real_out = func(*real_args, **real_kwargs)
        for fake, value in zip(outs, [t for t in torch.utils._pytree.tree_leaves(real_out)
                                      if isinstance(t, torch.Tensor)]):
            self._set(fake, value)

    def value(self, t, where: str):
        known = self.get(t)
        if known is None:
            raise RuntimeError(f"{where} reads the value of a tensor on the host ({t.dtype}, {tuple(t.shape)}) "
                               f"whose values the fake-CUDA rehearsal does not know")
        with torch.utils._python_dispatch._disable_current_modes():
            return known.item()


def leave() -> None:
    """End a fake-CUDA child once its results are written: torch's fake process group and
    autograd's threads for the fake device are torn down at interpreter exit without harm but
    noisily ("terminate called without an active exception"), so the process leaves directly."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def shim_loaded() -> bool:
    return torch._C._get_accelerator().type == "cuda"


# Frames never named as a cause: torch's own (dispatch, autograd, modes) and the rehearsal's modes.
_MACHINERY = (os.path.dirname(torch.__file__) + os.sep, os.path.dirname(__file__) + os.sep + "rank.py",
              os.path.dirname(__file__) + os.sep + "memory.py", os.path.dirname(__file__) + os.sep + "aten_doubles.py")


def package_frame() -> str:
    """``file:line function`` of the innermost frame of the package (relative to it), or else of
    the innermost caller outside torch and these modes (its full path: Megatron's, a test's)."""
    frames = traceback.extract_stack()[:-2]
    mine = [f for f in frames if "/megatron_startrail/" in f.filename]
    callers = [f for f in frames if not f.filename.startswith(_MACHINERY)]
    f = (mine or callers or frames)[-1]
    return f"{f.filename.split('/megatron_startrail/')[-1]}:{f.lineno} {f.name}"


def is_package_frame(where: str) -> bool:
    """Whether a :func:`package_frame` answer is a frame of the package (given relative to it;
    any other frame by its full path)."""
    return not where.startswith("/")


@dataclass
class Copy:
    src: str
    dst: str
    non_blocking: bool
    pinned: bool  # the host side is pinned memory
    nbytes: int
    where: str


@dataclass
class DeviceRules(TorchDispatchMode):
    """Records, for every op that runs: host syncs (:data:`SYNCING` on a CUDA tensor), copies
    between host and device (direction, non-blocking, pinned), and ops whose tensor arguments
    sit on more than one device (0-dim CPU scalars excepted, as CUDA allows them). Each with the
    package frame that caused it. Asserts nothing: the tests read the records."""

    syncs: list = field(default_factory=list)
    copies: list = field(default_factory=list)
    mixed: list = field(default_factory=list)
    cuda_queries: list = field(default_factory=list)
    precision: list = field(default_factory=list)  # (what, input float dtypes, output dtypes, frame)
    ops: Counter = field(default_factory=Counter)
    contracts: OpContracts | None = None  # checks the attention ops' arguments before they run
    stand_in_values: bool = False
    stand_ins: list = field(default_factory=list)  # (dtype, value given, frame): see _host_value

    def __post_init__(self):
        super().__init__()
        # FakeTensorMode has no pinned memory: a pinned copy is a clone remembered here, so that a
        # copy from it counts as pinned (and .is_pinned() answers).
        self._pinned = weakref.WeakValueDictionary()  # id -> tensor (tensors compare elementwise)
        self.known = KnownIntegers()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensors = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
        self.ops[func] += 1
        if self.contracts is not None:
            self.contracts.check(func, args, kwargs)
        if func in SYNCING and any(t.device.type == "cuda" for t in tensors):
            self.syncs.append((str(func), package_frame()))
        devices = {t.device.type for t in tensors if not (t.device.type == "cpu" and t.dim() == 0)}
        if func is aten._to_copy.default and "device" in kwargs:
            src, dst = args[0], torch.device(kwargs["device"])
            if src.device.type != dst.type:
                self._copy(src, src.device.type, dst.type, kwargs.get("non_blocking", False))
        elif func is aten.copy_.default and args[0].device.type != args[1].device.type:
            non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
            self._copy(args[1], args[1].device.type, args[0].device.type, non_blocking, host=args[0])
        elif len(devices) > 1:
            self.mixed.append((str(func), sorted(devices), package_frame()))
        if func is aten._pin_memory.default:
            pinned = args[0].clone()
            self._pinned[id(pinned)] = pinned
            self.known.follow(aten.clone.default, args, {}, pinned)
            return pinned
        if func is aten.is_pinned.default:
            return self._is_pinned(args[0])
        if func is aten._local_scalar_dense.default:
            return self._host_value(args[0])
        out = func(*args, **kwargs)
        self.known.follow(func, args, kwargs, out)
        if func in PRECISION:
            outs = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]
            self.precision.append((PRECISION[func], tuple(t.dtype for t in tensors if t.is_floating_point()),
                                   tuple(t.dtype for t in outs), package_frame()))
        return out

    def _host_value(self, t):
        """The value a host read gets: known integers' values; with ``stand_in_values``, a stand-in
        for an unknown float (1.0) or bool (False: no inf/NaN found) read outside the package
        (Megatron's grad norm, torch's Adam step), recorded in ``stand_ins``. The package's own
        reads of unknown values still raise, and so do unknown integers (sizes)."""
        where = package_frame()
        if self.stand_in_values and self.known.get(t) is None and not is_package_frame(where) \
                and (t.is_floating_point() or t.dtype == torch.bool):
            value = 1.0 if t.is_floating_point() else False
            self.stand_ins.append((str(t.dtype), value, where))
            return value
        return self.known.value(t, where)

    def _copy(self, src, src_type, dst_type, non_blocking, host=None):
        host = src if src_type == "cpu" else host
        pinned = host is not None and self._is_pinned(host)
        self.copies.append(Copy(src_type, dst_type, bool(non_blocking), pinned, src.numel() * src.element_size(),
                                package_frame()))

    def _is_pinned(self, t) -> bool:
        return self._pinned.get(id(t)) is t

    def host_to_device(self) -> list[Copy]:
        return [c for c in self.copies if (c.src, c.dst) == ("cpu", "cuda")]

    def device_to_host(self) -> list[Copy]:
        return [c for c in self.copies if (c.src, c.dst) == ("cuda", "cpu")]

    def clear(self) -> None:
        for record in (self.syncs, self.copies, self.mixed, self.precision, self.ops, self.stand_ins):
            record.clear()


class PinnedFactories(TorchFunctionMode):
    """``torch.tensor(..., pin_memory=True)`` (Megatron's RoPE and batch slicing) asks the CUDA
    hooks for a pinned-memory allocator before any op dispatches, which the shim has not: made
    unpinned, then pinned with ``.pin_memory()``, which :class:`DeviceRules` answers."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if not kwargs.pop("pin_memory", False):
            return func(*args, **kwargs)
        return func(*args, **kwargs).pin_memory()


@contextlib.contextmanager
def torch_cuda_answers(device: kernels.CudaDevice, asked_by: list):
    """torch's own Python code asks ``torch.cuda`` about a CUDA tensor's device (torch.distributed's
    broadcast: the capability), which a CPU build cannot answer: these answer for ``device``.
    Every caller's frame goes to ``asked_by``: the package must be none of them (it asks
    ``kernels.cuda_device``, told by ``assume_cuda_device``)."""
    saved = torch.cuda.get_device_capability

    def capability(index=None):
        caller = traceback.extract_stack()[-2]
        asked_by.append(("torch.cuda.get_device_capability", f"{caller.filename}:{caller.lineno}"))
        return device.capability

    torch.cuda.get_device_capability = capability
    try:
        yield
    finally:
        torch.cuda.get_device_capability = saved


@contextlib.contextmanager
def fake_cuda_rank(rank: int, world: int, device: kernels.CudaDevice = H100, *, stand_in_values: bool = False):
    """This process as rank ``rank`` of ``world`` GPUs: yields ``(fake_mode, rules)``. Tensors made
    inside are FakeTensors; ``rules`` (:class:`DeviceRules`) has recorded every op on exit, and
    ``rules.cuda_queries`` who asked torch.cuda what a CPU build cannot answer, and
    ``rules.contracts.checked`` the attention ops checked against their contracts.
    ``stand_in_values``: host reads of unknown floats and bools outside the package get a
    stand-in value instead of an error (:meth:`DeviceRules._host_value`; a training step's
    grad norm)."""
    if not shim_loaded():
        raise RuntimeError("fake CUDA needs the shim loaded before torch: start this process through "
                           "tests.fake_cuda.run (LD_PRELOAD=libfakecuda.so)")
    from torch.testing._internal.distributed.fake_pg import FakeStore  # noqa: PLC0415 - a test utility

    kernels.assume_cuda_device(0, device)
    dist.init_process_group("fake", store=FakeStore(), rank=rank, world_size=world)
    rules = DeviceRules(stand_in_values=stand_in_values)
    rules.contracts = OpContracts(known=rules.known.get)
    try:
        with torch_cuda_answers(device, rules.cuda_queries), FakeTensorMode(allow_non_fake_inputs=False) as mode, \
                rules, PinnedFactories():
            yield mode, rules
    finally:
        dist.destroy_process_group()
