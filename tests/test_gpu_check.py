"""The GPU validation kit's CPU self-check: argument parsing, tables, the timing part's check
against SDPA, the process per part, and the kit's four parts run at toy sizes on the CPU
kernels, each in its own process as on a GPU (``tests/gpu_check_faults.py`` holds the faulty
parts the kit is handed here)."""

import os
import sys

import pytest
import torch

from benchmarks.gpu import check as gpu_check
from benchmarks.gpu import check_kernels as gpu_check_kernels
from benchmarks.gpu.check_kernels import AccuracyRow, Case, check_case, time_kernel
from benchmarks.gpu.check_parts import Part, run_parts
from megatron_startrail.kernels import RULES, ReferenceKernel, make_kernel
from tests import early

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU = torch.device("cpu")


def test_argument_parsing():
    args = gpu_check.parse_args(["--cpu-selfcheck", "--dims", "16/8,32", "--rank-configs", "8x2,16x4",
                                 "--dtypes", "fp32,bf16", "--kernels", "reference", "--skip-rank"])
    assert args.device == CPU and args.dims == [(16, 8), (32, 32)]
    assert args.rank_configs == [(8, 2), (16, 4)] and args.dtypes == [torch.float32, torch.bfloat16]
    assert args.kernels == ["reference"] and args.block_seq == 40 and args.iters == 1
    assert args.parts == ["accuracy", "timing", "transport"] and args.rank_kv_heads == args.rank_heads
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit):  # the GPU defaults need a GPU
            gpu_check.parse_args([])


def test_tables_have_one_cell_per_column():
    case = Case("reference", torch.bfloat16, (24, 16), (-1, 0), (8, 2), "qkv")
    rows = [AccuracyRow(case, "PASS", {"out": 1e-3, "lse": 2e-6, "dq": 1e-3, "dk": 1e-3, "dv": 1e-3}, "").to_json(),
            AccuracyRow(case, "SKIP", {}, "flash_attn needs flash-attn 2.x").to_json()]
    table = gpu_check.accuracy_table(rows)
    assert all(line.count("|") == table[0].count("|") for line in table)
    assert "| batch 2, fused-QKV views | PASS | 1.0e-03 | 2.0e-06 |" in table[2]
    assert table[3].endswith("flash_attn needs flash-attn 2.x |")


def test_accuracy_draws_each_distinct_input_set_once_on_the_device(monkeypatch):
    """The accuracy part's cases share 12 input sets (heads x head dims x input layout): each is
    drawn once per process, on the case's device, and every case gets its own rounded copy (the
    H100 session drew ~7.35 G float64 normals on one CPU core, every case anew)."""
    devices = []
    draw = gpu_check_kernels.randn
    monkeypatch.setattr(gpu_check_kernels, "randn", lambda shape, gen, device, dtype: devices.append(device)
                        or draw(shape, gen, device, dtype))
    gpu_check_kernels._draws.cache_clear()
    cases = gpu_check_kernels.all_cases([torch.bfloat16, torch.float32], [(16, 16), (24, 16)], ["reference"])
    seen = []
    for case in cases:
        x = gpu_check_kernels._inputs(case, gpu_check_kernels.varlen_call(20, case.window), CPU)
        assert all(t.dtype == case.dtype and t.device == CPU for t in x)
        assert not any(t.untyped_storage().data_ptr() == s for t in x for s in seen)  # a copy per case
        seen = [t.untyped_storage().data_ptr() for t in x]
    assert len(cases) == 96 and gpu_check_kernels._draws.cache_info().misses == 12
    assert set(devices) == {CPU} and len(devices) == 8 * 4 + 4 * 2  # b1, b2: q, k, v, dO; fused: qkv, dO


def test_parts_run_autos_kernels_first_and_the_reference_last():
    """A part cut by its time loses the fallbacks, not auto's Hopper kernels."""
    order = gpu_check_kernels.kernel_order([rule.name for rule in RULES])
    assert order[0] == "torch_cuda_cudnn" and order[-1] == "reference"
    assert order.index("torch_cuda_flash") < order.index("flash_attn") < order.index("reference")
    cases = gpu_check_kernels.all_cases([torch.bfloat16], [(16, 16)])
    assert cases[0].kernel == "torch_cuda_cudnn" and cases[-1].kernel == "reference"


