"""What each GPU block-kernel backend needs of the installed build, checked once per process.

A backend that imports is not yet a backend that works here: flash-attn and PyTorch changed
what their attention functions return across releases, and the adapters (``flash_attn.py``,
``torch_cuda.py``) rely on a few of those behaviours. Each backend states them in
:data:`NEEDS`; :func:`build_problem` says what an installed build lacks, and
:func:`usable_builds` drops such a backend with one log line naming the package, its
version and what is missing, so that ``auto`` falls back to the next kernel instead of a
run that crashes (or merges a mis-laid lse) at its first attention call::

    backend          package (version read from)                  minimum  relies on
    flash_attn       flash-attn (flash_attn.__version__)          2.6      varlen, window, lse returned, lse [h, total]
    flash_attn_3     flash_attn_3 (package metadata)              3.0 (*)  varlen, window, lse returned, lse [h, total]
    torch_flash      torch (torch.__version__)                    2.6      varlen, window, lse [h, total] (meta kernel)
    torch_efficient  torch                                        2.6      lse returned
    torch_cudnn      torch (+ cuDNN >= 9, probed by the caller)   2.6      lse returned

    (*) any build: one version string for all of them; their behaviour is checked (below).

Facts from flash-attn's history that the checks encode:

- the variable-length lse is ``[heads, total_q]`` from flash-attn 2.6.0 on (PR #970);
  before, ``[batch, heads, max_seqlen_q]``, which ``unfold_lse`` would read wrongly;
- flash-attn 3 keeps one version string across its builds (3.0.0b1, then 3.0.0), so the
  version cannot tell its builds apart: builds of 2025-07-11 .. 2025-08-28 return ``out``
  only, builds from 2025-08-29 return ``(out, lse)`` when asked (``return_attn_probs``), and
  older builds always return it. A build with the parameter is good; one without it gets one
  tiny trial call (once per process), whose answer decides.
"""

from __future__ import annotations

import functools
import importlib
import importlib.metadata
import logging
import re
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BuildNeeds:
    package: str  # what the log line names
    minimum: tuple[int, ...]  # the oldest version whose behaviour the adapter relies on
    below_minimum: str  # what an older version lacks
    features: tuple[str, ...]  # what the adapter relies on (the checks name the one missing)
    version_decides: bool = False  # the version is the only sign of a feature: an unknown one is refused


_LSE_LAYOUT = "lse layout [heads, total_q]"
NEEDS = {
    "flash_attn": BuildNeeds("flash-attn", (2, 6), _LSE_LAYOUT, ("varlen", "sliding window", "lse returned",
                                                                  "lse layout"), version_decides=True),
    # Any version: flash-attn 3's builds share one version string; their behaviour is checked.
    "flash_attn_3": BuildNeeds("flash_attn_3", (3, 0), "the flash-attn 3 API",
                               ("varlen", "sliding window", "lse returned", "lse layout")),
    # torch >= 2.6 is the package's own minimum (c10d's group-relative ranks).
    "torch_flash": BuildNeeds("torch", (2, 6), "the op schemas the adapter calls",
                              ("varlen", "sliding window", "lse layout")),
    "torch_efficient": BuildNeeds("torch", (2, 6), "the op schemas the adapter calls", ("lse returned",)),
    "torch_cudnn": BuildNeeds("torch", (2, 6), "the op schemas the adapter calls", ("lse returned",)),
}


def version_tuple(text: str | None) -> tuple[int, ...] | None:
    """The leading numbers of a version string ("2.6.3.post1" -> (2, 6, 3)); None if it has none."""
    match = re.match(r"\d+(?:\.\d+)*", text or "")
    return tuple(int(x) for x in match.group().split(".")) if match else None


def _module(name: str):
    try:
        return importlib.import_module(name)
    except Exception:  # noqa: BLE001 - a broken install (ABI mismatch: OSError, RuntimeError) is "not usable"
        return None


def installed_version(backend: str) -> str | None:
    """The installed version of ``backend``'s package, as its package reports it."""
    if backend == "flash_attn":
        return getattr(_module("flash_attn"), "__version__", None)
    if backend == "flash_attn_3":
        # flash_attn_interface has no __version__; the distribution (and, in newer builds,
        # the flash_attn_3 package) carries it.
        for distribution in ("flash_attn_3", "flashattn-hopper"):  # its name from 2025-02-18 on, and before
            try:
                return importlib.metadata.version(distribution)
            except importlib.metadata.PackageNotFoundError:
                pass
        return getattr(_module("flash_attn_3"), "__version__", None)
    return torch.__version__


def _parameter_names(fn) -> frozenset[str]:
    from .flash_attn import _parameters  # noqa: PLC0415 - the adapter's own view of a signature

    return frozenset(name for name, _ in _parameters(fn))


