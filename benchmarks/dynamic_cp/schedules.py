"""Offline simulation of megatron-core 0.19.2's hybrid (dynamic) CP scheduler, with and
without StarTrail's aligned fill (megatron_startrail/megatron/aligned_schedule.py).

Each setting draws global batches of documents (about twice DP x CP x
``--max-seqlen-per-dp-cp-rank`` tokens, what a run packs into one global batch at that
density), schedules each batch with :class:`AlignedCPScheduler` and records Megatron's own
phase before the realignment: Megatron's fill changes neither which sub-samples share a
phase nor the leftovers, so the recorded phases *are* the unfixed scheduler's schedule
(checked against ``BalancedCPScheduler`` itself in tests/test_dynamic_cp_schedules.py) and
one pass gives both. Per setting: batches that cannot run (a sub-sample outside Megatron's
aligned groups, or the scheduler failing), balance (summed over phases, the busiest rank's
work over the mean rank's, work = length^2 / CP size, Megatron's own estimate; phases run
one after the other, so this is step time over ideal time), and sub-samples per CP size.

    python -m benchmarks.dynamic_cp.schedules --batches 10000 --out benchmarks/results/dynamic_cp_schedules.md
"""

from __future__ import annotations

import argparse
import math
import multiprocessing
import random
import sys
import time
import types
from dataclasses import dataclass, field

DISTRIBUTIONS = {
    # name: (description, draw(rng) -> document length in tokens)
    "log-uniform": ("log-uniform 64..32K", lambda rng: int(math.exp(rng.uniform(math.log(64), math.log(32768))))),
    "log-normal": ("log-normal, median 4K, sigma 1.5, cut at 64..1M",
                   lambda rng: min(1 << 20, max(64, int(rng.lognormvariate(math.log(4096), 1.5))))),
    "chat+code": ("70% chat log-uniform 100..2K, 30% code log-uniform 8K..128K",
                  lambda rng: int(math.exp(rng.uniform(math.log(100), math.log(2048)) if rng.random() < 0.7
                                           else rng.uniform(math.log(8192), math.log(131072))))),
}
# (DP x CP, --max-seqlen-per-dp-cp-rank, distribution): a subset of the grid that runs in
# minutes on 2 cores (the scheduler's cost grows with documents per batch x ranks: 256 ranks
# at 4K with log-uniform documents, 400 per batch, alone takes ~13 minutes per 10,000 batches).
GRID = [
    (8, 4096, "log-uniform"), (8, 65536, "log-uniform"), (16, 4096, "log-uniform"), (16, 16384, "log-uniform"),
    (64, 4096, "log-uniform"),
    (8, 4096, "log-normal"), (8, 16384, "log-normal"), (16, 4096, "log-normal"), (64, 4096, "log-normal"),
    (256, 4096, "log-normal"),
    (8, 4096, "chat+code"), (8, 65536, "chat+code"), (16, 16384, "chat+code"), (64, 4096, "chat+code"),
    (256, 4096, "chat+code"),
]


def global_batch(rng: random.Random, draw, dp_cp: int, max_seqlen: int) -> list[int]:
    """Documents of one global batch; a document longer than all ranks hold is cut into
    pieces that fit (what a packer with that --seq-length does)."""
    cap, docs, tokens = dp_cp * max_seqlen, [], 0
    while tokens < 2 * cap:
        length = draw(rng)
        tokens += length
        while length > cap:
            docs.append(cap)
            length -= cap
        docs.append(length)
    return docs


@dataclass
class Tally:
    """One schedule's totals over the batches of a setting."""

    unrunnable: int = 0
    max_work: float = 0.0  # summed over phases: the busiest rank's work
    mean_work: float = 0.0  # summed over phases: the mean rank's work
    phases: int = 0
    by_size: dict = field(default_factory=dict)  # CP size -> sub-samples

    def add(self, phases: list[list[list[int]]], seqlen: dict[int, int], is_aligned, placements) -> None:
        work, aligned = [[0.0] * len(p) for p in phases], True
        for phase, sample, ranks in placements(phases):
            aligned = aligned and is_aligned(ranks)
            self.by_size[len(ranks)] = self.by_size.get(len(ranks), 0) + 1
            for r in ranks:
                work[phase][r] += seqlen[sample] ** 2 / len(ranks)
        self.unrunnable += not aligned
        self.max_work += sum(max(w) for w in work)
        self.mean_work += sum(sum(w) / len(w) for w in work)
        self.phases += len(phases)

    @property
    def balance(self) -> float:
        return self.max_work / self.mean_work if self.mean_work else float("nan")


