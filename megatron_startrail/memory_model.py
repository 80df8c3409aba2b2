"""Closed form of the live bytes of one attention layer on one rank: what it keeps for the
backward, and the peak while its forward and backward run (the transient team buffers).

Same notation as :mod:`megatron_startrail.accounting` (``Eq``, ``Ekv``, ``Eo``, ``El``
elements per rank after the Ulysses all-to-all; ``e`` input and ``a`` accumulator element
sizes; team size ``C``; sub-ring length ``G``; ``init`` = 1 unless the initial send maps
the rank to itself). Counted: every tensor the attention allocates (the caller's q, k, v
and dO are not), at the moment its phase holds the most (docs/design.md, "Memory")::

    forward, sub-ring step 0     C Eq e  (team Q; 0 for C = 1)   + C Ekv e (team K|V)
                                 + init C Ekv e (initial send landing) + [G>1] C Ekv e (next hop)
                                 + C (Eo + El) a (partial out, lse)    + kernel tile
    backward, rotation "kv"      kept + [regathered] team Q, K|V + init C Ekv e (landing)
                                 + C 2 Eo e + C El a  (team dO | out, lse)
                                 + C Eq a (dQ) + held K|V + 3 C Ekv a (dK|dV: this step's,
                                   the one received, the one still being sent)
    backward, rotation "q"       kept + [regathered] team K|V + init C Ekv e
    (streamed per member)        + C Ekv a (the fixed dK|dV) + one member's (Eq + 2 Eo) e + El a
                                 + its held copies + 3 Eq a (its dQ accumulators)
    both                         + init C Ekv a (the reverse initial send landing) + kernel tile

"held" is a second copy of the circulating payload once it has moved (``G > 1``), two
while the next one lands (``G > 2``). The kernel tile is one call's gradients (rows of one
rank, :func:`megatron_startrail.blocks.backward_step`): ``(Eq + Ekv) a``. Backend buffers
(gloo's staging copies of collectives, a fused kernel's workspace) are not modelled:
``benchmarks/memory.py`` measures them, and the tests bound the model's error against it.
"""

from __future__ import annotations

from .accounting import AttentionShape, choose_backward_rotation, kept_for_backward_bytes, startrail_rank_elements
from .topology import StarTrailTopology


def layer_memory_bytes(shape: AttentionShape, *, cp_size: int, team_size: int, ulysses_size: int = 1,
                       startrail_rank: int = 1, rotation: str = "auto",
                       regather_in_backward: bool = False) -> dict[str, int]:
    """``{"kept", "forward_peak", "backward_peak", "peak"}``: bytes one rank's attention keeps
    for its backward, and the most it holds live during its forward and its backward (the
    kept bytes included; the caller's inputs not)."""
    u, c, e, a = ulysses_size, team_size, shape.dtype_bytes, shape.acc_bytes
    topo = StarTrailTopology(cp_size // u, c)
    g = topo.sub_ring_size
    init = int(topo.init_send_dst(startrail_rank) != startrail_rank)
    if rotation == "auto":
        rotation = choose_backward_rotation(shape, u, c)
    eq, ekv, eo, el = startrail_rank_elements(shape, u)
    regathers = regather_in_backward or (c == 1 and not init)
    kept = kept_for_backward_bytes(shape, ulysses_size=u, team_size=c, regather_in_backward=regathers,
                                   rotation=rotation)
    if regathers and u == 1:
        kept -= (eq + ekv) * e  # this rank's own q, k, v: the caller's tensors
    ulysses = (eq + ekv + eo) * e if u > 1 else 0  # the all-to-all'd q, k, v and output

    team_q = c * eq * e if c > 1 else 0
    team_kv = c * ekv * e
    forward = (ulysses + team_q + team_kv + init * team_kv + (team_kv if g > 1 else 0)
               + c * (eo + el) * a + (eo + el) * a)

    held_copies = 0 if g == 1 else (1 if g == 2 else 2)
    accumulators = 3 if g > 1 else 1  # this step's, the one received, the one still being sent
    reverse = init * c * ekv * a  # the reverse initial send's landing pieces, at the end
    if rotation == "kv":
        regathered = (team_q + team_kv * (1 + init)) if regathers else 0
        query_side = c * 2 * eo * e + (c * el * a if c > 1 else 0)
        rotating = c * eq * a + held_copies * team_kv + accumulators * c * ekv * a
        backward = ulysses + kept + regathered + query_side + rotating + reverse
    else:  # Note [streamed rotation q]: one member's query side at a time, K, V fixed
        if not regathers and u == 1:
            kept -= eq * e  # rotation "q" keeps this rank's own q: the caller's tensor
        regathered = team_kv * (1 + init) if regathers else 0
        side = (eq + 2 * eo) * e + el * a  # one member's q, dO, out, lse
        passing = (side if c > 1 else 0) + held_copies * side + accumulators * eq * a
        backward = ulysses + kept + regathered + c * ekv * a + passing + reverse
    backward += (eq + ekv) * a  # one kernel call's gradients
    return {"kept": kept, "forward_peak": forward, "backward_peak": backward, "peak": max(forward, backward)}


def activation_peak_bytes(shape: AttentionShape, *, layers: int, cp_size: int, team_size: int,
                          ulysses_size: int = 1, regather_in_backward: bool = False, rotation: str = "auto") -> int:
    """Per rank, the peak of ``layers`` attention layers of one micro-batch: what each keeps
    for the backward (:func:`~megatron_startrail.accounting.kept_for_backward_bytes`, its
    inputs included) plus what one layer holds beyond that while it runs (only one layer's
    forward or backward runs at a time)."""
    kept = kept_for_backward_bytes(shape, ulysses_size=ulysses_size, team_size=team_size,
                                   regather_in_backward=regather_in_backward, rotation=rotation)
    layer = layer_memory_bytes(shape, cp_size=cp_size, team_size=team_size, ulysses_size=ulysses_size,
                               regather_in_backward=regather_in_backward, rotation=rotation)
    return layers * kept + layer["peak"] - layer["kept"]
