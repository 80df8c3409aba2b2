"""Every path of the attention takes the tensors Megatron really hands it, and is exact.

Megatron's core attention receives views, not fresh tensors: without RoPE (learned or no
position embeddings, the NoPE layers of ``--no-rope-freq``) q, k, v are slices of the fused
QKV projection's output; a batch-first producer hands transposes; GQA code may hand
expanded K/V heads; autograd hands dO with any strides. Each setting of the attention
(both backward rotations, regathering, Ulysses -- with 1 < kv heads < U too --, TASP's
multi-ring, windows by halo and by schedule, both packed layouts in THD, MLA, GQA/MQA)
runs here on every such layout, against float64 dense attention with the same mask, in
float64 (1e-12) and float32 (2e-5). The gradients are read where autograd puts them for
the producer: on the fused / batch-first / unexpanded tensor the layout was made from.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_startrail import new_startrail_groups, startrail_attn
from tests.attention_cases import full_inputs, relative_error
from tests.multiproc import run_ranks
from tests.packed_cases import document_of_positions, held_positions, make_documents, windowed_reference

WORLD, CHUNK, BATCH = 8, 4, 2
TOL = {torch.float64: 1e-12, torch.float32: 2e-5}


@dataclass(frozen=True)
class Setting:
    name: str
    team: int = 1
    ulysses: int = 1
    rotation: str = "q"
    heads: int = 4
    kv_heads: int = 4
    dqk: int = 8
    dv: int = 8
    regather: bool = False
    transfer: str = "ring"
    window: tuple[int, int] | None = None
    halo: bool = True
    packing: str = "dense"  # or "sample" (Megatron pretraining), "document" (THD, padded spans)
    causal: bool = True


SETTINGS = [
    Setting("ring q", rotation="q"),
    Setting("ring kv", rotation="kv", causal=False),
    Setting("C2 q", team=2, rotation="q"),
    Setting("C2 kv", team=2, rotation="kv"),
    Setting("C2 q regather", team=2, rotation="q", regather=True),
    Setting("C2 kv regather GQA", team=2, rotation="kv", regather=True, kv_heads=2),
    Setting("U2 C2 q", ulysses=2, team=2, rotation="q"),
    Setting("U2 C2 kv GQA", ulysses=2, team=2, rotation="kv", kv_heads=2),
    Setting("U4 8h 2kv q", ulysses=4, rotation="q", heads=8, kv_heads=2),  # K/V heads replicated for U
    Setting("U4 8h 2kv kv", ulysses=4, rotation="kv", heads=8, kv_heads=2),
    Setting("TASP multiring", transfer="multiring", rotation="q"),
    Setting("C2 multiring MQA", team=2, transfer="multiring", rotation="kv", kv_heads=1),
    Setting("window halo", team=2, window=(3, 0)),
    Setting("window schedule", team=2, window=(3 * CHUNK, 0), halo=False, rotation="q"),
    Setting("packed sample", team=2, packing="sample", rotation="q"),
    Setting("packed document THD", team=2, packing="document", rotation="kv", kv_heads=2),
    Setting("packed document window", packing="document", window=(2, 0), rotation="q"),
    Setting("MLA C2 q", team=2, rotation="q", dqk=12, dv=8),
    Setting("MLA U2 kv regather", ulysses=2, team=2, rotation="kv", dqk=12, dv=8, regather=True),
]
LAYOUTS = ("fused", "batch_first", "expanded")


def _make_views(layout: str, q0, k0, v0, kv_heads: int):
    """``(q, k, v)`` with the values of ``q0 [n, b, h, dqk]``, ``k0``, ``v0 [n, b, 1 | hkv, d]``,
    laid out as a producer hands them; autograd takes their gradients back to the leaves."""
    n, b, h, dqk = q0.shape
    if layout == "fused":  # Megatron: [n, b, hkv, (h/hkv) dqk + dqk + dv] split on the last dim
        k_full, v_full = (t.expand(n, b, kv_heads, t.shape[-1]) for t in (k0, v0))
        g = h // kv_heads
        fused = torch.cat([q0.reshape(n, b, kv_heads, g * dqk), k_full, v_full], dim=-1)
        q, k, v = fused.split([g * dqk, dqk, v0.shape[-1]], dim=-1)
        return q.reshape(n, b, h, dqk), k, v  # reshape as Megatron does: a view for MHA
    if layout == "batch_first":  # [b, n, h, d] storage, heads transposed too
        def transposed(t):
            return t.permute(1, 0, 3, 2).contiguous().permute(1, 0, 3, 2)
        return transposed(q0), transposed(k0.expand(n, b, kv_heads, dqk)), transposed(
            v0.expand(n, b, kv_heads, v0.shape[-1]))
    # K/V heads expanded from one stored head (stride 0), q a slice of wider storage
    wide = torch.cat([q0, q0], dim=-1)
    return wide[..., :dqk], k0.expand(n, b, kv_heads, dqk), v0.expand(n, b, kv_heads, v0.shape[-1])


def _strided_dout(dout: torch.Tensor) -> torch.Tensor:
    """``dout`` as autograd may hand it: a transposed, sliced view."""
    wide = torch.cat([dout, dout], dim=-1).transpose(0, 1).contiguous().transpose(0, 1)
    return wide[..., : dout.shape[-1]]


def _documents(s: Setting, seed: int, world: int):
    """``(cu, padded, doc, positions held by each rank)`` for the setting's packing."""
    if s.packing == "dense":
        seq = 2 * world * CHUNK
        cu = torch.tensor([0, seq], dtype=torch.int32)
        return None, None, document_of_positions(cu, None), [held_positions(r, world, cu, None) for r in range(world)]
    cu, padded = make_documents(world, CHUNK, s.packing, seed)
    return cu, padded, document_of_positions(cu, padded), [held_positions(r, world, cu, padded) for r in range(world)]


