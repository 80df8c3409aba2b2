"""Parsed Megatron flags -> the StarTrail layer spec: the one place every StarTrail flag that
changes the model is read.

Both programs that train with StarTrail call :func:`startrail_spec_from_args`:
``examples/pretrain_gpt.py`` (its ``model_provider``; for a ``HybridModel``,
``--hybrid-layer-pattern``, :func:`startrail_hybrid_spec_from_args`) and Megatron-LM's own
``pretrain_gpt.py`` with ``patches/`` applied (its ``GPTModelConfig.transformer_layer_spec``).
So a flag added to ``arguments.py`` reaches the core attention of both once it is read
here, and neither caller can forget one (the patch once silently dropped
``--startrail-regather-in-backward`` because it listed the flags itself).

Flags read (:func:`config_from_args`): ``--startrail-team-size``, ``--ulysses-degree-in-cp``,
``--startrail-backward-rotation``, ``--startrail-transfer``, ``--startrail-regather-in-backward``,
``--startrail-no-reverse-overlap`` and ``--startrail-kernel`` become one
:class:`~megatron_startrail.config.StarTrailConfig`, which the StarTrail groups carry to the
core attention; Megatron's rank order
(``--use-tp-pp-dp-mapping``), ``--distributed-timeout-minutes`` and
``--nccl-communicator-config-path`` shape the groups as they shape Megatron's own.

Call after ``validate_startrail_args`` (it resolves ``auto`` team sizes, ``tasp`` and the
memory limit into these flags) and after ``initialize_model_parallel``.
"""

from __future__ import annotations

import datetime

import torch.distributed as dist

from ..config import StarTrailConfig
from ..groups import StarTrailGroups
from .built_groups import startrail_groups_once
from .dynamic_cp import DynamicCPGroups
from .hybrid_specs import check_startrail_hybrid_pattern, to_startrail_hybrid_spec
from .layer_specs import to_startrail_spec
from .mtp import install_startrail_mtp


def megatron_rank_order(args) -> str:
    """The rank order Megatron's ``initialize_model_parallel`` was given for these flags
    (``megatron.training.initialize``'s rule)."""
    return "tp-cp-ep-pp-dp" if getattr(args, "use_tp_pp_dp_mapping", False) else "tp-cp-ep-dp-pp"


def nccl_comm_cfgs_from_path(path: str | None) -> dict:
    """``--nccl-communicator-config-path``'s YAML (Bridge: ``dist.nccl_communicator_config_path``), as
    Megatron reads it for its own groups."""
    if not path:
        return {}
    import yaml  # noqa: PLC0415 - only with the flag, as in Megatron

    with open(path) as f:
        return yaml.safe_load(f) or {}


def startrail_groups_from_args(args) -> StarTrailGroups | DynamicCPGroups:
    """The StarTrail groups for the parsed flags: built on the first call (collective: every
    rank calls it in the same order, as Megatron builds models), reused after that. With
    ``--hybrid-context-parallel``: those of every CP size (:mod:`.dynamic_cp`)."""
    options = dict(
        config=config_from_args(args), order=megatron_rank_order(args),
        timeout=datetime.timedelta(minutes=args.distributed_timeout_minutes),
        nccl_comm_cfgs=nccl_comm_cfgs_from_path(getattr(args, "nccl_communicator_config_path", None)),
    )
    dynamic = getattr(args, "hybrid_context_parallel", False)  # a set of groups per CP size (dynamic_cp.py)
    if dynamic:
        options["team_sizes"] = getattr(args, "startrail_dynamic_team_sizes", None)
    if getattr(args, "mtp_num_layers", None):  # MTP trains as at CP = 1 (mtp.py)
        install_startrail_mtp()
    groups, built_now = startrail_groups_once(options, dynamic=dynamic)
    if built_now and dist.get_rank() == 0:
        by = getattr(args, "startrail_dynamic_team_sizes_by", None) if dynamic else None
        print(f"> {args.context_parallel_algo}: {describe_groups(groups, f', team sizes by {by}' if by else '')}",
              flush=True)
    return groups


def describe_groups(groups, how_built: str = "") -> str:
    """One log line's worth: the groups (then ``how_built``, e.g. how team sizes were chosen)
    and every setting they carry."""
    config = groups.config
    return (f"{groups.describe()}{how_built}, transfer {config.transfer}, "
            f"regather in backward {'on' if config.regather_in_backward else 'off'}, backward rotation "
            f"{config.backward_rotation}{'' if config.reverse_overlap else ' (reverse sends not overlapped)'}, "
            f"kernel {config.kernel}, attention "
            f"{'recomputed' if config.recompute_attention else 'kept'} under recomputation")


def config_from_args(args) -> StarTrailConfig:
    """Every StarTrail flag of ``args`` (after ``validate_startrail_args``) as one object."""
    return StarTrailConfig(
        team_size=args.startrail_team_size, ulysses_size=args.ulysses_degree_in_cp,
        backward_rotation=args.startrail_backward_rotation, transfer=args.startrail_transfer,
        regather_in_backward=bool(args.startrail_regather_in_backward), kernel=args.startrail_kernel,
        deterministic=bool(getattr(args, "deterministic_mode", False)),
        recompute_attention=bool(args.startrail_recompute_attention),
        reverse_overlap=bool(args.startrail_reverse_overlap),
    )


def startrail_spec_from_args(spec, args):
    """A copy of Megatron's layer or block ``spec`` with StarTrail core attention configured
    by every StarTrail flag in ``args`` (see the module docstring for the list)."""
    return to_startrail_spec(spec, startrail_groups_from_args(args))


def startrail_hybrid_spec_from_args(stack_spec, args):
    """The same for a ``HybridModel``'s stack spec (``--hybrid-layer-pattern``): a copy whose
    attention layers have StarTrail core attention (``hybrid_specs``), after refusing what the
    pattern asks that StarTrail cannot do (an error naming the flag, on every rank)."""
    check_startrail_hybrid_pattern(
        args.hybrid_layer_pattern,
        packed_sample_layout=args.dataloader_inter_document_masking and not getattr(args, "sft", False),
    )
    return to_startrail_hybrid_spec(stack_spec, startrail_groups_from_args(args))
