"""StarTrail attention: the autograd Function and the functional entry point.

Forward on StarTrail position ``r`` (team ``t``, member ``m``; docs/design.md, "Rank math")::

    1. team all-gather      q [n, b, h, dqk], k|v [n, b, hkv, dqk + dv]  ->  [C*n, ...]
    2. initial send          team K, V to init_send_dst(r), in C pieces  (paper Alg. 2)
                             (one per member's n rows)
    3. sub-ring, G steps     attend team queries to the K, V held, pass
                             K, V to the next; step 0 takes each piece   (paper Alg. 3)
                             of phase 2 as it lands: wait, pass on, attend
    4. team merge            partial (out, lse) of the team's queries ->
                             each member merges its own rows in float32   (reduce-scatter
                                                                            with lse merge)
Backward (paper 3.2.1): [with ``regather_in_backward``: phases 1-2 again, from this
rank's q, k, v;] all-gather dO, out, lse in the team; run the same sub-ring schedule
with either Q-side or K/V-side circulating (``rotation``), step 0 again taking the
initial send's pieces as they land; send dK, dV back along the reverse of the initial
send, in the same pieces (rotation "q": each as soon as the last step has computed it;
"kv": once the accumulators are home); reduce-scatter dQ, dK, dV in the team.

Memory: without regathering the forward keeps the team's Q and the K, V of the
initial send for the backward (``3C`` shares with MHA instead of ring attention's 3);
with it, only this rank's q, k, v, out and lse, what ring attention keeps, for one
more team all-gather and initial send per backward (Note [regather] in docs/memory.md).

Head dims: V may have its own head dim ``dv`` (Multi-Latent Attention); K and V travel
side by side in the last dim, so nothing is padded.

Packed documents change none of these phases: the rows every rank holds are described
by segments of documents (Note [documents] in :mod:`megatron_startrail.layout`), and the
block planner only pairs rows of the same document.
"""

from __future__ import annotations

import torch

from . import blocks
from . import max_logit as max_logits
from .accounting import AttentionShape, choose_backward_rotation
from .comm import CommStats, Communicator
from .compile_boundary import compile_boundary
from .documents import agree_on_documents
from .backward import backward_kv, backward_q
from .groups import StarTrailGroups
from .halo import halo_attn, halo_plan
from .kernels import LayerKernel, choose_layer_kernel
from .initial_send import PieceTransfer
from .layout import normalize_window, segment_rows
from .schedule import rotate
from .sinks import check_sink, local_sink, sink_grad
from .team import gather_team_and_send, team_segments
from .timeline import Timeline
from .transfer import TRANSFERS, LaneSplit, sub_ring_lanes
from .ulysses import gather_sequence, scatter_sequence

SUPPORTED_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


# -- the phases; the forward runs 1-4 (phases 1-2 in team.py, shared with the backward) -------


