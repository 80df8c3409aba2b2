"""Launches and non-kernel bytes per layer on one rank, in the H100 run's configurations.

The H100 run (../shared/gpu/h100-2026-11-27/, issue "Fast on a real GPU") timed one rank
at 128K tokens: P8 C2 at 0.83 of the fused call's share with the cuDNN adapter, P16 C4 at
0.60, and the FA2 adapter's call at 260 TFLOP/s against FA2's published 335. This counts,
without a GPU, what a rank does besides the attention kernel in one layer's forward +
backward: the launches, and the bytes every non-kernel op reads and writes (merges,
accumulator adds, casts, copies, gathers, fills), split into the schedule's own and, with
a CUDA adapter, the adapter's (pads, per-sequence copies, GQA expansion, ``.contiguous()``).
It uses :mod:`benchmarks.counters.launch_budget`'s counter (meta tensors, torch's no-op process
group); with a CUDA adapter the layer runs the adapter itself on meta, its fused op
counted as the kernel launch.

``ms at HBM`` is those bytes over the H100's HBM3 bandwidth (3.35 TB/s, the SXM data
sheet): a floor, not a measurement (the element-wise ops reach maybe 80-90% of it, and
each launch adds its own few microseconds).

    .venv/bin/python -m benchmarks.counters.layer_traffic --json benchmarks/results/layer_traffic.json
    .venv/bin/python -m benchmarks.counters.layer_traffic --before benchmarks/results/layer_traffic_before.json
    .venv/bin/python -m benchmarks.counters.layer_traffic --only "P8 C2 MHA 16x128 packed" --sites 12

``--sites N`` prints, under the table, each case's N source lines of the package whose ops move
the most bytes (where a change would cut them).
"""

from __future__ import annotations

from benchmarks.counters.launch_budget import Case, count, read_rows, table_args, write_rows

HBM_BYTES_PER_S = 3.35e12  # H100 SXM5 80GB HBM3, NVIDIA's data sheet
SHAPES = {"MHA 16x128": (16, 16), "GQA 32/8x128": (32, 8)}  # the H100 run's two head layouts


def cases(tokens: int = 131072) -> list[tuple[str, Case]]:
    out = []
    for world, team in ((8, 2), (16, 4)):
        for shape, (heads, kv_heads) in SHAPES.items():
            base = dict(world=world, team=team, tokens=tokens, heads=heads, kv_heads=kv_heads)
            tag = f"P{world} C{team} {shape}"
            out += [
                (f"{tag} dense", "reference", Case(tag, **base)),
                (f"{tag} dense, cuDNN adapter", "torch_cuda_cudnn", Case(tag, **base, kernel="torch_cuda_cudnn")),
                (f"{tag} dense, FA2 adapter", "torch_cuda_flash", Case(tag, **base, kernel="torch_cuda_flash")),
                (f"{tag} window (4096, 0)", "reference", Case(tag, **base, window=(4096, 0))),
                (f"{tag} packed, document layout", "reference", Case(tag, **base, docs="document")),
            ]
    return [(name, case) for name, _, case in out]


def row(name: str, case: Case, sites: int = 0) -> dict:
    """The table's row of ``case``; ``sites`` > 0: its ``sites`` issuing lines that move the most
    bytes too (``top_sites``, bytes by ``op file:line (function)``)."""
    c = count(case, sites=sites > 0)
    return {"case": name, "world": case.world, "team": case.team, "heads": case.heads, "kv_heads": case.kv_heads,
            "kernel": case.kernel, "launch": c.launch, "kernel_calls": c.kernel, "comm": c.comm,
            "schedule_bytes": c.bytes, "adapter_launch": c.adapter_launch, "adapter_bytes": c.adapter_bytes,
            "kernel_io_bytes": c.kernel_bytes, "touched_bytes": c.touched + c.adapter_touched,
            "top_bytes": {k: v for k, v in c.by_op_bytes.most_common(8)},
            **({"top_sites": dict(c.by_site_bytes.most_common(sites))} if sites > 0 else {})}


def _total(r: dict) -> float:
    return r["schedule_bytes"] + r["adapter_bytes"]


def _versus(r: dict, rows: list[dict]) -> str:
    """A CUDA adapter's row against the same case on the reference path, a packed or window
    row against its dense row (schedule + adapter bytes); "-" for the dense reference rows."""
    tag = r["case"].split(" dense")[0].split(" window")[0].split(" packed")[0]
    if r["case"] == f"{tag} dense":
        return "-"
    base = next((x for x in rows if x["case"] == f"{tag} dense"), None)
    return f"{_total(r) / _total(base):.2f}x" if base else "-"


def table(rows: list[dict], before: list[dict] | None) -> list[str]:
    prior = {r["case"]: r for r in before or []}
    head = ("| case | launches | kernel calls | schedule GB | adapter launches | adapter GB | kernel I/O GB "
            "| ms at HBM | vs dense reference | touched GB |")
    if before:
        head += (" launches before | schedule GB before | adapter GB before | ms at HBM before | vs dense reference "
                 "before | touched GB before |")
    out = [head, "|" + "---|" * (head.count("|") - 1)]

    def ms(r):
        return _total(r) / HBM_BYTES_PER_S * 1e3

    def touched(r):
        return f"{r['touched_bytes'] / 1e9:.2f}" if "touched_bytes" in r else "-"

    for r in rows:
        cells = [r["case"], r["launch"], r["kernel_calls"], f"{r['schedule_bytes'] / 1e9:.2f}", r["adapter_launch"],
                 f"{r['adapter_bytes'] / 1e9:.2f}", f"{r['kernel_io_bytes'] / 1e9:.2f}", f"{ms(r):.2f}",
                 _versus(r, rows), touched(r)]
        if before:
            p = prior.get(r["case"])
            cells += ([p["launch"], f"{p['schedule_bytes'] / 1e9:.2f}", f"{p['adapter_bytes'] / 1e9:.2f}",
                       f"{ms(p):.2f}", _versus(p, before), touched(p)] if p else ["-"] * 6)
        out.append("| " + " | ".join(str(c) for c in cells) + " |")
    return out


def main() -> None:
    args = table_args(__doc__, sites=True)
    rows = [row(name, case, args.sites) for name, case in cases(args.tokens) if not args.only or args.only in name]
    before = read_rows(args.before)
    print("\n".join(table(rows, before)))
    for r in rows if args.sites else ():
        print(f"\n{r['case']}: the {args.sites} lines that move the most bytes (GB)")
        for site, moved in r["top_sites"].items():
            print(f"  {moved / 1e9:7.3f}  {site}")
    write_rows(args.json, rows)


if __name__ == "__main__":
    main()
