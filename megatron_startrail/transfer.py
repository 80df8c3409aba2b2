"""How the sub-ring phase moves its payload: one ring, or several concurrent rings (TASP).

``"ring"``: StarTrail's sub-ring, one lane. ``"multiring"``: the ``G`` ranks of a
sub-ring, assumed fully connected (one node with all-to-all links, or a mesh of NICs),
carry the payload split over ``G - 1`` arc-disjoint directed Hamiltonian cycles (TASP,
arXiv 2509.26541), so every outgoing link of every rank is busy at every step instead
of one. Bytes per rank and sequential steps are unchanged; per-link bytes drop by
``G - 1``.
"""

from __future__ import annotations

from .schedule import Lane
from .topology import StarTrailTopology

TRANSFERS = ("ring", "multiring")


def sub_ring_lanes(topo: StarTrailTopology, position: int, transfer: str) -> list[Lane]:
    """The lanes of the sub-ring that contains ``position`` (same list on every member)."""
    ring = next(r for r in topo.sub_rings() if position in r)
    if transfer == "ring" or len(ring) <= 2:
        return [Lane(tuple(ring))]
    from .tasp_topology import multiring_cycles  # noqa: PLC0415 - only for multiring

    return [Lane(tuple(ring[v] for v in cycle)) for cycle in multiring_cycles(len(ring))]
