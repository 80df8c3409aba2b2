"""The closed form of one layer's live bytes (megatron_startrail/planning/memory_model.py) against
the measured peak (benchmarks/counters/peak_memory.py: CPU allocator events, forked gloo ranks;
benchmarks/counters/fake_cuda_memory.py: GPU-scale shapes on fake CUDA; and one H100's
``torch.cuda.max_memory_allocated``)."""

import json

import pytest

from benchmarks.counters.peak_memory import run
from megatron_startrail.accounting import AttentionShape
from megatron_startrail.planning.memory_model import activation_peak_bytes, layer_memory_bytes, layer_memory_terms
from tests import early

SHAPE = AttentionShape(256, 1, 4, 4, 32, 4)

# One H100 80GB HBM3 (torch 2.11.0+cu130, auto's kernel: torch_cuda_flash), 9ee7a82: rank 1 of P
# through torch's fake process group, 128K tokens of causal bf16 GQA 32/8 x 128, batch 1; bytes
# above q, k, v, dO. The ten "part B" rows with a model column of
# benchmarks/results/gpu/h100-2026-11-27/one_rank_gqa.jsonl (issue 50's memory table):
# (P, C, rotation, regather): (forward peak, kept, backward peak).
H100_ROWS = {
    (8, 1, "kv", False): (878706688, 136314880, 2120238080),
    (8, 1, "q", False): (878706688, 136314880, 2527085568),
    (8, 2, "kv", False): (1488977920, 538968064, 3230680064),
    (8, 2, "q", False): (1348468736, 270532608, 2898297856),
    (8, 2, "kv", True): (1348468736, 136314880, 3230680064),
    (16, 1, "kv", False): (439353344, 68157440, 1062208512),
    (16, 2, "kv", False): (744488960, 269484032, 1683506176),
    (16, 4, "kv", False): (1212153856, 470810624, 2222474240),
    (16, 4, "q", False): (1078984704, 202375168, 1212695552),
    (16, 4, "q", True): (1078984704, 68157440, 1112032256),
}

# Rows the code changed after the H100 measured them (issue 55, commit 3f98873): rotation "kv"
# gathers dO and out each into its own tensor and hands a call its rows as dense views, so at
# C = 1 (nothing gathered) the concatenated dO | out copy and each call's dense copies of its
# dO and out rows (n query rows: 2 n h dv e each) are gone. The model is compared with the
# H100's row less those bytes; the fake-CUDA rehearsal measures the new code
# (test_fake_cuda_memory_matches_the_model). To be remeasured on the next GPU session.
FREED_SINCE_THE_H100 = {(8, 1, "kv", False), (16, 1, "kv", False)}


@pytest.fixture(scope="module")
def measured():
    # P = 4: ring attention, StarTrail C = 2 (G = 1) with and without regathering.
    return run([4], [2], seq=1024, heads=4, dim=32, timeout=240, rotations=("auto", "q"))


def test_the_model_bounds_the_measured_peak(measured):
    # The model counts the attention's own buffers; the measurement adds the CPU kernel's
    # workspace and the autograd engine's, so it may exceed the model, by a bounded amount.
    for row in measured:
        model, got = row["model_peak_bytes"], row["peak_live_bytes"]
        assert 0.85 * model <= got <= 1.45 * model, (row["config"], got, model)


@early.recipe("fake-cuda-memory", __file__, tests=("test_fake_cuda_memory_matches_the_model",
                                                   "test_piece_major_rotation_q_backward_peaks_near_ring_at_c4"))
def start_fake_cuda_memory(directory):
    """benchmarks/counters/fake_cuda_memory.py at P = 16 (ring and C = 4; both rotations, with and
    without regathering), 128K tokens of bf16 GQA 32/8 x 128, rank 1, in a fake-CUDA process:
    the order of allocations is the program's, not gloo's timing. Started with the session
    (tests/early.py); or why the shim cannot be built here (a skip reason)."""
    from tests.fake_cuda.build import build_shim, why_not_buildable  # noqa: PLC0415
    from tests.fake_cuda.run import fake_cuda_command, fake_cuda_env  # noqa: PLC0415

    if (why := why_not_buildable()) is not None:
        return why
    shim = build_shim(directory / "shim")
    return early.Process(fake_cuda_command("benchmarks.counters.fake_cuda_memory", "--out", str(directory / "rows"),
                                           "--tokens", str(2**17), "--world-sizes", "16", "--team-sizes", "1", "4",
                                           "--no-extras"), fake_cuda_env(shim), directory)


@pytest.fixture(scope="module")
def fake_cuda_rows():
    process = early.started("fake-cuda-memory")
    if isinstance(process, str):
        pytest.skip(process)
    code, log = process.finish(timeout=300)
    assert code == 0, log[-3000:]
    return json.loads((process.directory / "rows.json").read_text())


