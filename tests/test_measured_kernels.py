"""``auto``'s CUDA rules against the committed GPU tables (issue 49 item 5, issue 50 item 1).

The rows are ``benchmarks/results/gpu/*/accuracy.json``, parsed from the kit's committed
tables by ``benchmarks/gpu/tables.py`` (checked here to be current). A (kernel, class) that
``auto`` picks on sm90 needs PASS rows of that kernel covering every call kind the class makes
(``measured.layer_kinds``) at its dtype, batch and head dims; no class auto picks on any GPU
may have a FAIL row; every reason cites a committed file. The reference kernel, the last
resort, is exempt: it is the pure-PyTorch definition the kit compares against.
"""

import itertools
import json
import os
import re
import types

import pytest
import torch

from benchmarks import ROOT
from benchmarks.gpu import tables as gpu_tables
from megatron_startrail.kernels import KernelRequest, choose_kernel, measured
from megatron_startrail.layout import dense_sequence, documents_from_cu_seqlens, plan_calls, rows_of_cp_ranks

FOLDERS = sorted(os.path.join(gpu_tables.GPU_RESULTS, d) for d in os.listdir(gpu_tables.GPU_RESULTS)
                 if os.path.isfile(os.path.join(gpu_tables.GPU_RESULTS, d, "accuracy.json")))
ROWS = [row for folder in FOLDERS for row in json.load(open(os.path.join(folder, "accuracy.json")))]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DIMS = [(64, 64), (128, 128), (192, 128), (256, 256), (320, 320), (576, 512)]
EVERY_BACKEND = frozenset({"flash_attn_3", "flash_attn", "torch_flash", "torch_efficient", "torch_cudnn"})
BACKEND_SETS = [EVERY_BACKEND, frozenset({"torch_flash", "torch_efficient", "torch_cudnn"}),
                frozenset({"torch_flash", "torch_efficient"}), frozenset({"torch_efficient"})]


def request(**fields) -> KernelRequest:
    # Only the fields this KernelRequest has: the same test runs against 9ee7a82's rules, which
    # knew no layer class or GPU (shown failing there; see the commit that added this file).
    return KernelRequest(**{k: v for k, v in fields.items() if k in KernelRequest.__dataclass_fields__})


def classes():
    """Every (dtype, batch, mask, packed, head dims) class, with a request of it."""
    for dtype, batch, mask, packed, (qk, v) in itertools.product(
            DTYPES, (1, 2), measured.MASKS, (False, True), DIMS):
        yield (dtype, batch, mask, packed, qk, v)


def auto_choices(capability, backend_sets=BACKEND_SETS):
    for (dtype, batch, mask, packed, qk, v), available in itertools.product(classes(), backend_sets):
        req = request(device_type="cuda", dtype=DTYPES[dtype], qk_head_dim=qk, v_head_dim=v, gqa_ratio=1,
                      available=available, batch=batch, mask=mask, packed=packed, capability=capability)
        yield (dtype, batch, mask, packed, qk, v), choose_kernel(req)


def _same_class(row, kernel, dtype, batch_class, qk, v) -> bool:
    row_batch = "1" if row["batch"] == 1 else ">1"
    dims_match = row["dims"] is None or measured.head_dim_class(*row["dims"]) == measured.head_dim_class(qk, v)
    return row["kernel"] == kernel and row["dtype"] == dtype and row_batch == batch_class and dims_match


def missing_passes(kernel, cls, reason) -> list[str]:
    """The call kinds of ``cls`` no committed PASS row of ``kernel`` covers (rows with recorded
    head dims; batch-2 rows stand for batch 1 only where the reason says so)."""
    dtype, batch, mask, packed, qk, v = cls
    batches = ["1" if batch == 1 else ">1"] + ([">1"] if batch == 1 and measured.BATCH_1_NOTE in reason else [])
    passes = [r for r in ROWS if r["status"] == "PASS" and r["dims"] is not None
              and any(_same_class(r, kernel, dtype, b, qk, v) for b in batches)]
    return sorted(k for k in measured.layer_kinds(mask, packed) if not any(k in r["kinds"] for r in passes))


def fail_rows(kernel, cls) -> list[dict]:
    """Committed FAIL rows of ``kernel`` in ``cls`` (same batch class; a row without head dims
    counts for every head dim) whose call held a kind the class makes."""
    dtype, batch, mask, packed, qk, v = cls
    kinds = measured.layer_kinds(mask, packed) - {"multi"}
    return [r for r in ROWS if r["status"] == "FAIL" and _same_class(r, kernel, dtype, "1" if batch == 1 else ">1",
                                                                     qk, v) and kinds & set(r["kinds"])]


# --- the committed tables are what the script makes of the committed sources ---------------

