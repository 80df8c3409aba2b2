"""Which tokens a rank holds, and which (query rows, key rows) blocks to compute.

Megatron's context-parallel layout is used unchanged (what
``megatron.core.utils.get_batch_on_this_cp_rank`` produces): the sequence is cut into
``2 * CP`` chunks of equal length and CP rank ``r`` holds chunks ``r`` and ``2*CP-1-r``,
in that order.

With Ulysses inside CP (``CP = U * S``), CP rank ``s*U + u`` is Ulysses rank ``u`` of
StarTrail position ``s``. The Ulysses all-to-all gathers the sequence of the ``U``
consecutive CP ranks in Ulysses-rank order, so StarTrail position ``s`` then holds the
``2U`` chunks ``[c, 2CP-1-c for c in s*U .. s*U+U-1]`` (still zigzag pairs), for a slice
of the heads. Everything after the Ulysses all-to-all and the team all-gather is a
concatenation of CP ranks' storage, so it is described by concatenating their segments.

Note [documents]
----------------
Local storage is described by *segments* ``(document, start, stop)``: consecutive rows
holding the GLOBAL token positions ``start .. stop-1`` of one document, listed in
storage order and back to back. Query row ``i`` may see key row ``j`` only if both
belong to the same document (and, causal, ``pos(j) <= pos(i)``). Rows of padding have
document :data:`PADDING`: they see nothing and nothing sees them, so their output is 0,
their lse ``-inf`` and their gradients 0 without any special case.

A packed sample (:class:`Documents`) comes in one of two layouts::

    sample layout    cu_seqlens only; the whole sample (S tokens) is zigzagged:
                     rank r holds chunks r, 2CP-1-r of S (Megatron pretraining,
                     --dataloader-inter-document-masking); positions 0 .. S-1
    document layout  cu_seqlens_padded too; every document's padded span is
                     zigzagged on its own: rank r holds, per document in order, chunks
                     r, 2CP-1-r of the span (Transformer Engine THD, Megatron --sft);
                     positions are padded positions, real tokens first in each span

Example, CP = 2, document layout, cu_seqlens = [0, 3, 8], cu_seqlens_padded = [0, 4, 12]
(spans of 4 and 8 tokens, chunks of 1 and 2)::

    rank 0: (0, 0, 1) (PAD, 3, 4)  | (1, 4, 6) (PAD, 10, 12)
    rank 1: (0, 1, 2) (0, 2, 3)    | (1, 6, 8) (1, 8, 9) (PAD, 9, 10)

Segments are cut at chunk edges, document edges and a document's real end. The dense
case (no cu_seqlens) is one document covering the sequence, so one planner serves all.

Note [causal blocks]
--------------------
For a query segment and a key segment of the same document (positions ``[qa, qb)`` and
``[ka, kb)``), query ``i`` sees key ``j`` iff ``j <= i``; see :func:`plan_calls`. For
whole chunks of one document this is::

    key chunk y < query chunk x   full block     (every query sees every key)
    y == x                        diagonal block (causal mask inside the block; lengths
                                                  are equal, so the kernel's top-left
                                                  aligned causal mask is right)
    y > x                         skipped        (every query is earlier than every key)

Example, CP = 2 (4 chunks), rank 0 holds chunks (0, 3), rank 1 holds (1, 2)::

                 keys ->  0   1   2   3
    queries  0            D   .   .   .
             1            F   D   .   .
             2            F   F   D   .
             3            F   F   F   D

Every zigzag pair of queries against every zigzag pair of keys holds exactly two
chunk-blocks of work, so the layout is load balanced for causal masks with no extra
data movement. Segments of different documents make no block at all.
"""

from __future__ import annotations

import bisect
import functools
from dataclasses import dataclass

from .device_copy import pack_on_device


def zigzag_chunks(cp_rank: int, cp_size: int) -> tuple[int, int]:
    """Global chunk indices held by CP rank ``cp_rank`` (chunk count ``2 * cp_size``)."""
    return (cp_rank, 2 * cp_size - 1 - cp_rank)



# Rows of local storage: (document, start, stop), global token positions [start, stop)
# of one document, back to back in storage order (Note [documents]).
Segment = tuple[int, int, int]
PADDING = -1  # the document of padding rows: they see nothing and nothing sees them