def test_packed_documents_are_timed_against_autos_packed_kernel(monkeypatch):
    """The timing part's packed row (4 documents in one call): the kernel against the yardstick
    (FA2's adapter on a GPU, the reference here) on the same tensors, after they agree; a kernel
    that differs is refused before it is timed."""
    row = gpu_check_kernels.time_packed("torch_cpu_flash", torch.float32, (16, 16), 64, 2, CPU, 1)
    assert row.against == "reference" and row.vs_sdpa < 1e-5 and row.shape.endswith("4 documents")
    assert gpu_check_kernels.packed_call(64).cu_seqlens_q == (0, 6, 25, 38, 64)
    combos = gpu_check_kernels.timing_combinations(["torch_cpu_flash", "reference"], [torch.float32], [(16, 16)], CPU)
    assert combos == [("torch_cpu_flash", torch.float32, (16, 16), c) for c in (True, False, "packed")]

    class Wrong(ReferenceKernel):
        def forward(self, *args, **kwargs):
            out, lse = super().forward(*args, **kwargs)
            return out * 1.1, lse

    real = gpu_check_kernels.make_kernel
    monkeypatch.setattr(gpu_check_kernels, "make_kernel", lambda name: Wrong() if name == "torch_cpu_flash"
                        else real(name))
    with pytest.raises(ValueError, match="differs from reference on packed documents"):
        gpu_check_kernels.time_packed("torch_cpu_flash", torch.float32, (16, 16), 64, 2, CPU, 1)


def test_a_wrong_kernel_is_a_failed_row(monkeypatch):
    class Wrong(ReferenceKernel):
        def backward(self, *args, **kwargs):
            dq, dk, dv = super().backward(*args, **kwargs)
            return dq * 1.1, dk, dv

    monkeypatch.setattr(gpu_check_kernels, "make_kernel", lambda name: Wrong())
    row = check_case(Case("reference", torch.float32, (16, 16), (37, 0), (4, 2)), 20, CPU, frozenset())
    assert row.status == "FAIL" and row.errors["dq"] > 0.05 and row.errors["out"] < 1e-6


@pytest.mark.parametrize("heads", [(4, 4), (4, 2)])
def test_accuracy_inputs_are_megatrons_strided_views(heads):
    """The "qkv" layout hands the kernel views of one fused QKV tensor, as Megatron's split does
    (k, v always strided; q too for MHA), and a transposed dO; batch 1 and 2 are contiguous."""
    call = gpu_check_kernels.varlen_call(20, (-1, 0))
    q, k, v, dout = gpu_check_kernels._inputs(Case("reference", torch.bfloat16, (16, 8), (-1, 0), heads, "qkv"),
                                              call, CPU)
    tq, tk = call.cu_seqlens_q[-1], call.cu_seqlens_k[-1]
    assert q.shape == (tq, 2, heads[0], 16) and k.shape == (tk, 2, heads[1], 16) and v.shape == (tk, 2, heads[1], 8)
    assert k.untyped_storage().data_ptr() == v.untyped_storage().data_ptr() and not k.is_contiguous()
    assert not v.is_contiguous() and not dout.is_contiguous() and dout.shape == (tq, 2, heads[0], 8)
    assert q.is_contiguous() == (heads[0] != heads[1])  # Megatron's reshape copies the query of GQA
    for layout, batch in (("b1", 1), ("b2", 2)):
        x = gpu_check_kernels._inputs(Case("reference", torch.bfloat16, (16, 8), (-1, 0), heads, layout), call, CPU)
        assert all(t.is_contiguous() and t.shape[1] == batch for t in x)


def test_strided_inputs_reach_the_kernel_as_views(monkeypatch):
    """A kernel that reads its inputs as if contiguous (``.view`` of the storage) fails the
    strided row and passes the contiguous ones: the layout is not copied away before the call."""
    real = make_kernel("torch_cpu_flash")

    class AssumesContiguous:
        def forward(self, q, k, v, call, scale):
            k = torch.as_strided(k, k.shape, torch.empty(k.shape).stride(), k.storage_offset())
            return real.forward(q, k, v, call, scale=scale)

        def backward(self, *args, **kwargs):
            return real.backward(*args, **kwargs)

    monkeypatch.setattr(gpu_check_kernels, "make_kernel", lambda name: AssumesContiguous())
    rows = {layout: check_case(Case("torch_cpu_flash", torch.float32, (16, 16), (-1, 0), (4, 2), layout), 20, CPU,
                               frozenset()) for layout in ("b2", "qkv")}
    assert rows["b2"].status == "PASS" and rows["qkv"].status == "FAIL" and rows["qkv"].errors["out"] > 0.1


