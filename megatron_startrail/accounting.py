"""Closed forms of what one rank sends per attention forward and backward.

Pure functions of the rank math (:mod:`megatron_startrail.topology`) and the tensor
sizes; the tests assert that the communicator's measured counters equal them exactly,
and the planner prices them. Conventions are those of :mod:`megatron_startrail.comm`
(collectives count the logical volume of a bandwidth-optimal algorithm).

Per StarTrail rank, after the Ulysses all-to-all, with ``e`` the input's element size,
``a`` the accumulator's (4, or 8 for float64 inputs), ``Eq``/``Ekv``/``Eo``/``El`` the
elements of this rank's Q, of its K and V together (``hkv (dqk + dv)`` per token: V
keeps its own head dim ``dv``, MLA), of its output (``h dv`` per token) and of its lse
(``s * b * heads``), ``G`` the sub-ring length and ``init`` = 1 unless the initial send
maps the rank to itself:

forward
    collective  (C-1) (Eq + Ekv) e          team all-gather of Q, K, V     [paper eq. 2:
              + (C-1) Eo e                   team merge of partial outputs   4(C-1)BNH/P]
              + (C-1) El a                   ... and of their lse
    p2p sent    (init + G - 1) C Ekv e       initial send + sub-ring        [paper eq. 3
    steps       init + G - 1                                                  omits init]
backward, rotation "q" (paper 3.2.1: K, V fixed; Q, dO, out, lse and dQ circulate,
streamed in C passes of one member's rows, Note [streamed rotation q] in backward.py)
    p2p sent    (G-1) C ((Eq + 2 Eo) e + El a) + [G>1] G C Eq a + init C Ekv a
    collective  as "kv" below, + (C-1) Eq e  (Q broadcast in the team: the forward keeps
                                              only this rank's)
              + [G=1] (C-1)^2 ((Eq + 2 Eo) e + El a + Eq a)  (the query side and dQ once
                                              per piece of K, V: Note [piece-major rotation q])
    steps       C [G>1] G + init
backward, rotation "kv" (K, V and dK, dV circulate; cheaper with GQA)
    p2p sent    (G-1) C Ekv e + [G>1] G C Ekv a + init C Ekv a
    collective  (C-1) (2 Eo e + El a)       all-gather dO, out, lse
              + (C-1) (Eq + Ekv) a           reduce-scatter dQ, dK, dV (float32)
    steps       [G>1] G + init              (the gradient accumulator's chain)
backward with regathering (``regather_in_backward``) adds the forward's phases 1-2:
    collective  (C-1) (Eq + Ekv) e           team all-gather of Q, K, V (inside a node;
                                             K, V only with rotation "q")
    p2p sent    init C Ekv e                 initial send (may cross nodes)
    steps       init
Ulysses (U > 1) adds (U-1)/U of the all-to-all'd Q, K, V and output bytes each way.

Kept for backward by the attention (:func:`kept_for_backward_bytes`), per rank:
``(C Eq + C Ekv) e + Eo e + El a`` (rotation "q": ``(Eq + C Ekv + Eo) e + El a``), or with
regathering ``(Eq + Ekv + Eo) e + El a`` (ring attention's: its own q, k, v, out, lse).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from .topology import StarTrailTopology


@dataclass(frozen=True)
class AttentionShape:
    """One layer's attention on one CP rank: ``q [seq_local, batch, heads, head_dim]``."""

    seq_local: int  # tokens on one CP rank (before the Ulysses all-to-all)
    batch: int
    heads: int  # query heads on this rank (after tensor parallelism)
    kv_heads: int
    head_dim: int  # of q and k
    dtype_bytes: int  # 2 for bf16/fp16, 4 for fp32, 8 for fp64
    v_head_dim: int | None = None  # of v and the output; None: head_dim (MLA: its own)

    @property
    def acc_bytes(self) -> int:
        return 8 if self.dtype_bytes == 8 else 4

    @property
    def v_dim(self) -> int:
        return self.head_dim if self.v_head_dim is None else self.v_head_dim


def ulysses_kv_heads(kv_heads: int, ulysses_size: int) -> int:
    """K/V heads entering the Ulysses all-to-all (replicated up to U when fewer)."""
    if ulysses_size > 1 and kv_heads % ulysses_size != 0:
        return ulysses_size
    return kv_heads