def _sub_ring_forward(comm, groups, docs, kernel, transfer, q_team, kv_init: PieceTransfer, *, causal, scale,
                      window=None, max_logit=None):
    """Phase 3 (paper Alg. 3): the team's queries against the K, V circulating in the
    sub-ring, step 0 attending to each piece of the initial send as it lands; returns the
    partial ``acc_out [b, h, C*n, dv]``, ``acc_lse [b, h, C*n]`` and the row runs no call
    reached (with C > 1 their out rows are left unwritten, Note [unseen rows] in blocks.py).
    ``max_logit [h]``: raised by every call's largest ``q . k`` (:mod:`.max_logit`)."""
    topo, pos = groups.topology, groups.startrail_rank
    rows = q_team.shape[0]
    fresh = blocks.FreshRows(rows)  # Note [fresh rows] in blocks.py
    dv = (kv_init.tensor if kv_init.tensor is not None else kv_init.piece(0)).shape[-1] - q_team.shape[-1]
    acc_out, acc_lse = blocks.new_partials(q_team, dv, fresh)
    q_segments = team_segments(groups, docs, topo.team_of(pos))
    if kv_init.tensor is None:  # a buffer per piece (Note [kept pieces]): one position, nothing circulates
        kv_segments = team_segments(groups, docs, topo.kv_team_at_step(pos, 0))
        for j, (a, b) in enumerate(kv_init.bounds):  # step 0 alone: each piece as it lands
            blocks.forward_step(kernel, q_team, kv_init.piece(j), q_segments, segment_rows(kv_segments, a, b),
                                acc_out, acc_lse, causal=causal, scale=scale, window=window,
                                max_rows=rows // groups.team_size, fresh=fresh, max_logit=max_logit)
        return acc_out, acc_lse, blocks.fill_unseen(acc_out, acc_lse, fresh, out=groups.team_size == 1)
    kv_rot = LaneSplit(
        sub_ring_lanes(topo, pos, transfer), rows,
        lambda origin: team_segments(groups, docs, topo.kv_team_at_step(origin, 0)),
    )

    def attend(step, payloads, part_rows):
        for lane_index, (lane, (kv,), kv_rows) in enumerate(zip(kv_rot.lanes, payloads, part_rows)):
            k_segments = kv_rot.part_segments(lane.origin(pos, step), lane_index, kv_rows)
            blocks.forward_step(kernel, q_team, kv, q_segments, k_segments, acc_out, acc_lse,
                                causal=causal, scale=scale, window=window, max_rows=rows // groups.team_size,
                                fresh=fresh, max_logit=max_logit)

    rotate(comm, kv_rot.lanes, pos, kv_rot.split([kv_init.tensor]), attend, op="sub_ring",
           pieces=kv_rot.pieces(kv_init))
    # In a team the rows no call reached keep their out unwritten: the merge writes them 0 in
    # its exchange buffer (Note [unseen rows] in blocks.py); alone, out is the result.
    return acc_out, acc_lse, blocks.fill_unseen(acc_out, acc_lse, fresh, out=groups.team_size == 1)


def _team_merge(comm, groups, partials: list[torch.Tensor], dtype, sink=None):
    """Phase 4: member ``m`` merges rows ``[m*n, (m+1)*n)`` of the team's partial results
    ``partials = [acc_out [b, h, C*n, dv], acc_lse [b, h, C*n], unseen]`` (emptied: they are
    freed once sent; ``unseen``: the row runs no call reached, their out rows unwritten when
    C > 1); returns ``out [n, b, h, dv]`` (``dtype``) and ``lse [n, b, h]`` (accumulator
    dtype), normalised with the attention sinks ``sink [h]`` when given (:mod:`.sinks`)."""
    c = groups.team_size
    acc_out, acc_lse, unseen = partials
    partials.clear()
    b, h, rows, dv = acc_out.shape
    n = rows // c
    if c == 1:
        return blocks.finished(acc_out, acc_lse, dtype, sink)  # [n, b, h, dv], [n, b, h]
    # [b, h, C*n, dv] -> [C (destination member), b, h, n, dv], cast and made dense (the
    # exchange takes it as it is: no second, contiguous copy of the cast), unseen rows 0.
    parts = blocks.exchange_parts(acc_out, unseen, c, dtype)
    part_lse = acc_lse.view(b, h, c, n).permute(2, 0, 1, 3)
    del acc_out, acc_lse
    # Both exchanges fly at once.
    parts = comm.all_to_all(parts, groups.team_group, c, op="team_merge", wait=False)
    part_lse = comm.all_to_all(part_lse, groups.team_group, c, op="team_merge", wait=False)
    # [n, b, h, dv] in dtype, [n, b, h]: the sinks and the cast inside the merge (Note [merged in place])
    return blocks.merge_partials(parts.wait(), part_lse.wait(), dtype, sink)


def layer_kernel(q, k, v, groups: StarTrailGroups, causal: bool, window, cu_seqlens, cu_seqlens_padded) -> LayerKernel:
    """The block kernel of one layer call, chosen once at the entry (before any communication)
    for the layer's class (kernels.measured): the mask ("window" when ``window`` bounds
    anything, else "causal" or "none") and whether the call packs documents (``cu_seqlens`` of
    more than one document, or per-document padding: what the agreed documents will say).
    Host facts only: no sync. ValueError naming ``--startrail-kernel`` when a forced kernel
    cannot take q, k, v."""
    mask = "window" if window is not None else "causal" if causal else "none"
    # (anything but a [2] tensor counts as packed here: the agreement names what is wrong with it)
    one_document = tuple(getattr(cu_seqlens, "shape", ()))[:1] == (2,)
    packed = cu_seqlens is not None and (cu_seqlens_padded is not None or not one_document)
    return choose_layer_kernel(q, k, v, groups.kernel, groups.config.deterministic, mask=mask, packed=packed)


def keeps_pieces(groups: StarTrailGroups, rotation: str, regather: bool) -> bool:
    """Note [kept pieces] (backward.py): whether the forward keeps the initial send's K, V as a
    tensor per piece, which the backward frees piece by piece."""
    return (rotation == "q" and not regather and groups.team_size > 1
            and groups.topology.one_position_sub_rings)


def regathers_for_free(groups: StarTrailGroups) -> bool:
    """Phases 1-2 move nothing on this rank (C = 1, initial send to itself: ring attention),
    so the backward always rebuilds their output from the inputs instead of keeping it."""
    topo, pos = groups.topology, groups.startrail_rank
    return topo.team_size == 1 and topo.init_send_dst(pos) == pos


class _StarTrailAttention(torch.autograd.Function):
    """Exact attention over the StarTrail group, on post-Ulysses local tensors.

    Kept for backward: the team's gathered Q and the K, V after the initial send
    (``C`` and ``2C`` times this rank's share), or, with ``regather`` (and always when
    phases 1-2 move nothing), only this rank's q, k, v, like ring attention; the backward
    then re-runs phases 1-2.

    With ``max_logit`` the forward returns ``(out, max_logit [h])`` too: the largest scaled
    logit per head of this rank's kernel calls (:mod:`.max_logit`; not differentiable).
    """

    @staticmethod
    def forward(ctx, q, k, v, sink, groups: StarTrailGroups, docs, causal, scale, rotation, transfer, regather,
                fwd_stats, bwd_stats, timeline, window, layer: LayerKernel, max_logit=False):
        # q [n, b, h, dqk], k [n, b, hkv, dqk], v [n, b, hkv, dv]; n = len(my chunks) * L;
        # sink [h] or None (attention sinks of these heads, :mod:`.sinks`); ``layer``: the kernel
        # chosen at the entry (startrail_attn), the one the forward's and backward's block steps call
        kernel = layer.kernel
        comm = Communicator(fwd_stats, groups.transports_on(q.device)[0], timeline)
        ctx.regather = regather or regathers_for_free(groups)
        # Note [kept pieces]: rotation "q" on one-position sub-rings keeps K, V a piece per buffer
        ctx.kept_pieces = keeps_pieces(groups, rotation, ctx.regather)
        q_team, kv_init = gather_team_and_send(comm, groups, q, k, v, gather_op="team_all_gather",
                                                send_op="init_send", whole=not ctx.kept_pieces)
        best = max_logits.new_accumulator(q) if max_logit else None
        partials = list(_sub_ring_forward(comm, groups, docs, kernel, transfer, q_team, kv_init, causal=causal,
                                          scale=scale, window=window, max_logit=best))
        # What the backward does not take is freed before the merge (peak memory): the team's
        # Q unless rotation "kv" keeps it, the initial send's K, V when regathering; the
        # partial results are dropped inside the merge once exchanged.
        if ctx.kept_pieces:
            kept_kv = [kv_init.piece(j) for j in range(len(kv_init.bounds))]
        else:
            kept_kv = [] if ctx.regather else [kv_init.tensor]
        kept_q_team = q_team if not ctx.regather and rotation != "q" else None
        del q_team, kv_init
        out, lse = _team_merge(comm, groups, partials, q.dtype, sink)  # with the sink: what the backward takes

        if ctx.regather:
            ctx.save_for_backward(q, k, v, out, lse)
        elif rotation == "q":  # the backward takes the team's queries member by member: keep only this rank's
            ctx.save_for_backward(q, *kept_kv, out, lse)
        else:
            ctx.save_for_backward(kept_q_team, *kept_kv, out, lse)
        del kept_kv
        ctx.groups, ctx.docs, ctx.causal, ctx.scale, ctx.kernel = groups, docs, causal, scale, kernel
        ctx.rotation, ctx.transfer, ctx.bwd_stats, ctx.timeline = rotation, transfer, bwd_stats, timeline
        ctx.window, ctx.sink, ctx.kept_pieces_freed = window, sink, False
        if best is None:
            return out
        best = max_logits.finish(best, scale)  # [h] of the heads this rank attends
        ctx.mark_non_differentiable(best)
        ctx.set_materialize_grads(False)  # no zeros made for max_logit's gradient (dout always comes)
        return out, best

    @staticmethod
    def backward(ctx, dout, *_):  # no gradient for max_logit
        # Unpacked once: saved-tensor hooks run at every read, and some allow one (torch's
        # non-reentrant checkpoint raises on a second; offloading would copy twice).
        saved = list(ctx.saved_tensors)
        dsink = None
        if ctx.needs_input_grad[3]:  # from out', lse' as saved (the last two), before the backward frees them
            dsink = sink_grad(dout, saved[-2], saved[-1], ctx.sink)
        dq, dk, dv = (backward_q if ctx.rotation == "q" else backward_kv)(ctx, dout, saved)
        return (dq, dk, dv, dsink) + (None,) * 13


def _window(window_size, causal: bool) -> tuple[int, int] | None:
    """``window_size`` as ``(left, right)`` ints, or None when it bounds nothing (-1, -1)."""
    if window_size is None:
        return None
    try:
        left, right = (int(x) for x in window_size)
    except (TypeError, ValueError):
        raise ValueError(f"window_size must be (left, right) with -1 for unbounded, got {window_size!r}") from None
    if left < -1 or right < -1:
        raise ValueError(f"window_size must be (left, right) with -1 for unbounded, got {window_size!r}")
    return (left, right) if normalize_window((left, right), causal) is not None else None


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, groups: StarTrailGroups) -> None:
    """Raise ValueError (naming the setting to change) before any communication."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.dim() != 4:
            raise ValueError(f"{name} must be [s_local, batch, heads, head_dim], got shape {tuple(t.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dtype not in SUPPORTED_DTYPES:
        raise ValueError(f"dtype {q.dtype} is not supported; use one of {SUPPORTED_DTYPES}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(f"k and v must agree in [s_local, batch, kv_heads], got {tuple(k.shape)} and {tuple(v.shape)}")
    if q.shape[:2] != k.shape[:2] or q.shape[3] != k.shape[3]:
        raise ValueError(
            f"q {tuple(q.shape)} and k {tuple(k.shape)} must agree in s_local, batch and head_dim "
            "(v may have its own head dim)"
        )
    s_local, heads, kv_heads = q.shape[0], q.shape[2], k.shape[2]
    cp = groups.cp_size
    if s_local % 2 != 0:
        raise ValueError(
            f"the sequence must be divisible by 2 * context-parallel size = {2 * cp} (each CP rank holds "
            f"two chunks), but a rank holds {s_local} tokens: change --seq-length"
        )
    if kv_heads == 0 or heads % kv_heads != 0:
        raise ValueError(f"query heads ({heads}) must be a multiple of kv heads ({kv_heads})")
    u = groups.ulysses_size
    if u > 1:
        if heads % u != 0:
            raise ValueError(
                f"attention heads on this rank ({heads}, after tensor parallelism) must be divisible by "
                f"the Ulysses degree {u}: change --ulysses-degree-in-cp (ulysses_size)"
            )
        if kv_heads % u != 0 and u % kv_heads != 0:
            raise ValueError(
                f"kv heads / query groups on this rank ({kv_heads}) must divide or be divisible by the "
                f"Ulysses degree {u}: change --ulysses-degree-in-cp (ulysses_size)"
            )


@compile_boundary  # under torch.compile: a graph break (Note [graph break at the attention])
def startrail_attn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    groups: StarTrailGroups,
    *,
    causal: bool = True,
    softmax_scale: float | None = None,
    cu_seqlens: torch.Tensor | None = None,
    cu_seqlens_padded: torch.Tensor | None = None,
    transfer: str | None = None,
    regather_in_backward: bool | None = None,
    timeline: Timeline | None = None,
    cp_group=None,
    window_size: tuple[int, int] | None = None,
    halo_exchange: bool = True,
    softmax_offset: torch.Tensor | None = None,
    return_max_logit: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Exact softmax attention over the whole context-parallel group.

    ``q [s_local, b, heads, dim]``, ``k``/``v`` ``[s_local, b, kv_heads, dim]`` in
    Megatron's CP layout (CP rank ``r`` holds chunks ``r`` and ``2*CP-1-r``); returns
    ``[s_local, b, heads, v_dim]``. GQA/MQA: ``kv_heads`` divides ``heads`` and K/V are
    never replicated to the query heads inside the ring. ``v`` may have its own head dim
    (Multi-Latent Attention); the output has it too.

    ``transfer`` and ``regather_in_backward`` default to the groups' configuration
    (``groups.config``, a :class:`~megatron_startrail.config.StarTrailConfig`).

    ``regather_in_backward=True`` keeps only what ring attention keeps for the backward
    (q, k, v, out, lse of this rank) and re-runs the team all-gather and the initial send
    in the backward (Megatron: ``--startrail-regather-in-backward``).

    Packed documents (Note [documents] in :mod:`megatron_startrail.layout`): with
    ``cu_seqlens`` (int32 ``[n_docs + 1]``, global, the same on every CP rank) attention
    stays inside each document. Without ``cu_seqlens_padded`` the whole packed sample is
    zigzagged (Megatron pretraining); with it every document's padded span is zigzagged
    on its own (Transformer Engine THD, Megatron SFT) and padding rows give 0 output and
    0 gradients. Packed input may be ``[t_local, heads, dim]`` (THD; the output is too)
    or ``[t_local, 1, heads, dim]``.

    ``transfer="multiring"`` spreads each sub-ring transfer over the ``G - 1``
    arc-disjoint Hamiltonian cycles of the sub-ring's ranks (TASP), for sub-rings inside
    a fully connected node; ``"ring"`` is StarTrail's single sub-ring.

    ``timeline`` (:class:`~megatron_startrail.timeline.Timeline`) records, forward and
    backward, the spans this rank spends blocked on each communication.

    ``window_size=(left, right)``: sliding-window attention with Megatron's and
    flash-attn's meaning (query ``i`` sees keys ``i - left .. i + right`` of its document;
    -1 is unbounded; ``right = 0`` is causal). Pairs outside the window make no kernel call
    (Note [kernel calls] in :mod:`megatron_startrail.layout`); when every query's window
    reaches only the neighbouring CP ranks' chunks, only those keys move (the halo
    exchange, :mod:`megatron_startrail.halo`), instead of the sub-ring and team phases.
    ``halo_exchange=False`` runs the schedule there too, moving every rank's K, V (to
    measure what the halo saves; benchmarks/testbed/cluster_bench.py's ``-nohalo``).

    ``cp_group`` (optional): the context-parallel process group of this rank, e.g.
    Megatron's ``pg_collection.cp``; it must hold the CP ranks the StarTrail groups were
    built for. The packed-document agreement runs on it (default: the StarTrail groups' own).

    ``softmax_offset [heads]``: attention sinks, a logit per head added to every row's softmax
    denominator (Megatron's ``--softmax-type``; :mod:`megatron_startrail.sinks`).

    ``return_max_logit=True`` returns ``(out, max_logit)``, as Transformer Engine's attention
    does for Megatron's QK-clip: ``max_logit [heads]`` (float32; float64 for float64 inputs,
    no gradient) is per head the largest ``softmax_scale * q . k`` over the pairs the mask lets
    through that this rank's kernel calls attended (sinks are not logits). This rank's pairs
    and the other CP ranks' are every pair once, so the MAX over the CP group is the whole
    sequence's (Megatron's ``clip_qk`` takes it over DP x CP); heads this rank does not attend
    after a Ulysses all-to-all are -inf (:mod:`megatron_startrail.max_logit`).
    """
    transfer, regather_in_backward = _settings(groups, transfer, regather_in_backward)
    thd = cu_seqlens is not None and q.dim() == 3
    if thd:  # [t, h, d] -> [t, 1, h, d]
        q, k, v = q.unsqueeze(1), k.unsqueeze(1), v.unsqueeze(1)
    check_inputs(q, k, v, groups)
    check_sink(softmax_offset, q.shape[2], q.device)
    window = _window(window_size, causal)
    # The kernel, chosen once for this call and carried to the schedule: a forced --startrail-kernel
    # that cannot take these inputs fails here, before any communication.
    layer = layer_kernel(q, k, v, groups, causal, window, cu_seqlens, cu_seqlens_padded)
    scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5
    stats = CommStats(), CommStats()  # forward, backward
    groups.last_forward_stats, groups.last_backward_stats = stats
    docs = agree_on_documents(cu_seqlens, cu_seqlens_padded, q.shape[0], q.shape[1], groups, stats[0], q.device,
                              cp_group)
    out = _attend(q, k, v, softmax_offset, groups, docs, stats, timeline, layer, causal=causal, scale=scale,
                  transfer=transfer, regather=bool(regather_in_backward), window=window, halo=halo_exchange,
                  max_logit=return_max_logit)
    out, best = out if return_max_logit else (out, None)
    out = out.squeeze(1) if thd else out
    return (out, best) if return_max_logit else out