def test_timing_hands_the_kernel_its_own_layout(monkeypatch):
    """The block kernel gets ``[seq, 1, heads, d]`` tensors, SDPA its ``[1, heads, seq, d]`` views.
    9ee7a82 rebound q, k, v, dout to the permuted views after defining the kernel's closure, which
    read them late: the kernel got ``[1, 16, 8192, 128]`` with a call of 8192 rows, and an H100
    faulted (an illegal memory access) while a CPU, where slicing clamps, passed."""
    seen = []
    real = make_kernel("torch_cpu_flash")

    class Spy:
        def forward(self, q, k, v, call, scale):
            seen.append(tuple(q.shape))
            return real.forward(q, k, v, call, scale=scale)

        def backward(self, dout, q, k, v, *args, **kwargs):
            seen.append(tuple(dout.shape))
            return real.backward(dout, q, k, v, *args, **kwargs)

    monkeypatch.setattr(gpu_check_kernels, "make_kernel", lambda name: Spy())
    row = time_kernel("torch_cpu_flash", torch.float32, (16, 8), True, 64, 2, CPU, 1)
    assert seen and set(seen) == {(64, 1, 2, 16), (64, 1, 2, 8)}, seen
    assert row.vs_sdpa < 1e-5


def test_timing_refuses_a_kernel_that_differs_from_sdpa(monkeypatch):
    real = make_kernel("torch_cpu_flash")

    class Off:
        def forward(self, *args, **kwargs):
            out, lse = real.forward(*args, **kwargs)
            return out * 1.01, lse

        def backward(self, *args, **kwargs):
            return real.backward(*args, **kwargs)

    monkeypatch.setattr(gpu_check_kernels, "make_kernel", lambda name: Off())
    with pytest.raises(ValueError, match="out differs from SDPA's by 1"):
        time_kernel("torch_cpu_flash", torch.float32, (16, 16), False, 64, 2, CPU, 1)


def _selfcheck(tmp_path, *extra):
    out = tmp_path / "gpu_check.md"
    status = gpu_check.main(["--cpu-selfcheck", "--out", str(out), *extra])
    return status, out.read_text(), out.with_suffix(".json")


def test_selfcheck_fails_when_its_timing_part_is_handed_permuted_tensors(monkeypatch, tmp_path):
    """The whole CPU self-check (each part in its process), its timing part's kernel handed SDPA's
    permuted views as 9ee7a82's did: it fails, naming the part; the accuracy rows stay."""
    monkeypatch.setitem(gpu_check.FUNCTIONS, "timing", "tests.gpu_check_faults:permuted_timing_part")
    status, text, _ = _selfcheck(tmp_path, "--skip-rank", "--dtypes", "fp32", "--kernels", "torch_cpu_flash",
                                 "--dims", "16/16")
    assert status == 1 and "## Errors" in text
    # Refused by the kernel's own host check (kernels/call_check.py: the call's rows against q's) or,
    # were that check gone, by the kit's comparison with SDPA: a ValueError either way, never a launch.
    assert "- timing torch_cpu_flash fp32 (16, 16) causal=True: ValueError: " in text
    assert "refused before launch" in text or "not handed SDPA's tensors" in text
    assert text.count(" | PASS | ") == 24  # 4 window classes x 2 head layouts x 3 input layouts


