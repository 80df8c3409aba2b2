"""The GPU rehearsal: the package's CUDA branch on fake CUDA tensors (tests/fake_cuda).

Child processes, started together with the shim preloaded, run the attention's matrix (in two shards)
(:mod:`tests.fake_cuda.matrix`: P 8/16 x C 1/2/4 x dense / sample / document x rotation q/kv x
regathering, and the kernels torch_cuda_flash, torch_cuda_efficient and flash-attn 2.8.3 through
an interface double that checks its C++ preconditions), with the torch ops checked against their
contracts (:mod:`tests.fake_cuda.aten_doubles`); another runs the CUDA adapters call by call
over batch 1/2, fused-QKV views, GQA, MLA and the masks (:mod:`tests.fake_cuda.kernel_matrix`).
The tests read what they recorded. Where no C++ compiler (or no torch headers) is at hand,
they skip and say which.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path

import pytest

from tests import early
from tests.attention_cases import pairs_not_run
from tests.fake_cuda.build import build_shim, why_not_buildable
from tests.fake_cuda.kernel_matrix import ADAPTERS
from tests.fake_cuda.matrix import KERNEL_OPS, KERNELS, LAYOUTS, ROTATIONS, TEAMS, cases
from tests.fake_cuda.run import fake_cuda_command, fake_cuda_env


# The children, read as the tests need them: the matrix in MATRIX_SHARDS interleaved shards, the
# kernel matrix and the self-check side by side on the machine's cores (one after another they
# took 230 s of a quiet 2-core run's wall time, one core idle). Started with the session
# (tests/early.py: they run while the tests before this module leave a core idle).
MATRIX_SHARDS = 2
CHILDREN = {f"matrix {i}": ("tests.fake_cuda.matrix", "--shard", f"{i}/{MATRIX_SHARDS}") for i in range(MATRIX_SHARDS)}
CHILDREN.update(kernel_matrix=("tests.fake_cuda.kernel_matrix",), selfcheck=("tests.fake_cuda.selfcheck",))


@early.recipe("fake-cuda-rehearsal", __file__)
def start_children(directory: Path):
    """{name: early.Process} of the children, or why the shim cannot be built here (a skip reason)."""
    why = why_not_buildable()
    if why is not None:
        return why
    shim = build_shim(directory / "shim")
    # (directories without spaces: LD_PRELOAD is a space-separated list)
    return {name: early.Process(fake_cuda_command(module, *args, "--json", str(directory / name.replace(" ", "-") /
                                                                           "out.json")),
                                fake_cuda_env(shim), directory / name.replace(" ", "-"))
            for name, (module, *args) in CHILDREN.items()}


@pytest.fixture(scope="module")
def children():
    running = early.started("fake-cuda-rehearsal")
    if isinstance(running, str):
        pytest.skip(running)
    return running


def result(child: early.Process):
    code, log = child.finish(timeout=900)
    out = child.directory / "out.json"
    assert code == 0 and out.exists(), log[-6000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def matrix(children):
    return [record for i in range(MATRIX_SHARDS) for record in result(children[f"matrix {i}"])]


def failing(matrix, wrong):
    """``case: what`` for every case where ``wrong(case record)`` says something (non-empty)."""
    return [f"{r['case']}: {wrong(r)}" for r in matrix if wrong(r)]


def test_every_case_ran(matrix):
    assert sorted(tuple(r["case"].values()) for r in matrix) == sorted(cases())
    assert len(matrix) == 27


def pairs(rows, settings):
    """{(a, b): the pairs of their values that ``rows`` (dicts) run} for every two ``settings``."""
    return {(a, b): {(r[a], r[b]) for r in rows} for a, b in itertools.combinations(settings, 2)}


def test_the_matrix_runs_every_value_and_every_pair_of_settings():
    rows = [dict(zip(("team", "layout", "rotation", "regather", "kernel"), ((p, c), *rest)))
            for p, c, *rest in cases()]
    values = {"team": TEAMS, "layout": LAYOUTS, "rotation": ROTATIONS, "regather": (False, True), "kernel": KERNELS}
    # With torch's flash kernel: every pair of (P, C), layout, rotation and regathering.
    flash = [((p, c), *rest[:-1]) for p, c, *rest in cases() if rest[-1] == KERNELS[0]]
    assert pairs_not_run(flash, [values[s] for s in ("team", "layout", "rotation", "regather")]) == []
    # Each other kernel: every layout with every rotation, each of its two teams with each rotation
    # and with each layout but the memory-efficient kernel's document layout (P8 C2 only).
    for kernel in KERNELS[1:]:
        mine = [r for r in rows if r["kernel"] == kernel]
        got = pairs(mine, ["team", "layout", "rotation"])
        assert got[("layout", "rotation")] == set(itertools.product(LAYOUTS, ROTATIONS)), kernel
        assert got[("team", "rotation")] == set(itertools.product([(8, 2), (16, 4)], ROTATIONS)), kernel
        skipped = {((16, 4), "document")} if kernel == "torch_cuda_efficient" else set()
        assert got[("team", "layout")] == set(itertools.product([(8, 2), (16, 4)], LAYOUTS)) - skipped, kernel
        assert not any(r["regather"] for r in mine), kernel
    assert len(set(map(lambda r: tuple(r.values()), rows))) == len(rows)  # no case twice


def test_nccl_transport_and_the_expected_kernel(matrix):
    assert not failing(matrix, lambda r: r["transports"] != ["nccl"] and r["transports"])
    assert not failing(matrix, lambda r: r["transports"] != ["nccl"] and "no communication")
    assert not failing(matrix, lambda r: r["kernel_ops"] != sorted(KERNEL_OPS[r["case"]["kernel"]]) and
                       f"kernel ops {r['kernel_ops']}")


def test_the_torch_ops_met_their_contracts(matrix):
    # A violation stops the child (the matrix fixture fails); here: the contracts did run.
    assert not failing(matrix, lambda r: r["case"]["kernel"].startswith("torch_cuda") and
                       r["contract_checks"] != sorted(KERNEL_OPS[r["case"]["kernel"]]) and r["contract_checks"])


@pytest.fixture(scope="module")
def kernel_matrix(children):
    return result(children["kernel_matrix"])


def test_cuda_adapters_meet_the_op_contracts_call_by_call(kernel_matrix):
    assert [c for c in kernel_matrix["cases"] if c["violation"]] == []
    assert {c["kernel"] for c in kernel_matrix["cases"]} == set(ADAPTERS) and len(kernel_matrix["cases"]) == 22
    # every op's contract ran: 6 calls each for flash, 7 launches for efficient (packed documents: 2), 4 for cuDNN
    assert kernel_matrix["checked"] == {f"aten.{op}.default": n for op, n in [
        ("_flash_attention_forward", 6), ("_flash_attention_backward", 6),
        ("_scaled_dot_product_efficient_attention", 7), ("_scaled_dot_product_efficient_attention_backward", 7),
        ("_scaled_dot_product_cudnn_attention", 4), ("_scaled_dot_product_cudnn_attention_backward", 4)]}
    assert kernel_matrix["flash_attn_calls"] == {"forward": 6, "backward": 6}


def test_the_kits_timing_call_is_refused_by_the_adapter_and_the_op_contract(kernel_matrix):
    assert kernel_matrix["kit"] == {
        "adapter": "torch_cuda_flash: call has 8192 query rows but q holds 1 rows ([1, 16, 8192, 128]) (call of 1 "
                   "sequences, window (-1, 0)); refused before launch",
        "op": "aten._flash_attention_forward: cu_seqlens_q ends at row 131072, the tensor holds 16 rows"}


def test_no_op_on_mixed_devices(matrix):
    assert not failing(matrix, lambda r: r["mixed"])


def test_no_sync_but_the_packed_documents_agreement_once_per_micro_batch(matrix):
    def wrong(r):
        if r["case"]["layout"] == "dense":
            return r["sync_sites"]
        if len(r["sync_sites"]) != 1 or not r["sync_sites"][0].startswith("documents.py:"):
            return r["sync_sites"]
        return r["syncs_after_first_forward"]  # the later layers and the backward: none
    assert not failing(matrix, wrong)
    assert not failing(matrix, lambda r: r["d2h"])


def test_at_most_two_non_blocking_pinned_copies_to_the_device_per_micro_batch(matrix):
    assert not failing(matrix, lambda r: len(r["h2d"]) > 2 or [c for c in r["h2d"] if not
                                                              (c["non_blocking"] and c["pinned"])])
    # Dense runs reuse their layout's metadata (one per shape on the groups): no copy at all.
    assert not failing(matrix, lambda r: r["case"]["layout"] == "dense" and r["h2d"])


def test_merges_lse_and_head_group_sums_in_float32(matrix):
    assert not failing(matrix, lambda r: r["precision"])


def test_the_package_asks_torch_cuda_nothing_a_cpu_build_cannot_answer(matrix):
    assert not failing(matrix, lambda r: r["cuda_queries"])


def test_the_rules_catch_what_they_are_for(children):
    got = result(children["selfcheck"])
    assert got["known"] == 7  # a host read of a device value runs (its value followed on the CPU)...
    assert [s[1].split(":")[0].rsplit("/", 2)[-2:] for s in got["syncs"]] == [["fake_cuda", "selfcheck.py"]]  # a sync
    to_device, to_host = got["copies"]
    assert (to_device["src"], to_device["non_blocking"], to_device["pinned"]) == ("cpu", False, False)
    assert (to_host["src"], to_host["dst"]) == ("cuda", "cpu")
    assert got["precision"] == [["merge", ["torch.bfloat16"], ["torch.bfloat16"]],
                                ["sum", ["torch.bfloat16"], ["torch.bfloat16"]]]
    assert [q[1] for q in got["cuda_queries"]] == ["/x/megatron_startrail/fake_module.py:2"]
