"""Closed form of the live bytes of one attention layer on one rank: what it keeps for the
backward, and the peak while its forward and backward run (the transient team buffers).

Same notation as :mod:`megatron_startrail.accounting` (``Eq``, ``Ekv``, ``Eo``, ``El``
elements per rank after the Ulysses all-to-all; ``e`` input and ``a`` accumulator element
sizes; team size ``C``; sub-ring length ``G``; ``init`` = 1 unless the initial send maps
the rank to itself). Counted: every tensor the attention allocates (the caller's q, k, v
and dO are not), at the moment its phase holds the most (docs/design.md, "Memory")::

    phases 1-2                   C Ekv e (the initial send's landing) + init 2 Ekv e (two
                                 pieces being sent; C = 1: init Ekv e and this rank's k | v)
    forward, sub-ring            C Eq e  (team Q; 0 for C = 1) + the most of: step 0, phases
                                 1-2 + [G>1] C Ekv e (next hop); steps >= 1 (G > 2), 3 C Ekv e
                                 (the step-0 payload, still held, this step's, the next hop)
                                 + C (Eo + El) a (partial out, lse) + forward call
    forward, team merge (C > 1)  what the forward keeps (team K, V; team Q for "kv") + the
                                 most of: C (Eo + El) a (partials) + C Eo e (their copy in the
                                 input dtype, sent), and C Eo e (received) + 3 Eo a + 2 C El a
    backward, rotation "kv"      kept + [regathered] team Q, team K, V (G = 1: + init Ekv e,
    (sub-ring step >= 1)         the last piece's send buffer) + C 2 Eo e + C El a (team
                                 dO | out, lse) + C Eq a (dQ) + held K|V + dK|dV: G > 1,
                                 3 C Ekv a (this step's, the previous one's being sent, the
                                 one received); G = 1, (C + 1) Ekv a (the step's, assembled
                                 from its pieces, and one piece's) + kernel call: its bf16
                                 dQ, dK, dV and its dense copies of dO, out: ring (Eq + 2 Eo)
                                 e + Ekv e / 2 (n query rows, a chunk of keys), team (Eq +
                                 2 Eo) e / 2 + Ekv e (a chunk of queries, n keys)
    backward, rotation "q"       kept + [regathered] team K, V (C = 1: phases 1-2)
    (streamed per member,        + C Ekv a (the fixed dK|dV) + the most of: [C>1] one
    sub-ring step >= 1)          member's (Eq + 2 Eo) e + El a (broadcast) + its held copies
                                 + 3 Eq a (dQ accumulators), and (C > 1) the last pass's last
                                 step: [not this rank's pass] one member's side + one held
                                 copy + 3 Eq a + init Ekv a (piece 0's reverse landing)
                                 + kernel call's bf16 gradients: ring (Eq + Ekv / 2) e,
                                 team (Eq + Ekv) e (n query rows, n keys)
    backward, rotation "q",      kept + one member's (Eq + 2 Eo) e + El a + 2 Eq a (dQ)
    G = 1 (piece-major)          + the most, over pieces j, of [regathered] (1 + [j<C-1](1 +
                                 init)) Ekv e (pieces of K, V) + (1 + [j>=1](1 + init) +
                                 [j>=m+2]) Ekv a (dK|dV: piece j's, [the previous one's sent
                                 and back], own rows, reduced once piece m+1 is sent back;
                                 m this rank's member index) + kernel call (Eq / 2 + Ekv) e

"held" is a second copy of the circulating payload once it has moved (``G > 1``), two
while the next one lands (``G > 2``). A backward kernel call's gradients are in the input
dtype (:func:`megatron_startrail.blocks.backward_step` adds them into the float32
accumulators and frees them before the next call); rotation "kv" hands the kernel dO and
out as slices of the gathered dO | out, which it copies dense. The reverse initial send's
landing comes after the sub-ring with rotation "kv" (the team's query side freed first):
never at its peak. The forward call is one call's output and lse and the merge's float32 copy of that output
(:func:`megatron_startrail.blocks.merge_lse_`): ``Eo (e + a) + 2 El a`` for ring attention,
whose calls take a rank's two chunks at once, half that in a team (one chunk per call).
``benchmarks/fake_cuda_memory.py`` measures all of it at GPU scale on fake CUDA. Backend buffers
(gloo's staging copies of collectives, a fused kernel's workspace) are not modelled:
``benchmarks/memory.py`` measures them, and the tests bound the model's error against it.
"""

from __future__ import annotations

