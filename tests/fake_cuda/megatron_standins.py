"""Stand-ins for what Megatron asks of a GPU build that fake CUDA on a CPU build cannot answer
(child side). Each says why; none changes what a rank computes, holds or communicates, and none
touches StarTrail: its code runs as on a GPU. Used by :mod:`tests.fake_cuda.megatron_step`.
"""

from __future__ import annotations

import contextlib

from megatron_startrail.megatron import cpu_patches

cpu_patches.install_import_shims()

import torch  # noqa: E402
from megatron.core.distributed import param_and_grad_buffer  # noqa: E402
from megatron.core.optimizer import clip_grads  # noqa: E402

_installed = []


def megatron_on_fake_cuda() -> None:
    """What Megatron asks ``torch.cuda`` that a CPU build cannot answer (the RNG tracker's CUDA
    generator, streams, events, ``current_device``): ``cpu_patches.apply``'s stand-ins, without
    its ``CudaToCpuMode`` (which sends every CUDA tensor to the CPU): here the tensors are meant
    to be (fake) CUDA ones."""
    if _installed:
        return
    cpu_patches.apply(cuda_tensors_to_cpu=False)
    megatron_on_fake_group()


def megatron_on_fake_group() -> None:
    """What Megatron needs of torch's fake process group, on fake CUDA or a real device (the
    GPU session's GPT step, ``benchmarks/gpu/session_gpt.py``): objects gathered as this rank's,
    bucket collectives one by one, the grad norm on the device."""
    if _installed:
        return
    _installed.append(True)
    # Host objects go through the process group as pickled byte tensors, which the fake group
    # leaves unfilled (and FakeTensors hold no bytes to unpickle). Every rank of this world
    # builds the same model, so each rank's object is this one's (Megatron's optimizer checks
    # that the ranks' parameter groups agree).
    torch.distributed.all_gather_object = lambda out, obj, group=None: out.__setitem__(slice(None), [obj] * len(out))
    # torch's _coalescing_manager issues the bucket collectives as one coalesced op
    # (c10d.reduce_scatter_tensor_coalesced_), which FakeTensorMode has no rule for: here each
    # is issued as it comes (same buffers and bytes; NCCL would group them into one launch).
    param_and_grad_buffer._coalescing_manager = one_by_one
    # Without apex or Transformer Engine, Megatron's grad norm falls back to a version that
    # reads every tensor's norm on the host (torch.tensor of a list of CUDA scalars). A GPU run
    # has TE's or apex's multi_tensor_l2norm, one kernel and no host read: this does the same.
    clip_grads.l2_norm_impl = device_l2_norm


def device_l2_norm(chunk_size, noop_flag, tensor_lists, per_tensor, *args):
    """``amp_C.multi_tensor_l2norm``'s answer, ``([norm], None)``, computed on the device."""
    norms = torch.stack([torch.linalg.vector_norm(t, dtype=torch.float32) for t in tensor_lists[0]])
    return torch.linalg.vector_norm(norms).reshape(1), None


class _Issued:
    def wait(self):
        pass


@contextlib.contextmanager
def one_by_one(group=None, device=None, async_ops=False):
    yield _Issued()


def to_device_bf16(module: torch.nn.Module) -> list[str]:
    """What megatron.training's get_model does with ``model.cuda()`` and Float16Module's
    ``module.bfloat16()``: every parameter on ``cuda:0`` in bf16 (the local spec's torch norms
    are made on the CPU: WrappedTorchNorm gives torch's norm no device). By hand, because nn.Module._apply swaps the parameters of a
    tensor subclass (FakeTensor) instead of assigning ``.data``, and the swap fails here; so
    Float16Module's own cast is then a no-op. Returns the names of the parameters moved."""
    moved = []
    for owner_name, owner in module.named_modules():
        for name, p in list(owner.named_parameters(recurse=False)):
            if p.device.type == "cuda" and p.dtype == torch.bfloat16:
                continue
            new = torch.nn.Parameter(p.detach().to("cuda", torch.bfloat16), requires_grad=p.requires_grad)
            # Megatron's attributes (sequence_parallel, ...); not the FakeTensor's own (its device)
            new.__dict__.update({k: v for k, v in p.__dict__.items() if k not in new.__dict__})
            setattr(owner, name, new)
            moved.append(f"{owner_name}.{name}")
    module.bfloat16 = lambda: module
    return moved