def test_committed_tables_are_parsed_from_the_kit_files():
    assert FOLDERS, "no committed GPU table under benchmarks/results/gpu"
    for folder in FOLDERS:
        committed = json.load(open(os.path.join(folder, "accuracy.json")))
        assert committed == gpu_tables.folder_rows(folder), (
            f"{folder}/accuracy.json is stale: run python -m benchmarks.gpu.tables")
        for name in os.listdir(folder):  # each kit table: as many rows as its own count line says
            text = open(os.path.join(folder, name)).read() if name.endswith(".md") else ""
            for counts in re.findall(r"PASS (\d+), FAIL (\d+), SKIP (\d+)\.", text):
                rows = [r for r in committed if r["source"] == name]
                assert [sum(r["status"] == s for r in rows) for s in ("PASS", "FAIL", "SKIP")] == [
                    int(c) for c in counts], name
    h100 = [r for r in ROWS if r["source"] == os.path.basename(measured.ACCURACY)]
    assert {r["batch"] for r in h100} == {2} and all(len(r["sequences"]) == 3 for r in h100)
    assert {r["kernel"] for r in h100 if r["status"] == "FAIL"} == {"torch_cuda_efficient"}


def test_layer_kinds_hold_every_call_the_planner_makes():
    # Dense and packed layers, causal or not, with and without a window, over CP sizes and teams:
    # every call the block planner makes is of a kind measured.layer_kinds names for the layer.
    n = 24
    for cp, team, (mask, window), packed in itertools.product(
            (2, 4), (1, 2), (("none", None), ("causal", None), ("window", (7, 0)), ("window", (40, 0))),
            (False, True)):
        local = 2 * n
        docs = (documents_from_cu_seqlens((0, 5, 31, 60, cp * local), None, cp, local) if packed
                else dense_sequence(cp, local))
        teams = [tuple(range(t, t + team)) for t in range(0, cp, team)]
        seen = set()
        for a, b in itertools.product(teams, teams):
            for max_rows in (None, n):
                for call in plan_calls(rows_of_cp_ranks(docs, a), rows_of_cp_ranks(docs, b), mask != "none",
                                       window, max_rows):
                    cu_q, cu_k = call.cu_seqlens_q, call.cu_seqlens_k
                    lengths = [(cu_q[i + 1] - cu_q[i], cu_k[i + 1] - cu_k[i]) for i in range(len(cu_q) - 1)]
                    seen |= set(gpu_tables.call_kinds(call.window, lengths))
        assert seen <= measured.layer_kinds(mask, packed), (cp, team, mask, window, packed, seen)
        assert seen - {"multi"}, (cp, team, mask, window, packed)


# --- the rules against the rows -------------------------------------------------------------

def test_auto_on_sm90_picks_only_what_a_committed_table_shows_pass():
    unconfirmed = []
    for cls, choice in auto_choices((9, 0)):
        if choice.name == "reference":
            continue
        missing = missing_passes(choice.name, cls, choice.reason)
        if missing:
            unconfirmed.append(f"{choice.name} for {cls}: no PASS row for {missing}")
    assert not unconfirmed, f"{len(unconfirmed)} unconfirmed picks, e.g.\n" + "\n".join(sorted(set(unconfirmed))[:12])


@pytest.mark.parametrize("capability", [(9, 0), (8, 0), (7, 5), None], ids=str)
def test_no_auto_choice_has_a_fail_row(capability):
    failing = []
    for cls, choice in auto_choices(capability):
        rows = fail_rows(choice.name, cls)
        if rows:
            failing.append(f"{choice.name} for {cls}: FAIL in {rows[0]['source']} ({rows[0]['note'] or rows[0]['errors']})")
    assert not failing, f"{len(failing)} picks with FAIL rows, e.g.\n" + "\n".join(sorted(set(failing))[:12])


def test_the_efficient_op_is_left_out_where_the_h100_showed_it_wrong_and_says_why():
    for capability in ((9, 0), (8, 0), (7, 5), None):
        for (dtype, batch, mask, packed, qk, v), choice in auto_choices(capability, [frozenset({"torch_efficient"})]):
            wrong = (dtype != "fp32" and batch > 1) or mask != "none"
            assert not (wrong and choice.name == "torch_cuda_efficient"), (capability, dtype, batch, mask)
    half = choose_kernel(request(device_type="cuda", dtype=torch.bfloat16, qk_head_dim=320, v_head_dim=320,
                                 available=EVERY_BACKEND, batch=2, capability=(9, 0)))
    assert half.name == "reference" and "dQ 0.36, dK 0.25" in half.reason
    masked = choose_kernel(request(device_type="cuda", dtype=torch.float32, qk_head_dim=128, v_head_dim=128,
                                   available=EVERY_BACKEND, mask="causal", capability=(9, 0)))
    assert masked.name == "reference" and "attn_bias.stride(2) = 1005" in masked.reason


