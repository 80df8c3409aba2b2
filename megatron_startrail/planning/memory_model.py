"""Closed form of the live bytes of one attention layer on one rank: what it keeps for the
backward, and the peak while its forward and backward run (the transient team buffers).

Same notation as :mod:`megatron_startrail.accounting` (``Eq``, ``Ekv``, ``Eo``, ``El``
elements per rank after the Ulysses all-to-all; ``e`` input and ``a`` accumulator element
sizes; team size ``C``; sub-ring length ``G``; ``init`` = 1 unless the initial send maps
the rank to itself). Counted: every tensor the attention allocates (the caller's q, k, v
and dO are not), at the moment its phase holds the most (docs/design.md, "Memory"). Each
phase's peak is a sum of named terms (:func:`layer_memory_terms`, one function per phase and
rotation below); every kernel call adds its kernel's workspace, ``W``, its own term
(:mod:`megatron_startrail.planning.workspace`, for that call's rows)::

    phases 1-2                   C Ekv e (the initial send's landing) + init 2 Ekv e (two
                                 pieces being sent; C = 1: init Ekv e and this rank's k | v)
    forward, sub-ring            C Eq e  (team Q; 0 for C = 1) + the most of: step 0, phases
                                 1-2 + [G>1] C Ekv e (next hop); steps >= 1 (G > 2), 3 C Ekv e
                                 (the step-0 payload, still held, this step's, the next hop)
                                 + C (Eo + El) a (partial out, lse) + forward call + W
    forward, team merge (C > 1)  what the forward keeps (team K, V; team Q for "kv") + the
                                 most of: C (Eo + El) a (partials) + C Eo e (their copy in the
                                 input dtype, sent), and C Eo e (received) + 3 Eo a + 2 C El a
    backward, rotation "kv"      kept + [regathered] team Q, team K, V (G = 1: + init Ekv e,
    (sub-ring step >= 1)         the last piece's send buffer) + [C > 1] C (2 Eo e + El a) (team
                                 dO, out, lse) + C Eq a (dQ) + held K|V + dK|dV: G > 1,
                                 3 C Ekv a (this step's, the previous one's being sent, the
                                 one received); G = 1, (C + 1) Ekv a (the step's, assembled
                                 from its pieces, and one piece's) + kernel call: its bf16
                                 dQ, dK, dV (dO, out: dense views): ring Eq e + Ekv e / 2
                                 (n query rows, a chunk of keys), team Eq e / 2 + Ekv e (a
                                 chunk of queries, n keys) + W
    backward, rotation "q"       kept + [regathered] team K, V (C = 1: phases 1-2)
    (streamed per member)        + C Ekv a (the fixed dK|dV) + with S = (Eq + 2 Eo) e + El a,
                                 one member's side: C = 1, held S + 3 Eq a (dQ accumulators);
                                 C > 1, the most of: step 0, 2 S (the broadcast, the next
                                 landing) + Eq a; steps >= 1, (1 + [G>2]) S + 3 Eq a; the last
                                 pass's last step, S + 3 Eq a + init Ekv a (piece 0's reverse
                                 landing)
                                 + kernel call's bf16 gradients: ring (Eq + Ekv / 2) e; team,
                                 at each step of each pass, that step's largest call (member
                                 i's rows against a fixed piece: n x n on the diagonal, else
                                 n x n/2 or n/2 x n by the zigzag order) + W
    backward, rotation "q",      kept + one member's (Eq + 2 Eo) e + El a + 2 Eq a (dQ)
    G = 1 (piece-major)          + the most, over pieces j, of [regathered] (1 + [j<C-1](1 +
                                 init)) Ekv e (pieces of K, V) + (1 + [j>=1](1 + init) +
                                 [j>=m+2]) Ekv a (dK|dV: piece j's, [the previous one's sent
                                 and back], own rows, reduced once piece m+1 is sent back;
                                 m this rank's member index) + kernel call (Eq / 2 + Ekv) e
                                 + W
    kept, U > 1                  + Eo e, Note [the Ulysses output kept]

"held" is a second copy of the circulating payload once it has moved (``G > 1``), two
while the next one lands (``G > 2``). A backward kernel call's gradients are in the input
dtype (:func:`megatron_startrail.blocks.backward_step` adds them into the float32
accumulators and frees them before the next call); rotation "kv" hands the kernel its rows
of the gathered dO and out as dense views (no copies). The reverse initial send's
landing comes after the sub-ring with rotation "kv" (the team's query side freed first):
never at its peak. The forward call is one call's output and lse and the merge's float32 copy of that output
(:func:`megatron_startrail.blocks.merge_lse_`): ``Eo (e + a) + 2 El a`` for ring attention,
whose calls take a rank's two chunks at once, half that in a team (one chunk per call).
``benchmarks/counters/fake_cuda_memory.py`` measures all of it at GPU scale on fake CUDA (which charges
each fused op's workspace for the op's duration), and tests/test_memory_model.py holds the model
to one H100's peaks (within 0.1% there: the backward peaks at a kernel call, with its
workspace). ``kernel="auto"`` is what the attention picks on an H100 with torch's own kernels
(FlashAttention-2 for bf16); the CPU kernels' workspace is not modelled, nor are backend buffers
(gloo's staging copies of collectives): ``benchmarks/counters/memory.py`` measures them, and the tests
bound the model's error against it.

Note [the Ulysses output kept]
------------------------------
With Ulysses (U > 1) the layer's output is the all-to-all back of StarTrail's output: a tensor
of its own, ``Eo e`` (``[n, b, h, dv]``), beside the StarTrail output the attention saves. Kept
through Megatron's recomputation (megatron/kept_attention.py), the kept graph holds it until the
backward: the recomputation hands it to the layer again without communicating. Without
recomputation ``linear_proj`` saves that same tensor as its input. Either way a U > 1 layer
holds one more ``out`` share than its attention's saved tensors (at U = 1 the output the layer
gets is the tensor the attention saves), and :func:`kept_per_layer_bytes` counts it. Not kept
would mean recomputing the all-to-all (communication) in the recomputation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..accounting import AttentionShape, choose_backward_rotation, kept_for_backward_bytes, startrail_rank_elements
from ..initial_send import reverse_overlaps
from ..kernels.selection import KernelRequest, choose_kernel
from ..topology import StarTrailTopology
from .workspace import KernelCallShape, backward_workspace_bytes, forward_workspace_bytes

# The backends a CUDA build of torch offers on an H100 (no flash-attn installed): what ``kernel="auto"``
# resolves against, through the same rules the attention's own choice applies.
_H100_TORCH = frozenset({"torch_flash", "torch_efficient", "torch_cudnn"})
_DTYPES = {2: torch.bfloat16, 4: torch.float32, 8: torch.float64}


@dataclass(frozen=True)
class _Layer:
    """What every term reads: elements per rank (``eq``, ``ekv``, ``eo``, ``el``), element sizes,
    the team and sub-ring, this rank's place in them, the resolved rotation and kernel."""

    shape: AttentionShape
    u: int
    c: int
    g: int
    e: int
    a: int
    eq: int
    ekv: int
    eo: int
    el: int
    init: int
    member: int
    one_position: bool
    rotation: str
    regathers: bool
    kernel: str
    topo: StarTrailTopology
    pos: int
    reverse_overlap: bool = True  # Note [reverse overlap] in initial_send.py

    @property
    def team_q(self) -> int:
        return self.c * self.eq * self.e if self.c > 1 else 0

    @property
    def team_kv(self) -> int:
        return self.c * self.ekv * self.e

    @property
    def phases_1_2(self) -> int:
        # Phase 2 (Note [streamed initial send] in team.py): with C > 1 the team's K, V are
        # broadcast a piece at a time into the send, two pieces held for sending, and land whole;
        # with C = 1 this rank's k | v is sent as it is, to a landing of its own.
        return self.team_kv + self.init * (2 * self.ekv * self.e if self.c > 1 else self.team_kv)

    @property
    def held_copies(self) -> int:
        return 0 if self.g == 1 else (1 if self.g == 2 else 2)

    @property
    def ulysses(self) -> int:  # the all-to-all'd q, k, v and output
        return (self.eq + self.ekv + self.eo) * self.e if self.u > 1 else 0

    def call(self, q_part: float, k_part: float) -> KernelCallShape:
        """A kernel call over ``q_part`` of this rank's query rows and ``k_part`` of its key rows."""
        s, heads = self.shape, self.shape.heads // self.u
        rows = self.eq // (heads * s.head_dim)  # tokens after the all-to-all, the batch folded in
        return KernelCallShape(int(rows * q_part), int(rows * k_part), heads, self.ekv // (rows * (s.head_dim + s.v_dim)),
                               max(s.head_dim, s.v_dim), self.e, s.batch)


