"""Stand-ins for the GPU-only (and heavy) packages that Megatron-Bridge imports but that its
GPT pretraining path on a CPU never calls: for the Bridge tests only.

``import megatron.bridge`` imports every model bridge, its PEFT layers and its training
utilities, and with them Transformer Engine, ModelOpt, nvidia-resiliency-ext, datasets and
diffusers at module level. None of these is installed here (Transformer Engine and the
others need CUDA), and none runs on the path the tests take (local layer spec, mock data,
gloo).

:func:`import_with_standins` imports Bridge's modules while a finder answers those names
with empty stand-in modules, then takes the stand-ins out of ``sys.modules`` again: Bridge's
modules keep the objects they bound at import, but every later ``import transformer_engine``
(megatron-core checks for TE inside functions, at run time) fails as before, so megatron-core
keeps its CPU paths. A stand-in's attributes are placeholder classes: usable as base classes,
decorators and default values at import time; calling one's method does nothing useful, and
a test that reached one would fail loudly rather than compute.

:func:`thd_get_partitioned_indices` stands in for the one Transformer Engine function that the
packed-document path does call (megatron-core's per-document CP cut); the packed test sets it
in its forked ranks only.
"""

from __future__ import annotations

import abc
import contextlib
import importlib
import importlib.abc
import importlib.machinery
import sys
import types

import torch

# Top-level names Bridge imports at module level that are absent on a CPU machine.
STANDIN_PACKAGES = (
    "transformer_engine", "transformer_engine_torch", "modelopt", "nvidia_resiliency_ext",
    "datasets", "diffusers", "megatron.energon",
)
# Installed, but unimportable here: torch's TensorBoard writer needs the tensorboard package
# (Bridge's training state imports SummaryWriter at module level; the tests log no TensorBoard).
REPLACED_MODULES = ("torch.utils.tensorboard",)


def _under(name: str, roots) -> bool:
    return any(name == r or name.startswith(r + ".") for r in roots)


def _placeholder_attribute(owner, attribute: str, module: str):
    """A new placeholder class named ``attribute``, kept on ``owner`` (a stand-in module or a
    placeholder class) so that the same name gives the same class; dunders stay missing."""
    if attribute.startswith("__"):
        raise AttributeError(attribute)
    value = _PlaceholderType(attribute, (_Placeholder,), {"__module__": module})
    setattr(owner, attribute, value)
    return value


class _PlaceholderType(abc.ABCMeta):  # ABCMeta: Bridge mixes placeholders with ABC
    """``te.ops.Sequential``: an attribute of a placeholder is a placeholder too."""

    def __getattr__(cls, attribute: str):
        return _placeholder_attribute(cls, attribute, cls.__module__)


class _Placeholder(metaclass=_PlaceholderType):
    """What every attribute of a stand-in module is (a subclass named after it)."""

    def __init__(self, *args, **kwargs):
        pass

    def __call__(self, *args, **kwargs):
        return args[0] if len(args) == 1 and callable(args[0]) and not kwargs else self


class StandInModule(types.ModuleType):
    def __init__(self, name: str):
        super().__init__(name, "test stand-in (tests/bridge/standins.py): not the real package")
        self.__path__ = []  # a package: its submodules are stand-ins too
        self.__version__ = "0.0.0"

    def __getattr__(self, attribute: str):
        return _placeholder_attribute(self, attribute, self.__name__)


class _StandInFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def __init__(self, roots):
        self.roots = tuple(roots)

    def find_spec(self, fullname, path=None, target=None):
        if _under(fullname, self.roots):
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)
        return None

    def create_module(self, spec):
        return StandInModule(spec.name)

    def exec_module(self, module):
        pass


@contextlib.contextmanager
def standins(roots=STANDIN_PACKAGES):
    """While inside: ``import <root>[.anything]`` gives a stand-in for every root of ``roots``
    not installed, and for :data:`REPLACED_MODULES`; afterwards they are gone from ``sys.modules``."""
    absent = [r for r in roots if importlib.util.find_spec(r) is None]  # a real installed package wins
    absent += [m for m in REPLACED_MODULES if m not in sys.modules]
    finder = _StandInFinder(absent)
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)
        for name in [n for n in sys.modules if _under(n, absent)]:
            del sys.modules[name]


def import_with_standins(*modules: str) -> list[types.ModuleType]:
    """Import ``modules`` (Bridge's) with the stand-ins in place; return them."""
    with standins():
        return [importlib.import_module(m) for m in modules]


def thd_get_partitioned_indices(cu_seqlens: torch.Tensor, total_tokens: int, world_size: int, rank: int):
    """Stand-in for Transformer Engine's ``tex.thd_get_partitioned_indices`` (GPU-only), which
    megatron-core's per-document CP cut calls: the rows CP rank ``rank`` holds of a THD stream
    whose documents (``cu_seqlens``, int ``[n_docs + 1]``, each length a multiple of
    2*``world_size``) are each cut into 2*``world_size`` chunks, the rank taking chunks
    ``rank`` and ``2*world_size-1-rank`` of every document, in document order. Returns int64
    ``[total_tokens / world_size]`` (a stream that ends in padding past ``cu_seqlens[-1]`` is
    not needed here and refused)."""
    bounds = [int(b) for b in cu_seqlens.reshape(-1)]
    if bounds[-1] != total_tokens:
        raise ValueError("stand-in: the documents must fill the stream")
    rows = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        chunk = (end - start) // (2 * world_size)
        if chunk * 2 * world_size != end - start:
            raise ValueError("stand-in: every document length must be a multiple of 2 * CP")
        for piece in (rank, 2 * world_size - 1 - rank):
            rows.append(torch.arange(start + piece * chunk, start + (piece + 1) * chunk))
    return torch.cat(rows)


def mtp_block_spec(config, vp_stage=None):
    """Stand-in for Bridge's ``gpt_provider.mtp_block_spec``, which always builds the MTP layers'
    own modules (norms, ``eh_proj``) with Transformer Engine (``use_transformer_engine=True``):
    the same block spec from the same decoder layer spec, with megatron-core's local modules.
    The MTP layer's transformer layer is the provider's ``transformer_layer_spec``, as in Bridge."""
    import inspect  # noqa: PLC0415

    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_mtp_block_spec  # noqa: PLC0415

    if not getattr(config, "mtp_num_layers", None):
        return None
    spec = config.transformer_layer_spec
    if callable(spec) and not hasattr(spec, "submodules") and not hasattr(spec, "layer_specs"):  # a function
        takes_stage = "vp_stage" in inspect.signature(spec).parameters
        spec = spec(config, vp_stage=vp_stage) if takes_stage else spec(config)
    return get_gpt_mtp_block_spec(config, spec, use_transformer_engine=False, vp_stage=vp_stage)