from ..accounting import AttentionShape, choose_backward_rotation, kept_for_backward_bytes, startrail_rank_elements
from ..topology import StarTrailTopology


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
    # Phase 2 (Note [streamed initial send] in team.py): with C > 1 the team's K, V are
    # broadcast a piece at a time into the send, two pieces held for sending, and land whole;
    # with C = 1 this rank's k | v is sent as it is, to a landing of its own.
    sending = init * (2 * ekv * e if c > 1 else team_kv)
    phases_1_2 = team_kv + sending
    # K, V in the sub-ring: step 0 the landing (and its sends) and the next hop; from step 1
    # (G > 2) three: the step-0 payload (held by the forward, which keeps it or passes it to
    # the sub-ring), the one attended to and the next hop landing.
    kv_ring = max(phases_1_2 + (team_kv if g > 1 else 0), 3 * team_kv if g > 2 else 0)
    # One forward kernel call: its output and lse, and the merge's float32 copy of the output
    # and share (blocks.merge_lse_). Its rows: ring attention's calls take this rank's two
    # chunks at once, a team's one chunk (half a rank's rows).
    call = (eo * (e + a) + 2 * el * a) // (1 if c == 1 else 2)
    partials = c * (eo + el) * a
    forward = ulysses + team_q + kv_ring + partials + call
    if c > 1:  # phase 4: the float32 partials beside their copy in the input dtype, then the merge
        kept_in_forward = (0 if regathers else team_kv + (team_q if rotation == "kv" else 0))
        merge = max(partials + c * eo * e, c * eo * e + 3 * eo * a + 2 * c * el * a)
        forward = max(forward, ulysses + kept_in_forward + merge)

    held_copies = 0 if g == 1 else (1 if g == 2 else 2)
    # Gradient accumulators of the sub-ring (schedule.rotate): from step 1, this step's, the
    # previous step's still being sent and the one received. G = 1: the step's gradients
    # assembled from its pieces (C pieces) beside the one piece being computed.
    member = topo.member_of(startrail_rank)
    if rotation == "kv":
        # Regathered: team Q and the team's K, V landing (the pieces' send buffers are done
        # with by then, except, G = 1, the last piece's, held by its transfer until step 0,
        # the only step, ends).
        regathered = (team_q + team_kv + (init * ekv * e if g == 1 else 0) if c > 1 else team_q + phases_1_2) \
            if regathers else 0
        query_side = c * 2 * eo * e + (c * el * a if c > 1 else 0)
        dkv = 3 * c * ekv * a if g > 1 else (c + 1) * ekv * a
        # One kernel call's bf16 gradients and its dense copies of dO and out (the fixed side
        # holds them side by side): ring attention's calls take a rank's n query rows against
        # one chunk (n/2) of keys, a team's one chunk of queries against a member's n keys.
        call = (eq + 2 * eo) * e + ekv * e // 2 if c == 1 else (eq + 2 * eo) * e // 2 + ekv * e
        # The reverse initial send's landing comes after the sub-ring, once the team's query
        # side is freed: never at the peak.
        backward = ulysses + kept + regathered + query_side + c * eq * a + held_copies * team_kv + dkv + call
    else:
        if not regathers and u == 1:
            kept -= eq * e  # rotation "q" keeps this rank's own q: the caller's tensor
        side = (eq + 2 * eo) * e + el * a  # one member's q, dO, out, lse
        if topo.one_position_sub_rings:  # Note [piece-major rotation q]: one piece of K, V at a time
            # While piece j computes: K, V regathered: piece j, [the next one landing and
            # its send buffer]; dK, dV: piece j's, [the previous piece's, still being sent,
            # and its reverse landing; this rank's own rows, reduced once piece j-1 is sent
            # back, after piece member+1's compute]. dQ: this member's and one block's.
            def pieces(j: int) -> int:
                kv = (1 + (j < c - 1) * (1 + init)) * ekv * e if regathers else 0
                in_flight = (j >= 1) * (1 + init)
                own_rows = j >= member + 2
                return kv + (1 + in_flight + own_rows) * ekv * a

            call = (eq // 2 + ekv) * e  # one call: a chunk of queries (n/2 rows), a piece's n keys
            backward = ulysses + kept + max(pieces(j) for j in range(c)) + side + 2 * eq * a + call
        else:  # Note [streamed rotation q]: one member's query side at a time, K, V fixed
            # Regathered: the team's K, V landing (or ring attention's k | v and its send).
            regathered = (team_kv if c > 1 else phases_1_2) if regathers else 0
            # Steps >= 1 of a pass whose member is not this rank: its side broadcast here,
            # held copies of it, 3 dQ accumulators (1 at G = 1: not streamed here).
            accumulators = 3 * eq * a
            passing = (side if c > 1 else 0) + held_copies * side + accumulators
            if c > 1:  # the last pass's last step: no next hop landing, piece 0's reverse landing
                last = (side if member != c - 1 else 0) + side + accumulators + init * ekv * a
                passing = max(passing, last)
            # One call's bf16 gradients: ring attention's take n query rows against a chunk
            # (n/2) of keys; a team's streamed passes a member's n query rows against a piece's n.
            call = (eq + ekv // 2) * e if c == 1 else (eq + ekv) * e
            backward = ulysses + kept + regathered + c * ekv * a + passing + call
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
