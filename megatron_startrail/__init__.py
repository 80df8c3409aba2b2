"""StarTrail (concentric-ring) context parallelism for Megatron-LM.

Functional API (no Megatron needed)::

    groups = new_startrail_groups(cp_ranks, team_size=2, ulysses_size=1)   # collective, once
    out = startrail_attn(q, k, v, groups, causal=True)                     # [s_local, b, h, d]
"""

from .attention import startrail_attn
from .comm import CommStats
from .groups import StarTrailGroups, new_startrail_groups
from .topology import StarTrailTopology, valid_team_sizes

__all__ = [
    "CommStats",
    "StarTrailGroups",
    "StarTrailTopology",
    "new_startrail_groups",
    "startrail_attn",
    "valid_team_sizes",
]
