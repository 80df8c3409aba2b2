"""Block work of one sub-ring step: a few variable-length kernel calls, and the lse merge.

Tensors here are in Megatron's sequence-first layout; the rows are runs of tokens of
one document each, listed alongside as segments (Note [documents] in
:mod:`megatron_startrail.layout`); rows of padding take part in no kernel call::

    q-side   q [Sq, b, h, dqk], dout, out [Sq, b, h, dv]
             lse [b, h, Sq] (forward accumulator), [Sq, b, h] (backward)
    kv-side  kv [Sk, b, hkv, dqk + dv]   (K and V side by side in the last dim:
                                          k = kv[..., :dqk], v = kv[..., dqk:])

``dv`` may differ from ``dqk`` (Multi-Latent Attention: dqk 192, dv 128); V is never
padded to K's head dim, in memory or on the wire.

A step is the calls :func:`~megatron_startrail.layout.plan_calls` gives (Note [kernel
calls]): each takes its rows as a view where they are one run, or gathered once by an
index; its result is merged in float32 with a handful of element-wise ops, and its
gradients added back the same way. Nothing here loops over documents or window tiles.
The calls come bound to their micro-batch's device metadata (indices, ``cu_seqlens``:
views of one buffer made in one copy per micro-batch, Note [device metadata] in
:mod:`megatron_startrail.microbatch`), so a step copies nothing from the host.
"""

from __future__ import annotations

import bisect

import torch

from . import max_logit as max_logits
from .kernels import BlockKernel
from .layout import KernelCall, Segment
from .microbatch import device_calls
from .sinks import add_sink_, lse_with_sink


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """What partial results and gradients accumulate in: float32, float64 for float64 inputs."""
    return torch.float64 if dtype == torch.float64 else torch.float32