def _layer(shape, cp_size, team_size, ulysses_size, startrail_rank, rotation, regather_in_backward, kernel,
           reverse_overlap: bool = True) -> _Layer:
    u, c = ulysses_size, team_size
    topo = StarTrailTopology(cp_size // u, c)
    init = int(topo.init_send_dst(startrail_rank) != startrail_rank)
    if rotation == "auto":
        rotation = choose_backward_rotation(shape, u, c)
    if kernel == "auto":  # what auto runs on an H100 with torch's own kernels
        kernel = choose_kernel(KernelRequest("cuda", _DTYPES[shape.dtype_bytes],
                                             shape.head_dim, shape.v_dim, max(1, shape.heads // shape.kv_heads),
                                             _H100_TORCH)).name
    eq, ekv, eo, el = startrail_rank_elements(shape, u)
    return _Layer(shape, u, c, topo.sub_ring_size, shape.dtype_bytes, shape.acc_bytes, eq, ekv, eo, el, init,
                  topo.member_of(startrail_rank), topo.one_position_sub_rings, rotation,
                  regather_in_backward or (c == 1 and not init), kernel, topo, startrail_rank, reverse_overlap)


def _kept(x: _Layer) -> int:
    """What the layer holds from its forward to its backward (:func:`kept_per_layer_bytes`) less
    the caller's tensors: this rank's own q, k, v where the backward reads them (U = 1)."""
    kept = kept_per_layer_bytes(x.shape, ulysses_size=x.u, team_size=x.c, regather_in_backward=x.regathers,
                                rotation=x.rotation)
    if x.u == 1 and x.regathers:
        kept -= (x.eq + x.ekv) * x.e  # this rank's own q, k, v: the caller's tensors
    elif x.u == 1 and x.rotation == "q":
        kept -= x.eq * x.e  # rotation "q" keeps this rank's own q: the caller's tensor
    return kept


def forward_terms(x: _Layer) -> dict[str, int]:
    """The forward's peak, term by term: the larger of a sub-ring step and (C > 1) the team merge."""
    # K, V in the sub-ring: step 0 the landing (and its sends) and the next hop; from step 1
    # (G > 2) three: the step-0 payload (held by the forward, which keeps it or passes it to
    # the sub-ring), the one attended to and the next hop landing.
    kv_ring = max(x.phases_1_2 + (x.team_kv if x.g > 1 else 0), 3 * x.team_kv if x.g > 2 else 0)
    # One kernel call: its output and lse, and the merge's float32 copy of the output and share
    # (blocks.merge_lse_). Ring attention's calls take this rank's two chunks at once, a team's one
    # chunk (half a rank's rows) against a member's keys.
    half = 1 if x.c == 1 else 2
    step = {"ulysses": x.ulysses, "team Q": x.team_q, "K, V in the sub-ring": kv_ring,
            "partials": x.c * (x.eo + x.el) * x.a,
            "call: out, lse, merge copy": (x.eo * (x.e + x.a) + 2 * x.el * x.a) // half,
            "call: workspace": forward_workspace_bytes(x.kernel, x.call(1 / half, 1 / 2 if x.c == 1 else 1))}
    if x.c == 1:
        return step
    # Phase 4: the float32 partials beside their copy in the input dtype, then the merge.
    kept_in_forward = 0 if x.regathers else x.team_kv + (x.team_q if x.rotation == "kv" else 0)
    partials, sent = x.c * (x.eo + x.el) * x.a, x.c * x.eo * x.e
    merge = {"ulysses": x.ulysses, "kept": kept_in_forward,
             "merge": max(partials + sent, sent + 3 * x.eo * x.a + 2 * x.c * x.el * x.a)}
    return step if sum(step.values()) >= sum(merge.values()) else merge


def _kv_backward_terms(x: _Layer) -> dict[str, int]:
    """Rotation "kv", a sub-ring step >= 1: the team's query side held whole, K|V circulating."""
    # Regathered: team Q and the team's K, V landing (the pieces' send buffers are done with by
    # then, except, G = 1, the last piece's, held by its transfer until step 0, the only step, ends).
    regathered = (x.team_q + x.team_kv + (x.init * x.ekv * x.e if x.g == 1 else 0) if x.c > 1
                  else x.team_q + x.phases_1_2) if x.regathers else 0
    # One kernel call: ring attention's take a rank's n query rows against one chunk (n/2) of keys,
    # a team's one chunk of queries against a member's n keys; its bf16 gradients (dO and out are
    # gathered each into its own tensor: the call's rows are dense views of them). The reverse initial send's
    # landing comes after the sub-ring, once the team's query side is freed: never at the peak.
    q_part, k_part = (1, 1 / 2) if x.c == 1 else (1 / 2, 1)
    return {"regathered": regathered, "team dO, out, lse": (x.c * (2 * x.eo * x.e + x.el * x.a) if x.c > 1 else 0),
            "dQ": x.c * x.eq * x.a, "held K|V": x.held_copies * x.team_kv,
            # This step's dK|dV, the previous one's being sent and the one received; G = 1: the
            # step's, assembled from its C pieces, beside the one piece being computed.
            "dK|dV": 3 * x.c * x.ekv * x.a if x.g > 1 else (x.c + 1) * x.ekv * x.a,
            "call: gradients": int((x.eq * q_part + x.ekv * k_part) * x.e),
            "call: workspace": backward_workspace_bytes(x.kernel, x.call(q_part, k_part))}


def _piece_major_terms(x: _Layer) -> dict[str, int]:
    """Rotation "q" with one position per sub-ring (Note [piece-major rotation q]): one piece of K, V at a time."""
    # While piece j computes: K, V regathered: piece j, [the next one landing and its send
    # buffer]; kept (Note [kept pieces] in backward.py): pieces j .. C-1, the earlier ones freed;
    # dK, dV: piece j's, [the previous piece's, still being sent, and its reverse landing, where
    # they fly while piece j computes (Note [reverse overlap] in initial_send.py); this rank's own
    # rows, reduced once they have landed: after piece member+1's compute, or before it without the overlap].
    flies = reverse_overlaps(x.c, x.ekv * x.e, x.ekv * x.a, regathered=x.regathers, overlap=x.reverse_overlap)
    own_reduced = x.member + 1 + (x.member + 1 < x.c and flies[x.member + 1])  # the first piece holding them

    def pieces(j: int) -> int:
        kv = ((1 + (j < x.c - 1) * (1 + x.init)) if x.regathers else x.c - j) * x.ekv * x.e
        return kv + (1 + flies[j] * (1 + x.init) + (j >= own_reduced)) * x.ekv * x.a

    return {"one member's q, dO, out, lse": (x.eq + 2 * x.eo) * x.e + x.el * x.a, "dQ": 2 * x.eq * x.a,
            "pieces of K, V and dK|dV": max(pieces(j) for j in range(x.c)),
            # One call: a chunk of queries (n/2 rows) against a piece's n keys.
            "call: gradients": (x.eq // 2 + x.ekv) * x.e,
            "call: workspace": backward_workspace_bytes(x.kernel, x.call(1 / 2, 1))}


def _call_rows(x: _Layer, q_pos: int, k_pos: int) -> tuple[float, float]:
    """The parts of its rows a backward call of position ``q_pos``'s queries against ``k_pos``'s
    keys takes, in Megatron's zigzag layout (position p: chunks p and 2P-1-p): itself, both
    against both (causal); later queries, both chunks against the keys' first; earlier, the
    queries' second chunk against both."""
    return (1, 1) if q_pos == k_pos else ((1, 1 / 2) if q_pos > k_pos else (1 / 2, 1))


def _streamed_q_terms(x: _Layer, pos: int) -> dict[str, int]:
    """Rotation "q" (Note [streamed rotation q]): one member's query side at a time, K, V fixed."""
    # Regathered: the team's K, V landing (or ring attention's k | v and its send).
    regathered = (x.team_kv if x.c > 1 else x.phases_1_2) if x.regathers else 0
    # A pass's payloads are one member's side (q, dO, out, lse); the step-0 one is the broadcast
    # (this rank's own, the caller's, at C = 1), freed once it has moved on. dQ accumulators: the
    # step's own, and from step 1 the previous one's being sent and the one received.
    side, dq = (x.eq + 2 * x.eo) * x.e + x.el * x.a, x.eq * x.a

    def call(q_part: float, k_part: float) -> dict[str, int]:
        return {"call: gradients": int((x.eq * q_part + x.ekv * k_part) * x.e),
                "call: workspace": backward_workspace_bytes(x.kernel, x.call(q_part, k_part))}

    fixed = {"regathered": regathered, "fixed dK|dV": x.c * x.ekv * x.a}
    if x.c == 1:  # steps >= 1: the payload (G > 2: and the next one landing); n query rows, n/2 keys
        return {**fixed, "passing query side, dQ": x.held_copies * side + 3 * dq, **call(1, 1 / 2)}
    # C > 1, at every step of every member's pass: step 0, the broadcast and the next landing;
    # steps >= 1, the payload [and the next landing]; the last pass's last step, piece 0's
    # reverse landing too. The calls: member i of the team s sub-ring steps back against each
    # piece of the fixed K, V (the initial send's team).
    group, j = divmod(x.topo.team_of(pos), x.g)
    kv_team = x.topo.kv_team_at_step(pos, 0)
    moments = []
    for i in range(x.c):
        for step in range(x.g):
            last = step == x.g - 1
            held = (2 * side + dq) if step == 0 else ((1 if last else 2) * side + 3 * dq)
            held += x.init * x.ekv * x.a if last and i == x.c - 1 else 0
            q_pos = x.topo.position(group * x.g + (j - step) % x.g, i)
            calls = [call(*_call_rows(x, q_pos, x.topo.position(kv_team, m))) for m in range(x.c)]
            moments.append({**fixed, "passing query side, dQ": held, **max(calls, key=lambda t: sum(t.values()))})
    return max(moments, key=lambda t: sum(t.values()))


def backward_terms(x: _Layer) -> dict[str, int]:
    """The backward's peak (at a kernel call of a sub-ring step), term by term."""
    terms = _kv_backward_terms(x) if x.rotation == "kv" else (
        _piece_major_terms(x) if x.one_position else _streamed_q_terms(x, x.pos))
    kept = _kept(x)
    if x.rotation == "q" and x.one_position and not x.regathers and x.c > 1:
        kept -= x.team_kv  # the kept pieces of K, V: counted piece by piece (_piece_major_terms)
    return {"ulysses": x.ulysses, "kept": kept, **terms}


def layer_memory_terms(shape: AttentionShape, *, cp_size: int, team_size: int, ulysses_size: int = 1,
                       startrail_rank: int = 1, rotation: str = "auto", regather_in_backward: bool = False,
                       kernel: str = "auto", reverse_overlap: bool = True) -> dict[str, dict[str, int]]:
    """``{"kept": {...}, "forward": {...}, "backward": {...}}``: each phase's peak as named terms
    (bytes) that sum to it. ``kernel``: whose workspace (planning/workspace.py); ``auto``: what
    the attention picks on an H100 with torch's kernels. ``reverse_overlap``: the setting of that
    name (Note [reverse overlap] in initial_send.py)."""
    x = _layer(shape, cp_size, team_size, ulysses_size, startrail_rank, rotation, regather_in_backward, kernel,
               reverse_overlap)
    return {"kept": {"kept": _kept(x)}, "forward": forward_terms(x), "backward": backward_terms(x)}


def layer_memory_bytes(shape: AttentionShape, *, cp_size: int, team_size: int, ulysses_size: int = 1,
                       startrail_rank: int = 1, rotation: str = "auto", regather_in_backward: bool = False,
                       kernel: str = "auto", reverse_overlap: bool = True) -> dict[str, int]:
    """``{"kept", "forward_peak", "backward_peak", "peak"}``: bytes one rank's attention keeps
    for its backward, and the most it holds live during its forward and its backward (the
    kept bytes included; the caller's inputs not): the sums of :func:`layer_memory_terms`."""
    terms = layer_memory_terms(shape, cp_size=cp_size, team_size=team_size, ulysses_size=ulysses_size,
                               startrail_rank=startrail_rank, rotation=rotation,
                               regather_in_backward=regather_in_backward, kernel=kernel,
                               reverse_overlap=reverse_overlap)
    fwd, bwd = sum(terms["forward"].values()), sum(terms["backward"].values())
    return {"kept": terms["kept"]["kept"], "forward_peak": fwd, "backward_peak": bwd, "peak": max(fwd, bwd)}


def kept_per_layer_bytes(shape: AttentionShape, *, ulysses_size: int, team_size: int, regather_in_backward: bool,
                         rotation: str = "auto") -> int:
    """What one layer holds between its forward and its backward, per rank: the attention's saved
    tensors, its inputs included (:func:`~megatron_startrail.accounting.kept_for_backward_bytes`),
    and with Ulysses (U > 1) one more ``out`` share, Note [the Ulysses output kept]."""
    kept = kept_for_backward_bytes(shape, ulysses_size=ulysses_size, team_size=team_size,
                                   regather_in_backward=regather_in_backward, rotation=rotation)
    return kept + (startrail_rank_elements(shape, ulysses_size).out * shape.dtype_bytes if ulysses_size > 1 else 0)


def memory_fallbacks(startrail_size: int, team_size: int, rotations: tuple[str, ...],
                     regathers: tuple[bool, ...] = (False, True),
                     reverse_overlap: bool = True) -> list[tuple[bool, str, bool]]:
    """The settings a memory limit tries, in order, as ``(regather, rotation, reverse overlap)``:
    for each of ``regathers``, each of ``rotations`` (as given; "q" streams the queries: a lower
    peak, the same bytes), then, on sub-rings of one position, rotation "q" without the reverse
    sends' overlap (Note [reverse overlap] in initial_send.py). The planner's ``_fitting`` and
    ``--startrail-memory-limit-gb`` for a given team size both walk this list."""
    serial = (reverse_overlap and team_size > 1 and "q" in rotations
              and StarTrailTopology(startrail_size, team_size).one_position_sub_rings)
    per_regather = [(r, reverse_overlap) for r in rotations] + ([("q", False)] if serial else [])
    return [(regather, r, overlap) for regather in regathers for r, overlap in per_regather]


def activation_peak_bytes(shape: AttentionShape, *, layers: int, cp_size: int, team_size: int,
                          ulysses_size: int = 1, regather_in_backward: bool = False, rotation: str = "auto",
                          kernel: str = "auto", reverse_overlap: bool = True) -> int:
    """Per rank, the peak of ``layers`` attention layers of one micro-batch: what each keeps
    (:func:`kept_per_layer_bytes`) plus what one layer holds beyond that while it runs (only one
    layer's forward or backward runs at a time), its kernel's workspace included."""
    kept = kept_per_layer_bytes(shape, ulysses_size=ulysses_size, team_size=team_size,
                                regather_in_backward=regather_in_backward, rotation=rotation)
    layer = layer_memory_bytes(shape, cp_size=cp_size, team_size=team_size, ulysses_size=ulysses_size,
                               regather_in_backward=regather_in_backward, rotation=rotation, kernel=kernel,
                               reverse_overlap=reverse_overlap)
    return layers * kept + layer["peak"] - layer["kept"]