def _settings(groups: StarTrailGroups, transfer, regather_in_backward) -> tuple[str, bool]:
    """The run's settings come with the groups (StarTrailConfig); a keyword given to
    :func:`startrail_attn` overrides them for one call (the functional API's tests and benchmarks)."""
    transfer = groups.config.transfer if transfer is None else transfer
    if regather_in_backward is None:
        regather_in_backward = groups.config.regather_in_backward
    if transfer not in TRANSFERS:
        raise ValueError(f"transfer={transfer!r} is not one of {TRANSFERS}")
    return transfer, regather_in_backward


def _backward_rotation(groups: StarTrailGroups, q, k, v) -> str:
    """The groups' backward rotation; for "auto" the one that moves fewer bytes for these shapes."""
    if groups.backward_rotation != "auto":
        return groups.backward_rotation
    shape = AttentionShape(q.shape[0], q.shape[1], q.shape[2], k.shape[2], q.shape[3], q.element_size(),
                           v_head_dim=v.shape[3])
    return choose_backward_rotation(shape, groups.ulysses_size, groups.team_size)


def _attend(q, k, v, sink, groups, docs, stats, timeline, layer: LayerKernel, *, causal, scale, transfer, regather,
            window, halo, max_logit=False):
    """The halo exchange where every window reaches only the CP neighbours, else (around the
    Ulysses all-to-alls) :class:`_StarTrailAttention`; ``[n, b, h, dv]``. ``sink [h]`` or None;
    ``layer``: the block kernel chosen at the entry. With ``max_logit``: ``(out, max_logit [h])``
    (:func:`startrail_attn`)."""
    fwd_stats, bwd_stats = stats
    plan = halo_plan(docs, window, causal, groups.cp_rank) if window is not None and halo else None
    if plan is not None:  # exchange just the keys the windows reach
        return halo_attn(q, k, v, sink, groups, docs, plan, window, causal, scale, layer.kernel, fwd_stats, bwd_stats,
                         timeline, max_logit)
    rotation = _backward_rotation(groups, q, k, v)
    sink = local_sink(sink, q.shape[2], groups.ulysses_size, groups.ulysses_rank)  # this rank's heads after Ulysses
    heads = q.shape[2]  # before the Ulysses all-to-all
    if groups.ulysses_size > 1:
        q, k, v = gather_sequence(q, k, v, groups, fwd_stats, bwd_stats, timeline)
    out = _StarTrailAttention.apply(q, k, v, sink, groups, docs, causal, scale, rotation, transfer, regather,
                                    fwd_stats, bwd_stats, timeline, window, layer, max_logit)
    out, best = out if max_logit else (out, None)
    if groups.ulysses_size > 1:
        out = scatter_sequence(out, groups, fwd_stats, bwd_stats, timeline)
        if best is not None:  # this rank's heads into their places among all of them
            best = max_logits.place_heads(best, heads, groups.ulysses_size, groups.ulysses_rank)
    return (out, best) if max_logit else out
