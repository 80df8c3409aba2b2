"""Megatron recomputation settings that cannot run, refused by name before the model is built.

``--recompute-granularity selective --recompute-modules mlp`` with the linear layers' biases on
(Megatron's default; ``--disable-bias-linear`` turns them off): megatron-core's
``TransformerLayer`` wraps the dense MLP in ``tensor_parallel.checkpoint``, and the MLP returns
``(output, bias)`` with ``bias`` the ``linear_fc2.bias`` parameter itself (its fc2 is built with
``skip_bias_add``, the bias added later in the fused bias-dropout-add). A ``torch.autograd.Function``
that returns a tensor it did not make from its inputs rewrites that tensor's history: the
parameter stops being a leaf, its ``grad_fn`` becomes the checkpoint's backward node. In the
backward, ``CheckpointFunction.backward`` recomputes the MLP, gets the same parameter back as an
output and back-propagates through it, which runs ``CheckpointFunction.backward`` again: the
recursion never ends (memory runs out, or on the CPU the run hangs). At CP = 1 as at any CP, on
megatron-core 0.19.2 (checked); the upstream report is in docs/composition.md.

Only a dense MLP is checkpointed that way: ``TransformerLayer`` sets ``recompute_mlp`` only
``if not self.is_moe_layer`` (an MoE layer's experts are recomputed by ``--recompute-modules moe``
instead). So the refusal holds where the model has a dense MLP layer: no ``--num-experts``, an
``--moe-layer-freq`` (every N-th layer MoE, or a list) that leaves a dense layer, or a
``--hybrid-layer-pattern`` with an MLP layer (``-``). Multi-token prediction layers take the last
decoder layer's spec, so they are dense only where that layer is.

``--recompute-granularity full --recompute-method uniform`` with ``--mtp-num-layers`` and
``--recompute-num-layers`` other than 1: megatron-core 0.19.2's ``MultiTokenPredictionLayer``
checkpoints itself under full recomputation and asserts ``recompute_num_layers == 1`` for the
uniform method, in its forward, so the run stops at its first training step on every rank,
StarTrail or not. It is refused here with Megatron's reason before the model is built.
"""

from __future__ import annotations


def check_recompute_modules(args) -> None:
    """Raise ValueError naming ``--recompute-modules mlp`` when Megatron's MLP recomputation
    would recurse without end (the MLP's bias parameter returned from its checkpoint)."""
    modules = getattr(args, "recompute_modules", None) or []
    if (getattr(args, "recompute_granularity", None) == "selective" and "mlp" in modules
            and getattr(args, "add_bias_linear", False) and has_dense_mlp_layer(args)):
        raise ValueError(
            "--recompute-modules mlp with the linear layers' biases on: megatron-core's checkpoint of a dense "
            "layer's MLP returns the linear_fc2 bias parameter itself and its backward recurses without end "
            "(at CP = 1 too; docs/composition.md, 'Recomputation'): add --disable-bias-linear or drop mlp "
            "from --recompute-modules (MoE layers are not checkpointed this way: --recompute-modules moe)")


def check_mtp_recompute(args) -> None:
    """Raise ValueError naming ``--recompute-num-layers`` where megatron-core's MTP layer would
    assert in its first forward (full, uniform recomputation of more than one layer)."""
    if (getattr(args, "mtp_num_layers", None) and getattr(args, "recompute_granularity", None) == "full"
            and getattr(args, "recompute_method", None) == "uniform" and getattr(args, "recompute_num_layers", 1) != 1):
        raise ValueError(
            f"--recompute-num-layers {args.recompute_num_layers} with --recompute-method uniform and --mtp-num-layers: "
            "megatron-core's MultiTokenPredictionLayer asserts 'recompute_num_layers must be 1 for MTP recompute' "
            "in its forward (at CP = 1 too): use --recompute-num-layers 1, or --recompute-method block (which "
            "megatron-core does not apply to the MTP layers)")


def has_dense_mlp_layer(args) -> bool:
    """Whether the model has a layer with a dense MLP, the only MLP ``--recompute-modules mlp``
    checkpoints (megatron-core's ``TransformerLayer``: ``if not self.is_moe_layer``)."""
    pattern = getattr(args, "hybrid_layer_pattern", None)
    if pattern is not None:  # hybrid models: "-" is an MLP layer, "E" an MoE one (MTP part included)
        return "-" in pattern
    if not getattr(args, "num_experts", None):
        return True
    freq = getattr(args, "moe_layer_freq", 1)
    # megatron-core's get_gpt_decoder_block_spec: layer i is MoE iff i % N == 0, or the list's 1s
    moe_pattern = [1 if i % freq == 0 else 0 for i in range(args.num_layers)] if isinstance(freq, int) else freq
    return 0 in moe_pattern
