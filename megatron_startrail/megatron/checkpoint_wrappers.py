"""Which recomputation a kept attention (kept_attention.py) runs under: Megatron's own
checkpoint, or a wrapper that is not Megatron's replay -- torch's ``torch.utils.checkpoint``
(either ``use_reentrant``) or any saved-tensor hooks (``torch.autograd.graph.saved_tensors_hooks``:
torch's non-reentrant checkpoint, ``save_on_cpu``, Megatron's fine-grained activation
offloading, a framework's own).

Everything is found by identity, never by shapes or order: the code objects of the functions
whose frames run a checkpointed function, the code of the pack hook on top of autograd's
saved-tensor hooks stack, and the ``torch.autograd.Function`` class of the node being run.
Note [attention kept through recomputation] says why such a wrapper makes keeping wrong.
"""

from __future__ import annotations

import inspect
import sys
import types

import torch
import torch.utils.checkpoint as torch_checkpoint
from megatron.core.tensor_parallel.random import CheckpointFunction

# The code object of Megatron's checkpoint forward: its frame holds the checkpoint's ctx.
_MEGATRON_FORWARD = CheckpointFunction.forward.__code__
# torch's checkpoint (unwrapped: torch wraps it to disable dynamo). Its frame is on the stack
# while it runs the checkpointed function, with either use_reentrant.
_TORCH_CHECKPOINT = inspect.unwrap(torch_checkpoint.checkpoint).__code__
# torch's reentrant checkpoint: its autograd Function (the node its backward recomputes in).
_TORCH_REENTRANT = torch_checkpoint.CheckpointFunction


def _hook_codes(*hook_classes) -> frozenset:
    """The code objects of the hooks the classes' ``__init__`` defines (their pack_hook, ...)."""
    return frozenset(c for cls in hook_classes if cls is not None
                     for c in cls.__init__.__code__.co_consts if isinstance(c, types.CodeType))


# The pack hooks torch's non-reentrant checkpoint pushes: in its forward, in its recomputation.
_TORCH_NON_REENTRANT_HOOKS = _hook_codes(getattr(torch_checkpoint, "_checkpoint_hook", None),
                                         getattr(torch_checkpoint, "_recomputation_hook", None))


def torch_checkpoint_name(use_reentrant) -> str:
    return f"torch.utils.checkpoint.checkpoint(use_reentrant={bool(use_reentrant)})"


def source_code(code: types.CodeType) -> types.CodeType:
    """The code object ``code`` was made from, where ``torch.compile`` made it: dynamo runs a frame it
    compiled as a transformed copy of the function's code, and what follows a graph break in that
    frame as a resume function (``torch_dynamo_resume_in_forward_at_604``: Megatron's checkpoint
    forward breaks where it calls the checkpointed function). Both are looked up in dynamo's own
    tables, by identity; any other code is its own source. Dynamo is never imported here."""
    dynamo_utils = sys.modules.get("torch._dynamo.utils")
    resume = sys.modules.get("torch._dynamo.resume_execution")
    if dynamo_utils is None or resume is None:  # nothing was compiled in this process
        return code
    for _ in range(16):  # a resume function of a resume function leads back in a few steps
        made_from = dynamo_utils.orig_code_map.get(code)
        if made_from is None:
            meta = resume.ContinueExecutionCache.generated_code_metadata.get(code)
            made_from = getattr(meta, "code", None)
        if made_from is None or made_from is code:
            return code
        code = made_from
    return code


def running_checkpoints():
    """``(ctx, wrapper)`` seen from the caller: ``ctx`` the innermost Megatron
    ``CheckpointFunction.forward`` on this thread's stack (None without one); ``wrapper`` the name
    of torch's checkpoint when one runs inside it (or, with no Megatron checkpoint, anywhere on
    the stack), else None. Frames that ``torch.compile`` runs as its own code count as the
    function they were made from (:func:`source_code`)."""
    frame, wrapper = sys._getframe(1), None
    while frame is not None:
        code = source_code(frame.f_code)
        if code is _MEGATRON_FORWARD:
            return frame.f_locals.get("ctx"), wrapper
        if code is _TORCH_CHECKPOINT and wrapper is None:  # use_reentrant is resolved (None -> True) by then
            wrapper = torch_checkpoint_name(frame.f_locals.get("use_reentrant"))
        frame = frame.f_back
    return None, wrapper


def saved_tensors_hooks_name() -> str | None:
    """The name of the saved-tensor hooks on top of autograd's stack, or None where none is set."""
    hooks = torch._C._autograd._top_saved_tensors_default_hooks(True)
    if hooks is None:
        return None
    pack = inspect.unwrap(hooks[0])  # torch's recomputation hook is wrapped to disable dynamo
    if getattr(pack, "__code__", None) in _TORCH_NON_REENTRANT_HOOKS:
        return torch_checkpoint_name(False)
    where = f"{getattr(pack, '__module__', '?')}.{getattr(pack, '__qualname__', type(pack).__name__)}"
    return f"torch.autograd.graph.saved_tensors_hooks (pack hook {where})"


def node_wrapper_name(node) -> str | None:
    """The name of torch's reentrant checkpoint when ``node`` (the autograd node being run) is its
    backward, else None."""
    if getattr(node, "_forward_cls", None) is _TORCH_REENTRANT:
        return torch_checkpoint_name(True)
    return None

