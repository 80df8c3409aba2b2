"""The GPU validation kit behind ``scripts/gpu_check.sh`` (one CUDA GPU, PyTorch; no megatron).

Four parts, each in its own process with its own timeout (:mod:`benchmarks.gpu.check_parts`):
a CUDA fault in one keeps every row written before it, and the others run. The Markdown table
(``benchmarks/results/gpu_check.md`` by default) and a JSON of every row beside it are written
after each part.

1. ``accuracy``: every block kernel x {bf16, fp16, fp32} x {equal head dims, MLA dims} x the
   window classes of a variable-length call (none, causal, a band, a band's cut edge) x {MHA,
   GQA} x {batch 1, batch 2, batch 2 as strided views of a fused QKV}, forward + backward
   against float64 (PASS / FAIL / SKIP with the reason);
2. ``timing``: each fused kernel that passed part 1, forward + backward against torch SDPA on
   the same tensors, after checking that both compute the same;
3. ``rank``: one StarTrail rank at long context through torch's no-op process group: its
   forward + backward time against (one fused SDPA forward + backward over the whole
   sequence) / P, and its memory against the model (``benchmarks/gpu/check_rank.py``);
4. ``transport``: the NCCL transport on one GPU: eager group initialisation, a self exchange
   on both channels, the timeline from CUDA events (``benchmarks/gpu/check_transport.py``).

``--cpu-selfcheck`` runs all four at toy sizes on the CPU, each in its process as on a GPU
(the CI test does, in seconds): it checks the kit itself, not any GPU kernel. The exit status
is 1 when any accuracy row FAILs or any part reports an error (speed never fails the run).

    bash scripts/gpu_check.sh                      # the full check on cuda:0
    python -m benchmarks.gpu.check --cpu-selfcheck --out /tmp/gpu_check.md
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks import RESULTS
from benchmarks.gpu.check_kernels import DTYPE_NAMES, DTYPES, TOLERANCE
from benchmarks.gpu.check_parts import Part, run_parts
from benchmarks.gpu.check_transport import TransportRow, transport_table
from megatron_startrail.kernels import KernelRequest, choose_kernel, cuda_device, usable_backends

DEFAULT_OUT = os.path.join(RESULTS, "gpu_check.md")
TARGET_EFFICIENCY = 0.90  # issue 14: the block loop at C = 2 should reach 90% of the fused call
PARTS = ("accuracy", "timing", "rank", "transport")
# Each part's time limit in seconds on a GPU (a CPU self-check: CPU_TIMEOUT_S each).
TIMEOUT_S = {"accuracy": 600, "timing": 300, "rank": 300, "transport": 120}
# Toy sizes: the limit only stops a hung part, on a CI machine however loaded. The suite starts the
# self-check with the session at the lowest CPU priority (tests/early.py), where a part may wait
# minutes for an idle core while the tests keep both busy: 1200 s, not a GPU part's few minutes.
CPU_TIMEOUT_S = 1200
FUNCTIONS = {"accuracy": "benchmarks.gpu.check_kernels:accuracy_part",
             "timing": "benchmarks.gpu.check_kernels:timing_part",
             "rank": "benchmarks.gpu.check_rank:rank_part",
             "transport": "benchmarks.gpu.check_transport:transport_part"}


def _dims(text: str) -> tuple[int, int]:
    qk, _, v = text.partition("/")
    return int(qk), int(v or qk)


def _configs(text: str) -> list[tuple[int, int]]:
    # "8x1,8x2,16x4" -> [(P, C), ...]
    return [tuple(int(x) for x in item.split("x")) for item in text.split(",") if item]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu-selfcheck", action="store_true",
                   help="toy sizes on the CPU: checks the kit (argument parsing, tables), not the GPU kernels")
    p.add_argument("--device", default=None, help="default cuda:0 (cpu with --cpu-selfcheck)")
    p.add_argument("--out", default=DEFAULT_OUT, help="Markdown table to write")
    p.add_argument("--dtypes", default="bf16,fp16,fp32")
    p.add_argument("--kernels", default=None, help="comma-separated kernel names (default: every kernel)")
    p.add_argument("--dims", default=None, help="head dims 'qk/v' comma-separated (default 128/128,192/128)")
    p.add_argument("--block-seq", type=int, default=None, help="query rows of the accuracy blocks (default 1000)")
    p.add_argument("--timing-seq", type=int, default=None, help="tokens of the timing shapes (default 8192)")
    p.add_argument("--timing-heads", type=int, default=16)
    p.add_argument("--rank-tokens", type=int, default=None, help="whole sequence of the one-rank run (default 131072)")
    p.add_argument("--rank-configs", type=_configs, default=None, help="'PxC,...' (default 8x1,8x2,16x4)")
    p.add_argument("--rank-heads", type=int, default=None, help="default 16")
    p.add_argument("--rank-head-dim", type=int, default=None, help="default 128")
    p.add_argument("--iters", type=int, default=None, help="timed repetitions (median reported; default 5)")
    p.add_argument("--rank-kv-heads", type=int, default=None, help="default: --rank-heads (MHA)")
    p.add_argument("--skip-timing", action="store_true")
    p.add_argument("--skip-rank", action="store_true")
    p.add_argument("--budget-s", type=float, default=3600, help="time for all parts together")
    args = p.parse_args(argv)
    small = args.cpu_selfcheck
    defaults = dict(
        device="cpu" if small else "cuda:0", dims="24/24,24/16" if small else "128/128,192/128",
        block_seq=40 if small else 1000, timing_seq=128 if small else 8192, rank_tokens=256 if small else 131072,
        rank_configs=[(4, 1), (4, 2)] if small else [(8, 1), (8, 2), (16, 4)], rank_heads=2 if small else 16,
        rank_head_dim=16 if small else 128, iters=1 if small else 5,
    )
    for name, value in defaults.items():
        if getattr(args, name) is None:
            setattr(args, name, value)
    if small:
        args.timing_heads = min(args.timing_heads, 2)
    args.rank_kv_heads = args.rank_kv_heads or args.rank_heads
    args.dtypes = [DTYPES[d] for d in args.dtypes.split(",")]
    args.dims = [_dims(d) for d in args.dims.split(",")]
    args.kernels = args.kernels.split(",") if args.kernels else None
    args.device = torch.device(args.device)
    if args.device.type == "cuda" and not torch.cuda.is_available():
        p.error("no CUDA device: run on a GPU machine, or use --cpu-selfcheck")
    args.parts = [n for n in PARTS if not (n == "timing" and args.skip_timing) and not (n == "rank" and args.skip_rank)]
    args.command = " ".join(["python -m benchmarks.gpu.check"] + (argv if argv is not None else sys.argv[1:]))
    return args


def environment(device: torch.device) -> list[str]:
    lines = [f"- python {platform.python_version()}, torch {torch.__version__}"]
    if device.type == "cuda":
        lines.append(f"- device: {torch.cuda.get_device_name(device)} (sm{''.join(map(str, torch.cuda.get_device_capability(device)))}), "
                     f"CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}")
    else:
        lines.append(f"- device: {device} ({platform.processor() or platform.machine()}): CPU self-check of the kit")
    usable = sorted(usable_backends(device))
    lines.append(f"- usable kernel backends: {', '.join(usable) or 'none (CPU kernels only)'}")
    if device.type != "cuda":
        lines.append("- CPU self-check: toy sizes; it shows the kit works, its timings say nothing about a GPU")
    return lines


def _fmt(x: float) -> str:
    return f"{x:.1e}"


def accuracy_table(rows) -> list[str]:
    out = ["| kernel | dtype | head dims q/k, v | window (left, right) | heads q/kv | inputs | status | out | lse | "
           "dq | dk | dv | tol | note |", "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        errs = [(_fmt(r["errors"][n]) if n in r["errors"] else "") for n in ("out", "lse", "dq", "dk", "dv")]
        out.append(f"| {r['kernel']} | {r['dtype']} | {r['dims'][0]}, {r['dims'][1]} | {tuple(r['window'])} | "
                   f"{r['heads'][0]}/{r['heads'][1]} | {LAYOUT_NAMES[r['layout']]} | {r['status']} | "
                   + " | ".join(errs) + f" | {TOLERANCE[DTYPES[r['dtype']]]:.0e} | {r['note']} |")
    return out


LAYOUT_NAMES = {"b1": "batch 1", "b2": "batch 2", "qkv": "batch 2, fused-QKV views"}


def timing_table(rows) -> list[str]:
    out = ["| kernel | dtype | head dims q/k, v | mask | shape b x h x s x d | against | vs it | "
           "block kernel fwd+bwd ms | its fwd+bwd ms | it / kernel |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        against = r.get("against", "sdpa")
        out.append(f"| {r['kernel']} | {r['dtype']} | {r['dims'][0]}, {r['dims'][1]} | "
                   f"{'causal' if r['causal'] else 'full'} | {r['shape']} | "
                   f"{'torch SDPA' if against == 'sdpa' else against} | {_fmt(r['vs_sdpa'])} | "
                   f"{r['kernel_ms']:.3f} | {r['sdpa_ms']:.3f} | {r['sdpa_ms'] / r['kernel_ms']:.2f} |")
    return out


def _gib(x) -> str:
    """GiB with 3 decimals (MiB below 0.01 GiB: the CPU self-check's toy sizes)."""
    if x is None or x != x:
        return "n/a"
    return f"{x / 2**30:.3f}" if x >= 2**30 / 100 else f"{x / 2**20:.2f} MiB"


def _tokens(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def fused_share(rank: dict, fused_rows: list[dict]) -> tuple[float, str]:
    """(fused SDPA fwd+bwd over the whole sequence / P in ms, how it was had): measured at this
    length, else scaled from the longest measured length of these heads by (tokens ratio)^2
    (causal attention's work; "extrapolated")."""
    same = [f for f in fused_rows if (f["heads"], f["kv_heads"], f["head_dim"], f["dtype"])
            == (rank["heads"], rank["kv_heads"], rank["head_dim"], rank["dtype"])]
    exact = [f for f in same if f["tokens"] == rank["tokens"]]
    if exact:
        return exact[0]["ms"] / rank["world"], ""
    if not same:
        return NAN, ""
    base = max(same, key=lambda f: f["tokens"])
    return base["ms"] * (rank["tokens"] / base["tokens"]) ** 2 / rank["world"], \
        f" (extrapolated from {_tokens(base['tokens'])})"


NAN = float("nan")


def rank_table(rows: list[dict]) -> list[str]:
    """One row per rank run: time and efficiency, then memory (GiB above q, k, v, dO) measured,
    modelled (``layer_memory_bytes``) and rehearsed on fake CUDA."""
    fused = [r for r in rows if r["kind"] == "fused"]
    out = ["| tokens | P | C | heads q/kv x dim | kernel | rotation | rank ms | fused SDPA / P ms | efficiency | "
           "kept GiB (model, rehearsal) | fwd peak GiB (model, rehearsal) | bwd peak GiB (model, rehearsal) | "
           "bwd peak / model |", "|" + "---|" * 13]
    for r in (r for r in rows if r["kind"] == "rank"):
        share, how = fused_share(r, fused)
        m, h = r["model"], r.get("rehearsal") or {}
        mem = [f"{_gib(r[key])} ({_gib(m[key])}, {_gib(h.get(key))})"
               for key in ("kept", "forward_peak", "backward_peak")]
        ratio = r["backward_peak"] / m["backward_peak"] if m["backward_peak"] else NAN
        out.append(f"| {_tokens(r['tokens'])} | {r['world']} | {r['team']} | {r['heads']}/{r['kv_heads']} x "
                   f"{r['head_dim']} | {r['kernel']} | {r['rotation']} | {r['rank_ms']:.2f} | {share:.2f}{how} | "
                   f"{share / r['rank_ms']:.2f} | " + " | ".join(mem) + f" | {ratio:.2f} |")
    return out


def efficiency_at_c2(rows: list[dict]) -> list[str]:
    """One verdict per length: the efficiency at C = 2 of each sequence length's rows (the lowest
    of its head layouts and P), never one minimum over warmed 128K rows and single unwarmed 1M rows."""
    fused = [r for r in rows if r["kind"] == "fused"]
    lines = []
    for tokens in sorted({r["tokens"] for r in rows if r["kind"] == "rank" and r["team"] == 2}):
        at_c2 = [fused_share(r, fused)[0] / r["rank_ms"] for r in rows
                 if r["kind"] == "rank" and r["team"] == 2 and r["tokens"] == tokens]
        at_c2 = [e for e in at_c2 if e == e]
        if not at_c2:
            continue
        warm = all(r.get("warmup", True) for r in rows if r["kind"] == "rank" and r["tokens"] == tokens)
        verdict = "met" if min(at_c2) >= TARGET_EFFICIENCY else "NOT met"
        how = "" if warm else " (one unwarmed step each, the fused call extrapolated)"
        lines.append(f"Efficiency at C = 2, {_tokens(tokens)} tokens: {min(at_c2):.2f} "
                     f"(target {TARGET_EFFICIENCY:.2f}: {verdict}){how}.")
    return [""] + lines if lines else []


# The layer classes auto's table tells apart (kernels/measured.py): (batch, mask, packed documents).
AUTO_CLASSES = ((1, "causal", False), (2, "causal", False), (1, "window", False), (1, "causal", True))


def auto_choice(args) -> list[str]:
    """Which kernel auto picks on this device (its compute capability picks the measured table)
    for each dtype, head dims and layer class."""
    available = usable_backends(args.device)
    capability = cuda_device(args.device.index or 0).capability if args.device.type == "cuda" else None
    lines = ["| dtype | head dims q/k, v | batch | mask | packed | kernel | reason |", "|---|---|---|---|---|---|---|"]
    for dtype in args.dtypes:
        for dims in args.dims:
            for batch, mask, packed in AUTO_CLASSES:
                choice = choose_kernel(KernelRequest(args.device.type, dtype, dims[0], dims[1], 1, available,
                                                     batch=batch, mask=mask, packed=packed, capability=capability))
                lines.append(f"| {DTYPE_NAMES[dtype]} | {dims[0]}, {dims[1]} | {batch} | {mask} | {packed} | "
                             f"{choice.name} | {choice.reason} |")
    return lines


def kit_parts(args, names=PARTS) -> list[Part]:
    """The kit's parts as :class:`Part` s (JSON arguments for their child processes)."""
    device, dtypes = str(args.device), [DTYPE_NAMES[d] for d in args.dtypes]
    dims = [list(d) for d in args.dims]
    rank_dtype = "bf16" if args.device.type == "cuda" else "fp32"

    def passed(results):  # the timing part times what passed the accuracy part (all, if it did not run)
        rows = results["accuracy"].rows if "accuracy" in results and results["accuracy"].status != "not run" else None
        return None if rows is None else [[r["kernel"], r["dtype"], r["dims"]] for r in rows if r["status"] == "PASS"]

    kwargs = {
        "accuracy": dict(dtypes=dtypes, dims=dims, kernels=args.kernels, block_seq=args.block_seq, device=device),
        "timing": lambda results: dict(kernels=args.kernels, dtypes=dtypes, dims=dims, seq=args.timing_seq,
                                       heads=args.timing_heads, device=device, iters=args.iters,
                                       passed=passed(results)),
        "rank": dict(tokens=args.rank_tokens, configs=[list(c) for c in args.rank_configs],
                     layouts=[[args.rank_heads, args.rank_kv_heads]], head_dim=args.rank_head_dim, dtype=rank_dtype,
                     device=device,
                     iters=args.iters),
        "transport": dict(device=device),
    }
    cpu = args.device.type != "cuda"
    return [Part(n, FUNCTIONS[n], kwargs[n], CPU_TIMEOUT_S if cpu else TIMEOUT_S[n]) for n in names]


def part_sections(args, results) -> list[str]:
    """The Markdown of the kit's parts that ran."""
    lines = []
    ran = {name: r for name, r in results.items() if r.status != "not run"}
    if "accuracy" in ran:
        rows = ran["accuracy"].rows
        counts = {s: sum(r["status"] == s for r in rows) for s in ("PASS", "FAIL", "SKIP")}
        lines += ["", "## Block kernels vs float64 (forward + backward)", "",
                  f"Blocks of {args.block_seq} query rows (full mask: {args.block_seq + args.block_seq // 2} keys) at "
                  "batch 1, batch 2, and batch 2 as views of one fused QKV tensor (Megatron's split) with a "
                  "transposed dO; errors are max |error| / max |reference|. "
                  f"PASS {counts['PASS']}, FAIL {counts['FAIL']}, SKIP {counts['SKIP']}.", ""] + accuracy_table(rows)
    if "timing" in ran:
        lines += ["", "## Block kernel vs torch SDPA (same tensors)", "",
                  f"Median of {args.iters} after a warm-up; kernels that passed part 1 only. `vs SDPA`: the largest "
                  "relative difference of out, dQ, dK, dV from SDPA's, checked before timing (over twice the "
                  "accuracy tolerance: not timed, an error).", ""] + timing_table(ran["timing"].rows)
    if "rank" in ran:
        rows = ran["rank"].rows
        lines += ["", "## One StarTrail rank at long context (no-op process group)", "",
                  "Rank 1 of P, batch 1, causal; communication returns at once (torch's fake process group), so "
                  "this is one rank's compute and memory. Efficiency = (fused SDPA fwd+bwd over the whole sequence "
                  f"/ P) / rank time; target >= {TARGET_EFFICIENCY:.0%} at C = 2. Memory: bytes above q, k, v, dO "
                  "(`torch.cuda.max_memory_allocated`), beside `layer_memory_bytes` and the fake-CUDA rehearsal "
                  "(`benchmarks/results/fake_cuda_memory.json`, GQA 32/8 x 128 bf16 only).", ""] + rank_table(rows)
        lines += efficiency_at_c2(rows)
    if "transport" in ran:
        lines += ["", "## The transport on one device", "",
                  "A world of one real process group: eager group initialisation, a P2P exchange with itself on the "
                  "ring and side channels, the timeline (CUDA events on NCCL). Two ranks' matching and overlap need "
                  "two GPUs; the CPU suite's NCCL-rules mode checks the matching.", ""]
        lines += transport_table([TransportRow(**r) for r in ran["transport"].rows])
    return lines


def transport_errors(results) -> list[str]:
    r = results.get("transport")
    return [f"transport: {row['check']}: {row['detail']}" for row in (r.rows if r else []) if not row["ok"]]


def write_report(path: str, title: str, args, results: dict, sections: list[str]) -> None:
    """``path`` (Markdown) and ``path`` with ``.json`` (every row): rewritten after each part."""
    errors = [e for r in results.values() for e in r.errors] + transport_errors(results)
    lines = [f"# {title}", "", f"Command: `{args.command}`", ""] + environment(args.device)
    lines += ["", "Parts (each its own process): " + ", ".join(
        f"{r.name} {r.status} ({r.seconds:.0f} s)" for r in results.values()) + "."]
    lines += sections
    if errors:
        lines += ["", "## Errors", ""] + [f"- {e}" for e in errors]
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text("\n".join(lines) + "\n")
    data = {"command": args.command, "environment": environment(args.device),
            "parts": {n: {"status": r.status, "seconds": r.seconds, "errors": r.errors, "rows": r.rows}
                      for n, r in results.items()}}
    Path(path).with_suffix(".json").write_text(json.dumps(data, indent=1) + "\n")


def failed(results: dict) -> bool:
    rows = results["accuracy"].rows if "accuracy" in results else []
    return any(r.errors for r in results.values()) or any(r["status"] == "FAIL" for r in rows) \
        or bool(transport_errors(results))


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.cpu_selfcheck:
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # toy sizes: threads only contend (the parts inherit it)
    sections = ["", "## Automatic choice on this device", ""] + auto_choice(args)

    def write(results):
        write_report(args.out, "gpu_check: StarTrail block kernels on one device", args, results,
                     sections + part_sections(args, results))

    with tempfile.TemporaryDirectory() as tmp:
        log = Path(tmp) / "parts.log"
        results = run_parts(kit_parts(args, args.parts), log, args.budget_s, write)
        if any(r.errors for r in results.values()):
            sys.stderr.write(log.read_text()[-6000:])
    print(f"[gpu_check] wrote {args.out} and {Path(args.out).with_suffix('.json')}", flush=True)
    return 1 if failed(results) else 0


if __name__ == "__main__":
    sys.exit(main())
