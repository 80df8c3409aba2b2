"""What a Megatron-Bridge run asks that StarTrail cannot do: refused by the setting's name.

Checked on every rank when the layer spec is resolved (``GPTModelProvider.provide``, after
Bridge made its process groups and before any StarTrail group exists), so a refused run
stops before it communicates. Settings are named as a Bridge user writes them
(``model.<field>`` of the ``ConfigContainer``, ``dist.<field>``).
"""

from __future__ import annotations

from megatron.core import parallel_state
from megatron.core.transformer.enums import AttnBackend

from ..megatron.attention_options import unsupported_attention_options


class StarTrailBridgeError(ValueError):
    """A Bridge setting that does not compose with StarTrail (the message names it)."""


def check_provider(provider) -> None:
    """Raise :class:`StarTrailBridgeError` naming every setting of ``provider`` (a
    ``GPTModelProvider``) that StarTrail cannot run; return quietly otherwise."""
    problems = []
    if getattr(provider, "attention_backend", None) == AttnBackend.local:
        # GPTModelProvider.provide overwrites the layer spec's core attention with Megatron's
        # DotProductAttention when this is set: StarTrail would vanish without a word.
        problems.append("model.attention_backend=AttnBackend.local: Bridge then replaces the spec's core attention "
                        "with Megatron's DotProductAttention, so StarTrail would silently not run; leave "
                        "model.attention_backend at its default (AttnBackend.auto): StarTrail is the core attention")
    for option, value in unsupported_attention_options(provider):  # the table Megatron's flags are checked with
        problems.append(f"model.{option.attribute}={value!r} ({option.flag}): {option.why}; "
                        f"set model.{option.attribute} to {_unset(option.attribute)}")
    if getattr(provider, "hybrid_context_parallel", False):
        problems.append("model.hybrid_context_parallel=True: Bridge 0.6.2's data path (gpt_step.get_batch) partitions "
                        "every batch over the fixed CP group and has no sub-sample scheduler, so no sub-sample reaches "
                        "the attention with its own CP size; set model.hybrid_context_parallel=False (hybrid CP with "
                        "StarTrail runs through megatron.training: docs/composition.md)")
    if problems:
        raise StarTrailBridgeError("startrail_layer_spec cannot run this Bridge configuration:\n  "
                                   + "\n  ".join(problems))
    check_process_groups(provider)


def check_process_groups(provider) -> None:
    """StarTrail builds its groups inside Megatron's global parallel state; with
    ``dist.use_decentralized_pg=True`` Bridge makes its groups from a ``HyperCommGrid``
    instead (NCCL only) and the model's CP group is not parallel_state's."""
    decentralized = StarTrailBridgeError(
        "startrail_layer_spec needs Megatron's global parallel state (parallel_state.initialize_model_parallel), "
        "which Bridge does not build with dist.use_decentralized_pg=True: set dist.use_decentralized_pg=False")
    if not parallel_state.model_parallel_is_initialized():
        raise decentralized
    pg_collection = getattr(provider, "_pg_collection", None)
    cp = getattr(pg_collection, "cp", None)
    if cp is not None and cp is not parallel_state.get_context_parallel_group():
        raise decentralized


def _unset(attribute: str) -> str:
    """The value that asks for nothing StarTrail lacks."""
    return {"attention_dropout": "0.0", "cp_comm_type": "'p2p' (or None)", "cuda_graph_impl": "'none'",
            "experimental_attention_variant": "None"}.get(attribute, "False")
