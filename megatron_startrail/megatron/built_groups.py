"""The StarTrail groups of a run, built once and reused: shared by the two front ends that
build them from settings (``from_args.py``: Megatron's parsed flags; ``megatron_startrail.bridge``:
a Megatron-Bridge model provider).

Megatron keeps its process groups in module globals; the StarTrail groups live exactly as
long: rebuilt only when Megatron's parallel state was re-initialized (a new CP group object)
or the options change. A model is built once per virtual pipeline stage, and Bridge resolves
the layer spec again for multi-token prediction: every call after the first reuses the groups.
"""

from __future__ import annotations

from megatron.core import parallel_state

from ..groups import StarTrailGroups
from .dynamic_cp import DynamicCPGroups, initialize_dynamic_startrail
from .parallel_state import initialize_startrail

# (Megatron's CP group, the options, the groups built for them). Holding the CP group object
# also keeps its id from being reused by a later one.
_built: tuple[object, dict, StarTrailGroups | DynamicCPGroups] | None = None


def startrail_groups_once(options: dict, *, dynamic: bool = False) -> tuple[StarTrailGroups | DynamicCPGroups, bool]:
    """``(groups, built_now)``: the groups for ``options`` (the keywords of
    :func:`~.parallel_state.initialize_startrail`, or of
    :func:`~.dynamic_cp.initialize_dynamic_startrail` when ``dynamic``), built on the first call
    (collective: every rank calls it in the same order, as Megatron builds models)."""
    global _built
    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError("call parallel_state.initialize_model_parallel before building the StarTrail layer spec")
    cp_group = parallel_state.get_context_parallel_group()
    if _built is not None and _built[0] is cp_group and _built[1] == options:
        return _built[2], False
    groups = (initialize_dynamic_startrail if dynamic else initialize_startrail)(**options)
    _built = (cp_group, dict(options), groups)
    return groups, True
