"""Committed GPU accuracy tables as rows a test can read: ``python -m benchmarks.gpu.tables``.

Reads the kit's Markdown accuracy tables (``benchmarks.gpu.check``'s "Block kernels vs
float64" section) and the efficient-adapter experiment (JSON lines) of a folder under
``benchmarks/results/gpu/`` and writes ``accuracy.json`` next to them: one row per measured
(kernel, dtype, batch, call, head dims, heads) with its status. ``auto``'s per-device table
(``megatron_startrail/kernels/measured.py``) is held to these rows by
``tests/test_measured_kernels.py``, which also checks that the committed JSON is what this
script makes of the committed sources (so nothing in it is typed by hand).

A row's ``kinds`` are the call kinds its call held (Note [kernel calls] in
``megatron_startrail/layout.py``): ``full``, ``causal`` (square), ``causal_nonsquare``,
``band``, ``cut_edge``, and ``multi`` when the call packed several sequences.
"""

from __future__ import annotations

import argparse
import json
import os
import re

from benchmarks import RESULTS

GPU_RESULTS = os.path.join(RESULTS, "gpu")

# max |error| / max |reference| per dtype: the kit's TOLERANCE (benchmarks/gpu/check_kernels.py)
TOLERANCE = {"fp32": 2e-5, "fp16": 4e-3, "bf16": 3e-2}
JSONL_DTYPES = {"float32": "fp32", "float16": "fp16", "bfloat16": "bf16"}


def kit_sequences(seq: int) -> list[tuple[int, int]]:
    """The (query rows, key rows) of the kit's accuracy call at 9ee7a82
    (``benchmarks.gpu.check_kernels.varlen_call``): three sequences, never fewer keys than queries."""
    return [(seq, seq), (seq // 2 + 3, seq + 5), (seq - 7, seq + 1)]


def call_kinds(window: tuple[int, int], sequences: list[tuple[int, int]]) -> list[str]:
    """The call kinds of a call of ``sequences`` under flash-attn's ``window`` (left, right)."""
    left, right = window
    kinds = set()
    for sq, sk in sequences:
        if (left, right) == (-1, -1):
            kinds.add("full")
        elif (left, right) == (-1, 0):
            kinds.add("causal" if sq == sk else "causal_nonsquare")
        elif right == -1:
            kinds.add("cut_edge")  # the run's end cuts every row (piece B)
        else:
            kinds.add("band")
    if len(sequences) > 1:
        kinds.add("multi")
    return sorted(kinds)


_ROW = re.compile(r"^\| (\w+) \| (bf16|fp16|fp32) \| (\d+), (\d+) \| \((-?\d+), (-?\d+)\) \| (\d+)/(\d+) \| "
                  r"(PASS|FAIL|SKIP) \|(.*)\|$")
_BLOCKS = re.compile(r"^Blocks of (\d+) query rows, batch (\d+)")


def _errors(cells: list[str]) -> dict[str, float]:
    return {name: float(cell) for name, cell in zip(("out", "lse", "dq", "dk", "dv"), cells) if cell}


def markdown_rows(path: str, source: str) -> list[dict]:
    """The accuracy rows of one kit table (its "Blocks of N query rows, batch B" line gives the call)."""
    rows, seq, batch = [], None, None
    with open(path) as f:
        for line in f:
            line = line.rstrip("\n")
            header = _BLOCKS.match(line)
            if header:
                seq, batch = int(header.group(1)), int(header.group(2))
            match = _ROW.match(line)
            if not match:
                continue
            kernel, dtype, dqk, dv, left, right, h, hkv, status, rest = match.groups()
            cells = [c.strip() for c in rest.split("|")]
            window = (int(left), int(right))
            sequences = kit_sequences(seq)
            rows.append(dict(source=source, kernel=kernel, dtype=dtype, batch=batch, window=list(window),
                             sequences=[list(s) for s in sequences], kinds=call_kinds(window, sequences),
                             dims=[int(dqk), int(dv)], heads=[int(h), int(hkv)], status=status,
                             errors=_errors(cells[:5]), note=cells[6] if len(cells) > 6 else ""))
    return rows


def experiment_rows(path: str, source: str) -> list[dict]:
    """The adapter rows (those naming a ``kernel``) of the efficient experiment: one sequence,
    causal for the "causal square" cases; head dims and heads were not recorded (None)."""
    rows = []
    with open(path) as f:
        for line in f:
            row = json.loads(line)
            if "kernel" not in row:
                continue  # torch's own SDPA autograd: not one of our adapters
            dtype = JSONL_DTYPES[row["dtype"]]
            window = (-1, 0) if row["case"].startswith("causal") else (-1, -1)
            sequences = [(row["sq"], row["sk"])]
            errors = {name: row[name] for name in ("out", "dq", "dk", "dv")}
            status = "PASS" if all(e <= TOLERANCE[dtype] for e in errors.values()) else "FAIL"
            rows.append(dict(source=source, kernel=row["kernel"], dtype=dtype, batch=row["b"], window=list(window),
                             sequences=[list(s) for s in sequences], kinds=call_kinds(window, sequences), dims=None,
                             heads=None, status=status, errors=errors, note=row["case"]))
    return rows


def folder_rows(folder: str) -> list[dict]:
    """Every accuracy row of one results folder, in file order (Markdown tables, then JSON lines)."""
    rows = []
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if name.endswith(".md") and name != "README.md":
            rows += markdown_rows(path, name)
        elif name.endswith(".jsonl") and "experiment" in name:
            rows += experiment_rows(path, name)
    return rows


def write(folder: str) -> str:
    path = os.path.join(folder, "accuracy.json")
    with open(path, "w") as f:
        json.dump(folder_rows(folder), f, indent=1)
        f.write("\n")
    return path


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folders", nargs="*", help="results folders (default: every folder under benchmarks/results/gpu)")
    args = p.parse_args(argv)
    folders = args.folders or [os.path.join(GPU_RESULTS, d) for d in sorted(os.listdir(GPU_RESULTS))
                               if os.path.isdir(os.path.join(GPU_RESULTS, d))]
    for folder in folders:
        print(write(folder))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