def test_a_dead_part_keeps_its_rows_and_the_others_run(tmp_path):
    """A part whose process dies mid-way (as after a CUDA fault) keeps the rows written before,
    reports the item it died in, and starts again after it; a hung part is stopped at its time;
    an item that raises is its error; the later parts run; the tables are written after each."""
    written = []
    parts = [Part("dies", "tests.gpu_check_faults:faulty_part", {"fault": "die", "at": 1, "count": 3}, 60),
             Part("hangs", "tests.gpu_check_faults:faulty_part", {"fault": "hang", "at": 1, "count": 3}, 8),
             Part("loses", "tests.gpu_check_faults:faulty_part", {"fault": "lose", "at": 0, "count": 2}, 60),
             Part("raises", "tests.gpu_check_faults:raising_part", {"count": 3}, 60)]
    results = run_parts(parts, tmp_path / "log", 120, lambda r: written.append({n: p.status for n, p in r.items()}))
    dies, hangs, loses, raises = (results[n] for n in ("dies", "hangs", "loses", "raises"))
    assert dies.rows == [{"item": 0}, {"item": 2}] and dies.errors == ["item 1: the process died (exit 134)"]
    assert hangs.rows == [{"item": 0}] and hangs.errors == ["item 1: timed out"] and hangs.status == "timeout"
    assert loses.rows == [{"item": 1}] and loses.errors == [
        "item 0: RuntimeError: CUDA error: an illegal memory access was encountered (pretend)"]
    assert raises.rows == [{"item": 0}, {"item": 2}] and raises.status == "errors"
    assert raises.errors == ["item 1: RuntimeError: CUDA out of memory (pretend) at 1"]
    assert [w["dies"] for w in written] == ["errors"] * 4 and written[0]["raises"] == "not run"


def test_a_kernel_that_kills_the_device_every_time_costs_one_restart(tmp_path):
    """After an item of a group (a kernel) kills the process, the fresh process skips the rest of
    that group: six deadly items cost one restart, and the sound group after them still runs
    (before: all four restarts spent on the deadly group, the sound one never reached)."""
    part = Part("grouped", "tests.gpu_check_faults:grouped_fault_part", {"bad": 6, "good": 2}, 60)
    result = run_parts([part], tmp_path / "log", 120, lambda r: None)["grouped"]
    assert result.rows == [{"item": 0}, {"item": 1}]
    assert result.errors == ["bad 0: the process died (exit 134)", "bad: 5 more items skipped: an earlier one lost "
                             "the device"]
    assert (tmp_path / "log").read_text().count("=== part grouped") == 2


@early.recipe("gpu-check-selfcheck", __file__, tests=("test_cpu_selfcheck_runs_every_part",))
def start_selfcheck(directory):
    """The kit's CPU self-check, started with the session (tests/early.py)."""
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    return early.Process([sys.executable, "-m", "benchmarks.gpu.check", "--cpu-selfcheck", "--out",
                          str(directory / "gpu_check.md"), "--dtypes", "fp32,bf16"], env, directory)


def test_cpu_selfcheck_runs_every_part():
    selfcheck = early.started("gpu-check-selfcheck")
    code, log = selfcheck.finish(timeout=1200)
    assert code == 0, log[-6000:]
    out = selfcheck.directory / "gpu_check.md"
    text = out.read_text()
    statuses = (" | PASS | ", " | SKIP | ", " | FAIL | ")
    rows = [line.split(" | ") for line in text.splitlines() if any(s in line for s in statuses)]
    assert rows and not any(r[6] == "FAIL" for r in rows)
    # 2 dtypes x 2 head dims x 4 window classes x 2 head layouts x 3 input layouts per kernel: the
    # CPU kernels pass all, every CUDA kernel is listed as skipped with the reason.
    for rule in RULES:
        mine = [r for r in rows if r[0] == f"| {rule.name}"]
        assert len(mine) == 96
        if rule.device_type == "cuda":
            assert all(r[6] == "SKIP" and "runs on cuda tensors" in r[-1] for r in mine)
        else:
            assert all(r[6] == "PASS" for r in mine)
    assert "| torch_cpu_flash | fp32 | 24, 16 | causal | 1x2x128x24/16 |" in text  # timing vs SDPA
    assert "| torch_cpu_flash | fp32 | 24, 16 | causal | 1x2x128x24/16, 4 documents | reference |" in text
    for p, c in ((4, 1), (4, 2)):
        assert f"| 256 | {p} | {c} | 2/2 x 16 | torch_cpu_flash |" in text  # one-rank run
    assert "Efficiency at C = 2, 256 tokens:" in text
    for check in ("transport of the backend", "self exchange"):  # part 4, on gloo here
        assert f"| {check} | ok |" in text
    assert "accuracy ok" in text and "transport ok" in text and "## Errors" not in text
    data = __import__("json").loads(out.with_suffix(".json").read_text())
    assert [r["status"] for r in data["parts"]["accuracy"]["rows"]].count("PASS") == 192
