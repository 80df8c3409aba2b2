"""Block kernels behind one interface, and the choice of one for an attention call.

:func:`choose_layer_kernel` is what the attention's entry calls, once per layer call: it
probes which backends this device can use (:func:`usable_backends`, once per device:
importable, fit for the device's capability, and the installed build's version and behaviour
checked by :mod:`.builds`), applies the pure rules of
:func:`~megatron_startrail.kernels.selection.choose_kernel` (on CUDA: the GPU's table of
measured kernels, :mod:`.measured`, for the layer's class) and builds the kernel; the
:class:`LayerKernel` it returns carries the choice to the schedule, which calls nothing else
of this package on the way (a forced kernel that cannot take the inputs fails there, before
any communication). :func:`kernel_for` (the kernel alone) and :func:`check_kernel` (the
choice alone, nothing built) are the same rules for tools and tests.
"""

from __future__ import annotations

import functools
import importlib
import warnings
from dataclasses import dataclass

import torch

from .base import BlockKernel
from .builds import usable_builds
from .measured import follows_sm90
from .reference import ReferenceKernel
from .selection import BACKENDS, KERNELS, RULES, KernelChoice, KernelRequest, choose_kernel, kernel_constraint
from .torch_cpu import TorchCPUFlashKernel


def _importable(module: str) -> bool:
    try:
        importlib.import_module(module)
    except Exception:  # noqa: BLE001 - a broken install (ABI mismatch: OSError, RuntimeError) is "not usable"
        return False
    return True


@dataclass(frozen=True)
class CudaDevice:
    """What the kernel choice needs to know of a GPU, beside the installed packages."""

    capability: tuple[int, int]  # torch.cuda.get_device_capability: (8, 0) A100, (9, 0) H100/H200
    sdpa_flash: bool  # torch was built with its flash-attention kernels
    cudnn_version: int  # 0: no cuDNN

    @staticmethod
    def probe(index: int) -> CudaDevice:
        """Asks torch about device ``index`` (the driver: only on a process that sees the GPU)."""
        has_cudnn = torch.backends.cudnn.is_available()
        return CudaDevice(tuple(torch.cuda.get_device_capability(index)),
                          torch.backends.cuda.is_flash_attention_available(),
                          (torch.backends.cudnn.version() or 0) if has_cudnn else 0)


# Probed once per device index and process (what a GPU is cannot change while the process runs),
# or told by assume_cuda_device. Plain facts: no tensors.
_CUDA_DEVICES: dict[int, CudaDevice] = {}


def cuda_device(index: int) -> CudaDevice:
    """Device ``index`` as :func:`assume_cuda_device` was told, else probed on first use."""
    if index not in _CUDA_DEVICES:
        _CUDA_DEVICES[index] = CudaDevice.probe(index)
    return _CUDA_DEVICES[index]


def assume_cuda_device(index: int, device: CudaDevice) -> None:
    """Choose kernels for device ``index`` as if it were ``device``, without asking the driver: a
    rehearsal on fake CUDA tensors (tests/fake_cuda), or a launcher that knows its GPUs. Before
    the first attention on that device; ValueError when it was already probed as another one."""
    known = _CUDA_DEVICES.get(index)
    if known is not None and known != device:
        raise ValueError(f"CUDA device {index} was already taken as {known}; assume_cuda_device must come "
                         f"before the first attention call on it")
    _CUDA_DEVICES[index] = device


@functools.lru_cache(maxsize=None)
def _usable_cuda_backends(device: CudaDevice, index: int) -> frozenset[str]:
    # What the device could run, then what the installed builds do (an unfit build: one log line).
    major, minor = device.capability
    usable = {"torch_efficient"}
    if major >= 8 and device.sdpa_flash:
        usable.add("torch_flash")
    if major >= 8 and device.cudnn_version >= 90000:
        usable.add("torch_cudnn")
    if major >= 8 and _importable("flash_attn.flash_attn_interface"):
        usable.add("flash_attn")
    if (major, minor) == (9, 0) and _importable("flash_attn_interface"):
        usable.add("flash_attn_3")
    return usable_builds(usable, torch.device("cuda", index))


def _cuda_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def usable_backends(device: torch.device) -> frozenset[str]:
    """The backends of :data:`~megatron_startrail.kernels.selection.BACKENDS` usable on ``device``."""
    if device.type != "cuda":
        return frozenset()
    index = _cuda_index(device)
    return _usable_cuda_backends(cuda_device(index), index)