def split_kv(kv: torch.Tensor, dqk: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """``[..., dqk + dv]`` (K | V side by side, or their gradients) -> K part, V part in ``dtype``."""
    return kv[..., :dqk].to(dtype), kv[..., dqk:].to(dtype)


def new_partials(q: torch.Tensor, dv: int, fresh: FreshRows | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward's accumulators for the rows of ``q [Sq, b, h, dqk]``, before any key:
    ``acc_out [b, h, Sq, dv]`` zeros and ``acc_lse [b, h, Sq]`` -inf (accumulator dtype). With
    ``fresh`` (rows ``Sq``) they are left unwritten: the first call to reach a row writes it
    (:func:`forward_step`), and :func:`fill_unseen` the rows none reached."""
    rows, b, h = q.shape[:3]
    acc = acc_dtype(q.dtype)
    if fresh is not None:
        return q.new_empty((b, h, rows, dv), dtype=acc), q.new_empty((b, h, rows), dtype=acc)
    return q.new_zeros((b, h, rows, dv), dtype=acc), q.new_full((b, h, rows), float("-inf"), dtype=acc)


# Note [fresh rows]
# -----------------
# The accumulators (the forward's out and lse, the backward's dQ, dK, dV in float32) used
# to start as zeros / -inf, and every kernel call merged into them. The first call to reach
# a row merges into nothing: out, lse of a merge into (0, -inf) are the call's own, and
# 0 + g = g. So a buffer made with ``new_empty`` comes with a :class:`FreshRows`, a host-side
# list of the row runs no call has written yet (the calls' row runs are planned on the
# host: no sync), and a call's rows are split into those it is the first to reach (a copy)
# and the others (the merge or add). Per element of a bf16 call into float32 rows, in bytes
# read + written: the forward's merge 18 (cast 6, lerp 12) and the fill 4 become a copy of
# 6; the backward's add 10 and the fill 4 become 6. Whatever no call reached is filled once
# (zeros, -inf) before the buffer is read; calls that gather their rows by an index fill
# every unwritten row first (an index may repeat a row: its gradients are summed).


class FreshRows:
    """The runs of rows ``[a, b)`` of a buffer that no call has written yet (Note [fresh rows])."""

    def __init__(self, rows: int) -> None:
        self._unwritten = [(0, rows)] if rows else []

    def take(self, a: int, b: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """Rows ``[a, b)`` are being written: returns the runs of them unwritten until now and
        the runs already written (absolute rows, in order), and marks them all written."""
        fresh, left = [], []
        for lo, hi in self._unwritten:
            x, y = max(lo, a), min(hi, b)
            if x >= y:
                left.append((lo, hi))
                continue
            fresh.append((x, y))
            left += [r for r in ((lo, x), (y, hi)) if r[0] < r[1]]
        self._unwritten = left
        written, pos = [], a
        for x, y in fresh:
            if pos < x:
                written.append((pos, x))
            pos = y
        if pos < b:
            written.append((pos, b))
        return fresh, written

    def unwritten(self, runs) -> bool:
        """Whether every row of ``runs`` (row runs ``(a, b)``: a gathered call's) is unwritten and no
        row repeats (a call that gathers such rows may write them instead of adding to them)."""
        ordered = sorted(r for r in runs if r[0] < r[1])
        if any(x[1] > y[0] for x, y in zip(ordered, ordered[1:])):
            return False
        return all(any(lo <= a and b <= hi for lo, hi in self._unwritten) for a, b in ordered)

    def fill(self, fill_rows) -> None:
        """``fill_rows(a, b)`` for every run still unwritten; then none is."""
        for a, b in self._unwritten:
            fill_rows(a, b)
        self._unwritten = []


def fill_unseen(acc_out: torch.Tensor, acc_lse: torch.Tensor, fresh: FreshRows | None, *,
                out: bool = True) -> list[tuple[int, int]]:
    """The forward's accumulators' rows no call reached: out 0, lse -inf (they saw no key).
    Returns those row runs. ``out=False`` leaves their out rows unwritten: the team merge
    zeroes them in its exchange buffer instead (:func:`exchange_parts`)."""
    runs: list[tuple[int, int]] = []

    def fill_rows(a: int, b: int) -> None:
        runs.append((a, b))
        if out:
            acc_out[:, :, a:b].zero_()
        acc_lse[:, :, a:b].fill_(float("-inf"))

    if fresh is not None:
        fresh.fill(fill_rows)
    return runs


def exchange_parts(acc_out: torch.Tensor, unseen: list[tuple[int, int]], c: int, dtype: torch.dtype) -> torch.Tensor:
    """The team merge's all-to-all buffer: ``acc_out [b, h, C*n, dv]`` (rows ``unseen`` left
    unwritten, :func:`fill_unseen`) as ``[C (destination member), b, h, n, dv]`` in ``dtype``,
    dense. The rows some call reached are cast in, those none reached written 0 here (Note
    [unseen rows])."""
    b, h, rows, dv = acc_out.shape
    n = rows // c
    parts = acc_out.new_empty((c, b, h, n, dv), dtype=dtype)
    if not unseen:  # cast and made dense in one copy
        parts.copy_(acc_out.view(b, h, c, n, dv).permute(2, 0, 1, 3, 4))
        return parts
    unseen = sorted(unseen)  # disjoint runs
    starts = [a for a, _ in unseen]
    edges = sorted({0, rows} | {e for run in unseen for e in run} | set(range(n, rows, n)))
    for x, y in zip(edges, edges[1:]):  # runs of one member's rows, each seen or unseen whole
        j, i = x // n, bisect.bisect_right(starts, x) - 1
        rows_of_part = parts[j, :, :, x - j * n : y - j * n]
        if i >= 0 and x < unseen[i][1]:
            rows_of_part.zero_()
        else:
            rows_of_part.copy_(acc_out[:, :, x:y])
    return parts


# Note [unseen rows]
# ------------------
# A team member's partial has rows its K, V never reach (causal: the team's queries before all
# of them; at P8 C2, 128K, half the team's rows). Zeroed in the float32 accumulator and then
# cast into the exchange buffer, each such element cost 8 + 8 bytes (read + written, as the
# layer-traffic count has it); written 0 straight into the bf16 buffer it costs 4. The seen
# rows are cast run by run (a few runs: a member's rows, cut where a run of unseen ones starts
# or ends). Their lse is -inf, so the merge weighs them 0 as before.


def finished(acc_out: torch.Tensor, acc_lse: torch.Tensor, dtype: torch.dtype,
             sink: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Merged accumulators as the attention's result: ``out [Sq, b, h, dv]`` in ``dtype`` and
    ``lse [Sq, b, h]`` (accumulator dtype; sequence first, as the backward takes them). With
    attention sinks ``sink [h]``, each row's final normalisation first, in the accumulator
    dtype (:func:`~megatron_startrail.sinks.add_sink_`; in place on the accumulators)."""
    if sink is not None:
        add_sink_(acc_out, acc_lse, sink)
    # Cast and made sequence first in one copy each (``.to`` of the permuted view keeps its
    # strides, and ``.contiguous()`` would copy it once more).
    b, h, rows, dv = acc_out.shape
    out = acc_out.new_empty((rows, b, h, dv), dtype=dtype)
    out.copy_(acc_out.permute(2, 0, 1, 3))
    return out, acc_lse.permute(2, 0, 1).contiguous()


def merge_lse_(acc_out: torch.Tensor, acc_lse: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    """In place: fold a partial (out, lse) into the accumulator (out ``[b, h, s, d]``, lse ``[b, h, s]``).

    ``acc_lse = -inf`` marks rows that have seen no key yet; every row of ``lse`` must be
    finite (a kernel call's rows all see a key, Note [kernel calls]). The new part's share
    is ``e^lse / (e^acc_lse + e^lse) = sigmoid(lse - acc_lse)`` (1 where nothing was seen
    yet), so the merge is one interpolation: 4 element-wise ops, 5 with a cast.
    """
    share = torch.sigmoid(lse.to(acc_lse.dtype) - acc_lse).unsqueeze(-1)
    acc_out.lerp_(out.to(acc_out.dtype), share)
    torch.logaddexp(acc_lse, lse.to(acc_lse.dtype), out=acc_lse)


def merge_partials(outs: torch.Tensor, lses: torch.Tensor, dtype: torch.dtype | None = None,
                   sink: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge ``C`` partial results: outs ``[C, b, h, s, d]``, lses ``[C, b, h, s]`` (acc dtype).

    Without ``dtype``: the merged ``out [b, h, s, d]`` and ``lse [b, h, s]`` in the accumulator
    dtype. With ``dtype`` (the team merge's last merge, Note [merged in place]): the attention's
    result as :func:`finished` gives it, ``out [s, b, h, d]`` in ``dtype`` and ``lse [s, b, h]``,
    normalised with the sinks ``sink [h]`` when given."""
    lse = torch.logsumexp(lses, dim=0)
    if sink is not None:  # lse' = logaddexp(lse, s_h), finite: the weights below normalise by it
        lse = ref = lse_with_sink(lse, sink)
    else:
        ref = lse.masked_fill(lse.isneginf(), 0.0)
    weights = torch.exp(lses - ref).unsqueeze(-1)  # rows nobody saw: all weights 0
    # Summed part by part into one float32 buffer (peak memory: no C products at once), each
    # part's product added in the same op (addcmul promotes a bf16 part as it reads it).
    out = outs[0] * weights[0]
    last = len(outs) if dtype is None else len(outs) - 1
    for part, weight in zip(outs[1:last], weights[1:last]):
        out.addcmul_(part, weight)
    if dtype is None:
        return out, lse
    b, h, rows, dv = out.shape
    result = out.new_empty((rows, b, h, dv), dtype=dtype)
    if last == 0:  # one part
        result.copy_(out.permute(2, 0, 1, 3))
    else:  # the last part added in float32 and written cast, sequence first, in one op
        torch.addcmul(out, outs[-1], weights[-1], out=result.permute(1, 2, 0, 3))
    return result, lse.permute(2, 0, 1).contiguous()


# Note [merged in place]
# ----------------------
# The team merge used to sum the C parts as ``out = p0 w0; out.add_(p_j * w_j)``, apply the
# sinks in place (``add_sink_``) and cast the float32 sum to the input dtype in a copy of its
# own (``finished``). Per element, bytes memory reads + writes at C = 2 with bf16 parts: the
# first product 6, the next product and its add 6 + 12, the cast 6: 30. Now each middle part is
# one ``addcmul_`` (10), and the last one is added in float32 and written straight into the
# sequence-first result in the input dtype (8): 6 + 8 = 14 at C = 2.
# The sinks need no pass of their own either: ``out' = out e^(lse - lse')`` is the sum of the
# parts weighted ``e^(lse_j - lse')``, so the weights take ``lse' = logaddexp(lse, s_h)``.


def take_rows(kv: torch.Tensor, ranges: tuple[tuple[int, int], ...]) -> torch.Tensor:
    """Rows of ``ranges`` as one tensor (a view when there is one range)."""
    if len(ranges) == 1:
        return kv[ranges[0][0] : ranges[0][1]]
    return torch.cat([kv[a:b] for a, b in ranges])


def add_rows(dst: torch.Tensor, src: torch.Tensor, ranges: tuple[tuple[int, int], ...]) -> None:
    """Add ``src`` (the rows of ``ranges``, concatenated) into those rows of ``dst``."""
    pos = 0
    for a, b in ranges:
        dst[a:b].add_(src[pos : pos + b - a])
        pos += b - a


def _rows(x: torch.Tensor, call: KernelCall, side: str, dim: int = 0) -> torch.Tensor:
    """The call's query (``side="q"``) or key rows of ``x`` along ``dim``: a view, or one gather.

    Every block kernel needs the last dim dense (flash-attn refuses anything else; PyTorch's
    CPU op reads garbage): a view whose last dim is strided (a producer's transposed
    storage) is copied here, where it enters a kernel. Megatron's views (slices of the fused
    QKV along the last dim, sequence/batch transposes) keep it dense and pass as views."""
    run = call.q_slice if side == "q" else call.k_slice
    if run is not None:
        rows = x.narrow(dim, run[0], run[1] - run[0])
        return rows if rows.stride(-1) == 1 else rows.contiguous()
    return x.index_select(dim, call.tensor(side + "_index", x.device))


def _call_runs(call: KernelCall, side: str) -> tuple[tuple[int, int], ...]:
    """The row runs a gathered call's query (``side="q"``) or key index takes, in order (host ints)."""
    return call.q_rows if side == "q" else tuple(r for ranges in call.k_rows for r in ranges)


def _add_into(dst: torch.Tensor, srcs: tuple[torch.Tensor, ...], call: KernelCall, side: str,
              fresh: FreshRows | None) -> None:
    """The call's rows (dim 0) of ``dst`` += ``srcs`` (side by side in the last dim: dK | dV
    into ``dkv``; a gathered key row may repeat: summed). Rows ``fresh`` says no call has
    written yet take the gradients as they are (Note [fresh rows])."""
    run = call.q_slice if side == "q" else call.k_slice
    parts, col = [], 0
    for src in srcs:
        parts.append(dst[..., col : col + src.shape[-1]])
        col += src.shape[-1]
    if run is None:
        index = call.tensor(side + "_index", dst.device)
        first = fresh is not None and fresh.unwritten(_call_runs(call, side))
        if fresh is not None:  # every unwritten row at once (a few runs); the call's own then written over
            fresh.fill(lambda a, b: dst[a:b].zero_())
        for part, src in zip(parts, srcs):
            if first:  # the first call to reach each of its rows: copied in (Note [fresh rows])
                part.index_copy_(0, index, src.to(dst.dtype))
            else:
                part.index_add_(0, index, src.to(dst.dtype))
        return
    a, b = run
    fresh_runs, written = fresh.take(a, b) if fresh is not None else ([], [run])
    for part, src in zip(parts, srcs):
        for x, y in fresh_runs:
            part[x:y].copy_(src[x - a : y - a])
        for x, y in written:
            part[x:y].add_(src[x - a : y - a])


def forward_step(
    kernel: BlockKernel,
    q: torch.Tensor,
    kv: torch.Tensor,
    q_segments: tuple[Segment, ...],
    k_segments: tuple[Segment, ...],
    acc_out: torch.Tensor,
    acc_lse: torch.Tensor,
    *,
    causal: bool,
    scale: float,
    window: tuple[int, int] | None = None,
    max_rows: int | None = None,
    fresh: FreshRows | None = None,
    max_logit: torch.Tensor | None = None,
) -> None:
    """Attend ``q`` to ``kv`` and merge into ``acc_out [b, h, Sq, dv]`` / ``acc_lse [b, h, Sq]``
    (at most ``max_rows`` query and key rows per kernel call); ``fresh``: the accumulators'
    rows no call has written yet (Note [fresh rows]). ``max_logit [h]``: the running largest
    unscaled ``q . k`` per head, raised by each call's pairs (:mod:`megatron_startrail.max_logit`)."""
    dqk = q.shape[-1]
    # Note [whole key runs] in layout.py: a kernel whose temporaries do not grow with the keys
    whole_key_runs = not getattr(kernel, "workspace_grows_with_keys", True)
    for call in device_calls(q_segments, k_segments, causal, window, max_rows, q.device, q.shape[1], whole_key_runs):
        kvs, qs = _rows(kv, call, "k"), _rows(q, call, "q")
        out, lse = kernel.forward(qs, kvs[..., :dqk], kvs[..., dqk:], call, scale=scale)
        if max_logit is not None:
            max_logits.fold_call_(max_logit, qs, kvs[..., :dqk], call)
        del qs
        out = out.permute(1, 2, 0, 3)  # [Tq, b, h, dv] -> [b, h, Tq, dv]
        if call.q_slice is not None:
            a, b = call.q_slice
            fresh_runs, written = fresh.take(a, b) if fresh is not None else ([], [(a, b)])
            for x, y in fresh_runs:  # Note [fresh rows]: the call's own result
                acc_out[:, :, x:y].copy_(out[:, :, x - a : y - a])
                acc_lse[:, :, x:y].copy_(lse[:, :, x - a : y - a])
            for x, y in written:
                merge_lse_(acc_out[:, :, x:y], acc_lse[:, :, x:y], out[:, :, x - a : y - a], lse[:, :, x - a : y - a])
        else:
            first = fresh is not None and fresh.unwritten(call.q_rows)
            fill_unseen(acc_out, acc_lse, fresh)  # every unwritten row at once (a few runs)
            index = call.tensor("q_index", q.device)
            if first:  # Note [fresh rows]: every row's first call, its result written over the fill
                acc_out.index_copy_(2, index, out.to(acc_out.dtype))
                acc_lse.index_copy_(2, index, lse.to(acc_lse.dtype))
            else:
                part_out, part_lse = acc_out.index_select(2, index), acc_lse.index_select(2, index)
                merge_lse_(part_out, part_lse, out, lse)
                acc_out.index_copy_(2, index, part_out)
                acc_lse.index_copy_(2, index, part_lse)
                del part_out, part_lse
        # Merged: freed before the next call's kernel runs (else two calls' results are live at once).
        del out, lse, kvs


def _rows_of_call(call: KernelCall) -> int:
    """Query plus key rows of a call (host ints)."""
    return call.cu_seqlens_q[-1] + call.cu_seqlens_k[-1]


# Note [largest call first]
# -------------------------
# A step's calls may come in any order (each call's gradients are exact on their own, Note [kernel
# calls]); the backward runs the largest first. Its rows are then the ones no call has written yet,
# which it writes as they are (Note [fresh rows]), and the smaller calls that share rows with it add.
# The other way round a per-sequence kernel's ``backward_into`` finds the large call's side partly
# written and zeroes the rest before adding: at P8 C2, 128K, the diagonal call (both zigzag halves)
# came after the full call on one of them, 8192 rows of dQ zeroed (0.13 GB a layer, MHA 16 x 128).
# The document layout moves less too (P8 C2 MHA 20.80 -> 19.99 GB a layer as counted): there too
# more rows are first written by a large call's copy.


def backward_step(
    kernel: BlockKernel,
    q: torch.Tensor,
    dout: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,  # [Sq, b, h], sequence first like the other query-side tensors
    kv: torch.Tensor,
    q_segments: tuple[Segment, ...],
    k_segments: tuple[Segment, ...],
    dq: torch.Tensor,
    dkv: torch.Tensor,
    *,
    causal: bool,
    scale: float,
    window: tuple[int, int] | None = None,
    max_rows: int | None = None,
    fresh_q: FreshRows | None = None,
    fresh_kv: FreshRows | None = None,
) -> None:
    """Add this step's gradients into ``dq [Sq, b, h, dqk]`` and ``dkv [Sk, b, hkv, dqk + dv]``
    (at most ``max_rows`` query and key rows per kernel call); ``fresh_q`` / ``fresh_kv``:
    their rows no call has written yet (Note [fresh rows])."""
    dqk = q.shape[-1]
    calls = device_calls(q_segments, k_segments, causal, window, max_rows, q.device, q.shape[1])
    for call in sorted(calls, key=_rows_of_call, reverse=True):  # Note [largest call first]
        kvs = _rows(kv, call, "k")
        inputs = (_rows(dout, call, "q"), _rows(q, call, "q"), kvs[..., :dqk], kvs[..., dqk:], _rows(out, call, "q"),
                  _rows(lse, call, "q").permute(1, 2, 0), call)
        if call.q_slice is not None and call.k_slice is not None and getattr(kernel, "backward_into", None) is not None:
            # A per-sequence kernel writes each launch's gradients into the accumulators' rows:
            # no whole-call gradients beside them (peak memory). Note [fresh rows]: a side whose
            # rows no call has written yet takes them as they are (``add`` False: a copy, no
            # zero fill and add); one partly written has its unwritten rows zeroed first.
            (a, b), (c, d) = call.q_slice, call.k_slice
            add = []
            for acc, fresh, (x0, x1) in ((dq, fresh_q, (a, b)), (dkv, fresh_kv, (c, d))):
                runs = fresh.take(x0, x1)[0] if fresh is not None else []
                add.append(runs != [(x0, x1)])
                if add[-1]:
                    for x, y in runs:
                        acc[x:y].zero_()
            kernel.backward_into((dq[a:b], dkv[c:d, ..., :dqk], dkv[c:d, ..., dqk:]), *inputs, scale=scale,
                                 add=(add[0], add[1], add[1]))
            continue
        gq, gk, gv = kernel.backward(*inputs, scale=scale)
        _add_into(dq, (gq,), call, "q", fresh_q)
        _add_into(dkv, (gk, gv), call, "k", fresh_kv)
        # Freed before the next call's kernel runs (else two calls' gradients are live at once).
        del gq, gk, gv