@dataclass(frozen=True)
class Documents:
    """The documents of one packed sample and how CP ranks hold it (Note [documents]).

    ``cu_seqlens`` (real lengths) and ``cu_seqlens_padded`` (``None`` for the sample
    layout) are global cumulative lengths, ``cu[0] == 0``; validated by
    :func:`documents_from_cu_seqlens`. Plain tuples, so the object is hashable and
    cheap to use as a cache key.
    """

    cp_size: int
    cu_seqlens: tuple[int, ...]
    cu_seqlens_padded: tuple[int, ...] | None = None


def dense_sequence(cp_size: int, local_tokens: int) -> Documents:
    """No document masking: one document covering the whole sequence. A new object each call:
    what hangs on it (its kernel calls' metadata on the device, :mod:`megatron_startrail.microbatch`)
    lives as long as its holder, the groups' per-shape entry (:func:`megatron_startrail.documents.agree_on_documents`),
    never as long as the process."""
    return Documents(cp_size, (0, cp_size * local_tokens))


class Segments(tuple):
    """A tuple of :data:`Segment` that remembers the :class:`Documents` object it describes
    (``docs``): how the block step finds its micro-batch's device metadata
    (:func:`megatron_startrail.microbatch.device_calls`). Equal to the plain tuple. Never a
    key of a cache that outlives the micro-batch: the cached functions below take plain tuples
    and document fields, and wrap their results anew for each caller."""

    docs: Documents | None = None

    @staticmethod
    def of(segments, docs: Documents | None) -> tuple[Segment, ...]:
        out = Segments(segments)
        out.docs = docs
        return out


def docs_of(*segment_lists) -> Documents | None:
    """The :class:`Documents` the first of these that knows it describes, or None."""
    return next((s.docs for s in segment_lists if getattr(s, "docs", None) is not None), None)


def _plain(segments) -> tuple[Segment, ...]:
    # The cache key of the functions below: a plain tuple, holding no Documents object.
    return tuple(segments)


def _check_cu(name: str, cu: tuple[int, ...]) -> str | None:
    if len(cu) < 2 or cu[0] != 0:
        return f"{name} must start with 0 and hold n_docs + 1 >= 2 entries, got {list(cu[:8])}"
    bad = next((i for i in range(1, len(cu)) if cu[i] < cu[i - 1]), None)
    if bad is not None:
        return (f"{name} must be non-decreasing (cumulative document lengths), but "
                f"{name}[{bad}] = {cu[bad]} < {name}[{bad - 1}] = {cu[bad - 1]}")
    return None


def documents_from_cu_seqlens(
    cu_seqlens: tuple[int, ...], cu_seqlens_padded: tuple[int, ...] | None, cp_size: int, local_tokens: int
) -> Documents | str:
    """The :class:`Documents` of a packed sample, or a message saying what to change.

    Pure and local (no communication): the caller makes every rank agree before raising.
    """
    held = cp_size * local_tokens
    error = _check_cu("cu_seqlens", cu_seqlens)
    if error:
        return error
    if cu_seqlens_padded is None:
        if cu_seqlens[-1] != held:
            return (f"cu_seqlens[-1] = {cu_seqlens[-1]} must equal the tokens of the packed sample, "
                    f"{cp_size} CP ranks x {local_tokens} = {held} (sample layout: the whole sample is "
                    f"zigzagged; pass cu_seqlens_padded for per-document zigzag)")
        return Documents(cp_size, cu_seqlens)
    error = _check_cu("cu_seqlens_padded", cu_seqlens_padded)
    if error:
        return error
    if len(cu_seqlens_padded) != len(cu_seqlens):
        return (f"cu_seqlens_padded has {len(cu_seqlens_padded)} entries but cu_seqlens has "
                f"{len(cu_seqlens)}: both list n_docs + 1 boundaries")
    for i in range(len(cu_seqlens) - 1):
        span, real = cu_seqlens_padded[i + 1] - cu_seqlens_padded[i], cu_seqlens[i + 1] - cu_seqlens[i]
        if span % (2 * cp_size) != 0 or span < real:
            return (f"document {i} has {real} tokens in a padded span of {span}: every span must be at "
                    f"least the document and divisible by 2 * --context-parallel-size = {2 * cp_size} "
                    f"(pad each sequence to a multiple of {2 * cp_size}, as Megatron's --sft does)")
    if cu_seqlens_padded[-1] != held:
        return (f"cu_seqlens_padded[-1] = {cu_seqlens_padded[-1]} must equal the tokens of the packed "
                f"sample, {cp_size} CP ranks x {local_tokens} = {held}")
    return Documents(cp_size, cu_seqlens, cu_seqlens_padded)