def request_for(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, mask: str = "causal",
                packed: bool = False) -> KernelRequest:
    """The :class:`KernelRequest` of these tensors on their device: the usable backends and, on
    CUDA, the GPU's compute capability (both known after the first call: no driver query, no
    sync). ``mask`` ("none", "causal", "window") and ``packed`` are the layer's class."""
    capability = cuda_device(_cuda_index(q.device)).capability if q.device.type == "cuda" else None
    return KernelRequest.of(q, k, v, usable_backends(q.device), mask=mask, packed=packed, capability=capability)


def make_kernel(name: str, deterministic: bool = False) -> BlockKernel:
    """A kernel object by name (imports the optional GPU adapters only when asked for);
    ``deterministic`` reaches the kernels that have a deterministic backward switch."""
    kernel = _make_kernel(name)
    if deterministic:
        kernel.deterministic = True
    return kernel


def _make_kernel(name: str) -> BlockKernel:
    if name == "reference":
        return ReferenceKernel()
    if name == "torch_cpu_flash":
        return TorchCPUFlashKernel()
    if name in ("flash_attn", "flash_attn_3"):
        from .flash_attn import FlashAttn3Kernel, FlashAttnKernel  # noqa: PLC0415 - optional

        return FlashAttnKernel() if name == "flash_attn" else FlashAttn3Kernel()
    if name == "torch_cuda_cudnn_varlen":
        from .cudnn_varlen import TorchCUDACudnnVarlenKernel  # noqa: PLC0415 - GPU-only adapter

        return TorchCUDACudnnVarlenKernel()
    from . import torch_cuda  # noqa: PLC0415 - GPU-only adapters

    return {
        "torch_cuda_flash": torch_cuda.TorchCUDAFlashKernel,
        "torch_cuda_efficient": torch_cuda.TorchCUDAEfficientKernel,
        "torch_cuda_cudnn": torch_cuda.TorchCUDACudnnKernel,
    }[name]()


@functools.lru_cache(maxsize=None)
def _warn_once(message: str) -> None:
    warnings.warn(message, RuntimeWarning, stacklevel=3)


def _choose(request: KernelRequest, name: str) -> KernelChoice:
    choice = choose_kernel(request, name)
    if choice.name == "reference" and name == "auto":
        _warn_once(f"StarTrail uses the slow reference block kernel: {choice.reason}")
    elif name == "auto" and request.device_type == "cuda" and follows_sm90(request.capability):
        _warn_once(f"StarTrail's kernel choice on this unmeasured GPU (compute capability "
                   f"{request.capability[0]}.{request.capability[1]}) follows the H100's (sm90) table: run "
                   "scripts/gpu_session.sh on it and commit its tables to measure it")
    return choice


def check_kernel(name: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> KernelChoice:
    """The choice for q ``[..., h, d_qk]``, k ``[..., hkv, d_qk]``, v ``[..., hkv, d_v]``; ValueError
    naming ``--startrail-kernel`` when a forced ``name`` cannot take them. Communicates nothing."""
    return choose_kernel(request_for(q, k, v), name)


@dataclass(frozen=True)
class LayerKernel:
    """The block kernel of one attention layer call, chosen once at its entry and carried to
    the schedule: what it was chosen for, the choice (name and why) and the kernel object the
    block steps call, forward and backward."""

    request: KernelRequest
    choice: KernelChoice
    kernel: BlockKernel


def choose_layer_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, name: str = "auto",
                        deterministic: bool = False, *, mask: str = "causal", packed: bool = False) -> LayerKernel:
    """The block kernel for these tensors (heads at dim -2, head dim last) in a layer of this
    class (``mask``: "none", "causal" or "window"; ``packed``: documents), ``name`` forced or
    "auto" (ValueError naming ``--startrail-kernel`` when a forced one cannot take them). Once
    per layer call, at its entry: host facts only, no sync."""
    request = request_for(q, k, v, mask=mask, packed=packed)
    choice = _choose(request, name)
    return LayerKernel(request, choice, make_kernel(choice.name, deterministic))


def kernel_for(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, name: str = "auto",
               deterministic: bool = False, *, mask: str = "causal", packed: bool = False) -> BlockKernel:
    """:func:`choose_layer_kernel`'s kernel alone."""
    return choose_layer_kernel(q, k, v, name, deterministic, mask=mask, packed=packed).kernel


__all__ = [
    "BACKENDS", "BlockKernel", "CudaDevice", "KERNELS", "RULES", "KernelChoice", "KernelRequest", "LayerKernel",
    "ReferenceKernel", "assume_cuda_device", "choose_layer_kernel", "cuda_device",
    "TorchCPUFlashKernel", "check_kernel", "choose_kernel", "kernel_constraint", "kernel_for", "make_kernel",
    "request_for", "usable_backends",
]
