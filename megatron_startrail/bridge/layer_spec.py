"""``startrail_layer_spec``: the value of Megatron-Bridge's ``GPTModelProvider.transformer_layer_spec``
that turns StarTrail on.

Bridge accepts a ``ModuleSpec`` there, or a function of the provider (and, if the function
takes it, ``vp_stage``) that ``GPTModelProvider.provide`` calls after Bridge's
``initialize_megatron`` made the process groups: once per model chunk (virtual pipeline
stage), and once more per chunk for the multi-token-prediction block
(``gpt_provider.mtp_block_spec``). A :class:`StarTrailLayerSpec` is such a function. Each
call:

1. refuses what does not compose (``checks.py``: the local attention backend, which would
   overwrite the core attention, ``cp_comm_type`` other than p2p, hybrid CP, decentralized
   process groups, and the attention options Megatron's flags are refused for);
2. resolves the spec Bridge would have built (``base``: Bridge's ``default_layer_spec``
   unless given; a ``ModuleSpec`` or a function of the provider, as Bridge takes them);
3. builds the StarTrail groups on the first call, collectively (every rank resolves the spec
   in the same order, as Bridge builds models), inside Megatron's CP groups; later calls
   reuse them (``megatron/built_groups.py``);
4. returns that spec with StarTrail core attention (``to_startrail_spec``: layer or block
   specs, MLA, the MTP layers' attention), whose self-attention takes packed batches in the
   per-document layout Bridge cuts them in (``packed_layout.py``).

Bridge's two rank orders (``dist.use_tp_pp_dp_mapping`` False or True: ``tp-cp-ep-dp-pp``,
``tp-cp-ep-pp-dp``) put CP right after TP, so both give the same CP groups, which are all
StarTrail's groups depend on: the groups are built in Megatron's default order either way
(``initialize_startrail`` checks this rank's CP group is one of them).
"""

from __future__ import annotations

import dataclasses
import datetime
import inspect

import torch.distributed as dist

from ..config import StarTrailConfig
from ..megatron.built_groups import startrail_groups_once
from ..megatron.from_args import describe_groups, nccl_comm_cfgs_from_path
from ..megatron.layer_specs import to_startrail_spec
from ..megatron.mtp import install_startrail_mtp
from ..megatron.parallel_state import DEFAULT_ORDER
from .checks import StarTrailBridgeError, check_provider
from .packed_layout import BRIDGE_ATTENTION


@dataclasses.dataclass(frozen=True)
class StarTrailLayerSpec:
    """A function of Bridge's model provider giving the StarTrail layer spec (see the module
    docstring). Make it with :func:`startrail_layer_spec`."""

    config: StarTrailConfig
    base: object = None  # ModuleSpec, or a function of the provider [, vp_stage]; None: Bridge's default_layer_spec
    distributed_timeout_minutes: int | None = None  # Bridge's dist.distributed_timeout_minutes
    nccl_communicator_config_path: str | None = None  # Bridge's dist.nccl_communicator_config_path

    def __call__(self, provider, vp_stage: int | None = None):
        check_provider(provider)
        spec = self.base_spec(provider, vp_stage)
        if getattr(provider, "mtp_num_layers", None):
            if hasattr(spec, "layer_specs") and not spec.layer_specs:
                # Bridge then re-derives the MTP layer's spec from Megatron's TE decoder specs,
                # past this function: the MTP attention would not be StarTrail's.
                raise StarTrailBridgeError(
                    "model.mtp_num_layers with a block spec that has no decoder layer on this pipeline stage: Bridge "
                    "then builds the MTP layer from Megatron's own spec, without StarTrail; change "
                    "model.pipeline_model_parallel_layout (or the layers per stage) so the MTP stage holds a decoder "
                    "layer")
            install_startrail_mtp()  # MTP's label roll and loss across CP ranks, as at CP = 1 (mtp.py)
        groups, built_now = startrail_groups_once(self.group_options(provider))
        if built_now and dist.get_rank() == 0:
            print(f"> startrail (Megatron-Bridge): {describe_groups(groups)}", flush=True)
        return to_startrail_spec(spec, groups, BRIDGE_ATTENTION)

    def base_spec(self, provider, vp_stage):
        """The spec Bridge would have built for ``provider`` (its own rule for a function:
        ``vp_stage`` is passed when the function takes it)."""
        base = self.base
        if base is None:
            from megatron.bridge.models.gpt_provider import default_layer_spec  # noqa: PLC0415 - Bridge on use only

            base = default_layer_spec
        if not callable(base) or hasattr(base, "submodules") or hasattr(base, "layer_specs"):
            return base  # a ModuleSpec (or a block spec) as it is
        if "vp_stage" in inspect.signature(base).parameters:
            return base(provider, vp_stage=vp_stage)
        return base(provider)

    def group_options(self, provider) -> dict:
        """``initialize_startrail``'s keywords for this provider."""
        config = dataclasses.replace(self.config, deterministic=bool(getattr(provider, "deterministic_mode", False)))
        minutes = self.distributed_timeout_minutes
        return dict(config=config, order=DEFAULT_ORDER,
                    timeout=datetime.timedelta(minutes=minutes) if minutes is not None else None,
                    nccl_comm_cfgs=nccl_comm_cfgs_from_path(self.nccl_communicator_config_path))


def startrail_layer_spec(*, team_size: int, base=None, distributed_timeout_minutes: int | None = None,
                         nccl_communicator_config_path: str | None = None, **options) -> StarTrailLayerSpec:
    """StarTrail core attention for a Megatron-Bridge GPT model: assign the result to
    ``cfg.model.transformer_layer_spec``.

    ``team_size``: StarTrail's C (``C*C`` must divide CP / ``ulysses_size``; 1 is ring attention).
    ``options``: the other :class:`~megatron_startrail.config.StarTrailConfig` settings, by the
    same names (``ulysses_size``, ``backward_rotation``, ``transfer``, ``regather_in_backward``,
    ``kernel``, ``recompute_attention``, ``reverse_overlap``). ``base``: the spec to wrap (a ``ModuleSpec`` or a
    function of the provider, e.g. Bridge's ``local_layer_spec``; default: Bridge's
    ``default_layer_spec``, the Transformer Engine one). ``distributed_timeout_minutes`` and
    ``nccl_communicator_config_path``: give Bridge's ``dist`` values so that StarTrail's groups
    are made like Bridge's own.
    """
    if "deterministic" in options:
        raise StarTrailBridgeError("deterministic: set model.deterministic_mode instead (StarTrail follows it)")
    if not isinstance(team_size, int) or isinstance(team_size, bool):
        raise StarTrailBridgeError(f"team_size={team_size!r}: give StarTrail's team size as an integer C "
                                   "(C*C dividing CP / ulysses_size; 1 is ring attention); 'auto' is for the "
                                   "--startrail-team-size flag of megatron.training runs only")
    unknown = set(options) - {f.name for f in dataclasses.fields(StarTrailConfig)}
    if unknown:
        raise StarTrailBridgeError(f"startrail_layer_spec got unknown settings {sorted(unknown)}; the settings are "
                                   f"{[f.name for f in dataclasses.fields(StarTrailConfig) if f.name != 'deterministic']}")
    return StarTrailLayerSpec(StarTrailConfig(team_size=team_size, **options), base=base,
                              distributed_timeout_minutes=distributed_timeout_minutes,
                              nccl_communicator_config_path=nccl_communicator_config_path)
