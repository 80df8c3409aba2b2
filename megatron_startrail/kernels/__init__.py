"""Block kernels behind one interface; :func:`select_kernel` picks one for a device."""

from __future__ import annotations

import torch

from .base import BlockKernel
from .reference import ReferenceKernel
from .torch_cpu import TorchCPUFlashKernel

KERNELS = ("auto", "reference", "torch_cpu_flash", "torch_cuda_flash", "flash_attn")


def select_kernel(device: torch.device, name: str = "auto") -> BlockKernel:
    """The block kernel for ``device``: ``auto`` takes the fastest one available."""
    if name not in KERNELS:
        raise ValueError(f"kernel={name!r} is not one of {KERNELS}")
    if name == "reference":
        return ReferenceKernel()
    if device.type == "cpu":
        if name not in ("auto", "torch_cpu_flash"):
            raise ValueError(f"kernel={name!r} needs a CUDA device; inputs are on CPU")
        return TorchCPUFlashKernel()
    from . import cuda  # noqa: PLC0415 - GPU-only adapters

    if name == "torch_cuda_flash":
        return cuda.TorchCUDAFlashKernel()
    if name in ("auto", "flash_attn"):
        try:
            return cuda.FlashAttnKernel()
        except ImportError:
            if name == "flash_attn":
                raise
    return cuda.TorchCUDAFlashKernel()


__all__ = ["BlockKernel", "ReferenceKernel", "TorchCPUFlashKernel", "select_kernel", "KERNELS"]
