"""The launch budget of one layer on one rank (GPU hot-path issue), counted on CPU.

benchmarks/counters/launch_budget.py counts the ATen ops one rank dispatches for a layer's forward
+ backward (meta tensors, torch's no-op process group, the block kernel one op a call).
Here at a smaller shape than its 128K table, with the same rules: dense causal within 1.5x
a minimal zigzag ring at the same P; windowed and packed layers within 2x the dense layer
at the same P, C and tokens -- and the counts that must not grow with documents or
window length do not.
"""

import pytest
import torch

from benchmarks.counters.launch_budget import Case, Counts, _OpCounter, count

TOKENS = 16384


@pytest.fixture(scope="module")
def yardstick():
    return {p: count(Case("ring", p, 0, TOKENS)).launch for p in (8, 16)}


@pytest.mark.parametrize("world, team", [(8, 1), (8, 2), (16, 4)])
def test_launch_budget(world, team, yardstick):
    def launches(**kw):
        return count(Case("case", world, team, TOKENS, **kw))

    dense = launches()
    assert dense.launch <= 1.5 * yardstick[world], (dense.launch, yardstick[world])
    chunk = TOKENS // (2 * world)
    for kw in ({"window": (chunk // 2, 0)}, {"window": (3 * chunk, 0)}, {"docs": "sample"}, {"docs": "document"},
               {"causal": False}, {"kv_heads": 1}, {"head_dim": 192}, {"rotation": "q"}, {"rotation": "kv"},
               {"regather": True}):
        got = launches(**kw)
        assert got.launch <= 2 * dense.launch, (kw, got.launch, dense.launch)
        assert got.kernel <= 2 * dense.kernel, (kw, got.kernel, dense.kernel)


def test_calls_do_not_grow_with_documents_or_window():
    """64 documents per sample make no more kernel calls than 8 of them would: a step's
    documents share a call; a window 8x as long makes no more calls either."""
    dense = count(Case("dense", 8, 2, TOKENS))
    packed = count(Case("packed", 8, 2, TOKENS, docs="document"))
    assert packed.kernel <= dense.kernel
    short = count(Case("w", 8, 2, TOKENS, window=(64, 0), halo=False))
    long = count(Case("w", 8, 2, TOKENS, window=(512, 0), halo=False))
    assert short.kernel == long.kernel <= dense.kernel


@pytest.mark.parametrize("heads, kv_heads", [(4, 4), (8, 2)], ids=["MHA", "GQA"])
def test_cuda_adapters_move_no_more_than_the_reference_path(heads, kv_heads):
    # Issue 55: the fused adapters' layer moves what the reference path's does. FA2's rise of
    # 1.88 GB (backward_into zero-filled the accumulators' unwritten rows and added into them,
    # Note [fresh rows]) and the cuDNN adapter's .contiguous() copies of q, k, v, dO, out
    # (7.6 GB at P8 C2, 128K) each fail this, and so does cuDNN with GQA expanding K/V and
    # summing dK, dV over the groups (1.81x; its op takes GQA's heads where no bias goes in, an
    # H100 probe showed). One rank on meta, 8K tokens.
    base = dict(world=8, team=2, tokens=8192, heads=heads, kv_heads=kv_heads)
    ref = count(Case("ref", **base))
    for kernel in ("torch_cuda_flash", "torch_cuda_cudnn"):
        got = count(Case(kernel, **base, kernel=kernel))
        assert got.bytes + got.adapter_bytes <= 1.02 * ref.bytes, (kernel, got.by_op_bytes, ref.by_op_bytes)
        # zero-filled rows: a side only partly unwritten is still zeroed first (0.14 GB at 128K,
        # 1.25x the reference path's fills at 8K); the rise was 4.5x
        assert got.by_op_bytes["aten.zero_"] <= 1.5 * ref.by_op_bytes["aten.zero_"], kernel


def test_rotation_q_sends_the_step0_rows_it_wrote_and_adds_only_those(monkeypatch):
    """Note [step-0 rows] (backward.py): at P8 C2, causal, rotation q, a member's early zigzag half
    (chunk = T / 16 rows of its 2 chunks) is reached by no step-0 call. Those rows were zeroed
    (float32: 4 + 4 bytes an element as counted) and added in at step 1 (4 + 4 + 4), in each of
    the C passes; now neither. With the runs' limit at 0 the old schedule comes back."""
    from megatron_startrail import backward  # noqa: PLC0415

    case = Case("q", 8, 2, TOKENS, rotation="q")
    count(case)  # the micro-batch's call metadata learned (Note [device metadata]): both counts alike
    now = count(case)
    monkeypatch.setattr(backward, "_STEP0_MAX_RUNS", 0)
    before = count(case)
    rows, team = TOKENS // 16, 2
    per_row = case.heads * case.head_dim * (8 + 12)  # zero_ and add_ of float32 dQ
    assert before.bytes - now.bytes == team * rows * per_row
    assert before.launch - now.launch == team  # the zero fills


@pytest.mark.parametrize("kernel", ["reference", "torch_cuda_flash"])
def test_bytes_by_site_add_up_to_the_counted_bytes(kernel):
    """``layer_traffic --sites``: every byte the counter charges is charged to one issuing line,
    and a packed layer's gathers are charged to the schedule's row gather (blocks._rows)."""
    case = Case("packed", 8, 2, TOKENS, docs="document", kernel=kernel)
    count(case)  # the first count also learns the micro-batch's metadata (more launches): warmed up first
    plain, traced = count(case), count(case, sites=True)
    assert traced.bytes == plain.bytes and traced.launch == plain.launch  # tracing changes nothing counted
    assert not plain.by_site_bytes
    assert sum(traced.by_site_bytes.values()) == traced.bytes + traced.adapter_bytes > 0
    assert "outside the package" not in " ".join(traced.by_site_bytes)
    gathers = [site for site in traced.by_site_bytes if site.startswith("index_select blocks.py:")]
    assert any(site.endswith("(_rows)") for site in gathers), sorted(traced.by_site_bytes)


def test_index_ops_are_charged_at_the_rows_they_visit():
    """The ``schedule GB`` rule (launch_budget._moved_bytes): an index op reads and writes the rows
    its index names, not the whole tensor it indexes into; every other op, each argument at its
    view's size, read, and the result written. Checked on what the counter sees dispatched."""
    acc, rows = torch.randn(1000, 3, 4), torch.randn(8, 3, 4)
    index, row_bytes = torch.randperm(1000)[:8], 3 * 4 * 4
    for op, expected in ((lambda: acc.index_select(0, index), 2 * 8 * row_bytes),
                         (lambda: acc.index_add_(0, index, rows), 3 * 8 * row_bytes),
                         (lambda: acc.index_copy_(0, index, rows), 3 * 8 * row_bytes),
                         (lambda: acc[:8].add_(rows), 3 * 8 * row_bytes)):
        counts = Counts()
        with _OpCounter(counts):
            op()
        index_bytes = 0 if "aten.add_" in counts.by_op else index.numel() * index.element_size()
        assert counts.launch == 1 and counts.bytes == expected + index_bytes, (counts.by_op, counts.bytes)


def test_sites_are_refused_for_the_yardstick():
    """The yardstick ring is written in the counter, not the package: it has no issuing line to
    charge bytes to, so asking for its sites is an error, not an empty table."""
    with pytest.raises(ValueError, match="yardstick"):
        count(Case("ring", 8, 0, TOKENS), sites=True)