def test_fake_cuda_memory_matches_the_model(fake_cuda_rows):
    # Kept: exactly the model's. Forward, backward and peak: within 5% (every moment of both
    # is modelled; benchmarks/results/fake_cuda_memory.md).
    for row in fake_cuda_rows:
        model, what = row["model"], (row["team"], row["rotation"], row["regather"])
        assert row["kept"] == model["kept"], what
        for key in ("forward_peak", "backward_peak", "peak"):
            assert abs(row[key] / model[key] - 1) <= 0.05, (what, key, row, model)


def test_piece_major_rotation_q_backward_peaks_near_ring_at_c4(fake_cuda_rows):
    # P = 16, C = 4: sub-rings of one position, the piece-major backward (Note [piece-major
    # rotation q] in backward.py): one piece of K, V, its dK, dV and one member's dQ live at a
    # time. Before it, rotation "q" peaked at 1.38x ring's (1.49x regathering). Its backward
    # against ring attention's peak (at the rotation "auto" picks); with GQA the team's
    # forward (team Q, C partials) is the higher phase at C = 4 and not what this bounds.
    rows = {(r["team"], r["rotation"], r["regather"]): r for r in fake_cuda_rows if r["reverse_overlap"]}
    ring = rows[(1, fake_cuda_rows[0]["auto_rotation"], False)]["peak"]
    # The bars were set against ring's peak when its rotation "kv" still held a concatenated
    # dO | out and each call's dense copies of them (2 n h dv e each; FREED_SINCE_THE_H100): they
    # are added back so that the bars keep guarding the piece-major path. Against today's ring
    # (1062 -> 793 MB here), C = 4 rotation "q" is 1.40x with or without regathering: issue 55, item 4.
    ring += 2 * (2 * (2**17 // 16) * 32 * 128 * 2)
    # Without regathering the backward frees each kept piece of K, V as it is done (Note [kept
    # pieces] in backward.py): 1.14x -> 1.05x, as low as regathering; held to the end it fails.
    assert rows[(4, "q", False)]["backward_peak"] <= 1.1 * ring
    assert rows[(4, "q", True)]["backward_peak"] <= 1.1 * ring


def test_without_the_reverse_overlap_no_landing_outlives_its_piece(fake_cuda_rows):
    """Note [reverse overlap] (initial_send.py): at C = 4 in bf16 no piece's dK, dV fly over the
    next piece, so piece j computes beside its own dK, dV alone, not piece j-1's send buffer and
    landing too ([n, 1, 8, 256] float32 each, twice a piece of K | V). Rank 1's backward then
    peaks where its own rows' dK, dV (kept to the end) join the pieces: without regathering,
    piece 0 (4 kept pieces, one accumulator) against piece 1 (3 kept, three accumulators), 1.5
    accumulator pieces less; regathering (3 pieces of K, V landing at a time), piece 2 against
    piece 3, one less. Measured on fake CUDA as the model says; held again, the peak rises by them."""
    rows = {(r["regather"], r["reverse_overlap"]): r for r in fake_cuda_rows if r["team"] == 4 and r["rotation"] == "q"}
    accumulator_piece = (2**17 // 16) * 8 * (128 + 128) * 4
    for regather, pieces_less in ((False, 1.5), (True, 1.0)):
        overlapped, serial = rows[(regather, True)], rows[(regather, False)]
        gain = overlapped["model"]["backward_peak"] - serial["model"]["backward_peak"]
        assert gain == pieces_less * accumulator_piece, (regather, gain)
        assert overlapped["backward_peak"] - serial["backward_peak"] >= 0.98 * gain, (regather, serial)
        assert abs(serial["backward_peak"] / serial["model"]["backward_peak"] - 1) <= 0.05, serial


def test_regathering_keeps_what_ring_keeps_and_the_model_says_so(measured):
    kept = {row["config"]: row["kept_bytes"] for row in measured}
    assert kept["startrail-2-regather"] == kept["ring"] < kept["startrail-2 (rotation q)"] < kept["startrail-2"]
    shape = AttentionShape(1024 // 4, 1, 4, 4, 32, 4)
    model = {name: layer_memory_bytes(shape, cp_size=4, team_size=c, regather_in_backward=rg)["kept"]
             for name, c, rg in (("ring", 1, False), ("startrail-2", 2, False), ("startrail-2-regather", 2, True))}
    assert model["startrail-2-regather"] == model["ring"] < model["startrail-2"]


@pytest.mark.parametrize("cp_size, team_size", [(8, 2), (16, 4), (16, 2)])
def test_team_buffers_grow_with_the_team(cp_size, team_size):
    ring = layer_memory_bytes(SHAPE, cp_size=cp_size, team_size=1)
    team = layer_memory_bytes(SHAPE, cp_size=cp_size, team_size=team_size)
    assert team["forward_peak"] > ring["forward_peak"] and team["backward_peak"] > ring["backward_peak"]
    assert team["peak"] == max(team["forward_peak"], team["backward_peak"])


def test_each_layer_adds_what_one_layer_is_measured_to_keep(measured):
    # The planner's peak over L layers grows per layer by what a layer keeps for its backward.
    # Measured: the bytes autograd saved for one layer (benchmarks/counters/peak_memory.py), without the
    # inputs q, k, v; the layer keeps them too where its backward reads them -- all three for
    # ring attention and regathering, q alone for rotation "q" (the team's K, V and the
    # gathered Q otherwise). Each is one rank's [256, 1, 4, 32] float32 share.
    share = 256 * 1 * 4 * 32 * 4
    inputs_kept = {"ring": 3, "startrail-2": 0, "startrail-2-regather": 3, "startrail-2 (rotation q)": 1,
                   "startrail-2-regather (rotation q)": 3, "startrail-2 (rotation q, no reverse overlap)": 1,
                   "startrail-2-regather (rotation q, no reverse overlap)": 3}
    shape = AttentionShape(1024 // 4, 1, 4, 4, 32, 4)
    for row in measured:
        kw = dict(cp_size=4, team_size=row["team_size"], regather_in_backward=row["regather"],
                  rotation=row["rotation"], reverse_overlap=row["reverse_overlap"])
        growth = activation_peak_bytes(shape, layers=3, **kw) - activation_peak_bytes(shape, layers=2, **kw)
        assert growth == row["kept_bytes"] + inputs_kept[row["config"]] * share, (row["config"], growth, row)
    # Regathering trades kept bytes for transient ones: it pays with enough layers only.
    with_, without = (activation_peak_bytes(SHAPE, layers=16, cp_size=8, team_size=2, regather_in_backward=r)
                      for r in (True, False))
    assert with_ < without


@pytest.mark.parametrize("config", sorted(H100_ROWS))
def test_the_model_is_within_ten_percent_of_the_h100(config):
    # Kept: exact; forward within 5%; backward within 10%: with the kernel's workspace
    # (planning/workspace.py: FA2's fp32 dQ accumulator, its row sums and, for GQA, dK and dV at
    # the 32 query heads) -- without it the backward was 10-24% under the H100's.
    world, team, rotation, regather = config
    forward, kept, backward = H100_ROWS[config]
    shape = AttentionShape(2**17 // world, 1, 32, 8, 128, 2)
    if config in FREED_SINCE_THE_H100:
        backward -= 2 * (2 * (2**17 // world) * 32 * 128 * 2)
    kw = dict(cp_size=world, team_size=team, startrail_rank=1, rotation=rotation, regather_in_backward=regather)
    model = layer_memory_bytes(shape, **kw)
    assert model["kept"] == kept
    assert abs(model["forward_peak"] / forward - 1) <= 0.05, (model, forward)
    assert abs(model["backward_peak"] / backward - 1) <= 0.10, (model, backward)
    terms = layer_memory_terms(shape, **kw)["backward"]
    assert terms["call: workspace"] > 0 and sum(terms.values()) == model["backward_peak"]
    # The same model without a workspace (the reference kernel has none modelled) misses the H100
    # by more than the bar on the rings (ring: 1.596 GiB modelled against 1.975 measured at P8).
    bare = layer_memory_bytes(shape, **kw, kernel="reference")["backward_peak"]
    assert model["backward_peak"] - bare == terms["call: workspace"]
    if team == 1:
        assert backward / bare - 1 > 0.10


def test_fake_cuda_charges_an_ops_workspace_from_its_call_shape():
    # LiveStorages (tests/fake_cuda/memory.py) charges each fused op its workspace from the op's
    # own arguments: FA2's backward of P8 ring attention's call at 128K tokens (16384 query rows,
    # one sequence, against 8192 keys; GQA 32/8 x 128, bf16). The H100 held 406,864,896 bytes
    # above the model without a workspace in that row (1,024 more than this).
    import torch  # noqa: PLC0415

    from megatron_startrail.planning.workspace import KernelCallShape, backward_workspace_bytes  # noqa: PLC0415
    from tests.fake_cuda.memory import workspace_bytes  # noqa: PLC0415

    def meta(*shape, dtype=torch.bfloat16):
        return torch.empty(*shape, device="meta", dtype=dtype)

    q, kv, cum = meta(16384, 32, 128), meta(8192, 8, 128), meta(2, dtype=torch.int32)
    args = (q, q, kv, kv, q, meta(32, 16384, dtype=torch.float32), cum, cum, 16384, 8192, 0.0, True, None, None)
    got = workspace_bytes(torch.ops.aten._flash_attention_backward.default, args)
    assert got == backward_workspace_bytes("torch_cuda_flash", KernelCallShape(16384, 8192, 32, 8, 128, 2, 1))
    assert got == (16384 + 128) * 32 * 128 * 4 + 32 * (16384 + 128) * 4 + 2 * 8192 * 32 * 128 * 2 == 406863872
    assert workspace_bytes(torch.ops.aten._flash_attention_forward.default, (q, kv, kv, cum, cum)) == 0
    assert workspace_bytes(torch.ops.aten.mm.default, (q, q)) == 0
