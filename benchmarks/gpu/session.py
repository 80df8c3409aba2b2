"""One prepared command for a lent GPU: ``bash scripts/gpu_session.sh`` (docs/gpus.md, "A GPU session").

Every part runs in its own process with its own time limit (:mod:`benchmarks.gpu.check_parts`),
all of them within ``--budget-s`` (450 s: an H100 lease is 15 minutes, a machine's start about
one, one command at most 10); the tables are rewritten after each part, so a fault or the end of
the time loses only the part it hits. Parts, in order, with their limits on a GPU (s):

=============  =====  =================================================================================
accuracy        100   the kit: every block kernel vs float64 at batch 1, 2 and fused-QKV views
timing           45   the kit: each kernel that passed vs SDPA on the same tensors, per call
rank-128k        75   one rank at 128K, MHA 16/16 and GQA 32/8 x 128, P 8/16, C 1/2/4: time,
                      efficiency vs fused SDPA / P, memory vs ``memory_model`` and the rehearsal
profile          30   ``torch.profiler`` kernel table of one rank (P8 C2, 128K, GQA)
syncdebug        40   ``torch.cuda.set_sync_debug_mode("warn")`` after the first micro-batch:
                      dense, packed documents, a window (P8 C2, 128K, GQA)
transport        30   the NCCL transport on one GPU
gpt              75   ``tests/fake_cuda``'s production-shape Megatron GPT step on the device (CP8 C2,
                      CP16 C4), its peak vs the rehearsal's 15.83 / 10.24 GiB (needs megatron-core)
rank-1m         110   one rank at 1M (as 128K, one measured step each; fused SDPA extrapolated)
=============  =====  =================================================================================

Files under ``--out`` (default ``$OUT``, the device tool's folder; else ``benchmarks/results/gpu``):
``gpu_check.md`` / ``.json`` (the kit's two parts), ``gpu_session.md`` / ``.json`` (the others),
``gpu_session.log`` (every part's output): five, under the tool's eight.

``--cpu-selfcheck`` runs every part at toy sizes on the CPU, each in its own process, the GPT
step on the rehearsal's fake CUDA (``tests/test_gpu_session.py``, in CI).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

import torch

from benchmarks import RESULTS
from benchmarks.gpu import block_loop_prediction
from benchmarks.gpu import check as gpu_check
from benchmarks.gpu.check_parts import Part, run_parts
from benchmarks.gpu.check_transport import TransportRow, transport_table

ORDER = ("accuracy", "timing", "rank-128k", "profile", "syncdebug", "transport", "gpt", "rank-1m")
TIMEOUT_S = {"accuracy": 100, "timing": 45, "rank-128k": 75, "profile": 30, "syncdebug": 40, "transport": 30,
             "gpt": 75, "rank-1m": 110}
# Toy sizes: the limit only stops a hung part, on a CI machine however loaded. The suite starts the
# self-check with the session at the lowest CPU priority (tests/early.py), where a part may wait
# minutes for an idle core while the tests keep both busy: 1200 s, not a GPU part's few minutes.
CPU_TIMEOUT_S = 1200
BUDGET_S = 450
# The rehearsal's configurations (tests/fake_cuda/megatron_step.py, fake_cuda_memory.py) and toy ones.
CONFIGS = {"gpu": [[8, 1], [8, 2], [16, 1], [16, 2], [16, 4]], "cpu": [[4, 1], [4, 2]]}
LAYOUTS = {"gpu": [[16, 16], [32, 8]], "cpu": [[2, 2], [4, 2]]}
GPT_TOY = dict(seq_length=256, layers=2, hidden=64, heads=4, query_groups=2, ffn=128, vocab=128)


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--cpu-selfcheck", action="store_true", help="every part at toy sizes on the CPU")
    p.add_argument("--out", default=None, help="folder of the result files (default $OUT, else benchmarks/results/gpu)")
    p.add_argument("--budget-s", type=float, default=None, help=f"all parts together (default {BUDGET_S})")
    p.add_argument("--parts", default=",".join(ORDER), help="comma-separated, of " + ", ".join(ORDER))
    args = p.parse_args(argv)
    args.parts = [n for n in ORDER if n in args.parts.split(",")]
    if args.out is None:
        args.out = (os.path.join(tempfile.gettempdir(), "gpu_session_selfcheck") if args.cpu_selfcheck
                    else os.environ.get("OUT") or os.path.join(RESULTS, "gpu"))
    args.budget_s = args.budget_s or (3600 if args.cpu_selfcheck else BUDGET_S)  # (CPU_TIMEOUT_S's note)
    if not args.cpu_selfcheck and not torch.cuda.is_available():
        p.error("no CUDA device: run on a GPU machine, or use --cpu-selfcheck")
    args.command = " ".join(["python -m benchmarks.gpu.session"] + (argv if argv is not None else sys.argv[1:]))
    return args


def kit_args(args) -> argparse.Namespace:
    """The kit's own arguments for its two parts here (the CPU: one dtype and one MLA shape)."""
    argv = ["--cpu-selfcheck", "--dtypes", "fp32", "--dims", "24/16"] if args.cpu_selfcheck else []
    kit = gpu_check.parse_args(argv + ["--out", str(Path(args.out) / "gpu_check.md")])
    kit.command = args.command + " (its kit parts)"
    return kit


