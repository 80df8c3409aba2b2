"""Test-harness hooks around examples/pretrain_gpt.py (tests/megatron/example.py), installed in a
forked rank before it runs the example: the model fuzzer's (benchmarks/accuracy/model_fuzz.py)
wrappers and its max-logit record. None is a flag of the example; each patches this process only.

- ``wrap_layers_in_torch_checkpoint(mode)``: every ``TransformerLayer.forward`` inside
  ``torch.utils.checkpoint.checkpoint`` (``nonreentrant`` / ``reentrant``), what a framework's
  activation checkpointing does around Megatron's layers (checkpoint_wrappers.py).
- ``saved_tensor_hooks_around_step(kind)``: every training step inside saved-tensor hooks,
  ``save_on_cpu`` (torch.autograd.graph.save_on_cpu) or ``pack_clone`` (a pack hook that copies).
- ``startrail_attention_at_cp1()``: the CP = 1 run's decoder layers get StarTrail's core
  attention (one-rank StarTrail groups), the reference of ``--qk-clip`` /
  ``--log-max-attention-logit``: Megatron's local attention reports no max logits.
- ``record_max_logits()``: the max attention logit ``train_step`` returns each step (what
  Megatron logs as ``max_attention_logit``), by iteration.
"""

from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import checkpoint as torch_checkpoint

WRAPS = ("none", "nonreentrant", "reentrant")
SAVED_TENSOR_HOOKS = ("none", "save_on_cpu", "pack_clone")


def wrap_layers_in_torch_checkpoint(mode: str) -> None:
    from megatron.core.transformer.transformer_layer import TransformerLayer  # noqa: PLC0415

    if mode == "none":
        return
    forward = TransformerLayer.forward

    def checkpointed(self, *args, **kwargs):
        if mode == "nonreentrant":
            return torch_checkpoint(forward, self, *args, use_reentrant=False, **kwargs)
        # The reentrant checkpoint takes no keyword arguments and passes gradients only to its
        # tensor arguments: hidden_states [s, b, h] goes positionally, the rest bound.
        if "hidden_states" in kwargs:
            hidden, rest = kwargs.pop("hidden_states"), args
        else:
            hidden, rest = args[0], args[1:]
        return torch_checkpoint(lambda h: forward(self, h, *rest, **kwargs), hidden, use_reentrant=True)

    TransformerLayer.forward = checkpointed


def _train_step_around(wrapper) -> None:
    """megatron.training's train_step, as ``wrapper(train_step, *args, **kwargs)``."""
    from megatron.training import training  # noqa: PLC0415

    train_step = training.train_step
    training.train_step = functools.wraps(train_step)(lambda *a, **k: wrapper(train_step, *a, **k))


def saved_tensor_hooks_around_step(kind: str) -> None:
    if kind == "none":
        return

    def hooked(train_step, *args, **kwargs):
        if kind == "save_on_cpu":
            context = torch.autograd.graph.save_on_cpu()
        else:  # a pair of hooks of one's own: the saved tensor copied at pack, returned at unpack
            context = torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t)
        with context:
            return train_step(*args, **kwargs)

    _train_step_around(hooked)


def startrail_attention_at_cp1() -> None:
    """The example at CP = 1 with StarTrail's core attention in its decoder and MTP layers: the
    model's ``GPTModel`` is built from the StarTrail copies of its layer and MTP block specs,
    Megatron's validation of ``--qk-clip`` / ``--log-max-attention-logit`` is the one for
    StarTrail attention, and the example's checks are those of a StarTrail run (packed documents
    in the sample layout, ``--dataloader-inter-document-masking``, without Multi-Latent
    Attention: Megatron's local attention has no THD, StarTrail's has)."""
    from megatron.training import get_args  # noqa: PLC0415

    from megatron_startrail.megatron.arguments import validate_megatron_args  # noqa: PLC0415
    from megatron_startrail.megatron.from_args import megatron_rank_order  # noqa: PLC0415
    from megatron_startrail.megatron.layer_specs import to_startrail_spec  # noqa: PLC0415
    from megatron_startrail.megatron.parallel_state import initialize_startrail  # noqa: PLC0415
    from tests.megatron.example import pretrain_gpt  # noqa: PLC0415

    gpt_model, groups = pretrain_gpt.GPTModel, []

    def with_startrail_attention(*args, transformer_layer_spec, **kwargs):
        if not groups:
            groups.append(initialize_startrail(1, order=megatron_rank_order(get_args())))
        if kwargs.get("mtp_block_spec") is not None:
            kwargs["mtp_block_spec"] = to_startrail_spec(kwargs["mtp_block_spec"], groups[0])
        return gpt_model(*args, transformer_layer_spec=to_startrail_spec(transformer_layer_spec, groups[0]), **kwargs)

    validate_example_args = pretrain_gpt.validate_example_args

    def validate_as_startrail(args):
        algo, args.context_parallel_algo = args.context_parallel_algo, "startrail"
        try:
            validate_example_args(args)
        finally:
            args.context_parallel_algo = algo

    pretrain_gpt.GPTModel = with_startrail_attention
    pretrain_gpt.validate_example_args = validate_as_startrail
    pretrain_gpt.validate_megatron_args = functools.partial(validate_megatron_args, startrail_attention=True)


def record_max_logits() -> dict[int, float]:
    """{iteration: the max attention logit train_step returned}, filled as the run goes."""
    from megatron.training import get_args  # noqa: PLC0415

    logits: dict[int, float] = {}

    def recording(train_step, *args, **kwargs):
        out = train_step(*args, **kwargs)
        logits[get_args().curr_iteration + 1] = float(out[-1])  # (Megatron numbers the step after it)
        return out

    _train_step_around(recording)
    return logits
