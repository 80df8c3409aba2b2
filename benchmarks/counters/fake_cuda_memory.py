"""One attention layer's memory per rank at GPU scale, on fake CUDA, against the closed-form model.

    python -m benchmarks.counters.fake_cuda_memory --out benchmarks/results/fake_cuda_memory

The parent builds the fake-CUDA shim (``tests/fake_cuda``) and reruns this module under it; there
one process is rank ``r`` of ``P`` H100s in turn (torch's fake process group: collectives and P2P
return at once; FakeTensors: shapes and bytes, no compute). Each configuration runs one causal
forward + backward of bf16 GQA attention (32 query heads, 8 KV heads, head dim 128, batch 1) after
a warm-up, and :class:`tests.fake_cuda.memory.LiveStorages` counts the bytes of every storage the ops create while it
lives -- what CUDA's caching allocator would have handed out, less its rounding:

- ``kept``: live after the forward returns (its output and what autograd saved);
- ``forward_peak`` / ``backward_peak``: the most live during each, ``peak`` the larger.

The caller's q, k, v, dO (and the sink logits) exist before and are not counted; the gradients
are. Those are the definitions of :func:`megatron_startrail.planning.memory_model.layer_memory_bytes`,
which gives the model columns (sinks and windows have no term there: measured only). Without
gloo's timing the order of events is the program's, so one run is the answer.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import tempfile
from pathlib import Path

import torch

from megatron_startrail.accounting import AttentionShape, choose_backward_rotation
from megatron_startrail.planning.memory_model import layer_memory_bytes

GiB = 2**30
HEADS, KV_HEADS, DIM = 32, 8, 128


def measure(world: int, team: int, tokens: int, *, rotation: str = "auto", regather: bool = False,
            window: int | None = None, sinks: bool = False, rank: int = 1, explain: bool = False,
            reverse_overlap: bool = True) -> dict:
    """Rank ``rank`` of ``world``'s measured and modelled bytes (inside a fake-CUDA process)."""
    from megatron_startrail import new_startrail_groups, startrail_attn  # noqa: PLC0415
    from tests.fake_cuda.rank import fake_cuda_rank  # noqa: PLC0415

    local = tokens // world
    with fake_cuda_rank(rank, world):
        groups = new_startrail_groups(team_size=team, backward_rotation=rotation, regather_in_backward=regather,
                                      reverse_overlap=reverse_overlap, eager_init=False)
        # The caller's tensors: q [local, 1, 32, 128], k, v [local, 1, 8, 128] bf16, dO like q;
        # the sink logits [32] float32.
        q, k, v = (torch.randn(local, 1, h, DIM, device="cuda", dtype=torch.bfloat16, requires_grad=True)
                   for h in (HEADS, KV_HEADS, KV_HEADS))
        dout = torch.randn(local, 1, HEADS, DIM, device="cuda", dtype=torch.bfloat16)
        sink = torch.zeros(HEADS, device="cuda", dtype=torch.float32, requires_grad=True) if sinks else None
        kwargs = dict(causal=True, softmax_offset=sink, window_size=None if window is None else (window, 0))

        def layer(tracker=None):
            out = startrail_attn(q, k, v, groups, **kwargs)
            if tracker is not None:
                tracker.kept, tracker.phase = tracker.live, "backward"
            out.backward(dout)
            for t in (q, k, v, sink):
                if t is not None:
                    t.grad = None  # the caller's: gone before the next layer

        layer()  # warm-up: the groups' caches (layouts, kernel choice) are made here, not measured
        gc.collect()
        gc.disable()  # nothing waits for the collector: a cycle holding a tensor would show
        try:
            from tests.fake_cuda.memory import LiveStorages  # noqa: PLC0415 - inside the fake-CUDA process

            with LiveStorages(explain) as tracker:
                layer(tracker)
        finally:
            gc.enable()
    row = {"world": world, "team": team, "tokens": tokens, "rank": rank, "rotation": rotation,
           "regather": regather, "reverse_overlap": reverse_overlap, "window": window, "sinks": sinks,
           "kept": tracker.kept,
           "forward_peak": tracker.peaks["forward"], "backward_peak": tracker.peaks["backward"]}
    row["peak"] = max(row["forward_peak"], row["backward_peak"])
    if explain:
        row["at_peak"] = {phase: sorted(live, key=lambda x: -x[1]) for phase, live in tracker.at_peak.items()}
    shape = AttentionShape(local, 1, HEADS, KV_HEADS, DIM, 2)
    row["auto_rotation"] = choose_backward_rotation(shape, 1, team)
    if window is None and not sinks:  # the model has no term for windows or sinks
        model = layer_memory_bytes(shape, cp_size=world, team_size=team, startrail_rank=rank, rotation=rotation,
                                   regather_in_backward=regather, reverse_overlap=reverse_overlap)
        row["model"] = model
    return row