def fake_cuda_env() -> dict:
    """The CPU self-check's GPT part runs on fake CUDA: the shim built here, preloaded there."""
    from tests.fake_cuda.build import build_shim, why_not_buildable  # noqa: PLC0415

    if (why := why_not_buildable()) is not None:
        raise RuntimeError(f"the GPT part's CPU self-check needs fake CUDA: {why}")
    return {"LD_PRELOAD": str(build_shim(Path(tempfile.gettempdir()) / "startrail_fake_cuda"))}


def session_parts(args, kit) -> list[Part]:
    cpu = args.cpu_selfcheck
    size = "cpu" if cpu else "gpu"
    device, dtype = ("cpu", "fp32") if cpu else ("cuda:0", "bf16")
    tokens, big = (256, 512) if cpu else (131072, 1048576)
    one = dict(world=4 if cpu else 8, team=2, heads=LAYOUTS[size][1][0], kv_heads=LAYOUTS[size][1][1],
               head_dim=16 if cpu else 128, dtype=dtype, device=device, tokens=tokens)
    rank = dict(configs=CONFIGS[size], layouts=LAYOUTS[size], head_dim=one["head_dim"], dtype=dtype, device=device)
    kwargs = {
        "rank-128k": ("benchmarks.gpu.check_rank:rank_part", dict(rank, tokens=tokens, iters=1 if cpu else 3)),
        "profile": ("benchmarks.gpu.session_probes:profile_part", dict(one, top=8 if cpu else 25)),
        "syncdebug": ("benchmarks.gpu.session_probes:sync_part", one),
        "transport": ("benchmarks.gpu.check_transport:transport_part", dict(device=device)),
        "gpt": ("benchmarks.gpu.session_gpt:gpt_part",
                dict(configs=[[4, 1], [4, 2]] if cpu else [[8, 2], [16, 4]], shape=GPT_TOY if cpu else {},
                     device="cuda:0")),
        # GQA 32/8 first: the layout the rehearsal and the memory model were checked on, so the end
        # of the part's time cuts MHA's rows, not those
        "rank-1m": ("benchmarks.gpu.check_rank:rank_part",
                    dict(rank, layouts=sorted(rank["layouts"], key=lambda hh: hh[0] == hh[1]), tokens=big, iters=0,
                         warmup=False, fused=False)),
    }
    parts = {p.name: p for p in gpu_check.kit_parts(kit, ["accuracy", "timing"])}
    for name, (function, kw) in kwargs.items():
        env = fake_cuda_env() if cpu and name == "gpt" and name in args.parts else {}
        parts[name] = Part(name, function, kw, CPU_TIMEOUT_S if cpu else TIMEOUT_S[name], env)
    for part in parts.values():
        part.timeout_s = CPU_TIMEOUT_S if cpu else TIMEOUT_S[part.name]
    return [parts[n] for n in args.parts]


def profile_table(rows: list[dict]) -> list[str]:
    total = next((r for r in rows if r["name"] == "(all)"), None)
    out = [] if total is None else [
        f"P{total['world']} C{total['team']}, {total['tokens']} tokens, {total['heads']}/{total['kv_heads']} heads: "
        f"one step {total['step_ms']:.2f} ms; {total['count']} {total['what']} launched, {total['distinct']} distinct, "
        f"{total['self_ms']:.2f} ms of self time in all.", ""]
    out += ["| name | calls | self ms | avg us | share |", "|---|---|---|---|---|"]
    return out + [f"| `{r['name']}` | {r['count']} | {r['self_ms']:.3f} | {r['avg_us']:.1f} | {r['share']:.1%} |"
                  for r in rows if r["name"] != "(all)"]


def sync_table(rows: list[dict]) -> list[str]:
    out = ["| layout | P | C | tokens | micro-batches counted | synchronizing ops | first found | how |",
           "|---|---|---|---|---|---|---|---|"]
    return out + [f"| {r['layout']} | {r['world']} | {r['team']} | {r['tokens']} | {r['micro_batches_counted']} | "
                  f"{r['syncs']} | {'; '.join(r['found'][:2]) or '-'} | {r['how']} |" for r in rows]


