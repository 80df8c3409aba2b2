"""Peak live memory of one attention layer (forward + backward), per rank, against ring attention.

    python -m benchmarks.counters.peak_memory --out benchmarks/results/peak_memory

For each world size P and configuration, P forked gloo ranks (one CP group, causal attention,
Megatron's zigzag layout, the peer table's workload: 2048 tokens, 4 heads of 32, float32)
run one forward + backward after a warm-up, and measure with ``benchmarks/counters/memory.py``, the
method of the peer table (``cluster_bench.py``):

- ``peak live``: the peak of live tensor bytes above the start (the caller's q, k, v, dO
  not counted; what the layer keeps for its backward is);
- ``kept for bwd``: the bytes of the tensors saved for the backward (q, k, v excluded).

Both are the maximum over ranks; the peak is the median of ``--repeats`` runs (default 3:
which transfers complete together differs from run to run on gloo, and so does the peak;
the table gives the range too). ``model`` is the closed form of
:mod:`megatron_startrail.planning.memory_model` (the attention's own buffers; the CPU kernel's
workspace is not in it). Configurations: ring attention (team size 1) and StarTrail with
team size C, with and without ``regather_in_backward``, with the backward rotation ``auto``
picks, with rotation "q" (streamed per team member, Note [streamed rotation q] in
``megatron_startrail/backward.py``; piece by piece where sub-rings have one position, Note
[piece-major rotation q]); by default P = 8 with C = 2 and P = 16 with C = 4.

Writes ``OUT.json`` and ``OUT.md``; ``--from-json`` rewrites the table of a saved run.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import torch

from benchmarks import RESULTS
from benchmarks.counters.memory import peak_live_bytes, saved_bytes
from megatron_startrail import new_startrail_groups, startrail_attn
from megatron_startrail.accounting import AttentionShape
from megatron_startrail.planning.memory_model import layer_memory_bytes

MiB = 2**20


def peak_worker(rank, world_size, configs, seq, heads, dim):
    """Every configuration's (peak live, kept for backward) bytes on this rank; a
    configuration is ``(team size, regather, backward rotation, reverse overlap)``."""
    torch.set_num_threads(1)
    n = seq // world_size
    gen = torch.Generator().manual_seed(rank)
    q0, k0, v0, dout = (torch.randn(n, 1, heads, dim, generator=gen) for _ in range(4))
    results = []
    for team_size, regather, rotation, overlap in configs:
        groups = new_startrail_groups(team_size=team_size, backward_rotation=rotation, reverse_overlap=overlap)

        def step():
            q, k, v = (t.clone().requires_grad_(True) for t in (q0, k0, v0))
            out, kept = saved_bytes(lambda: startrail_attn(q, k, v, groups, causal=True,  # noqa: B023
                                                           regather_in_backward=regather), exclude=(q, k, v))
            out.backward(dout)
            return kept

        step()  # warm-up: first-call allocations (kernel selection, caches) stay out of the peak
        gc.collect()  # garbage of earlier calls freed now, not during the measurement (it would count as negative)
        q, k, v = (t.clone().requires_grad_(True) for t in (q0, k0, v0))

        def measured():
            out = startrail_attn(q, k, v, groups, causal=True, regather_in_backward=regather)  # noqa: B023
            out.backward(dout)

        results.append((peak_live_bytes(measured, q0.device)[1], step()))
    return results


def name(team_size: int, regather: bool, rotation: str, overlap: bool = True) -> str:
    core = "ring" if team_size == 1 else f"startrail-{team_size}" + ("-regather" if regather else "")
    return core if rotation == "auto" else f"{core} (rotation {rotation}{'' if overlap else ', no reverse overlap'})"


def run(world_sizes: list[int], team_sizes: list[int], seq: int, heads: int, dim: int, timeout: float,
        repeats: int = 1, rotations: tuple[str, ...] = ("auto", "q")) -> list[dict]:
    """Rows of the table; with ``repeats``, each configuration's peak is the median of that
    many runs (which transfers complete together varies on gloo, and so does the peak).
    ``rotations``: the backward rotations of the StarTrail configurations."""
    runs = [_run_once(world_sizes, team_sizes, seq, heads, dim, timeout, rotations) for _ in range(repeats)]
    rows = runs[0]
    for index, row in enumerate(rows):
        peaks = sorted(run[index]["peak_live_bytes"] for run in runs)
        row["peak_live_bytes_runs"] = peaks
        row["peak_live_bytes"] = peaks[len(peaks) // 2]
    return rows


def _run_once(world_sizes, team_sizes, seq, heads, dim, timeout, rotations) -> list[dict]:
    from tests.multiproc import run_ranks  # noqa: PLC0415 - forked gloo ranks, as in the tests

    rows = []
    for world, c in zip(world_sizes, team_sizes):
        # "auto" takes the backward rotation that moves fewer bytes ("kv" for this float32 MHA
        # workload, by the lse); "q" streams the team's query side member by member.
        configs = [(1, False, "auto", True)] + [(c, regather, r, True) for r in rotations for regather in (False, True)]
        if "q" in rotations and world == c * c:  # Note [reverse overlap]: on sub-rings of one position
            configs += [(c, regather, "q", False) for regather in (False, True)]
        per_rank = run_ranks(peak_worker, world, args=(configs, seq, heads, dim), timeout=timeout)
        shape = AttentionShape(seq // world, 1, heads, heads, dim, 4)
        for index, (team, regather, rotation, overlap) in enumerate(configs):
            model = layer_memory_bytes(shape, cp_size=world, team_size=team, regather_in_backward=regather,
                                       rotation=rotation, kernel="torch_cpu_flash",  # its workspace: not modelled
                                       reverse_overlap=overlap)
            rows.append({
                "world_size": world, "config": name(team, regather, rotation, overlap), "team_size": team,
                "regather": regather, "rotation": rotation, "reverse_overlap": overlap,
                "peak_live_bytes": max(r[index][0] for r in per_rank),
                "kept_bytes": max(r[index][1] for r in per_rank),
                "model_peak_bytes": model["peak"],
            })
    return rows


def table(rows: list[dict], before: dict | None = None) -> str:
    """Markdown: per world size, each configuration's peak against ring attention's."""
    ring = {r["world_size"]: r["peak_live_bytes"] for r in rows if r["team_size"] == 1}
    head = ("| P | configuration | peak live MiB/rank | peak / ring | runs: min-max / ring | model peak MiB "
            "| kept for bwd MiB/rank |")
    rule = "|---|---|---|---|---|---|---|"
    if before:
        head += " before: peak live MiB | before: peak / ring |"
        rule += "---|---|"
    lines = [head, rule]
    for r in rows:
        runs = r.get("peak_live_bytes_runs", [r["peak_live_bytes"]])
        spread = f"{runs[0] / ring[r['world_size']]:.2f}-{runs[-1] / ring[r['world_size']]:.2f}x"
        line = (f"| {r['world_size']} | {r['config']} | {r['peak_live_bytes'] / MiB:.2f} | "
                f"{r['peak_live_bytes'] / ring[r['world_size']]:.2f}x | {spread} | {r['model_peak_bytes'] / MiB:.2f} | "
                f"{r['kept_bytes'] / MiB:.2f} |")
        if before:
            old = before.get((r["world_size"], r["config"]))
            old_ring = before[(r["world_size"], "ring")]
            line += " - | - |" if old is None else f" {old / MiB:.2f} | {old / old_ring:.2f}x |"
        lines.append(line)
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world-sizes", type=int, nargs="+", default=[8, 16])
    parser.add_argument("--team-sizes", type=int, nargs="+", default=[2, 4], help="one per world size")
    parser.add_argument("--seq-length", type=int, default=2048)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--head-dim", type=int, default=32)
    parser.add_argument("--timeout", type=float, default=900.0)
    parser.add_argument("--repeats", type=int, default=3, help="runs per configuration; the table gives the median")
    parser.add_argument("--before", metavar="JSON", help="a run of an earlier commit, for before/after columns")
    parser.add_argument("--out", default=os.path.join(RESULTS, "peak_memory"))
    parser.add_argument("--from-json", metavar="JSON", help="only rewrite the table of a saved run")
    args = parser.parse_args(argv)
    if args.from_json:
        with open(args.from_json) as f:
            rows = json.load(f)["rows"]
    else:
        start = time.perf_counter()
        rows = run(args.world_sizes, args.team_sizes, args.seq_length, args.heads, args.head_dim, args.timeout,
                   args.repeats)
        print(f"[peak_memory] {time.perf_counter() - start:.0f} s")
    before = None
    if args.before:
        with open(args.before) as f:
            before = {(r["world_size"], r["config"]): r["peak_live_bytes"] for r in json.load(f)["rows"]}
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out + ".json", "w") as f:
        json.dump({"spec": vars(args), "rows": rows}, f, indent=1)
    with open(args.out + ".md", "w") as f:
        f.write(table(rows, before))
    print(table(rows, before))
    return 0


if __name__ == "__main__":
    sys.exit(main())