class RankElements(NamedTuple):
    """Elements of one StarTrail rank's tensors, after the Ulysses all-to-all."""

    q: int  # q (and dq)            [s, b, h, dqk]
    kv: int  # k and v together      [s, b, hkv, dqk + dv]
    out: int  # out (and dout)       [s, b, h, dv]
    lse: int  # lse                  [s, b, h]


def startrail_rank_elements(shape: AttentionShape, ulysses_size: int) -> RankElements:
    """Elements of one StarTrail rank's tensors after the Ulysses all-to-all:
    ``U * seq_local`` tokens, ``heads / U`` query heads, K/V heads replicated up to U."""
    u = ulysses_size
    tokens = shape.seq_local * u * shape.batch
    heads, kv_heads = shape.heads // u, ulysses_kv_heads(shape.kv_heads, u) // u
    return RankElements(
        q=tokens * heads * shape.head_dim,
        kv=tokens * kv_heads * (shape.head_dim + shape.v_dim),
        out=tokens * heads * shape.v_dim,
        lse=tokens * heads,
    )


def backward_p2p_parts(shape: AttentionShape, ulysses_size: int, team_size: int) -> dict[str, tuple[int, int]]:
    """Per rotation, the bytes one rank sends per backward sub-ring step as
    ``(payload, gradient accumulator)``: the payload moves G-1 times, the accumulator G."""
    c, e, a = team_size, shape.dtype_bytes, shape.acc_bytes
    el = startrail_rank_elements(shape, ulysses_size)
    return {
        "q": (c * ((el.q + 2 * el.out) * e + el.lse * a), c * el.q * a),
        "kv": (c * el.kv * e, c * el.kv * a),
    }


def backward_p2p_bytes_per_step(shape: AttentionShape, ulysses_size: int, team_size: int) -> dict[str, int]:
    """Bytes one backward sub-ring step moves (payload + accumulator), per rotation choice."""
    return {k: sum(v) for k, v in backward_p2p_parts(shape, ulysses_size, team_size).items()}


def choose_backward_rotation(shape: AttentionShape, ulysses_size: int, team_size: int) -> str:
    """The cheaper backward rotation; ties go to the paper's ("q")."""
    per_step = backward_p2p_bytes_per_step(shape, ulysses_size, team_size)
    return "q" if per_step["q"] <= per_step["kv"] else "kv"


def kept_for_backward_bytes(shape: AttentionShape, *, ulysses_size: int, team_size: int,
                            regather_in_backward: bool, rotation: str = "auto") -> int:
    """Bytes one rank's attention keeps for its backward (its saved tensors, inputs of
    the StarTrail function included; after the Ulysses all-to-all those are its own
    q, k, v). Ring attention (C = 1) always keeps what regathering keeps. Without
    regathering: the K, V of the initial send and, for rotation "kv", the team's Q (rotation
    "q" takes the team's queries member by member in the backward: this rank's q only)."""
    c, e, a = team_size, shape.dtype_bytes, shape.acc_bytes
    el = startrail_rank_elements(shape, ulysses_size)
    if regather_in_backward or c == 1:
        return (el.q + el.kv + el.out) * e + el.lse * a
    if rotation == "auto":
        rotation = choose_backward_rotation(shape, ulysses_size, c)
    queries = el.q if rotation == "q" else c * el.q
    return (queries + c * el.kv + el.out) * e + el.lse * a