def gpt_table(rows: list[dict]) -> list[str]:
    out = ["| CP | C | tokens | params | kernel | transport | allocated at start GiB | step s | peak above start GiB | "
           "rehearsal peak GiB | peak / rehearsal |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    return out + [f"| {r['cp']} | {r['team']} | {r['seq_length']} | {r['params']} | {', '.join(r['kernels'])} | "
                  f"{', '.join(r['transports'])} | {gpu_check._gib(r.get('allocated_at_start'))} | "
                  f"{r['step_seconds']:.2f} | {gpu_check._gib(r['peak_bytes'])} | "
                  f"{gpu_check._gib(r['rehearsal_peak_bytes'])} | {r['peak_over_rehearsal']:.2f} |" for r in rows]


def prediction_table(rank_rows: list[dict], preds: list[dict]) -> list[str]:
    """Each 128K rank row the committed prediction covers (``benchmarks/results/block_loop_prediction.json``:
    auto's sm90 path), its measured efficiency beside the predicted one."""
    fused = [r for r in rank_rows if r["kind"] == "fused"]
    out = []
    for r in rank_rows:
        pred = block_loop_prediction.lookup(preds, r.get("world"), r.get("team"), r.get("heads"), r.get("kv_heads"))
        if r["kind"] != "rank" or r["tokens"] != block_loop_prediction.TOKENS or pred is None:
            continue
        share = gpu_check.fused_share(r, fused)[0]
        out.append(f"| {r['world']} | {r['team']} | {r['heads']}/{r['kv_heads']} | {r['kernel']} | "
                   f"{r['rank_ms']:.2f} | {pred['predicted_ms']:.1f} | {share / r['rank_ms']:.2f} | "
                   f"{pred['predicted_efficiency']:.2f} ({pred['kernel']}) |")
    head = ["| P | C | heads q/kv | kernel measured | rank ms | predicted ms | efficiency measured | predicted |",
            "|---|---|---|---|---|---|---|---|"]
    return head + out if out else []


def session_sections(results: dict) -> list[str]:
    ran = {n: r for n, r in results.items() if r.status != "not run" and n not in ("accuracy", "timing")}
    lines = []
    rank_rows = [row for n in ("rank-128k", "rank-1m") if n in ran for row in ran[n].rows]
    if rank_rows:
        lines += ["", "## One StarTrail rank (no-op process group)", "",
                  "Rank 1 of P, batch 1, causal, bf16 (fp32 in the CPU self-check); communication returns at "
                  "once, so this is one rank's compute and memory. Efficiency = (fused SDPA fwd+bwd over the whole "
                  "sequence / P) / rank time (at 1M the fused call is scaled from 128K by the square of the length). Memory: GiB above q, k, v, dO; "
                  "model `layer_memory_bytes`, rehearsal `benchmarks/results/fake_cuda_memory.json`.", ""]
        lines += gpu_check.rank_table(rank_rows) + gpu_check.efficiency_at_c2(rank_rows)
        beside = prediction_table(rank_rows, block_loop_prediction.committed())
        if beside:
            lines += ["", "## Prediction beside measurement (128K, `benchmarks/results/block_loop_prediction.md`)",
                      ""] + beside
    sections = {"profile": ("## Kernel table of one rank (torch.profiler)", profile_table),
                "syncdebug": ("## Synchronizing operations after the first micro-batch", sync_table),
                "transport": ("## The transport on one device",
                              lambda rows: transport_table([TransportRow(**r) for r in rows])),
                "gpt": ("## Megatron GPT step on the device (fake process group, rank 1 of CP)", gpt_table)}
    for name, (title, table) in sections.items():
        if name in ran:
            lines += ["", title, ""] + table(ran[name].rows)
    return lines


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.cpu_selfcheck:
        os.environ.setdefault("OMP_NUM_THREADS", "1")  # toy sizes: threads only contend (the parts inherit it)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    kit = kit_args(args)
    kit_sections = ["", "## Automatic choice on this device", ""] + gpu_check.auto_choice(kit)

    def write(results):
        kit_results = {n: r for n, r in results.items() if n in ("accuracy", "timing")}
        if kit_results:
            gpu_check.write_report(str(out / "gpu_check.md"), "gpu_check: StarTrail block kernels on one device",
                                   kit, kit_results, kit_sections + gpu_check.part_sections(kit, kit_results))
        gpu_check.write_report(str(out / "gpu_session.md"), "gpu_session: one lent GPU", args,
                               {n: r for n, r in results.items() if n not in kit_results}, session_sections(results))

    args.device = kit.device
    results = run_parts(session_parts(args, kit), out / "gpu_session.log", args.budget_s, write)
    beside = prediction_table([row for n in ("rank-128k",) if n in results for row in results[n].rows],
                              block_loop_prediction.committed())
    if beside:
        print("[gpu_session] the block loop, predicted beside measured:\n" + "\n".join(beside), flush=True)
    files = sorted(p.name for p in out.iterdir())
    print(f"[gpu_session] wrote {', '.join(files)} in {out}", flush=True)
    return 1 if gpu_check.failed(results) else 0


if __name__ == "__main__":
    sys.exit(main())