def test_every_reason_cites_a_committed_file():
    cited = re.compile(r"benchmarks/results/gpu/[\w./-]+\.(?:md|jsonl|json)")
    for table in measured.TABLES:
        for rule in table.rules + table.left_out:
            files = cited.findall(rule.reason)
            assert files, (table.name, rule.kernel, rule.reason)
            for path in files:
                assert os.path.isfile(os.path.join(ROOT, path)), path
            if table.measured and rule in table.rules:
                assert "PASS" in rule.reason, rule.reason  # and, with the file, its figures
            if not table.measured and rule in table.rules:
                assert "unmeasured" in rule.reason, rule.reason


# --- the attention layer asks for its class ---------------------------------------------------

def test_the_attention_layer_asks_for_its_class(monkeypatch):
    from megatron_startrail import attention  # noqa: PLC0415

    asked = []
    monkeypatch.setattr(attention, "choose_layer_kernel", lambda q, k, v, name, deterministic, **cls: asked.append(cls))
    groups = types.SimpleNamespace(kernel="auto", config=types.SimpleNamespace(deterministic=False))
    q = torch.empty(8, 2, 4, 16)  # [s, b, h, d]
    one, two = torch.tensor([0, 16], dtype=torch.int32), torch.tensor([0, 5, 16], dtype=torch.int32)
    for cu, padded, causal, window in ((None, None, True, None), (None, None, False, None), (None, None, True, (4, 0)),
                                       (two, None, True, None), (two, None, False, (3, 3)), (one, None, True, None),
                                       (one, one, True, None)):
        attention.layer_kernel(q, q, q, groups, causal, window, cu, padded)
    assert asked == [dict(mask="causal", packed=False), dict(mask="none", packed=False),
                     dict(mask="window", packed=False), dict(mask="causal", packed=True),
                     dict(mask="window", packed=True), dict(mask="causal", packed=False),
                     dict(mask="causal", packed=True)]
    req = KernelRequest.of(q, q[:, :, :2], q, mask="window", packed=True, capability=(9, 0))
    assert (req.batch, req.gqa_ratio, req.mask, req.packed, req.capability) == (2, 2, "window", True, (9, 0))
    with pytest.raises(ValueError, match="mask='sliding'"):
        KernelRequest("cuda", torch.bfloat16, 128, 128, mask="sliding")


# --- unmeasured GPUs newer than Hopper follow the sm90 table; cuDNN's ragged op is forced only --

def test_an_unmeasured_newer_gpu_follows_the_sm90_table_and_an_a100_keeps_its_order():
    for capability in ((10, 0), (10, 3), (12, 0), (9, 1)):
        for (cls, choice), (_, sm90) in zip(auto_choices(capability), auto_choices((9, 0))):
            assert choice.name == sm90.name, (capability, cls)
            if choice.name != "reference":
                assert f"sm{capability[0]}{capability[1]} is unmeasured" in choice.reason and "follows the sm90" \
                    in choice.reason, choice.reason
    dense = request(device_type="cuda", dtype=torch.bfloat16, qk_head_dim=128, v_head_dim=128,
                    available=EVERY_BACKEND, capability=(10, 0))
    assert choose_kernel(dense).name == "torch_cuda_cudnn"
    a100 = choose_kernel(request(**{**dense.__dict__, "capability": (8, 0)}))
    assert a100.name == "flash_attn" and "unmeasured on this device" in a100.reason


def test_a_newer_gpu_warns_once_that_it_follows_the_h100(monkeypatch):
    import warnings  # noqa: PLC0415

    from megatron_startrail import kernels  # noqa: PLC0415

    kernels._warn_once.cache_clear()
    req = request(device_type="cuda", dtype=torch.bfloat16, qk_head_dim=128, v_head_dim=128,
                  available=EVERY_BACKEND, capability=(10, 0))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            assert kernels._choose(req, "auto").name == "torch_cuda_cudnn"
        kernels._choose(request(**{**req.__dict__, "capability": (9, 0)}), "auto")
    assert [str(w.message) for w in caught] == [
        "StarTrail's kernel choice on this unmeasured GPU (compute capability 10.0) follows the H100's (sm90) table: "
        "run scripts/gpu_session.sh on it and commit its tables to measure it"]


def test_cudnn_varlen_is_forced_only_until_a_gpu_table_measures_it():
    for capability in ((9, 0), (10, 0), (8, 0), None):
        assert all(choice.name != "torch_cuda_cudnn_varlen" for _, choice in auto_choices(capability))
    packed = request(device_type="cuda", dtype=torch.bfloat16, qk_head_dim=128, v_head_dim=128,
                     available=EVERY_BACKEND, packed=True, capability=(9, 0))
    assert choose_kernel(packed).name == "torch_cuda_flash"
    forced = choose_kernel(packed, "torch_cuda_cudnn_varlen")
    assert forced.name == "torch_cuda_cudnn_varlen" and "forced" in forced.reason
    assert any(r.kernel == "torch_cuda_cudnn_varlen" and "faster than torch_cuda_flash" in r.reason
               for r in measured.SM90.left_out)