def run_setting(groups, rank, s: Setting, layout: str, dtype, seed: int, sink: str | None = None) -> dict[str, float]:
    """One setting on one layout: relative error of out, dq, dk, dv against float64 (packed:
    of batch 0, the one sample handed to the attention). ``sink``: with attention sinks,
    "off-by-one" (zeros, no gradient) or "learnable" (random logits; then the sinks'
    gradient, summed over the ranks -- collective on the default group -- is checked too)."""
    cu, padded, doc, held = _documents(s, seed, groups.cp_size)
    seq, mine = len(doc), held[rank]
    # K/V share one stored head when the layout expands them; the reference sees them expanded.
    stored_kv = 1 if layout == "expanded" else s.kv_heads
    q, k = full_inputs(seed, seq, BATCH, s.heads, stored_kv, s.dqk, torch.float64)[:2]
    _, _, v, dout = full_inputs(seed + 1, seq, BATCH, s.heads, stored_kv, s.dv, torch.float64)  # MLA: V's dim

    def expand(t):
        return t.expand(seq, BATCH, s.kv_heads, t.shape[-1])

    packed, thd = s.packing != "dense", s.packing == "document"
    sinks = None if sink is None else torch.zeros(s.heads, dtype=torch.float64) if sink == "off-by-one" else \
        torch.randn(s.heads, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    ref_inputs = [q, expand(k), expand(v), dout]
    if packed:  # the reference of the one sample handed over
        ref_inputs = [t[:, :1] for t in ref_inputs]
    ref = windowed_reference(*ref_inputs, doc, torch.arange(seq), s.window or (-1, -1), s.causal, s.dqk**-0.5,
                             sink=sinks)
    leaves = [t[mine].to(dtype).requires_grad_(True) for t in (q, k, v)]
    lq, lk, lv = _make_views(layout, *leaves, s.kv_heads)
    local_dout = _strided_dout(dout[mine].to(dtype))
    if packed:  # one packed sample: [t, 1, h, d] (Megatron), or THD [t, h, d] (Transformer Engine) --
        # batch 0 of the strided storage
        lq, lk, lv, local_dout = (t[:, 0] if thd else t[:, :1] for t in (lq, lk, lv, local_dout))
    local_sinks = None if sinks is None else sinks.to(dtype).requires_grad_(sink == "learnable")
    out = startrail_attn(lq, lk, lv, groups, causal=s.causal, softmax_scale=s.dqk**-0.5, cu_seqlens=cu,
                         cu_seqlens_padded=padded, transfer=s.transfer, regather_in_backward=s.regather,
                         window_size=s.window, halo_exchange=s.halo, softmax_offset=local_sinks)
    assert out.shape == lq.shape[:-1] + (s.dv,), (out.shape, lq.shape)
    out.backward(local_dout)

    def rows(t, kv=False):  # this rank's rows of a reference tensor (expanded heads summed)
        return t[mine].sum(2, keepdim=True) if kv and stored_kv < s.kv_heads else t[mine]

    want = [rows(ref[0]), rows(ref[1]), rows(ref[2], kv=True), rows(ref[3], kv=True)]
    got = [out.unsqueeze(1) if thd else out] + [t.grad[:, :1] if packed else t.grad for t in leaves]
    errors = {name: relative_error(g, w) for name, g, w in zip(("out", "dq", "dk", "dv"), got, want)}
    if sink == "learnable":  # every rank's rows' share, summed (what Megatron's gradient all-reduce does)
        dsink = local_sinks.grad.clone()
        torch.distributed.all_reduce(dsink)
        errors["dsink"] = relative_error(dsink, ref[4])
    return errors


def check_settings(rank, runs, seed: int, settings=SETTINGS, kernel: str = "auto") -> tuple[list[str], int]:
    """Every setting of ``settings`` on each ``(layout, dtype, sink)`` of ``runs``, with
    poisoned uninitialised memory; returns the failures and how many runs were checked."""
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True  # poison: unwritten rows show up as NaN
    groups, failures, checked = {}, [], 0
    for index, s in enumerate(settings):
        key = (s.team, s.ulysses, s.rotation)
        if key not in groups:  # collective: every rank builds the same sets in the same order
            groups[key] = new_startrail_groups(team_size=s.team, ulysses_size=s.ulysses, backward_rotation=s.rotation,
                                               kernel=kernel)
        for layout, dtype, sink in runs:
            errors = run_setting(groups[key], rank, s, layout, dtype, seed=seed + index, sink=sink)
            checked += 1
            for name, err in errors.items():
                if not err <= TOL[dtype]:  # NaN fails too
                    failures.append(f"{s.name} / {layout} / {dtype} / sink {sink}: {name} error {err:.3g}")
    return failures, checked


def fuzz_worker(rank, world_size):
    """Every setting on every layout in float64, and on Megatron's fused layout in float32."""
    runs = [(layout, torch.float64, None) for layout in LAYOUTS] + [("fused", torch.float32, None)]
    return check_settings(rank, runs, seed=500)


def test_every_setting_is_exact_on_the_layouts_megatron_hands_it():
    results = run_ranks(fuzz_worker, WORLD, timeout=600)
    failures = sorted({f for fails, _ in results for f in fails})
    assert not failures, "\n".join(failures[:40])
    assert all(n == len(SETTINGS) * (len(LAYOUTS) + 1) for _, n in results)


# Note [whole key runs] (layout.py): a kernel whose temporaries do not grow with the keys (CPU flash
# here, as the GPU adapters) is planned with a full sequence's one run of keys whole in the forward.
# The settings whose forward has such runs past a rank's rows (a team's whole sub-ring payload),
# packed and windowed ones among them, on Megatron's fused layout in float64.
FUSED_PLANNED = ("C2 q", "C2 kv", "U2 C2 kv GQA", "window schedule", "packed sample", "packed document THD",
                 "MLA C2 q")


def fused_planning_worker(rank, world_size):
    """check_settings with CPU flash; also how many forward calls took keys past ``max_rows``."""
    from megatron_startrail import blocks  # noqa: PLC0415

    settings, past_max_rows, plan = [s for s in SETTINGS if s.name in FUSED_PLANNED], [], blocks.device_calls

    def device_calls(q_segments, k_segments, causal, window, max_rows, device, batch, whole_key_runs=False):
        calls = plan(q_segments, k_segments, causal, window, max_rows, device, batch, whole_key_runs)
        past_max_rows.extend(c for c in calls if max_rows and c.k_slice and c.k_slice[1] - c.k_slice[0] > max_rows)
        return calls

    blocks.device_calls = device_calls
    try:
        failures, checked = check_settings(rank, [("fused", torch.float64, None)], seed=700, settings=settings,
                                           kernel="torch_cpu_flash")
    finally:
        blocks.device_calls = plan
    return failures, checked, len(past_max_rows)


def test_a_kernel_planned_with_whole_key_runs_is_exact():
    results = run_ranks(fused_planning_worker, WORLD, timeout=600)
    failures = sorted({f for fails, _, _ in results for f in fails})
    assert not failures, "\n".join(failures[:40])
    assert all(n == len(FUSED_PLANNED) for _, n, _ in results)
    assert sum(whole for _, _, whole in results) > 0  # the plan this is about ran


def table_worker(rank, world_size):
    """Worst error over out, dq, dk, dv per setting and run (for the table below)."""
    groups, rows = {}, []
    for index, s in enumerate(SETTINGS):
        key = (s.team, s.ulysses, s.rotation)
        if key not in groups:
            groups[key] = new_startrail_groups(team_size=s.team, ulysses_size=s.ulysses, backward_rotation=s.rotation)
        runs = [(layout, torch.float64) for layout in LAYOUTS] + [("fused", torch.float32)]
        rows.append([max(run_setting(groups[key], rank, s, layout, dtype, seed=500 + index).values())
                     for layout, dtype in runs])
    return rows


if __name__ == "__main__":  # python -m tests.test_layout_fuzz: the table of the closing note
    per_rank = run_ranks(table_worker, WORLD, timeout=600)
    print("| setting | " + " | ".join(f"float64 {layout}" for layout in LAYOUTS) + " | float32 fused |")
    print("|---|" + "---|" * (len(LAYOUTS) + 1))
    for index, s in enumerate(SETTINGS):
        worst = [max(rows[index][j] for rows in per_rank) for j in range(len(LAYOUTS) + 1)]
        print(f"| {s.name} | " + " | ".join(f"{e:.1e}" for e in worst) + " |")
