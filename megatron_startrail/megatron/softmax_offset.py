"""Attention sinks in Megatron: the ``softmax_offset`` of ``--softmax-type``, made as
Megatron's own ``DotProductAttention`` makes it (megatron-core 0.19.2), so that a checkpoint
moves between a StarTrail run and a CP = 1 run with Megatron's core attention:

- ``off-by-one``: a zeros tensor ``[heads of the TP partition]``, not a parameter (nothing
  to learn, nothing in the checkpoint);
- ``learnable``: the parameter ``softmax_offset [heads of the TP partition]``, in
  ``params_dtype``, initialised by ``config.init_method`` at the same point of the layer's
  construction (so the random stream stays the same), and sharded along its one dim by
  tensor parallelism in the distributed checkpoint.

The attention applies it: :mod:`megatron_startrail.sinks`.
"""

from __future__ import annotations

import inspect

import torch
from megatron.core import parallel_state
from megatron.core.transformer.utils import make_sharded_tensors_for_checkpoint

SOFTMAX_TYPES = ("vanilla", "off-by-one", "learnable")


def tp_group_of(pg_collection):
    """The tensor-parallel group the layer's heads are split over."""
    tp = getattr(pg_collection, "tp", None) if pg_collection is not None else None
    return tp if tp is not None else parallel_state.get_tensor_model_parallel_group()


def make_softmax_offset(module: torch.nn.Module, config, heads_per_partition: int) -> None:
    """Set ``module.softmax_offset``: None (vanilla), zeros (off-by-one) or a parameter (learnable)."""
    softmax_type = getattr(config, "softmax_type", "vanilla") or "vanilla"
    if softmax_type not in SOFTMAX_TYPES:
        raise ValueError(f"--softmax-type {softmax_type!r} is not one of {SOFTMAX_TYPES}")
    device = torch.cuda.current_device() if torch.cuda.is_available() else torch.device("cpu")
    if softmax_type == "vanilla":
        module.softmax_offset = None
    elif softmax_type == "off-by-one":
        module.softmax_offset = torch.zeros(heads_per_partition, device=device, dtype=config.params_dtype)
    else:
        module.register_parameter("softmax_offset", torch.nn.Parameter(
            torch.empty(heads_per_partition, device=device, dtype=config.params_dtype)))
        if config.perform_initialization:
            module.softmax_offset = config.init_method(module.softmax_offset)


def softmax_offset_sharded_state_dict(module: torch.nn.Module, tp_group, prefix: str, sharded_offsets, metadata):
    """Megatron's sharded state dict of the layer's learnable sinks (TP-sharded on dim 0);
    empty otherwise."""
    learnable = isinstance(getattr(module, "softmax_offset", None), torch.nn.Parameter)
    state_dict = module.state_dict(prefix="", keep_vars=True) if learnable else {}
    kwargs = {}
    accepted = inspect.signature(make_sharded_tensors_for_checkpoint).parameters
    if "tp_group" in accepted:  # megatron-core >= 0.17 takes the groups explicitly
        kwargs["tp_group"] = tp_group
    if "dp_cp_group" in accepted:
        kwargs["dp_cp_group"] = (metadata or {}).get("dp_cp_group")
    return make_sharded_tensors_for_checkpoint(state_dict, prefix, {"softmax_offset": 0}, sharded_offsets, **kwargs)