def _cut_at_documents(cu: tuple[int, ...], start: int, stop: int) -> list[Segment]:
    """Positions ``[start, stop)`` of the sample layout, cut at document edges."""
    out = []
    doc = bisect.bisect_right(cu, start) - 1
    while start < stop:
        while cu[doc + 1] <= start:  # skip empty documents
            doc += 1
        end = min(stop, cu[doc + 1])
        out.append((doc, start, end))
        start = end
    return out


def cp_rank_segments(docs: Documents, cp_rank: int) -> tuple[Segment, ...]:
    """The segments of CP rank ``cp_rank``'s local storage (Note [documents])."""
    return Segments.of(_cp_rank_segments(docs.cp_size, docs.cu_seqlens, docs.cu_seqlens_padded, cp_rank), docs)


@functools.lru_cache(maxsize=1024)  # keyed on the fields: the cache keeps no Documents object alive
def _cp_rank_segments(cp_size: int, cu: tuple[int, ...], padded: tuple[int, ...] | None,
                      cp_rank: int) -> tuple[Segment, ...]:
    chunks = zigzag_chunks(cp_rank, cp_size)
    n_chunks = 2 * cp_size
    segments: list[Segment] = []
    if padded is None:  # sample layout
        chunk_len = cu[-1] // n_chunks
        for c in chunks:
            segments += _cut_at_documents(cu, c * chunk_len, (c + 1) * chunk_len)
        return tuple(segments)
    for doc in range(len(cu) - 1):  # document layout: per document, its two chunks
        piece = (padded[doc + 1] - padded[doc]) // n_chunks
        real_end = padded[doc] + cu[doc + 1] - cu[doc]
        for c in chunks:
            a, b = padded[doc] + c * piece, padded[doc] + (c + 1) * piece
            if min(b, real_end) > a:
                segments.append((doc, a, min(b, real_end)))
            if b > max(a, real_end):
                segments.append((PADDING, max(a, real_end), b))
    return tuple(segments)


def rows_of_cp_ranks(docs: Documents, cp_ranks: tuple[int, ...]) -> tuple[Segment, ...]:
    """Segments of the storage that concatenates these CP ranks' storage, in order
    (after the Ulysses all-to-all and the team all-gather)."""
    return Segments.of((seg for r in cp_ranks for seg in cp_rank_segments(docs, r)), docs)


def split_segments(segments: tuple[Segment, ...], parts: int) -> tuple[tuple[Segment, ...], ...]:
    """:func:`_split_segments`, each part knowing the documents ``segments`` knows."""
    docs = docs_of(segments)
    return tuple(Segments.of(part, docs) for part in _split_segments(_plain(segments), parts))


