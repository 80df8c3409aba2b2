#!/usr/bin/env python
"""Mutation check of the attention core: does the fast test suite catch bugs of the shapes
real bugs take?

Each mutation below changes one line of ``megatron_startrail/`` (a dropped contiguity, an
off-by-one in a zigzag or window bound, a swapped peer, a wrong MLA scale, a lost team
member in the merge, a copy instead of an add, ...). For each, in a temporary git worktree
of HEAD (the repository's own checkout is never touched), this script applies it (the old
text must occur exactly once), runs the fast tests with ``-x`` and records the first
failing test; then restores the file. It prints a markdown table ``mutation | caught by``
and exits non-zero when a mutant survives (or no longer applies: a changed line, so the
list needs updating).

    python scripts/mutation_check.py               # all mutations (about 15-20 minutes on 2 cores)
    python scripts/mutation_check.py -k 3 -k 17    # only these (numbers of --list)
    python scripts/mutation_check.py --list        # the mutations, numbered
    python scripts/mutation_check.py --worktree /tmp/mut  # reuse an existing worktree (reset to its HEAD)
    python scripts/mutation_check.py --no-baseline       # skip the unmutated run that comes first (~4 min)

Runs the worktree's code and tests with ``PYTHONPATH=<worktree>`` (checked at start:
``megatron_startrail`` must import from the worktree) and this interpreter.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# The fast part of the suite, quick and broad files first (-x stops at the first failure).
FAST_TESTS = [
    "tests/test_mutants_caught.py",
    "tests/test_layout_fuzz.py",
    "tests/test_kernels_and_merge.py",
    "tests/test_attention_distributed.py",
    "tests/test_regather_and_mla.py",
    "tests/test_piece_major.py",
    "tests/test_window.py",
    "tests/test_packed_documents.py",
    "tests/test_multiring.py",
    "tests/test_pipelined_initial_send.py",
    "tests/test_nccl_rules.py",
    "tests/test_topology.py",
]

# (file, old text, new text, what it breaks). ``old`` must occur exactly once in the file;
# it may carry a neighbouring line as an anchor, but old and new differ in one line only.
MUTATIONS: list[tuple[str, str, str, str]] = [
    # -- contiguity: a strided tensor reaching a collective or a kernel
    ("megatron_startrail/comm.py",
     "sends = [(t.contiguous(), peer) for t, peer in sends]",
     "sends = [(t, peer) for t, peer in sends]",
     "P2P sends no longer made dense"),
    ("megatron_startrail/backward.py",
     "own_side = [q.contiguous(), dout.contiguous(), out, lse]",
     "own_side = [q, dout.contiguous(), out, lse]",
     "rotation q broadcasts/rotates the raw (strided) q"),
    ("megatron_startrail/comm.py",
     "        x = x.contiguous()\n        out = x.new_empty((group_size * x.shape[0],)",
     "        out = x.new_empty((group_size * x.shape[0],)",
     "all-gather of a strided tensor (no dense copy)"),
    ("megatron_startrail/comm.py",
     "        x = x.contiguous()\n        out = torch.empty_like(x)",
     "        out = torch.empty_like(x)",
     "all-to-all of a strided tensor (the team merge's permuted partials)"),
    ("megatron_startrail/comm.py",
     "        x = x.contiguous()\n        out = x.new_empty((x.shape[0] // group_size,)",
     "        out = x.new_empty((x.shape[0] // group_size,)",
     "reduce-scatter of a strided tensor"),
    ("megatron_startrail/blocks.py",
     "return rows if rows.stride(-1) == 1 else rows.contiguous()",
     "return rows",
     "kernel gets a view whose last dim is strided"),
    # -- Ulysses head replication (1 < kv heads < U)
    ("megatron_startrail/ulysses.py",
     "k = k.repeat_interleave(u // kv_heads, dim=2)",
     "k = k.repeat(1, 1, u // kv_heads, 1)",
     "K heads replicated in tile order, not interleaved"),
    # -- zigzag / chunk layout, packed documents
    ("megatron_startrail/layout.py",
     "return (cp_rank, 2 * cp_size - 1 - cp_rank)",
     "return (cp_rank, cp_size + cp_rank)",
     "CP rank holds chunks r, CP+r (no zigzag)"),
    ("megatron_startrail/layout.py",
     "real_end = padded[doc] + cu[doc + 1] - cu[doc]",
     "real_end = padded[doc] + cu[doc + 1] - cu[doc] - 1",
     "document layout: last real token of a document taken as padding"),
    ("megatron_startrail/team.py",
     "cp_ranks = tuple(p * u + i for p in groups.topology.team_positions(team) for i in range(u))",
     "cp_ranks = tuple(p * u + i for i in range(u) for p in groups.topology.team_positions(team))",
     "team rows ordered Ulysses-rank-major instead of member-major"),
    # -- window bounds
    ("megatron_startrail/layout.py",
     "lo = -INF if left is None or left < 0 else -int(left)",
     "lo = -INF if left is None or left < 0 else -int(left) - 1",
     "window reaches one key too far left"),
    ("megatron_startrail/halo.py",
     "x, y = max(a, qa + lo), min(b, qb - 1 + hi + 1)",
     "x, y = max(a, qa + lo), min(b, qb - 1 + hi)",
     "halo misses the last row a window reaches"),
    # -- peers
    ("megatron_startrail/topology.py",
     "group, j = divmod(team, g)",
     "j, group = divmod(team, g)",
     "initial send: wrong source (team group and index swapped)"),
    ("megatron_startrail/schedule.py",
     "return self.order[(self.order.index(pos) - step) % len(self.order)]",
     "return self.order[(self.order.index(pos) + step) % len(self.order)]",
     "sub-ring: origin of the held payload counted the wrong way"),
    ("megatron_startrail/topology.py",
     "return ((j - step) % g) * self.team_size + self.member_of(pos)",
     "return ((j + step) % g) * self.team_size + self.member_of(pos)",
     "kv_team_at_step counted the wrong way round the sub-ring"),
    # -- merges
    ("megatron_startrail/blocks.py",
     "for part, weight in zip(outs[1:], weights[1:]):",
     "for part, weight in zip(outs[2:], weights[2:]):",
     "team merge loses member 1's partial"),
    ("megatron_startrail/blocks.py",
     "torch.logaddexp(acc_lse, lse.to(acc_lse.dtype), out=acc_lse)",
     "torch.maximum(acc_lse, lse.to(acc_lse.dtype), out=acc_lse)",
     "lse merge keeps the max instead of log-sum-exp"),
    # -- accumulators: a copy instead of an add
    ("megatron_startrail/blocks.py",
     "dst[run[0] : run[1]].add_(src)",
     "dst[run[0] : run[1]].copy_(src)",
     "gradient of a call copied over the accumulator (view path)"),
    ("megatron_startrail/blocks.py",
     'dst.index_add_(0, call.tensor(side + "_index", dst.device), src.to(dst.dtype))',
     'dst.index_copy_(0, call.tensor(side + "_index", dst.device), src.to(dst.dtype))',
     "gradient of a call copied over the accumulator (gathered path)"),
    ("megatron_startrail/schedule.py",
     "                        c.add_(r)",
     "                        c.copy_(r)",
     "sub-ring gradient accumulator overwritten instead of summed"),
    ("megatron_startrail/backward.py",
     "dq = dq_i if dq is None else dq.add_(dq_i)",
     "dq = dq_i",
     "rotation q: dQ of later rounds replaces earlier ones (piece-major)"),
    ("megatron_startrail/backward.py",
     "while self._next <= last:",
     "while self._next < last:",
     "reverse reduce stops one piece short"),
    # -- piece order of the streamed / piece-major backward
    ("megatron_startrail/backward.py",
     "final = (i == c - 1, len(q_rot.lanes[0].order) - 1)  # the last pass's last step",
     "final = (i == 0, len(q_rot.lanes[0].order) - 1)  # the last pass's last step",
     "rotation q sends dK, dV back after the first pass, not the last"),
    # -- scale and dtype
    ("megatron_startrail/attention.py",
     "scale = softmax_scale if softmax_scale is not None else q.shape[-1] ** -0.5",
     "scale = softmax_scale if softmax_scale is not None else v.shape[-1] ** -0.5",
     "default softmax scale from V's head dim (wrong for MLA)"),
    ("megatron_startrail/blocks.py",
     "return torch.float64 if dtype == torch.float64 else torch.float32",
     "return torch.float32",
     "partials, lse and gradients accumulate in float32 for float64 inputs"),
    ("megatron_startrail/blocks.py",
     "acc_lse.permute(2, 0, 1).contiguous()",
     "acc_lse.permute(2, 0, 1).to(dtype).contiguous()",
     "lse kept in the inputs' dtype (bf16) instead of the accumulator's"),
    ("megatron_startrail/blocks.py",
     "ref = lse.masked_fill(lse.isneginf(), 0.0)",
     "ref = lse",
     "team merge of rows nobody saw (padding): exp(-inf - -inf) = NaN"),
    # -- packed documents: every rank must agree on cu_seqlens
    ("megatron_startrail/documents.py",
     "    if cp > 1:",
     "    if cp > 2:",
     "document agreement skipped on two CP ranks"),
    # -- piece-major order
    ("megatron_startrail/backward.py",
     "for pieces in ([[j] for j in range(c)] if piece_major else [list(range(c))]):",
     "for pieces in ([[j] for j in range(c)] if not piece_major else [list(range(c))]):",
     "rotation q runs piece by piece where the sub-ring circulates, and not where G = 1"),
    # -- regathering
    ("megatron_startrail/attention.py",
     "ctx.regather = regather or regathers_for_free(groups)",
     "ctx.regather = regather",
     "ring attention (C=1) keeps its K, V for the backward instead of regathering"),
]


def _line_of(text: str, old: str, new: str) -> int:
    """1-based line of the (first) line the mutation changes."""
    start = text.index(old)
    old_lines, new_lines = old.split("\n"), new.split("\n")
    offset = next((i for i, (a, b) in enumerate(zip(old_lines, new_lines)) if a != b), min(len(old_lines),
                                                                                          len(new_lines)) - 1)
    return text.count("\n", 0, start) + 1 + offset


def _changed_line(old: str, new: str) -> tuple[str, str]:
    """The one line the mutation changes, before and after ("(deleted)" when it goes)."""
    old_lines, new_lines = old.split("\n"), new.split("\n")
    i = next((i for i, (x, y) in enumerate(zip(old_lines, new_lines)) if x != y), len(new_lines))
    if len(new_lines) < len(old_lines):
        return old_lines[i].strip(), "(deleted)"
    return old_lines[i].strip(), new_lines[i].strip()


def _first_failure(output: str) -> str | None:
    for pattern in (r"^FAILED (\S+)", r"^ERROR (\S+)"):
        m = re.search(pattern, output, re.M)
        if m:
            return m.group(1)
    if re.search(r"\b\d+ (failed|errors?)\b", output):
        return "(failed; see the log)"
    return None


def run_mutation(worktree: str, index: int, mutation, tests: list[str], timeout: float, log_dir: str) -> dict:
    path, old, new, what = mutation
    file = os.path.join(worktree, path)
    with open(file) as f:
        text = f.read()
    count = text.count(old)
    before, after = _changed_line(old, new)
    row = {"index": index, "where": path, "what": what, "old": before, "new": after}
    if count != 1:
        row.update(caught=None, result=f"DOES NOT APPLY ({count} matches: update the list)")
        return row
    row["where"] = f"{path}:{_line_of(text, old, new)}"
    with open(file, "w") as f:
        f.write(text.replace(old, new))
    env = dict(os.environ, PYTHONPATH=worktree, STARTRAIL_CHECK_NCCL_RULES="1")
    cmd = [sys.executable, "-m", "pytest", *tests, "-x", "-q", "-p", "no:cacheprovider"]
    t0 = time.monotonic()
    try:
        proc = subprocess.run(cmd, cwd=worktree, env=env, capture_output=True, text=True, timeout=timeout)
        output, rc = proc.stdout + proc.stderr, proc.returncode
    except subprocess.TimeoutExpired as e:
        output = (e.stdout or b"").decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        rc = None
    finally:
        subprocess.run(["git", "-C", worktree, "checkout", "--", path], check=True)
    row["seconds"] = round(time.monotonic() - t0)
    with open(os.path.join(log_dir, f"mutant_{index:02d}.log"), "w") as f:
        f.write(output)
    if rc is None:
        row.update(caught=True, result=f"hung (> {timeout:.0f} s)")
    elif rc == 0:
        row.update(caught=False, result="SURVIVED")
    else:
        failure = _first_failure(output)
        row.update(caught=failure is not None, result=failure or f"pytest exit {rc} (no test failed: see the log)")
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-k", type=int, action="append", help="run only mutation number K (repeatable)")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument("--worktree", help="an existing git worktree to mutate (default: a temporary one of HEAD)")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds per mutant (default 1200)")
    parser.add_argument("--tests", nargs="+", default=None, help="test files (default: the fast part)")
    parser.add_argument("--logs", default=None, help="folder for each mutant's pytest log")
    parser.add_argument("--no-baseline", action="store_true",
                        help="skip running the unmutated tests first (they must pass, or every mutant looks caught)")
    args = parser.parse_args()
    selected = [(i, m) for i, m in enumerate(MUTATIONS, 1) if not args.k or i in args.k]
    if args.list:
        for i, (path, old, new, what) in selected:
            before, after = _changed_line(old, new)
            print(f"{i:2d}. {path}: {what}\n      - {before}\n      + {after}")
        return 0

    made = args.worktree is None
    worktree = args.worktree or tempfile.mkdtemp(prefix="startrail_mut_")
    if made:
        os.rmdir(worktree)
        subprocess.run(["git", "-C", REPO, "worktree", "add", "--detach", worktree, "HEAD"], check=True,
                       capture_output=True)
    log_dir = args.logs or tempfile.mkdtemp(prefix="startrail_mut_logs_")
    os.makedirs(log_dir, exist_ok=True)
    tests = [t for t in (args.tests or FAST_TESTS) if os.path.exists(os.path.join(worktree, t))]
    rows = []
    try:
        subprocess.run(["git", "-C", worktree, "checkout", "--", "."], check=True)
        where = subprocess.run([sys.executable, "-c", "import megatron_startrail; print(megatron_startrail.__file__)"],
                               cwd=worktree, env=dict(os.environ, PYTHONPATH=worktree), capture_output=True,
                               text=True, check=True).stdout.strip()
        if not where.startswith(os.path.realpath(worktree)) and not where.startswith(worktree):
            raise SystemExit(f"megatron_startrail imports from {where}, not from the worktree {worktree}")
        print(f"worktree {worktree} ({where}); logs in {log_dir}; tests: {' '.join(tests)}", file=sys.stderr)
        if not args.no_baseline:
            proc = subprocess.run([sys.executable, "-m", "pytest", *tests, "-x", "-q", "-p", "no:cacheprovider"],
                                  cwd=worktree, env=dict(os.environ, PYTHONPATH=worktree,
                                                         STARTRAIL_CHECK_NCCL_RULES="1"),
                                  capture_output=True, text=True, timeout=args.timeout)
            if proc.returncode != 0:
                print(proc.stdout[-3000:] + proc.stderr[-2000:], file=sys.stderr)
                raise SystemExit("the unmutated tests fail: fix them first (or pass --no-baseline)")
            print("baseline: the unmutated tests pass", file=sys.stderr)
        for i, mutation in selected:
            row = run_mutation(worktree, i, mutation, tests, args.timeout, log_dir)
            rows.append(row)
            print(f"[{i}] {row['where']}: {row['what']} -> {row['result']} ({row.get('seconds', 0)} s)",
                  file=sys.stderr, flush=True)
    finally:
        if made:
            subprocess.run(["git", "-C", REPO, "worktree", "remove", "--force", worktree], capture_output=True)
            shutil.rmtree(worktree, ignore_errors=True)

    print("| # | where | mutation | caught by |")
    print("|---|---|---|---|")
    for row in rows:
        change = f"{row['what']}: `{row['old']}` -> `{row['new']}`".replace("|", "\\|")
        print(f"| {row['index']} | {row['where']} | {change} | {row['result']} |")
    bad = [r for r in rows if not r["caught"]]
    print(f"\n{len(rows) - len(bad)} of {len(rows)} mutants caught", file=sys.stderr)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
