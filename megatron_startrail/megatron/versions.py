"""Which megatron-core is installed, and what of the Megatron integration it can carry.

Tested with megatron-core 0.19.2 (everything) and 0.16.1 (``scripts/check_megatron_016.sh``):

- every megatron-core from 0.16.1 on: StarTrail core attention, the StarTrail groups in
  Megatron's grid, GPT layer and block specs with StarTrail (``layer_specs.to_startrail_spec``
  on ``SelfAttention``) and the CPU patches;
- megatron-core 0.19 or newer only: Multi-Latent Attention with StarTrail (``packed_mla``:
  Megatron's ``_run_core_attention`` and ``FusedMLASelfAttention`` are not in 0.16.1), the
  ``HybridModel`` stack (``hybrid_specs``: ``megatron.core.models.hybrid`` is not in 0.16.1)
  and ``megatron.training`` (``parse_args``, ``pretrain``, the example; not in the 0.16.1
  wheel).

On an older megatron-core the project still imports; building one of the latter raises
:class:`MegatronCoreTooOld`, naming the version it needs and the one installed.
"""

from __future__ import annotations

from packaging.version import InvalidVersion, Version

# The oldest megatron-core with MLA's ``_run_core_attention`` / ``FusedMLASelfAttention`` and
# ``megatron.core.models.hybrid`` that this project is tested with (0.19.2).
FULL_SUPPORT = (0, 19)
FULL_SUPPORT_TESTED = "0.19.2"


class MegatronCoreTooOld(RuntimeError):
    """A StarTrail feature that the installed megatron-core cannot carry."""


def megatron_core_version() -> str:
    """``megatron.core``'s own version string (``package_info``: also right for a Megatron-LM
    checkout on ``PYTHONPATH``, which has no installed distribution)."""
    from megatron.core import package_info  # noqa: PLC0415

    return str(package_info.__version__)


def has_full_support(version: str | None = None) -> bool:
    """True for megatron-core 0.19 and newer (pre-releases of 0.19.0 included)."""
    version = megatron_core_version() if version is None else version
    try:
        return Version(version).release[:2] >= FULL_SUPPORT
    except InvalidVersion:  # a Megatron-LM checkout with an odd version string: assume new
        return True


def require_full_support(feature: str, why: str = "") -> None:
    """Raise :class:`MegatronCoreTooOld` for ``feature`` unless megatron-core is 0.19 or newer."""
    version = megatron_core_version()
    if has_full_support(version):
        return
    minimum = ".".join(map(str, FULL_SUPPORT))
    raise MegatronCoreTooOld(
        f"{feature} with StarTrail needs megatron-core >= {minimum} (tested with {FULL_SUPPORT_TESTED}); "
        f"installed: megatron-core {version}{f' ({why})' if why else ''}. "
        f"pip install 'megatron-core>={FULL_SUPPORT_TESTED}'"
    )