def configurations(tokens_list: list[int], worlds: list[int], teams=(1, 2, 4), extras: bool = True) -> list[dict]:
    """Every (P, C) with C*C dividing P, both rotations, regathering (C > 1; ring attention
    always regathers), rotation "q" without the reverse sends' overlap where sub-rings have one
    position (P = C*C: Note [reverse overlap] in initial_send.py), and at the default rotation:
    sinks, a 4096-token window (the halo exchange) and one of half the sequence (beyond the
    halo's reach: the schedule)."""
    rows = []
    for tokens in tokens_list:
        for world in worlds:
            for team in (t for t in teams if world % (t * t) == 0):
                for rotation in ("q", "kv"):
                    for regather in (False, True) if team > 1 else (False,):
                        rows.append(dict(world=world, team=team, tokens=tokens, rotation=rotation, regather=regather))
                for regather in (False, True) if team > 1 and world == team * team else ():
                    rows.append(dict(world=world, team=team, tokens=tokens, rotation="q", regather=regather,
                                     reverse_overlap=False))
                if not extras:
                    continue
                rows.append(dict(world=world, team=team, tokens=tokens, sinks=True))
                for window in (4096, tokens // 2):
                    rows.append(dict(world=world, team=team, tokens=tokens, window=window))
    return rows


def name(row: dict) -> str:
    rotation = row["auto_rotation"] + " (auto)" if row["rotation"] == "auto" else row["rotation"]
    parts = ["ring" if row["team"] == 1 else f"C={row['team']}", f"rotation {rotation}"]
    parts += ["regather"] * row["regather"] + ["no reverse overlap"] * (not row.get("reverse_overlap", True))
    parts += ["sinks"] * row["sinks"]
    parts += [f"window {row['window']}"] if row["window"] else []
    return ", ".join(parts)


def table(rows: list[dict]) -> str:
    """Markdown, GiB per rank; ``/ ring``: the peak over ring attention's at that P and length."""
    ring = {(r["world"], r["tokens"]): r["peak"] for r in rows  # at the rotation "auto" picks
            if r["team"] == 1 and r["rotation"] == r["auto_rotation"] and not (r["window"] or r["sinks"])}
    lines = ["| tokens | P | configuration | peak | / ring | model peak | peak / model | forward peak (model) "
             "| backward peak (model) | kept | model kept |", "|" + "---|" * 11]
    for r in rows:
        m = r.get("model")
        ratio = r["peak"] / ring[(r["world"], r["tokens"])] if (r["world"], r["tokens"]) in ring else None
        of_model = f"{r['peak'] / m['peak']:.3f}" if m else "-"

        def gib(x, model_key=None):
            text = f"{x / GiB:.3f}"
            return text + (f" ({m[model_key] / GiB:.3f})" if m and model_key else "")

        lines.append(
            f"| {r['tokens'] // 1024}K | {r['world']} | {name(r)} | {gib(r['peak'])} | "
            f"{'-' if ratio is None else f'{ratio:.2f}x'} | {gib(m['peak']) if m else 'no term'} | "
            f"{of_model} | {gib(r['forward_peak'], 'forward_peak')} | "
            f"{gib(r['backward_peak'], 'backward_peak')} | {gib(r['kept'])} | {gib(m['kept']) if m else '-'} |")
    return "\n".join(lines) + "\n"


def child(out: str, tokens_list: list[int], worlds: list[int], teams, extras: bool) -> None:
    """Under the shim: measure every configuration (rank 1 of P) and write ``OUT.json``, ``OUT.md``."""
    rows = []
    for config in configurations(tokens_list, worlds, teams, extras):
        config.setdefault("rotation", "auto")
        rows.append(measure(**config))
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out + ".json").write_text(json.dumps(rows, indent=1) + "\n")
    header = (f"# One attention layer's memory per rank on fake CUDA\n\n    python -m benchmarks.counters.fake_cuda_memory "
              f"--out {out}\n\n{__doc__.split(chr(10) + chr(10), 2)[2]}\n"
              f"bf16, {HEADS} query heads, {KV_HEADS} KV heads, head dim {DIM}, batch 1, causal; rank 1 of P; GiB "
              "(2^30 bytes) per rank. Model: `layer_memory_bytes` (in parentheses for the forward and backward "
              "peaks); `no term`: sinks and windows are not modelled.\n\n")
    Path(out + ".md").write_text(header + table(rows))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/results/fake_cuda_memory")
    parser.add_argument("--tokens", type=int, nargs="+", default=[2**17, 2**20])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--team-sizes", type=int, nargs="+", default=[1, 2, 4], help="those whose square divides P")
    parser.add_argument("--no-extras", action="store_true", help="without the sinks and windows rows")
    args = parser.parse_args(argv)
    from tests.fake_cuda.rank import leave, shim_loaded  # noqa: PLC0415
    if shim_loaded():
        child(args.out, args.tokens, args.world_sizes, args.team_sizes, not args.no_extras)
        leave()  # the results are written
    from tests.fake_cuda.build import build_shim, why_not_buildable  # noqa: PLC0415
    from tests.fake_cuda.run import run_fake_cuda  # noqa: PLC0415
    if (why := why_not_buildable()) is not None:
        sys.exit(f"fake CUDA is not available here: {why}")
    shim_dir = Path(tempfile.gettempdir()) / "startrail_fake_cuda"
    done = run_fake_cuda(build_shim(shim_dir), "benchmarks.counters.fake_cuda_memory", *(argv if argv is not None else sys.argv[1:]))
    sys.stdout.write(done.stdout)
    sys.stderr.write(done.stderr)
    return done.returncode


if __name__ == "__main__":
    sys.exit(main())
