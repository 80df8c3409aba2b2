"""How the sub-ring phase moves its payload: one ring, or several concurrent rings (TASP).

``"ring"``: StarTrail's sub-ring, one lane. ``"multiring"``: the ``G`` ranks of a
sub-ring, assumed fully connected (one node with all-to-all links, or a mesh of NICs),
carry the payload split over ``G - 1`` arc-disjoint directed Hamiltonian cycles (TASP,
arXiv 2509.26541), so every outgoing link of every rank is busy at every step instead
of one. Bytes per rank and sequential steps are unchanged; per-link bytes drop by
``G - 1``.
"""

from __future__ import annotations

import functools

import torch

from .config import TRANSFERS  # noqa: F401 - the choices, defined with the config
from .initial_send import PieceTransfer
from .layout import Segment, segment_rows, split_rows, split_segments
from .schedule import Lane, Piece
from .topology import StarTrailTopology



def sub_ring_lanes(topo: StarTrailTopology, position: int, transfer: str) -> list[Lane]:
    """The lanes of the sub-ring that contains ``position`` (same list on every member)."""
    ring = next(r for r in topo.sub_rings() if position in r)
    if transfer == "ring" or len(ring) <= 2:
        return [Lane(tuple(ring))]
    from .tasp_topology import multiring_cycles  # noqa: PLC0415 - only for multiring

    return [Lane(tuple(ring[v] for v in cycle)) for cycle in multiring_cycles(len(ring))]


class LaneSplit:
    """A circulating payload split over the lanes of the transfer.

    ``segments_of(origin)`` gives the rows (as segments, Note [documents]) of the
    payload that position ``origin`` holds at step 0; lane ``k`` carries the ``k``-th
    contiguous part of every such payload (:func:`~megatron_startrail.layout.split_segments`).
    ``rows`` is the payload's row count (the same on every position).
    """

    def __init__(self, lanes: list[Lane], rows: int, segments_of) -> None:
        # More lanes than rows would leave parts empty: use fewer lanes.
        self.lanes = lanes[: max(1, min(len(lanes), rows))]
        self.rows = rows
        self._segments_of = segments_of

    def part_segments(self, origin: int, lane: int, rows: tuple[int, int] | None = None) -> tuple[Segment, ...]:
        """Segments of lane ``lane``'s part of ``origin``'s payload (only ``rows`` of it, if given)."""
        part = split_segments(self._segments_of(origin), len(self.lanes))[lane]
        return part if rows is None else segment_rows(part, *rows)

    def pieces(self, arriving: PieceTransfer) -> list[Piece]:
        """The pieces of ``arriving`` (rows of the whole payload) as rows of every lane's part."""
        parts = split_rows(self.rows, len(self.lanes))
        return [
            Piece(tuple((min(max(a, la), lb) - la, min(max(b, la), lb) - la) for la, lb in parts),
                  functools.partial(arriving.piece, j))
            for j, (a, b) in enumerate(arriving.bounds)
        ]

    def split(self, tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
        """Per lane, its part of each ``[rows, ...]`` tensor (views)."""
        return [[t[a:b] for t in tensors] for a, b in split_rows(self.rows, len(self.lanes))]

    def join(self, parts: list[torch.Tensor]) -> torch.Tensor:
        """Inverse of :meth:`split` for one tensor per lane."""
        return parts[0] if len(parts) == 1 else torch.cat(parts)