def _flash_attn_2_missing(interface) -> list[str]:
    fn = getattr(interface, "flash_attn_varlen_func", None)
    if fn is None or not hasattr(interface, "_flash_attn_varlen_backward"):
        return ["varlen (flash_attn_varlen_func and _flash_attn_varlen_backward)"]
    names = _parameter_names(fn)
    missing = [] if "window_size" in names else ["sliding window (window_size)"]
    return missing + ([] if "return_attn_probs" in names else ["lse returned (return_attn_probs)"])


def _flash_attn_3_missing(interface, device) -> list[str]:
    fn = getattr(interface, "flash_attn_varlen_func", None)
    if fn is None or not hasattr(interface, "_flash_attn_backward"):
        return ["varlen (flash_attn_varlen_func and _flash_attn_backward)"]
    names = _parameter_names(fn)
    if "window_size" not in names:
        return ["sliding window (window_size)"]
    if "return_attn_probs" in names:
        return []
    return _trial_lse(fn, device)


def _trial_lse(fn, device) -> list[str]:
    """One call of 8 rows, 2 heads, head dim 128 (compiled in every build): does it return an
    lse ``[heads, total]``? Everything is made on ``device``: no host-to-device copy."""
    rows, heads = 8, 2
    try:
        x = torch.zeros(rows, heads, 128, dtype=torch.bfloat16, device=device)
        cu = torch.arange(0, 2 * rows, rows, dtype=torch.int32, device=device)
        res = fn(x, x, x, cu, cu, rows, rows, causal=True)
    except Exception as e:  # noqa: BLE001 - whatever the build raises, it is not usable as called
        return [f"lse returned (a trial call failed: {type(e).__name__}: {e})"]
    if isinstance(res, torch.Tensor):
        return ["lse returned (flash_attn_varlen_func returns out only: builds of 2025-07-11 .. 2025-08-28; "
                "use a build from 2025-08-29 or later)"]
    if tuple(res[1].shape) != (heads, rows):
        return [f"lse layout [heads, total_q] (got {tuple(res[1].shape)})"]
    return []


def _torch_flash_missing() -> list[str]:
    op = getattr(torch.ops.aten, "_flash_attention_forward", None)
    if op is None:
        return ["varlen (aten::_flash_attention_forward)"]
    if not {"window_size_left", "window_size_right"} <= {a.name for a in op.default._schema.arguments}:
        return ["sliding window (window_size_left / window_size_right)"]
    # The op's meta kernel follows its CUDA one: the lse of a 2-head, 8-row call, without a GPU.
    x = torch.empty(8, 2, 64, dtype=torch.bfloat16, device="meta")
    cu = torch.empty(2, dtype=torch.int32, device="meta")
    try:
        lse = op(x, x, x, cu, cu, 8, 8, 0.0, True, False)[1]
    except Exception:  # noqa: BLE001 - no meta kernel in this build: nothing to check without a GPU
        return []
    return [] if tuple(lse.shape) == (2, 8) else [f"lse layout [heads, total_q] (got {tuple(lse.shape)})"]


def _missing(backend: str, device) -> list[str]:
    if backend in ("flash_attn", "flash_attn_3"):
        name = "flash_attn.flash_attn_interface" if backend == "flash_attn" else "flash_attn_interface"
        interface = _module(name)
        if interface is None:
            return [f"an importable {name}"]
        return _flash_attn_2_missing(interface) if backend == "flash_attn" else _flash_attn_3_missing(interface, device)
    if backend == "torch_flash":
        return _torch_flash_missing()
    op = "_scaled_dot_product_efficient_attention" if backend == "torch_efficient" else (
        "_scaled_dot_product_cudnn_attention")
    return [] if hasattr(torch.ops.aten, op) else [f"lse returned (aten::{op})"]


@functools.lru_cache(maxsize=None)
def build_problem(backend: str, device: str) -> str | None:
    """Why the installed build of ``backend`` cannot serve the adapter on ``device``, or None.
    Once per process and device (the answer cannot change while it runs)."""
    needs = NEEDS[backend]
    version = installed_version(backend)
    parsed = version_tuple(version)
    minimum = ".".join(map(str, needs.minimum))
    missing = []
    if parsed is None and needs.version_decides:
        missing.append(f"a version to read (needs {needs.package} >= {minimum} for {needs.below_minimum})")
    elif parsed is not None and parsed < needs.minimum:
        missing.append(f"{needs.below_minimum} (needs {needs.package} >= {minimum})")
    if not missing:
        missing = _missing(backend, device)
    if not missing:
        return None
    return f"{needs.package} {version or '(version unknown)'} is skipped: it lacks " + "; ".join(missing)


@functools.lru_cache(maxsize=None)
def _log_once(message: str) -> None:
    log.warning("StarTrail block kernels: %s", message)


def usable_builds(candidates, device: torch.device) -> frozenset[str]:
    """The backends of ``candidates`` whose installed build passes :func:`build_problem`;
    each one that fails is logged once per process, with its package, version and lack."""
    usable = set()
    for backend in sorted(candidates):
        problem = build_problem(backend, str(device))
        if problem is None:
            usable.add(backend)
        else:
            _log_once(problem)
    return frozenset(usable)