@functools.lru_cache(maxsize=4096)
def _split_segments(segments: tuple[Segment, ...], parts: int) -> tuple[tuple[Segment, ...], ...]:
    """Cut the storage into ``parts`` near-equal contiguous row ranges (cutting segments
    at the edges); part ``k`` is rows ``[k*n//parts, (k+1)*n//parts)``.

    Used to spread one transfer over several concurrent rings (TASP): each part travels
    on its own ring and is still a valid set of segments to attend to. Contiguous
    parts are never empty while ``parts <= n``, whatever the document lengths.
    """
    total = sum(b - a for _, a, b in segments)
    bounds = [total * k // parts for k in range(parts + 1)]
    out: list[list[Segment]] = [[] for _ in range(parts)]
    row = 0
    for doc, a, b in segments:
        for k in range(parts):  # the part of rows [row, row + b - a) inside part k
            lo, hi = max(row, bounds[k]), min(row + b - a, bounds[k + 1])
            if hi > lo:
                out[k].append((doc, a + lo - row, a + hi - row))
        row += b - a
    return tuple(tuple(p) for p in out)


def segment_rows(segments: tuple[Segment, ...], start: int, stop: int) -> tuple[Segment, ...]:
    """Rows ``[start, stop)`` of the storage ``segments`` describe, as segments (cut at the
    edges): what a row slice of a payload holds, e.g. one piece of the initial send."""
    return Segments.of(_segment_rows(_plain(segments), start, stop), docs_of(segments))


@functools.lru_cache(maxsize=4096)
def _segment_rows(segments: tuple[Segment, ...], start: int, stop: int) -> tuple[Segment, ...]:
    out: list[Segment] = []
    row = 0
    for doc, a, b in segments:
        lo, hi = max(row, start), min(row + b - a, stop)
        if hi > lo:
            out.append((doc, a + lo - row, a + hi - row))
        row += b - a
    return tuple(out)


def split_rows(total: int, parts: int) -> list[tuple[int, int]]:
    """The row range of each part of :func:`split_segments` in storage of ``total`` rows."""
    return [(total * k // parts, total * (k + 1) // parts) for k in range(parts)]


# Note [rows of CP ranks]
# -----------------------
# Whatever rows a step attends to -- a team's gathered sequence, a lane's part of a payload,
# a piece of the initial send, a halo -- are rows of CP ranks' storage, so they can also be
# written as *runs* ``(cp rank, first row, end row)``, which name no document. The schedule
# asks the planner for the same runs in every micro-batch (the CP size and the tokens are
# fixed; only the documents change), so the runs it asked for once, planned again with the
# next micro-batch's documents, give every kernel call of that micro-batch before its first
# step (:mod:`megatron_startrail.microbatch`: their device metadata in one copy).


@functools.lru_cache(maxsize=16)
def _position_index(cp_size: int, cu: tuple[int, ...], padded: tuple[int, ...] | None):
    """Every storage segment of every CP rank as ``(start, stop, rank, first row)``, by start
    position (global positions are unique, padding included), and the starts alone."""
    entries = []
    for rank in range(cp_size):
        row = 0
        for _, a, b in _cp_rank_segments(cp_size, cu, padded, rank):
            entries.append((a, b, rank, row))
            row += b - a
    entries.sort()
    return [e[0] for e in entries], entries


def rank_runs(docs: Documents, segments: tuple[Segment, ...]) -> tuple[tuple[int, int, int], ...]:
    """``segments`` (rows of ``docs``) as runs ``(cp rank, first row, end row)`` of CP ranks'
    storage, neighbouring rows of one rank joined (Note [rows of CP ranks])."""
    starts, entries = _position_index(docs.cp_size, docs.cu_seqlens, docs.cu_seqlens_padded)
    runs: list[tuple[int, int, int]] = []
    for _, a, b in segments:
        while a < b:  # a segment may cross storage segments (of one rank or of several)
            start, stop, rank, row = entries[bisect.bisect_right(starts, a) - 1]
            end, first = min(b, stop), row + a - start
            if runs and runs[-1][0] == rank and runs[-1][2] == first:
                runs[-1] = (rank, runs[-1][1], first + end - a)
            else:
                runs.append((rank, first, first + end - a))
            a = end
    return tuple(runs)


def segments_of_runs(docs: Documents, runs: tuple[tuple[int, int, int], ...]) -> tuple[Segment, ...]:
    """The inverse of :func:`rank_runs`: the segments of these rows under ``docs``."""
    return Segments.of((seg for rank, a, b in runs for seg in segment_rows(cp_rank_segments(docs, rank), a, b)),
                       docs)


# Note [kernel calls]
# -------------------
# A step's work goes to the block kernel as a few variable-length calls with flash-attn's
# semantics (``flash_attn_varlen_func``): sequence ``i`` of a call is query rows
# ``q_rows[i]`` against the concatenation of key rows ``k_rows[i]``, and with ``sq``, ``sk``
# its lengths, query ``r`` sees key ``c`` iff
#
#     r + sk - sq - left  <=  c  <=  r + sk - sq + right          (-1: that side unbounded)
#
# -- the window is placed by aligning the sequence's last query with its last key (causal
# is ``(-1, 0)``, bottom-right aligned). One call takes every document and every band of a
# step that shares ``(left, right)``, so the number of calls does not grow with documents or
# window tiles.
#
# For a query segment at positions ``[qa, qb)`` and a run of key positions ``[ka, kb)`` of
# the same document (segments next to each other in storage and in position make one run),
# query ``q`` sees key ``k`` iff ``lo <= k - q <= hi`` (:func:`normalize_window`; causal
# without a window is ``(-inf, 0)``). Queries in ``[ka - hi, kb - lo)`` see something; they
# make at most two sequences, each exact with one ``(left, right)``:
#
#     A  rows before kb - hi    keys [q + lo, q + hi]     last key = last query + hi:
#                                                         (hi - lo, 0); causal: (-1, 0)
#     B  rows from kb - hi      keys [q + lo, kb)         the run's end cuts every row:
#                                                         (kb - lo - qe, -1) with qe the
#                                                         last row + 1; (0, -1) unless the
#                                                         query segment ends first;
#                                                         no left bound: (-1, -1), full
#
# Full sequences (-1, -1) of one query segment are merged (their keys concatenated), so a
# query sees each visible key once. Within a call the query rows of different sequences
# never overlap (the merge adds each call's result row by row); sequences that would are
# put in another call of the same class. Every query row of a sequence sees at least one
# key, so a call never returns a row without keys (lse is finite: the merge needs no case
# for -inf). ``max_rows`` bounds the query rows and the gathered key rows of one call (a
# kernel's buffers grow with both); full sequences are cut into tiles to fit.

INF = float("inf")


@dataclass(frozen=True)
class KernelCall:
    """One variable-length kernel call (Note [kernel calls]); rows are of local storage."""

    q_rows: tuple[tuple[int, int], ...]  # sequence i: query rows [a, b)
    k_rows: tuple[tuple[tuple[int, int], ...], ...]  # sequence i: key row ranges, concatenated
    window: tuple[int, int] = (-1, -1)  # flash-attn's (left, right); (-1, 0) is causal

    @classmethod
    def back_to_back(cls, lengths, window: tuple[int, int] = (-1, -1)) -> KernelCall:
        """A call of sequences of ``(query rows, key rows)`` lengths, each side's rows packed in
        order (what a kernel sees; tests and the GPU kit build calls this way)."""
        q_rows, k_rows, a, b = [], [], 0, 0
        for sq, sk in lengths:
            q_rows.append((a, a + sq))
            k_rows.append(((b, b + sk),))
            a, b = a + sq, b + sk
        return cls(tuple(q_rows), tuple(k_rows), tuple(window))

    def __hash__(self) -> int:  # the key of the device metadata, looked up every step: hashed once
        return self._hash

    @functools.cached_property
    def _hash(self) -> int:
        return hash((self.q_rows, self.k_rows, self.window))

    @property
    def causal(self) -> bool:
        return self.window == (-1, 0)

    @functools.cached_property
    def cu_seqlens_q(self) -> tuple[int, ...]:
        return _cumulative([b - a for a, b in self.q_rows])

    @functools.cached_property
    def cu_seqlens_k(self) -> tuple[int, ...]:
        return _cumulative([sum(b - a for a, b in ranges) for ranges in self.k_rows])

    @functools.cached_property  # read by the GPU kernels every step: computed once per call
    def max_seqlen_q(self) -> int:
        return max(b - a for a, b in self.q_rows)

    @functools.cached_property
    def max_seqlen_k(self) -> int:
        return max(sum(b - a for a, b in ranges) for ranges in self.k_rows)

    @functools.cached_property
    def q_slice(self) -> tuple[int, int] | None:
        """``(a, b)`` when the query rows are one run ``a .. b-1`` in order (no gather)."""
        return _one_run(self.q_rows)

    @functools.cached_property
    def k_slice(self) -> tuple[int, int] | None:
        return _one_run(tuple(r for ranges in self.k_rows for r in ranges))

    @functools.cached_property
    def q_index(self) -> tuple[int, ...]:
        return tuple(i for a, b in self.q_rows for i in range(a, b))

    @functools.cached_property
    def k_index(self) -> tuple[int, ...]:
        return tuple(i for ranges in self.k_rows for a, b in ranges for i in range(a, b))

    def values(self, what: str, batch: int = 1) -> tuple[int, ...]:
        """``q_index`` / ``k_index`` or ``cu_seqlens_q`` / ``cu_seqlens_k``; with ``batch`` > 1 the
        ``cu_seqlens`` of the batch folded into the sequence dim (every sequence once per sample)."""
        values = getattr(self, what)
        if what.startswith("cu_") and batch > 1:
            total = values[-1]
            return tuple(x + i * total for i in range(batch) for x in values[:-1]) + (batch * total,)
        return values

    def tensor(self, what: str, device, batch: int = 1):
        """:meth:`values` as a tensor on ``device`` (int32 ``cu_seqlens``, int64 indices), made
        anew at every call: for a call used on its own (tests, the GPU kit). The attention's
        calls come bound to their micro-batch's metadata, made in one copy
        (:func:`megatron_startrail.microbatch.device_calls`), and read it from there."""
        return pack_on_device([(self, what, batch)], device)[(self, what, batch)]


def _cumulative(lengths: list[int]) -> tuple[int, ...]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return tuple(out)


def _one_run(ranges: tuple[tuple[int, int], ...]) -> tuple[int, int] | None:
    for (_, b), (a, _) in zip(ranges, ranges[1:]):
        if a != b:
            return None
    return (ranges[0][0], ranges[-1][1])


def normalize_window(window: tuple[int, int] | None, causal: bool) -> tuple[float, float] | None:
    """``(left, right)`` (-1 or None: unbounded) -> ``(lo, hi)`` bounds of key minus query
    position, or None when the window bounds nothing the mask does not already."""
    if window is None:
        return None
    left, right = window
    lo = -INF if left is None or left < 0 else -int(left)
    hi = INF if right is None or right < 0 else int(right)
    if causal:
        hi = min(hi, 0)
    if lo == -INF and hi == (0 if causal else INF):
        return None
    return lo, hi


def coalesce(ranges: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """Row ranges sorted, with touching or overlapping ones merged."""
    out: list[tuple[int, int]] = []
    for a, b in sorted(ranges):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(b, out[-1][1]))
        else:
            out.append((a, b))
    return tuple(out)


def _split_ranges(ranges: tuple[tuple[int, int], ...], limit: int) -> list[tuple[tuple[int, int], ...]]:
    """``ranges`` cut into consecutive groups of at most ``limit`` rows each."""
    groups: list[tuple[tuple[int, int], ...]] = []
    current: list[tuple[int, int]] = []
    room = limit
    for a, b in ranges:
        while a < b:
            take = min(b - a, room)
            current.append((a, a + take))
            a, room = a + take, room - take
            if room == 0:
                groups.append(tuple(current))
                current, room = [], limit
    if current:
        groups.append(tuple(current))
    return groups


# A run of key positions [ka, kb) of one document, its rows in position order.
_Run = tuple[int, int, tuple[tuple[int, int], ...]]


def _joined(segments: tuple[Segment, ...]) -> list[tuple[int, int, int, int]]:
    """``(document, start, stop, first row)`` of every run of segments that follow each other
    in storage and in position (one document): such a run is one view of the storage."""
    out: list[tuple[int, int, int, int]] = []
    row = 0
    for doc, a, b in segments:
        if out and out[-1][0] == doc and out[-1][2] == a:
            out[-1] = (doc, out[-1][1], b, out[-1][3])
        elif b > a:
            out.append((doc, a, b, row))
        row += b - a
    return out


def _key_runs(k_segments: tuple[Segment, ...]) -> dict[int, list[_Run]]:
    """Per document, its key runs (:func:`_joined`; runs are never gathered together: the
    pairs of a query segment with each run are exact on their own, and a view costs nothing)."""
    runs: dict[int, list[_Run]] = {}
    for doc, ka, kb, r in _joined(k_segments):
        if doc != PADDING:
            runs.setdefault(doc, []).append((ka, kb, ((r, r + kb - ka),)))
    return runs


def _run_rows(run: _Run, a: float, b: float) -> tuple[tuple[int, int], ...]:
    """The rows of positions ``[a, b)`` of ``run``."""
    out, pos = [], run[0]
    for r0, r1 in run[2]:
        lo, hi = max(a, pos), min(b, pos + r1 - r0)
        if hi > lo:
            out.append((int(r0 + lo - pos), int(r0 + hi - pos)))
        pos += r1 - r0
    return tuple(out)


def _bound(value: float) -> int:
    return -1 if value == INF else int(value)


def _sequences(qa: int, qb: int, run: _Run, lo: float, hi: float):
    """Sequences ``(class, q0, q1, key rows)`` (positions ``q0 .. q1-1``) of a query segment
    ``[qa, qb)`` against one key run (Note [kernel calls]: pieces A and B)."""
    ka, kb = run[0], run[1]
    qs, qe = max(qa, ka - hi), min(qb, kb - lo)
    if qs >= qe:
        return
    cut = min(max(qs, kb - hi), qe)
    if cut > qs:  # A: the last key of every row is the row + hi (hi finite here)
        y = int(cut)
        yield (_bound(hi - lo), 0), int(qs), y, _run_rows(run, qs + lo, y + hi)
    if qe > cut:  # B: the run's end cuts every row
        x, y = int(cut), int(qe)
        left = -1 if lo == -INF or y - 1 + lo <= ka else int(kb - lo - y)
        yield (left, -1), x, y, _run_rows(run, x + lo, kb)


def _full_sequences(pieces: list[tuple[int, int, tuple[tuple[int, int], ...]]]):
    """Full pieces ``(q0, q1, key rows)`` of one query segment -> sequences in which each query
    row sees each of its keys once: cut at every piece edge, keys of the pieces covering each
    cut joined, neighbours with the same keys merged."""
    edges = sorted({p[0] for p in pieces} | {p[1] for p in pieces})
    out: list[tuple[int, int, tuple[tuple[int, int], ...]]] = []
    for u, v in zip(edges, edges[1:]):
        keys = coalesce([r for a, b, rows in pieces if a <= u and v <= b for r in rows])
        if not keys:
            continue
        if out and out[-1][1] == u and out[-1][2] == keys:
            out[-1] = (out[-1][0], v, keys)
        else:
            out.append((u, v, keys))
    return out


class _Bins:
    """The calls of one class: first fit, query rows never overlapping within a call, at most
    ``max_rows`` query and gathered key rows per call (a longer sequence gets a call alone)."""

    def __init__(self, max_rows: int | None) -> None:
        self.max_rows = max_rows
        self.calls: list[tuple[list, list, list[int]]] = []  # q rows, k rows, [q total, k total]

    def add(self, q: tuple[int, int], keys: tuple[tuple[int, int], ...]) -> None:
        nq, nk = q[1] - q[0], sum(b - a for a, b in keys)
        for qs, ks, size in self.calls:
            fits = self.max_rows is None or (size[0] + nq <= self.max_rows and size[1] + nk <= self.max_rows)
            if qs[-1][1] <= q[0] and fits:
                qs.append(q)
                ks.append(keys)
                size[0], size[1] = size[0] + nq, size[1] + nk
                return
        self.calls.append(([q], [keys], [nq, nk]))


def _merge_neighbours(sequences, max_rows):
    """Full sequences, sorted: where one's query rows end where the next's begin and their keys
    are the same, one sequence (within ``max_rows`` query rows)."""
    out = []
    for q, keys in sequences:
        if out and out[-1][0][1] == q[0] and out[-1][1] == keys and (
                max_rows is None or q[1] - out[-1][0][0] <= max_rows):
            out[-1] = ((out[-1][0][0], q[1]), keys)
        else:
            out.append((q, keys))
    return out


def plan_calls(q_segments: tuple[Segment, ...], k_segments: tuple[Segment, ...], causal: bool,
               window: tuple[int, int] | None = None, max_rows: int | None = None,
               whole_key_runs: bool = False) -> tuple[KernelCall, ...]:
    """The kernel calls that cover exactly the visible (query, key) pairs, each once
    (Note [kernel calls]; Note [causal blocks] for what causal means across chunks).
    ``whole_key_runs``: a full sequence whose keys are one run of rows takes them all, past
    ``max_rows`` (Note [whole key runs])."""
    return _plan_calls(_plain(q_segments), _plain(k_segments), causal, window, max_rows, whole_key_runs)


# Note [own rows in one call]
# ---------------------------
# Causal without a window, a query side and a key side often hold the same rows of a document:
# a rank's two zigzag chunks of it, next to each other in storage ([front, back]; Megatron's
# THD order keeps a document's chunks together) but not in position. Cut at position runs,
# they made three sequences -- front x front and back x back causal, back x front full, the
# last gathered when documents are many (its query rows every other run of the storage).
# Their rows in storage order are in position order, so causal on the concatenated rows is
# exact (row i sees row j iff j <= i iff position j <= position i): one causal sequence of
# the rows, a view on both sides, the same pairs and FLOPs (a causal kernel skips the upper
# triangle), and every query row written by one call instead of two and merged. A group
# longer than max_rows keeps the cut sequences (the reference kernel's scores grow with it).


def _storage_groups(segments: tuple[Segment, ...]) -> list[tuple[int, tuple[tuple[int, int], ...], tuple[int, ...]]]:
    """``(document, position runs, first row of each run)`` of every group of :func:`_joined` runs
    that follow each other in storage, of one document, in increasing positions (Note [own rows in
    one call]); each joined run is in one group, in storage order."""
    out: list[tuple[int, tuple[tuple[int, int], ...], tuple[int, ...]]] = []
    for doc, a, b, row in _joined(segments):
        if out and out[-1][0] == doc and out[-1][2][-1] + out[-1][1][-1][1] - out[-1][1][-1][0] == row \
                and out[-1][1][-1][1] <= a:
            out[-1] = (doc, out[-1][1] + ((a, b),), out[-1][2] + (row,))
        else:
            out.append((doc, ((a, b),), (row,)))
    return out


def _own_rows(q_segments, k_segments, max_rows):
    """Note [own rows in one call]: ``(query rows, key rows)`` of each query group whose positions a
    key group holds the same, within ``max_rows``; and the ``(query run, key run)`` pairs they take,
    by the first rows of :func:`_joined`'s runs (a set: looked up for every pair of runs)."""
    keys = {(doc, positions): rows for doc, positions, rows in _storage_groups(k_segments) if doc != PADDING}
    sequences, taken = [], set()
    for doc, positions, q_rows in _storage_groups(q_segments):
        n = sum(b - a for a, b in positions)
        k_rows = keys.get((doc, positions))
        if len(positions) > 1 and k_rows is not None and (max_rows is None or n <= max_rows):
            sequences.append(((q_rows[0], q_rows[0] + n), ((k_rows[0], k_rows[0] + n),)))
            taken.update((q, k) for q in q_rows for k in k_rows)
    return sequences, taken


# Note [whole key runs]
# ---------------------
# ``max_rows`` bounds a call's key rows for the kernels whose temporaries grow with them (the
# reference kernel's [sq, sk] scores). A fused kernel's forward holds out and lse of its query
# rows whatever the keys, so there a full sequence's keys, when they are one run of rows (a
# view: nothing is gathered), go to one call instead of max_rows tiles: each query row is merged
# once per run instead of once per tile. At P8 C2, 128K, the forward's step 1 holds the whole
# sub-ring payload (C*n rows of K, V): 4 calls of n keys became 2 of 2n, two merges of n/2 rows
# fewer. Keys in several runs stay cut (a longer gather would be a temporary that grows with
# them), and the backward keeps max_rows (its dK, dV are key rows).


@functools.lru_cache(maxsize=4096)  # pure, and called every step with the same few layouts
def _plan_calls(q_segments: tuple[Segment, ...], k_segments: tuple[Segment, ...], causal: bool,
                window: tuple[int, int] | None, max_rows: int | None,
                whole_key_runs: bool = False) -> tuple[KernelCall, ...]:
    bounds = normalize_window(window, causal)
    lo, hi = bounds if bounds is not None else (-INF, 0 if causal else INF)
    runs = _key_runs(k_segments)
    by_class: dict[tuple[int, int], list[tuple[tuple[int, int], tuple[tuple[int, int], ...]]]] = {}
    # Note [own rows in one call]: one causal sequence per group, and the pairs of runs it takes
    own, taken = _own_rows(q_segments, k_segments, max_rows) if (lo, hi) == (-INF, 0) else ([], set())
    if own:
        by_class[(-1, 0)] = own
    for doc, qa, qb, qo in _joined(q_segments):
        full = []
        for run in runs.get(doc, ()) if doc != PADDING else ():
            if (qo, run[2][0][0]) in taken:
                continue
            for cls, q0, q1, keys in _sequences(qa, qb, run, lo, hi):
                if cls == (-1, -1):
                    full.append((q0, q1, keys))
                else:
                    by_class.setdefault(cls, []).append(((qo + q0 - qa, qo + q1 - qa), keys))
        for q0, q1, keys in _full_sequences(full):
            rows = (qo + q0 - qa, qo + q1 - qa)
            q_tiles = [rows] if max_rows is None else [
                (a, min(rows[1], a + max_rows)) for a in range(rows[0], rows[1], max_rows)]
            whole = max_rows is None or (whole_key_runs and len(keys) == 1)  # Note [whole key runs]
            k_tiles = [keys] if whole else _split_ranges(keys, max_rows)
            by_class.setdefault((-1, -1), []).extend((t, k) for t in q_tiles for k in k_tiles)
    calls = []
    for cls in sorted(by_class):
        sequences = sorted(by_class[cls])
        if cls == (-1, -1):  # neighbouring query rows with the same keys: one sequence, no key gathered twice
            sequences = _merge_neighbours(sequences, max_rows)
        bins = _Bins(max_rows)
        for q, keys in sequences:
            bins.add(q, keys)
        calls += [KernelCall(tuple(qs), tuple(ks), cls) for qs, ks, _ in bins.calls]
    return tuple(calls)
