"""The initial send (paper Alg. 2) and its reverse, in pieces.

The team's K, V ``kv_team [C*n, b, hkv, dqk + dv]`` travel as ``C`` row pieces, one per
team member's ``n`` rows (row slices: no copies), each its own transfer, so that the
sub-ring's step 0 can attend to the first piece while the others are still on the wire
(:func:`~megatron_startrail.schedule.rotate`'s ``pieces``). The ``C`` transfers are one
sequential round, counted as one P2P step. The backward sends dK, dV back the same way,
piece by piece as each becomes final.
"""

from __future__ import annotations

import itertools

import torch

from .comm import Communicator, PendingP2P
from .layout import split_rows
from .topology import StarTrailTopology


class PieceTransfer:
    """Row pieces of a ``[C*n, ...]`` payload landing one by one (the one landing class: the
    initial send, its streamed form in :func:`~megatron_startrail.team.streamed_team_send`,
    and a tensor already here). ``post_piece(j)`` starts piece ``j`` and returns ``(pending,
    landing)``: ``landing`` holds rows ``bounds[j]`` once ``pending.wait()`` returns
    (``pending`` None: already). Pieces are posted in order, every piece up to ``j + ahead``
    before piece ``j`` is waited for -- the same sequence on every rank, as NCCL matches by
    it. ``tensor`` is the whole landing when the pieces are rows of one tensor (else None)."""

    def __init__(self, bounds: list[tuple[int, int]], post_piece, *, ahead: int, tensor: torch.Tensor | None = None):
        self.bounds, self.tensor = bounds, tensor
        self._post_piece, self._ahead = post_piece, ahead
        self._posted: list[tuple[PendingP2P | None, torch.Tensor | None]] = []
        self._post_through(ahead - 1)

    @classmethod
    def local(cls, tensor: torch.Tensor, pieces: int) -> PieceTransfer:
        """A tensor already here, cut into the same pieces as a transfer of it would be."""
        bounds = split_rows(tensor.shape[0], pieces)
        return cls(bounds, lambda j: (None, tensor[bounds[j][0]:bounds[j][1]]), ahead=pieces, tensor=tensor)

    @classmethod
    def kept(cls, pieces: list[torch.Tensor]) -> PieceTransfer:
        """Pieces already here, each its own tensor (the forward's kept pieces, Note [kept
        pieces] in backward.py)."""
        ends = list(itertools.accumulate(p.shape[0] for p in pieces))
        bounds = [(end - p.shape[0], end) for end, p in zip(ends, pieces)]
        return cls(bounds, lambda j: (None, pieces[j]), ahead=len(pieces))

    def _post_through(self, last: int) -> None:
        while len(self._posted) <= min(last, len(self.bounds) - 1):
            self._posted.append(self._post_piece(len(self._posted)))
        if len(self._posted) == len(self.bounds):
            # All posted: let go of what the poster holds (the send buffer it cuts pieces
            # from is freed when its transfers complete, not when this landing is).
            self._post_piece = None

    def piece(self, j: int) -> torch.Tensor:
        """Rows of piece ``j``, once landed."""
        self._post_through(j + self._ahead)
        pending, landing = self._posted[j]
        if pending is not None:
            pending.wait()
        return landing

    def release(self, j: int) -> None:
        """Piece ``j`` is done with: its landing buffer may go (a separate one per piece)."""
        self._posted[j] = (self._posted[j][0], None)


def post_initial_send(comm: Communicator, topo: StarTrailTopology, pos: int, kv_team: torch.Tensor, *,
                      op: str) -> PieceTransfer:
    """Post the initial send of ``kv_team`` to ``init_send_dst(pos)`` in ``C`` pieces; returns
    what ``pos`` starts the sub-ring with, landing (``kv_team`` itself when it maps to itself)."""
    c = topo.team_size
    dst, src = topo.init_send_dst(pos), topo.init_send_src(pos)
    if dst == pos:
        return PieceTransfer.local(kv_team, c)
    kv_init = torch.empty_like(kv_team)
    bounds = split_rows(kv_team.shape[0], c)

    def post_piece(j: int):
        a, b = bounds[j]
        return comm.post([(kv_team[a:b], dst)], [(kv_init[a:b], src)], op=op, channel="side",
                         counts_as_step=j == 0), kv_init[a:b]

    return PieceTransfer(bounds, post_piece, ahead=c, tensor=kv_init)  # all C posted at once


