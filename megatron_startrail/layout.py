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
``[ka, kb)``), query ``i`` sees key ``j`` iff ``j <= i``; see :func:`plan_blocks`. For
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


def zigzag_chunks(cp_rank: int, cp_size: int) -> tuple[int, int]:
    """Global chunk indices held by CP rank ``cp_rank`` (chunk count ``2 * cp_size``)."""
    return (cp_rank, 2 * cp_size - 1 - cp_rank)


def startrail_position_chunks(position: int, ulysses_size: int, cp_size: int) -> tuple[int, ...]:
    """Chunks held by StarTrail position ``position`` after the Ulysses all-to-all."""
    chunks: list[int] = []
    for u in range(ulysses_size):
        chunks.extend(zigzag_chunks(position * ulysses_size + u, cp_size))
    return tuple(chunks)



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
    """No document masking: one document covering the whole sequence."""
    return Documents(cp_size, (0, cp_size * local_tokens))


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


@functools.lru_cache(maxsize=1024)
def cp_rank_segments(docs: Documents, cp_rank: int) -> tuple[Segment, ...]:
    """The segments of CP rank ``cp_rank``'s local storage (Note [documents])."""
    chunks = zigzag_chunks(cp_rank, docs.cp_size)
    n_chunks = 2 * docs.cp_size
    segments: list[Segment] = []
    if docs.cu_seqlens_padded is None:  # sample layout
        chunk_len = docs.cu_seqlens[-1] // n_chunks
        for c in chunks:
            segments += _cut_at_documents(docs.cu_seqlens, c * chunk_len, (c + 1) * chunk_len)
        return tuple(segments)
    cu, padded = docs.cu_seqlens, docs.cu_seqlens_padded
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


@functools.lru_cache(maxsize=1024)
def rows_of_cp_ranks(docs: Documents, cp_ranks: tuple[int, ...]) -> tuple[Segment, ...]:
    """Segments of the storage that concatenates these CP ranks' storage, in order
    (after the Ulysses all-to-all and the team all-gather)."""
    return tuple(seg for r in cp_ranks for seg in cp_rank_segments(docs, r))


@functools.lru_cache(maxsize=4096)
def split_segments(segments: tuple[Segment, ...], parts: int) -> tuple[tuple[Segment, ...], ...]:
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


@functools.lru_cache(maxsize=4096)
def segment_rows(segments: tuple[Segment, ...], start: int, stop: int) -> tuple[Segment, ...]:
    """Rows ``[start, stop)`` of the storage ``segments`` describe, as segments (cut at the
    edges): what a row slice of a payload holds, e.g. one piece of the initial send."""
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


@dataclass(frozen=True)
class Block:
    """One kernel call: query rows against key rows of local storage.

    ``k_rows`` may list several ranges (concatenated for the call). ``causal`` blocks are
    square with the diagonal on the diagonal (top-left aligned), the one mask every
    kernel agrees on. ``band`` (sliding windows only, Note [window blocks]) is
    ``(offset, lo, hi)``: block row ``r`` sees block column ``c`` iff
    ``lo <= c + offset - r <= hi`` (positions: key minus query).
    """

    q_rows: tuple[int, int]
    k_rows: tuple[tuple[int, int], ...]
    causal: bool
    band: tuple[int, float, float] | None = None


# Note [window blocks]
# --------------------
# A sliding window (Megatron's --window-size L,R; flash-attn's window_size) lets query
# position i see key position j of its document iff i - L <= j <= i + R (-1: unbounded;
# causal caps R at 0). In key-minus-query terms: lo <= j - i <= hi. For a query segment
# [qa, qb) and a key segment [ka, kb), only rows i in [ka - hi, kb - 1 - lo] see any key
# (so no row of a block ever sees nothing); they are cut into tiles of BAND_TILE rows, and
# tile [t, te) sees keys [t + lo, te - 1 + hi]. Of those, keys [te - 1 + lo, t + hi] are
# seen by every row of the tile (one full block for the fused kernel); the keys left and
# right of them form the band's edges, each a masked block (reference math, explicit
# mask). Pairs entirely outside the window make no block, so a window shorter than a
# chunk makes most (query chunk, key chunk) pairs no kernel call at all.
BAND_TILE = 128


def normalize_window(window: tuple[int, int] | None, causal: bool) -> tuple[float, float] | None:
    """``(left, right)`` (-1 or None: unbounded) -> ``(lo, hi)`` bounds of key minus query
    position, or None when the window bounds nothing the mask does not already."""
    if window is None:
        return None
    left, right = window
    lo = -float("inf") if left is None or left < 0 else -int(left)
    hi = float("inf") if right is None or right < 0 else int(right)
    if causal:
        hi = min(hi, 0)
    if lo == -float("inf") and hi == (0 if causal else float("inf")):
        return None
    return lo, hi