def simulate(setting: tuple[int, int, str], batches: int, seed: int = 0) -> dict:
    """Fixed and unfixed tallies of one setting (a worker process: imports Megatron here)."""
    from megatron_startrail.megatron import cpu_patches  # noqa: PLC0415

    cpu_patches.install_import_shims()  # megatron.core without triton on a CPU
    from megatron_startrail.megatron.aligned_schedule import AlignedCPScheduler, is_aligned, placements  # noqa

    class Recording(AlignedCPScheduler):
        def realign(self, sample_ids_per_rank, seqlen, total_gpus):
            self.megatron_phases.append([list(ids) for ids in sample_ids_per_rank])
            return super().realign(sample_ids_per_rank, seqlen, total_gpus)

    dp_cp, max_seqlen, dist = setting
    rng = random.Random(f"{seed}/{dp_cp}/{max_seqlen}/{dist}")
    fixed, unfixed, errors, start = Tally(), Tally(), 0, time.time()
    for _ in range(batches):
        docs = global_batch(rng, DISTRIBUTIONS[dist][1], dp_cp, max_seqlen)
        seqlen = dict(enumerate(docs))
        sched = Recording(max_seqlen, types.SimpleNamespace(size=lambda: dp_cp))
        sched.megatron_phases = []
        try:
            _, phases = sched.get_groups_and_subsamples(list(seqlen.items()), None)
        except AssertionError:  # Megatron's own placement step gave up: neither runs
            errors += 1
            continue
        fixed.add(phases, seqlen, is_aligned, placements)
        unfixed.add(sched.megatron_phases, seqlen, is_aligned, placements)
    return dict(setting=setting, batches=batches, fixed=fixed, unfixed=unfixed, errors=errors,
                seconds=time.time() - start)


def table(results: list[dict]) -> str:
    rows = ["| DP x CP | max seqlen / rank | documents | batches | unrunnable fixed | unrunnable unfixed "
            "| balance fixed | balance unfixed | phases / batch | sub-samples per batch by CP size (fixed) |",
            "|---:|---:|---|---:|---:|---:|---:|---:|---:|---|"]
    for r in results:
        n, m, d = r["setting"]
        f, u, b = r["fixed"], r["unfixed"], r["batches"]
        sizes = ", ".join(f"{k}: {v / b:.1f}" for k, v in sorted(f.by_size.items()))
        rows.append(f"| {n} | {m // 1024}K | {d} | {b} | {f.unrunnable + r['errors']} | "
                    f"{u.unrunnable + r['errors']} | {f.balance:.3f} | {u.balance:.3f} | {f.phases / b:.1f} | {sizes} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, default=10000, help="global batches per setting")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", help="write the table (markdown) here")
    args = p.parse_args(argv)
    start = time.time()
    # The costliest settings first, so that two workers finish together.
    grid = sorted(GRID, key=lambda s: -s[0] * s[0] * s[1])
    with multiprocessing.get_context("spawn").Pool(args.workers) as pool:
        results = pool.starmap(simulate, [(s, args.batches, args.seed) for s in grid], chunksize=1)
    results.sort(key=lambda r: (list(DISTRIBUTIONS).index(r["setting"][2]), r["setting"][0], r["setting"][1]))
    text = table(results)
    legend = "\n".join(f"- {name}: {desc}" for name, (desc, _) in DISTRIBUTIONS.items())
    report = (f"# Hybrid CP schedules: megatron-core 0.19.2's BalancedCPScheduler, with and without the aligned fill\n\n"
              f"`python -m benchmarks.dynamic_cp.schedules --batches {args.batches} --seed {args.seed}`, "
              f"{time.time() - start:.0f} s on {args.workers} workers. Global batches of about 2 x DP x CP x max "
              "seqlen tokens. Unrunnable: a sub-sample on ranks that are not one of Megatron's aligned groups "
              "(or the scheduler failing). Balance: summed over phases, busiest rank's work / mean rank's work "
              "(work = length^2 / CP size).\n\n" + legend + "\n\n" + text + "\n")
    print(report)
    if args.out:
        with open(args.out, "w") as f:
            f.write(report)
    return 1 if any(r["fixed"].unrunnable or r["errors"] for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