# Note [reverse overlap]
# ----------------------
# The piece-major backward (Note [piece-major rotation q] in backward.py) sends piece j's dK, dV
# back as soon as its C passes are done and reduces the landing in the team once piece j+1 has
# computed: the transfer hides behind piece j+1's compute. For that time it holds, beside piece
# j+1's own dK, dV, piece j's (the send buffer) and what lands of it: two accumulator pieces. What
# the pieces of K, V free meanwhile (a kept piece, freed when its dK, dV go back) pays for them
# only late: in float32, piece 1 is the backward's peak at C = 4 (CPU heap harness, P16 C4: 21.1
# shares of a rank's q, ring attention 17.0); in bf16 (accumulators twice a piece of K, V) every
# piece j < 4 is over piece 0's. Without the overlap (reverse_overlap=False,
# --startrail-no-reverse-overlap) piece j's transfer is waited for, and its landing reduced, before
# piece j+1 computes, except where holding them raises no peak: the K, V pieces and
# accumulators live while piece j+1 computes with the transfer in flight are at most piece 0's
# (every kept piece of K, V and piece 0's dK, dV). The rule sees the team's shapes only, so every
# member makes the same choice (the reduce is a team collective): a member whose initial send
# maps it to itself holds one buffer less, and its own rows' dK, dV (kept to the end) are left
# out. The planner prices what the overlap hides (planner._with_pieces).


def reverse_overlaps(c: int, kv_piece_bytes: int, acc_piece_bytes: int, *, regathered: bool,
                     overlap: bool = True) -> tuple[bool, ...]:
    """Entry ``j``: whether piece ``j-1``'s dK, dV are still flying back (and landing) while
    piece ``j`` computes (Note [reverse overlap]); entry 0 is False. ``kv_piece_bytes``: one
    piece of K | V; ``acc_piece_bytes``: its dK | dV accumulator; ``regathered``: the pieces of K,
    V land in the backward (piece j, the next one and its send buffer), else the forward kept
    all C, freed one by one."""
    if overlap:
        return (False,) + (True,) * (c - 1)

    def held(j: int, flying: bool) -> int:
        pieces = 1 + 2 * (j < c - 1) if regathered else c - j
        return pieces * kv_piece_bytes + (1 + 2 * flying) * acc_piece_bytes

    return tuple(j > 0 and held(j, True) <= held(0, False) for j in range(c))


class ReverseInitialSend:
    """dK, dV ``dkv_init [C*n, b, hkv, dqk + dv]`` back along the reverse of the initial
    send, in the pieces of the forward (one team member's ``n`` rows each): :meth:`send`
    posts piece ``j`` as soon as it is final; :meth:`piece` gives what landed of piece ``j``
    here (the team's dK, dV of member ``j``'s rows, from this rank's sub-ring). Receive
    buffers are made piece by piece, when posted: not the whole ``C*n`` rows at once."""

    def __init__(self, comm: Communicator, topo: StarTrailTopology, pos: int, dkv_init: torch.Tensor | None,
                 bounds: list[tuple[int, int]], *, op: str = "init_send_reverse") -> None:
        self._comm, self._op, self._dkv, self._bounds = comm, op, dkv_init, bounds
        self._dst, self._src = topo.init_send_dst(pos), topo.init_send_src(pos)
        self._local = self._dst == pos  # the initial send mapped this rank to itself: nothing moves
        self._posted: dict[int, tuple[PendingP2P | None, torch.Tensor | None]] = {}

    def send(self, j: int, rows: torch.Tensor | None = None) -> None:
        """Post piece ``j``: rows ``bounds[j]`` of ``dkv_init``, or ``rows`` when the pieces
        are separate tensors (``dkv_init=None``: the piece-major backward)."""
        if j in self._posted:
            return
        if rows is None:
            a, b = self._bounds[j]
            rows = self._dkv[a:b]
        if self._local:  # nothing to move: the piece is this rank's own
            self._posted[j] = (None, rows)
            return
        back = torch.empty_like(rows)
        pending = self._comm.post([(rows, self._src)], [(back, self._dst)], op=self._op, channel="side",
                                  counts_as_step=not self._posted)
        self._posted[j] = (pending, back)

    def piece(self, j: int) -> torch.Tensor:
        """Rows of piece ``j`` of this rank's team dK, dV, once here (pieces up to ``j`` are
        posted first, in order, as every peer posts them; later ones may not be final yet)."""
        for i in range(j + 1):
            self.send(i)
        pending, back = self._posted[j]
        if pending is not None:
            pending.wait()
        return back

    def release(self, j: int) -> None:
        """Piece ``j`` is done with (its buffers may go)."""
        self._posted[j] = (self._posted[j][0], None)