def expected_comm(
    shape: AttentionShape,
    *,
    cp_size: int,
    team_size: int,
    ulysses_size: int = 1,
    startrail_rank: int = 0,
    rotation: str = "auto",
    regather_in_backward: bool = False,
) -> dict[str, dict[str, int]]:
    """Closed-form :class:`~megatron_startrail.comm.CommStats` fields for one rank.

    Returns ``{"forward": {...}, "backward": {...}}`` with keys ``p2p_bytes_sent``,
    ``p2p_bytes_recv``, ``collective_bytes_sent``, ``collective_bytes_recv``,
    ``p2p_steps``.
    """
    u, c, e, a = ulysses_size, team_size, shape.dtype_bytes, shape.acc_bytes
    topo = StarTrailTopology(cp_size // u, c)
    g = topo.sub_ring_size
    if rotation == "auto":
        rotation = choose_backward_rotation(shape, u, c)
    init = int(topo.init_send_dst(startrail_rank) != startrail_rank)

    el = startrail_rank_elements(shape, u)
    eq, ekv, eo, e_lse = el  # elements: Q, K+V, out, lse

    # Ulysses all-to-all volume per direction (per CP rank, before the exchange).
    uly_in = (u - 1) * (eq + ekv) * e // u
    uly_out = (u - 1) * eo * e // u

    gather_inputs = (c - 1) * (eq + ekv) * e  # phase 1, team all-gather of q, k, v
    init_send = init * c * ekv * e  # phase 2
    fwd_coll = gather_inputs + (c - 1) * (eo * e + e_lse * a) + uly_in + uly_out
    fwd_p2p = init_send + (g - 1) * c * ekv * e
    fwd_steps = init + g - 1

    payload, accumulator = backward_p2p_parts(shape, u, c)[rotation]
    bwd_p2p = (g - 1) * payload + (g * accumulator if g > 1 else 0) + init * c * ekv * a
    bwd_coll = (c - 1) * ((2 * eo * e + e_lse * a) + (eq + ekv) * a) + uly_in + uly_out
    # Rotation "q" takes the team's queries member by member (Note [streamed rotation q] in
    # backward.py): C passes of G steps each, and Q itself is broadcast in the backward
    # (the forward keeps only this rank's) -- so a regathering backward gathers K, V only.
    passes = c if rotation == "q" else 1
    bwd_steps = passes * (g if g > 1 else 0) + init
    if rotation == "q":
        bwd_coll += (c - 1) * eq * e
        if topo.one_position_sub_rings:  # Note [piece-major rotation q]: query side and dQ once per piece
            bwd_coll += (c - 1) * (c - 1) * ((eq + 2 * eo) * e + e_lse * a + eq * a)
    if regather_in_backward:  # phases 1-2 again
        bwd_coll += gather_inputs - ((c - 1) * eq * e if rotation == "q" else 0)
        bwd_p2p += init_send
        bwd_steps += init

    def stats(p2p: int, coll: int, steps: int) -> dict[str, int]:
        return {
            "p2p_bytes_sent": p2p,
            "p2p_bytes_recv": p2p,
            "collective_bytes_sent": coll,
            "collective_bytes_recv": coll,
            "p2p_steps": steps,
        }

    return {"forward": stats(fwd_p2p, fwd_coll, fwd_steps), "backward": stats(bwd_p2p, bwd_coll, bwd_steps)}


def paper_forward_bytes(shape: AttentionShape, *, cp_size: int, team_size: int) -> dict[str, int]:
    """The paper's eq. 1-3 volumes (bytes, one forward, per rank), for comparison.

    Eq. 1 (ring, C = 1): ``(P-1) 2 BNH/P``. Eq. 2 (collective): ``4 BNH (C-1)/P``.
    Eq. 3 (sub-ring P2P): ``(P/C^2 - 1) 2 C BNH/P``. ``BNH/P`` is one rank's Q; the
    paper assumes K, V as large as Q (no GQA) and leaves out the initial send and the
    lse of the merge.
    """
    p, c, e = cp_size, team_size, shape.dtype_bytes
    local = shape.seq_local * shape.batch * shape.heads * shape.head_dim * e  # BNH/P
    return {
        "ring_p2p": (p - 1) * 2 * local,
        "collective": 4 * (c - 1) * local,
        "sub_ring_p2p": (p // (c * c) - 1) * 2 * c * local,
    }


# -- sliding windows: the halo exchange (megatron_startrail/halo.py) -------------------------
#
# Dense layout (no packed documents): chunks of n = S / (2 CP) tokens, CP rank r holds
# chunks r and 2CP-1-r. The queries of chunk j see the keys at positions
# [j n + lo, (j+1) n - 1 + hi] (lo = -left, hi = right, causal: hi <= 0; unbounded sides
# reach the sequence's ends), so receiver r needs, of owner s's chunks, the positions in
# the union of its two chunks' reaches. Forward: those K|V rows, in the input dtype;
# backward: their dK|dV back to the owner, in the accumulator dtype. Before any Ulysses
# all-to-all, on the whole CP group: neither C nor U changes it. One round each way.


def _overlap(a: tuple[float, float], b: tuple[float, float]) -> float:
    """Length of the intersection of the half-open intervals ``a`` and ``b``."""
    return max(0.0, min(a[1], b[1]) - max(a[0], b[0]))


def halo_rows(seq_length: int, cp_size: int, window: tuple[int, int], causal: bool) -> dict[tuple[int, int], int]:
    """``{(owner, receiver): rows}``: K|V rows of CP rank ``owner``'s storage that CP rank
    ``receiver``'s windows reach (pairs that exchange nothing are left out); dense layout,
    ``window=(left, right)`` with -1 unbounded (flash-attn's meaning)."""
    left, right = window
    lo = -float("inf") if left < 0 else -left
    hi = float("inf") if right < 0 else right
    if causal:
        hi = min(hi, 0)
    n, chunks = seq_length // (2 * cp_size), lambda r: (r, 2 * cp_size - 1 - r)
    span = lambda j: (j * n, (j + 1) * n)  # noqa: E731 - positions of chunk j

    def reach(j: int) -> tuple[float, float]:  # positions chunk j's queries see, half-open
        return max(0.0, j * n + lo), min(float(seq_length), (j + 1) * n + hi)

    rows = {}
    for receiver in range(cp_size):
        a, b = (reach(j) for j in chunks(receiver))
        both = (max(a[0], b[0]), min(a[1], b[1]))
        for owner in range(cp_size):
            if owner == receiver:
                continue
            # |K n (A u B)| = |K n A| + |K n B| - |K n A n B| per chunk K of the owner
            got = sum(_overlap(span(k), a) + _overlap(span(k), b) - (_overlap(span(k), both) if both[0] < both[1]
                                                                      else 0.0) for k in chunks(owner))
            if got:
                rows[(owner, receiver)] = int(got)
    return rows


def halo_bytes(shape: AttentionShape, *, cp_size: int, window: tuple[int, int], causal: bool,
               cp_rank: int) -> dict[str, dict[str, int]]:
    """The :class:`~megatron_startrail.comm.CommStats` fields of CP rank ``cp_rank`` when the
    halo exchange runs (dense layout), as :func:`expected_comm` gives them for the schedule:
    one row of K|V is ``b hkv (dqk + dv)`` elements, ``e`` bytes forward and ``a`` backward,
    where the gradients of the rows a rank received go back to their owners."""
    rows = halo_rows(shape.seq_local * cp_size, cp_size, window, causal)
    mine = sum(r for (owner, _), r in rows.items() if owner == cp_rank)  # rows others' windows reach
    reached = sum(r for (_, receiver), r in rows.items() if receiver == cp_rank)  # rows this rank's reach
    row = shape.batch * shape.kv_heads * (shape.head_dim + shape.v_dim)

    def stats(sent: int, recv: int, nbytes: int) -> dict[str, int]:
        return {"p2p_bytes_sent": sent * row * nbytes, "p2p_bytes_recv": recv * row * nbytes,
                "collective_bytes_sent": 0, "collective_bytes_recv": 0, "p2p_steps": int(bool(sent or recv))}

    return {"forward": stats(mine, reached, shape.dtype_bytes), "backward": stats(reached, mine, shape.acc_bytes)}


# -- Megatron's all_gather CP type, priced beside StarTrail (planning/cp_types.py) ---------
#
# Transformer Engine's KV all-gather CP (``cp_comm_type="all_gather"``,
# AttnFuncWithCPAndKVAllGather): the forward all-gathers K and V over the CP group and
# attends the rank's two chunks of queries locally; it keeps only the rank's own K, V, so
# the backward all-gathers them again, computes dK, dV for the whole sequence and
# reduce-scatters them (in the input dtype: TE allocates dK, dV as K's dtype). No P2P.
# Ulysses (``a2a``) and its hierarchical form (``a2a+p2p``) are :func:`expected_comm` with
# U = CP, or U ranks of all-to-all around a ring of CP / U (team size 1).


def allgather_cp_comm(shape: AttentionShape, *, cp_size: int) -> dict[str, dict[str, int]]:
    """:class:`~megatron_startrail.comm.CommStats` fields of one rank under Megatron's
    ``all_gather`` CP, counted as the communicator counts an all-gather / reduce-scatter
    (bandwidth-optimal: ``(P-1)`` pieces sent and received)::

        forward    (P-1) Ekv e        all-gather K, V
        backward   (P-1) Ekv e        all-gather K, V again
                 + (P-1) Ekv e        reduce-scatter dK, dV
    """
    kv = shape.seq_local * shape.batch * shape.kv_heads * (shape.head_dim + shape.v_dim) * shape.dtype_bytes
    moved = (cp_size - 1) * kv

    def stats(coll: int) -> dict[str, int]:
        return {"p2p_bytes_sent": 0, "p2p_bytes_recv": 0, "collective_bytes_sent": coll,
                "collective_bytes_recv": coll, "p2p_steps": 0}

    return {"forward": stats(moved), "backward": stats(2 * moved)}
