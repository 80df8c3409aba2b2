"""How the sub-ring phase moves its payload: one ring, or several concurrent rings (TASP).

``"ring"``: StarTrail's sub-ring, one lane. ``"multiring"``: the ``G`` ranks of a
sub-ring, assumed fully connected (one node with all-to-all links, or a mesh of NICs),
carry the payload split over ``G - 1`` arc-disjoint directed Hamiltonian cycles (TASP,
arXiv 2509.26541), so every outgoing link of every rank is busy at every step instead
of one. Bytes per rank and sequential steps are unchanged; per-link bytes drop by
``G - 1``.
"""

from __future__ import annotations

import torch

from .blocks import add_rows, take_rows
from .layout import Segment, segment_rows, split_segments
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


class LaneSplit:
    """A circulating payload split over the lanes of the transfer.

    ``segments_of(origin)`` gives the rows (as segments) of the payload that position
    ``origin`` holds at step 0; lane ``k`` carries part ``k`` of every such payload.
    """

    def __init__(self, lanes: list[Lane], chunk_len: int, segments_of) -> None:
        # More lanes than tokens per chunk would leave parts empty: use fewer lanes.
        self.lanes = lanes[: max(1, min(len(lanes), chunk_len))]
        self._segments_of = segments_of

    def part_segments(self, origin: int, lane: int) -> tuple[Segment, ...]:
        return split_segments(self._segments_of(origin), len(self.lanes))[lane]

    def part_rows(self, origin: int) -> list[tuple[tuple[int, int], ...]]:
        whole = self._segments_of(origin)
        return [tuple(segment_rows(p, whole)) for p in split_segments(whole, len(self.lanes))]

    def split(self, position: int, tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        """Per lane, the part of each ``[rows, ...]`` tensor it carries (views for one lane)."""
        return [[take_rows(t, rows) for t in tensors] for rows in self.part_rows(position)]

    def join(self, position: int, parts: list[torch.Tensor]) -> torch.Tensor:
        """Inverse of :meth:`split` for one tensor per lane."""
        if len(parts) == 1:
            return parts[0]
        rows = sum(b - a for _, a, b in self._segments_of(position))
        out = parts[0].new_zeros((rows,) + tuple(parts[0].shape[1:]))
        for part, part_rows in zip(parts, self.part_rows(position)):
            add_rows(out, part, part_rows)
        return out