def _window_blocks(qo: int, qa: int, qb: int, ko: int, ka: int, kb: int, lo: float, hi: float) -> list[Block]:
    """The blocks of one same-document (query segment, key segment) pair under a window
    (Note [window blocks]); rows ``qo + ..`` and keys ``ko + ..`` of local storage."""
    rows = (max(qa, ka - hi), min(qb, kb - 1 - lo + 1))
    blocks = []
    for t in range(int(rows[0]), int(rows[1]), BAND_TILE):
        te = min(t + BAND_TILE, int(rows[1]))
        see = (max(ka, t + lo), min(kb, te - 1 + hi + 1))  # keys any row of the tile sees
        every = (max(see[0], te - 1 + lo), min(see[1], t + hi + 1))  # keys every row sees
        q_rows = (qo + t - qa, qo + te - qa)
        if every[0] < every[1]:
            edges = [(see[0], every[0]), (every[1], see[1])]
            blocks.append(Block(q_rows, ((ko + int(every[0]) - ka, ko + int(every[1]) - ka),), False))
        else:
            edges = [see]
        for a, b in edges:
            if a < b:
                a, b = int(a), int(b)
                blocks.append(Block(q_rows, ((ko + a - ka, ko + b - ka),), False, (a - t, lo, hi)))
    return blocks


def coalesce(ranges: list[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
    """Row ranges sorted, with touching or overlapping ones merged."""
    out: list[tuple[int, int]] = []
    for a, b in sorted(ranges):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(b, out[-1][1]))
        else:
            out.append((a, b))
    return tuple(out)


def _merge_query_runs(blocks: list[Block]) -> tuple[Block, ...]:
    """Adjacent full blocks with the same key rows become one call (e.g. non-causal)."""
    out: list[Block] = []
    for blk in blocks:
        prev = out[-1] if out else None
        if (prev is not None and not prev.causal and not blk.causal and prev.k_rows == blk.k_rows
                and prev.q_rows[1] == blk.q_rows[0]):
            out[-1] = Block((prev.q_rows[0], blk.q_rows[1]), blk.k_rows, False)
        else:
            out.append(blk)
    return tuple(out)


@functools.lru_cache(maxsize=4096)  # pure, and called every step with the same few layouts
def plan_blocks(q_segments: tuple[Segment, ...], k_segments: tuple[Segment, ...], causal: bool,
                window: tuple[int, int] | None = None) -> tuple[Block, ...]:
    """Kernel calls that cover exactly the visible (query, key) pairs; see Note [causal blocks]
    and, with a sliding ``window`` ``(left, right)``, Note [window blocks].

    Only segments of the same document meet. For a query segment ``[qa, qb)`` and a key
    segment ``[ka, kb)`` of one document, causal::

        keys [ka, min(kb, qa))         precede every query row        -> full
        rows/keys [e, e + m), e = max(ka, qa), m = min(qb, kb) - e     -> square causal
        rows [kb, qb) x keys [e, kb)   (queries past the key run)      -> full

    Full blocks of one query segment are merged into a single call, and so are adjacent
    query segments with the same full key rows.
    """
    k_by_doc: dict[int, list[tuple[int, int, int]]] = {}
    row = 0
    for doc, ka, kb in k_segments:
        if doc != PADDING:
            k_by_doc.setdefault(doc, []).append((ka, kb, row))
        row += kb - ka
    bounds = normalize_window(window, causal)
    if bounds is not None:
        windowed: list[Block] = []
        qo = 0
        for doc, qa, qb in q_segments:
            for ka, kb, ko in k_by_doc.get(doc, ()) if doc != PADDING else ():
                windowed += _window_blocks(qo, qa, qb, ko, ka, kb, *bounds)
            qo += qb - qa
        return tuple(windowed)
    blocks: list[Block] = []
    qo = 0
    for doc, qa, qb in q_segments:
        full: list[tuple[int, int]] = []
        extra: list[Block] = []
        for ka, kb, ko in k_by_doc.get(doc, ()) if doc != PADDING else ():
            if not causal:
                full.append((ko, ko + kb - ka))
                continue
            if ka < min(kb, qa):
                full.append((ko, ko + min(kb, qa) - ka))
            e = max(ka, qa)
            m = min(qb, kb) - e
            if m > 0:
                extra.append(Block((qo + e - qa, qo + e - qa + m), ((ko + e - ka, ko + e - ka + m),), True))
                if qb > kb:
                    extra.append(Block((qo + kb - qa, qo + qb - qa), ((ko + e - ka, ko + kb - ka),), False))
        if full:
            blocks.append(Block((qo, qo + qb - qa), coalesce(full), False))
        blocks.extend(extra)
        qo += qb - qa
    return _merge_query_runs(blocks)
