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
"""

from __future__ import annotations


def check_recompute_modules(args) -> None:
    """Raise ValueError naming ``--recompute-modules mlp`` when Megatron's MLP recomputation
    would recurse without end (the MLP's bias parameter returned from its checkpoint)."""
    modules = getattr(args, "recompute_modules", None) or []
    if (getattr(args, "recompute_granularity", None) == "selective" and "mlp" in modules
            and getattr(args, "add_bias_linear", False)):
        raise ValueError(
            "--recompute-modules mlp with the linear layers' biases on: megatron-core's checkpoint of the "
            "MLP returns the linear_fc2 bias parameter itself and its backward recurses without end "
            "(at CP = 1 too; docs/composition.md, 'Recomputation'): add --disable-bias-linear or drop mlp "
            "from --recompute-modules")
