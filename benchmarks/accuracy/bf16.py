"""bf16 accuracy of StarTrail at long context, against a float64 reference.

    python -m benchmarks.accuracy.bf16 --lengths 4096 8192 16384 32768 65536 --world-size 8 \
        --out benchmarks/results/bf16_accuracy

For every total sequence length S, ``--world-size`` P forked gloo ranks (one CP group, causal
attention, Megatron's zigzag layout) run forward + backward in bfloat16 with

- ``ring``: StarTrail with team size C = 1 (the project's ring attention),
- ``startrail-C``: StarTrail with team size C (default 2),
- ``single-device``: ``torch.nn.functional.scaled_dot_product_attention`` on the whole
  bf16 sequence on one rank (PyTorch's CPU flash kernel: float32 softmax and accumulation),

on the same bf16-rounded inputs, and compare out, dQ, dK, dV with float64 attention. The
float64 reference streams over key blocks (flash-style online softmax), so 64K tokens fit in
memory; it is computed in parallel: every rank does its own query rows (out, lse, dQ) and its
own key rows (dK, dV, with the lse and ``D = rowsum(dO * O)`` of all rows gathered).

Error metrics, per tensor, over the whole sequence:
``max_rel`` = max |got - ref| / max |ref|, and ``rms_rel`` = ||got - ref||_2 / ||ref||_2.

Writes ``OUT.json``, ``OUT.md`` (table) and ``OUT.png`` (error vs length).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
import torch.distributed as dist

from benchmarks import RESULTS
from megatron_startrail import new_startrail_groups, startrail_attn
from tests.attention_cases import zigzag_ranges  # Megatron's CP layout, shared with the tests

TENSORS = ("out", "dq", "dk", "dv")
REF_BLOCK = 2048  # rows/keys per float64 block: [h, 2048, 2048] scores = 64 MiB at h = 2


def full_inputs(seed: int, seq: int, heads: int, dim: int) -> list[torch.Tensor]:
    """q, k, v, dout ``[seq, 1, heads, dim]``: bf16 values held in float64 (identical on every rank)."""
    gen = torch.Generator().manual_seed(seed)
    return [
        torch.randn(seq, 1, heads, dim, generator=gen, dtype=torch.float64).to(torch.bfloat16).to(torch.float64)
        for _ in range(4)
    ]


def take_rows(x: torch.Tensor, ranges: list[tuple[int, int]]) -> torch.Tensor:
    """Rows ``[a, b)`` of every range, concatenated (this rank's rows for its zigzag ranges)."""
    return torch.cat([x[a:b] for a, b in ranges])


def _hsd(x: torch.Tensor) -> torch.Tensor:
    # [s, 1, h, d] -> [h, s, d]
    return x[:, 0].transpose(0, 1)


def _scores(q: torch.Tensor, k: torch.Tensor, q0: int, k0: int, scale: float) -> torch.Tensor:
    """Causal scores of query rows starting at q0 against key rows starting at k0: [h, nq, nk]."""
    s = torch.matmul(q, k.transpose(-1, -2)) * scale
    q_pos = torch.arange(q0, q0 + q.shape[1]).unsqueeze(1)
    k_pos = torch.arange(k0, k0 + k.shape[1]).unsqueeze(0)
    return s.masked_fill(k_pos > q_pos, float("-inf"))


def reference_forward(q, k, v, q0: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 causal attention of rows [q0, q0 + n) (q [h, n, d]) over k, v [h, S, d], streaming
    over key blocks with an online softmax. Returns out [h, n, d] and lse [h, n]."""
    n = q.shape[1]
    out, lse = torch.empty_like(q), torch.empty(q.shape[:2], dtype=q.dtype)
    for a in range(0, n, REF_BLOCK):
        qb = q[:, a : a + REF_BLOCK]
        row_max = torch.full(qb.shape[:2], float("-inf"), dtype=q.dtype)
        row_sum = torch.zeros(qb.shape[:2], dtype=q.dtype)
        acc = torch.zeros_like(qb)
        for k0 in range(0, q0 + a + qb.shape[1], REF_BLOCK):
            s = _scores(qb, k[:, k0 : k0 + REF_BLOCK], q0 + a, k0, scale)
            new_max = torch.maximum(row_max, s.amax(dim=-1))
            shrink = torch.exp(row_max - new_max)  # exp(-inf) = 0 on the first block
            p = torch.exp(s - new_max.unsqueeze(-1))
            row_sum = row_sum * shrink + p.sum(dim=-1)
            acc = acc * shrink.unsqueeze(-1) + torch.matmul(p, v[:, k0 : k0 + REF_BLOCK])
            row_max = new_max
        out[:, a : a + REF_BLOCK] = acc / row_sum.unsqueeze(-1)
        lse[:, a : a + REF_BLOCK] = row_max + torch.log(row_sum)
    return out, lse


def reference_dq(q, k, v, dout, lse, delta, q0: int, scale: float) -> torch.Tensor:
    """dQ of rows [q0, q0 + n) (q, dout [h, n, d]; lse, delta [h, n]) over all visible keys."""
    dq = torch.zeros_like(q)
    for a in range(0, q.shape[1], REF_BLOCK):
        rows = slice(a, a + REF_BLOCK)
        for k0 in range(0, q0 + a + q[:, rows].shape[1], REF_BLOCK):
            kb, vb = k[:, k0 : k0 + REF_BLOCK], v[:, k0 : k0 + REF_BLOCK]
            p = torch.exp(_scores(q[:, rows], kb, q0 + a, k0, scale) - lse[:, rows].unsqueeze(-1))
            ds = p * (torch.matmul(dout[:, rows], vb.transpose(-1, -2)) - delta[:, rows].unsqueeze(-1))
            dq[:, rows] += torch.matmul(ds, kb) * scale
    return dq


def reference_dkv(q, k, v, dout, lse, delta, k0: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """dK, dV of key rows [k0, k0 + n) (k, v [h, n, d]) over all queries q, dout [h, S, d]
    (lse, delta [h, S]) that see them."""
    dk, dv = torch.zeros_like(k), torch.zeros_like(v)
    seq = q.shape[1]
    for a in range(0, k.shape[1], REF_BLOCK):
        keys = slice(a, a + REF_BLOCK)
        first_query = (k0 + a) // REF_BLOCK * REF_BLOCK  # queries before the block see none of it
        for q0 in range(first_query, seq, REF_BLOCK):
            rows = slice(q0, q0 + REF_BLOCK)
            p = torch.exp(_scores(q[:, rows], k[:, keys], q0, k0 + a, scale) - lse[:, rows].unsqueeze(-1))
            dv[:, keys] += torch.matmul(p.transpose(-1, -2), dout[:, rows])
            ds = p * (torch.matmul(dout[:, rows], v[:, keys].transpose(-1, -2)) - delta[:, rows].unsqueeze(-1))
            dk[:, keys] += torch.matmul(ds.transpose(-1, -2), q[:, rows]) * scale
    return dk, dv


def reference_on_my_rows(full, ranges, scale) -> dict[str, torch.Tensor]:
    """float64 out, dq (this rank's query rows) and dk, dv (its key rows), each [n_local, 1, h, d]."""
    q, k, v, dout = (_hsd(t) for t in full)
    world = dist.get_world_size()
    outs, lses = [], []
    for a, b in ranges:
        out, lse = reference_forward(q[:, a:b], k, v, a, scale)
        outs.append(out)
        lses.append(lse)
    out = torch.cat(outs, dim=1)
    delta = (take_rows(full[3], ranges)[:, 0].transpose(0, 1) * out).sum(dim=-1)  # [h, n_local]
    lse_local = torch.cat(lses, dim=1)
    # Every rank's lse and D rows, placed back in sequence order: [h, S].
    gathered = [torch.empty(2, *lse_local.shape, dtype=torch.float64) for _ in range(world)]
    dist.all_gather(gathered, torch.stack([lse_local, delta]).contiguous())
    lse_all = torch.empty(q.shape[:2], dtype=torch.float64)
    delta_all = torch.empty_like(lse_all)
    for r, part in enumerate(gathered):
        offset = 0
        for a, b in zigzag_ranges(r, world, q.shape[1]):
            lse_all[:, a:b], delta_all[:, a:b] = part[0][:, offset : offset + b - a], part[1][:, offset : offset + b - a]
            offset += b - a
    dq = torch.cat([reference_dq(q[:, a:b], k, v, dout[:, a:b], lse_all[:, a:b], delta_all[:, a:b], a, scale)
                    for a, b in ranges], dim=1)
    dkv = [reference_dkv(q, k[:, a:b], v[:, a:b], dout, lse_all, delta_all, a, scale) for a, b in ranges]
    dk, dv = torch.cat([x[0] for x in dkv], dim=1), torch.cat([x[1] for x in dkv], dim=1)
    # [h, n, d] -> [n, 1, h, d]
    return {name: t.transpose(0, 1).unsqueeze(1) for name, t in zip(TENSORS, (out, dq, dk, dv))}


def startrail_on_my_rows(full, ranges, groups) -> dict[str, torch.Tensor]:
    q, k, v, dout = (take_rows(t, ranges).to(torch.bfloat16) for t in full)
    q, k, v = (t.requires_grad_(True) for t in (q, k, v))
    out = startrail_attn(q, k, v, groups, causal=True)
    out.backward(dout)
    return dict(zip(TENSORS, (out.detach(), q.grad, k.grad, v.grad)))


def single_device_on_my_rows(full, ranges) -> dict[str, torch.Tensor]:
    """Rank 0 runs bf16 SDPA on the whole sequence; every rank receives the results, keeps its rows."""
    seq, _, heads, dim = full[0].shape
    results = torch.empty(4, seq, 1, heads, dim, dtype=torch.bfloat16)
    if dist.get_rank() == 0:
        # [s, 1, h, d] -> [1, h, s, d]
        q, k, v, dout = (t.to(torch.bfloat16).permute(1, 2, 0, 3).contiguous() for t in full)
        q, k, v = (t.requires_grad_(True) for t in (q, k, v))
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
        out.backward(dout)
        for i, t in enumerate((out.detach(), q.grad, k.grad, v.grad)):
            results[i] = t.permute(2, 0, 1, 3)
    dist.broadcast(results, src=0)
    return {name: take_rows(results[i], ranges) for i, name in enumerate(TENSORS)}


def global_errors(got: dict, ref: dict) -> dict[str, dict[str, float]]:
    """max_rel and rms_rel of each tensor over every rank's rows."""
    errors = {}
    for name in TENSORS:
        diff = got[name].double() - ref[name]
        maxes = torch.stack([diff.abs().max(), ref[name].abs().max()])
        sums = torch.stack([diff.square().sum(), ref[name].square().sum()])
        dist.all_reduce(maxes, op=dist.ReduceOp.MAX)
        dist.all_reduce(sums)
        errors[name] = {"max_rel": (maxes[0] / maxes[1]).item(), "rms_rel": (sums[0] / sums[1]).sqrt().item()}
    return errors


def accuracy_worker(rank, world_size, lengths, heads, dim, team_size, seed):
    """One rank: errors of every method at every length (the same dict on every rank)."""
    torch.set_num_threads(1)
    methods = {"ring": new_startrail_groups(team_size=1), f"startrail-{team_size}": new_startrail_groups(team_size=team_size)}
    rows = []
    for seq in lengths:
        if seq % (2 * world_size) != 0:
            raise ValueError(f"--lengths: {seq} is not divisible by 2 * --world-size = {2 * world_size}")
        full = full_inputs(seed + seq, seq, heads, dim)
        ranges = zigzag_ranges(rank, world_size, seq)
        start = time.perf_counter()
        ref = reference_on_my_rows(full, ranges, dim**-0.5)
        ref_s = time.perf_counter() - start
        for name, groups in methods.items():
            start = time.perf_counter()
            errors = global_errors(startrail_on_my_rows(full, ranges, groups), ref)
            rows.append({"seq": seq, "method": name, "errors": errors, "seconds": time.perf_counter() - start})
        start = time.perf_counter()
        errors = global_errors(single_device_on_my_rows(full, ranges), ref)
        rows.append({"seq": seq, "method": "single-device", "errors": errors, "seconds": time.perf_counter() - start})
        for row in rows[-3:]:
            row["reference_seconds"] = ref_s
        if rank == 0:
            print(f"[bf16_accuracy] S={seq}: reference {ref_s:.1f} s, "
                  + ", ".join(f"{r['method']} out {r['errors']['out']['max_rel']:.2e}" for r in rows[-3:]), flush=True)
    return rows


def ratios(rows: list[dict], method: str, metric: str) -> dict[int, dict[str, float]]:
    """Error of ``method`` / error of single-device, per length and tensor."""
    single = {r["seq"]: r["errors"] for r in rows if r["method"] == "single-device"}
    return {
        r["seq"]: {t: r["errors"][t][metric] / single[r["seq"]][t][metric] for t in TENSORS}
        for r in rows if r["method"] == method
    }


def table(rows: list[dict], spec: dict) -> str:
    lines = [
        f"P = {spec['world_size']} ranks (forked gloo, one CP group), causal, batch 1, {spec['heads']} heads of "
        f"{spec['dim']}, bf16 inputs; error against float64 attention on the same bf16-rounded inputs.",
        "`max` = max |err| / max |ref|, `rms` = ||err||_2 / ||ref||_2, over the whole sequence.",
        "",
        "The last two columns: the largest ratio, over out/dQ/dK/dV, of this method's error to single-device's.",
        "",
        "| tokens | method | out max | out rms | dQ max | dQ rms | dK max | dK rms | dV max | dV rms "
        "| worst max ratio | worst rms ratio |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    single = {r["seq"]: r["errors"] for r in rows if r["method"] == "single-device"}
    for r in rows:
        cells = " | ".join(f"{r['errors'][t][m]:.2e}" for t in TENSORS for m in ("max_rel", "rms_rel"))
        worst = [max(r["errors"][t][m] / single[r["seq"]][t][m] for t in TENSORS) for m in ("max_rel", "rms_rel")]
        lines.append(f"| {r['seq']} | {r['method']} | {cells} | {worst[0]:.2f} | {worst[1]:.2f} |")
    return "\n".join(lines) + "\n"


def plot(rows: list[dict], path: str) -> None:
    import matplotlib  # noqa: PLC0415

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # noqa: PLC0415

    methods = list(dict.fromkeys(r["method"] for r in rows))
    fig, axes = plt.subplots(1, len(TENSORS), figsize=(16, 3.8), sharex=True)
    for ax, t in zip(axes, TENSORS):
        for i, m in enumerate(methods):
            for metric, style in (("rms_rel", "-"), ("max_rel", ":")):
                pts = sorted((r["seq"], r["errors"][t][metric]) for r in rows if r["method"] == m)
                ax.plot([p[0] for p in pts], [p[1] for p in pts], style, marker="o", color=f"C{i}",
                        label=f"{m} ({metric[:3]})")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(f"{t}: error / reference (rms solid, max dotted)", fontsize=9)
        ax.set_xlabel("total tokens")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle("bf16 attention error against float64 vs total sequence length")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 8192, 16384, 32768, 65536])
    parser.add_argument("--world-size", type=int, default=8)
    parser.add_argument("--team-size", type=int, default=2)
    parser.add_argument("--heads", type=int, default=2)
    parser.add_argument("--dim", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--timeout", type=float, default=3600.0)
    parser.add_argument("--out", default=os.path.join(RESULTS, "bf16_accuracy"))
    parser.add_argument("--from-json", metavar="JSON", help="Only rewrite the table and plot of a saved run.")
    args = parser.parse_args(argv)
    if args.from_json:
        with open(args.from_json) as f:
            saved = json.load(f)
        write_outputs(saved["rows"], saved["spec"], args.out)
        return 0

    # Rank 0 alone runs the single-device attention while the others wait in a broadcast:
    # give the process group a timeout that covers it (tests.multiproc reads this at import).
    os.environ.setdefault("STARTRAIL_TEST_PG_TIMEOUT", str(args.timeout))
    from tests.multiproc import run_ranks  # noqa: PLC0415

    start = time.perf_counter()
    rows = run_ranks(accuracy_worker, args.world_size,
                     args=(args.lengths, args.heads, args.dim, args.team_size, args.seed), timeout=args.timeout)[0]
    spec = {k: getattr(args, k) for k in ("world_size", "team_size", "heads", "dim", "seed", "lengths")}
    spec["wall_seconds"] = time.perf_counter() - start
    write_outputs(rows, spec, args.out)
    return 0


def write_outputs(rows: list[dict], spec: dict, out: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out + ".json", "w") as f:
        json.dump({"spec": spec, "rows": rows}, f, indent=1)
    with open(out + ".md", "w") as f:
        f.write(table(rows, spec))
    plot(rows, out + ".png")
    print(table(rows, spec))


if __name__ == "__main__":
    sys.exit(main())
