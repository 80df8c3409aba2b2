"""Run a GPU check's parts each in its own process, with its own timeout, so that no fault loses rows.

A CUDA fault (an illegal memory access) destroys the process's CUDA context: every later call
fails, and whatever the process held in memory is gone. So the kits (``benchmarks.gpu.check``,
``benchmarks.gpu.session``) split their work into parts (:class:`Part`), and each part into
items. The parent runs each part as ``python -m benchmarks.gpu.check_parts`` with the part's
function and arguments; the child writes one JSON line per event to a rows file, flushed at once:

- ``{"start": i, "what": ...}`` before item ``i``;
- ``{"end": i, "rows": [...]}`` with its rows, or ``{"end": i, "error": ...}`` when it raised;
- ``{"end": i, "skipped": group}`` for an item of a group that lost the device before.

An item that raises is that item's error; the child goes on unless the device is lost
(:func:`device_lost`), and then exits. The parent reads the rows file whatever happened: an item
started but never ended (the process died, or the part's time ran out) becomes that item's error,
and after a death (not a timeout) the part is started again after that item, within its time.
Items may name a *group* (the accuracy part's kernel): after a death in one, the fresh process
skips the rest of that group, so a kernel that kills the device on every case costs one restart,
not all of them (one error line says how many of its items were skipped).
What the parent collects (:class:`PartResult`) is rendered and written after each part.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterable

from benchmarks import ROOT

LOST_DEVICE_EXIT = 3  # the child's exit status when its device context is gone
MAX_RESTARTS = 4  # per part: items that kill the process, each skipped on the next start


@dataclass
class Part:
    """``function`` (``module:name``) is called in the child as ``function(items, **kwargs)``
    where ``items`` is an :class:`ItemRunner`; ``kwargs`` must be JSON, or a function of the
    results so far that returns them (a part that needs an earlier part's rows)."""

    name: str
    function: str
    kwargs: dict | Callable[[dict], dict]
    timeout_s: float
    env: dict = field(default_factory=dict)  # set in the part's process (LD_PRELOAD for fake CUDA)


@dataclass
class PartResult:
    name: str
    rows: list = field(default_factory=list)
    errors: list = field(default_factory=list)  # "what: message"
    seconds: float = 0.0
    status: str = "not run"  # ok / errors / timeout / not run


# --- child side ---------------------------------------------------------------------------

def device_lost() -> bool:
    """Whether this process's CUDA context is gone (after an illegal memory access every call
    raises, ``synchronize`` included). False on a machine without CUDA."""
    import torch  # noqa: PLC0415

    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return False
    try:
        torch.cuda.synchronize()
    except Exception:  # noqa: BLE001 - any failure here means the context cannot be used
        return True
    return False


class ItemRunner:
    """The child's side: runs items in order, skipping the first ``skip``, and writes the events."""

    def __init__(self, path: str, skip: int, skip_groups: frozenset = frozenset()) -> None:
        self._file = open(path, "a", buffering=1)  # noqa: SIM115 - line-buffered for the whole part
        self.skip = skip
        self.skip_groups = skip_groups  # groups that lost the device in an earlier process of this part

    def _write(self, event: dict) -> None:
        self._file.write(json.dumps(event) + "\n")
        self._file.flush()
        os.fsync(self._file.fileno())

    def run(self, items: Iterable, fn: Callable, what: Callable = str, group: Callable | None = None) -> None:
        """``fn(item)`` returns a list of JSON rows; ``what(item)`` names it in errors; ``group(item)``
        (a string) names the items skipped together after one of them lost the device."""
        for i, item in enumerate(items):
            if i < self.skip:
                continue
            name = group(item) if group is not None else None
            if name is not None and name in self.skip_groups:
                self._write({"end": i, "skipped": name})
                continue
            self._write({"start": i, "what": what(item), **({"group": name} if name is not None else {})})
            try:
                rows = fn(item)
            except Exception as err:  # noqa: BLE001 - the item's error, reported in the table
                print(f"[{what(item)}] {traceback.format_exc()}", file=sys.stderr, flush=True)
                self._write({"end": i, "error": f"{type(err).__name__}: {first_line(err)}"})
                if device_lost():
                    sys.exit(LOST_DEVICE_EXIT)
            else:
                self._write({"end": i, "rows": rows})


def first_line(err: BaseException) -> str:
    return (str(err).splitlines() or [""])[0][:240]


def child_main(argv=None) -> int:
    p = argparse.ArgumentParser(description="one part of a GPU check (started by run_parts)")
    p.add_argument("--function", required=True)
    p.add_argument("--kwargs", default="{}")
    p.add_argument("--rows", required=True)
    p.add_argument("--skip", type=int, default=0)
    p.add_argument("--skip-groups", default="[]", help="JSON list of item groups to skip")
    args = p.parse_args(argv)
    module, _, name = args.function.partition(":")
    fn = getattr(importlib.import_module(module), name)
    fn(ItemRunner(args.rows, args.skip, frozenset(json.loads(args.skip_groups))), **json.loads(args.kwargs))
    return 0


# --- parent side --------------------------------------------------------------------------

@dataclass
class Events:
    """What a rows file says: the rows, the errors, the item started and not ended, the last item
    seen (-1: none), and each started item's group."""

    rows: list
    errors: list
    unfinished: int | None
    last: int
    groups: dict


def read_events(path: Path) -> Events:
    """The :class:`Events` of a rows file; a torn last line is ignored. Items skipped with their
    group are one error per group."""
    rows, errors, started, last, groups, skipped = [], [], {}, -1, {}, {}
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            event = json.loads(line)
        except json.JSONDecodeError:
            continue
        last = max(last, event.get("start", event.get("end", -1)))
        if "start" in event:
            started[event["start"]] = event["what"]
            if "group" in event:
                groups[event["start"]] = event["group"]
        elif "skipped" in event:
            skipped[event["skipped"]] = skipped.get(event["skipped"], 0) + 1
        elif "error" in event:
            errors.append(f"{started.pop(event['end'], '?')}: {event['error']}")
        else:
            started.pop(event["end"], None)
            rows += event["rows"]
    errors += [f"{g}: {n} more items skipped: an earlier one lost the device" for g, n in skipped.items()]
    return Events(rows, errors, max(started) if started else None, last, groups)


def _start(part: Part, kwargs: dict, rows: Path, skip: int, log, skip_groups=()) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               PYTHONUNBUFFERED="1", **part.env)
    cmd = [sys.executable, "-m", "benchmarks.gpu.check_parts", "--function", part.function,
           "--kwargs", json.dumps(kwargs), "--rows", str(rows), "--skip", str(skip),
           "--skip-groups", json.dumps(sorted(skip_groups))]
    return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # the part's own process group (start_new_session)
    except ProcessLookupError:
        pass
    proc.wait()


def run_part(part: Part, kwargs: dict, log_path: Path, deadline: float) -> PartResult:
    """Runs ``part`` until it ends, its timeout passes or ``deadline`` (``time.monotonic``) comes."""
    result, start, timed_out = PartResult(part.name), time.monotonic(), False
    end = min(start + part.timeout_s, deadline)
    with tempfile.TemporaryDirectory() as tmp, open(log_path, "a") as log:
        rows_path, skip, lost = Path(tmp) / "rows.jsonl", 0, set()
        for _ in range(MAX_RESTARTS + 1):
            if time.monotonic() >= end:
                break
            log.write(f"\n=== part {part.name} (skip {skip}) ===\n")
            log.flush()
            proc = _start(part, kwargs, rows_path, skip, log, lost)
            try:
                rc = proc.wait(timeout=max(end - time.monotonic(), 0.1))
            except subprocess.TimeoutExpired:
                _kill(proc)
                rc, timed_out = None, True
            events = read_events(rows_path)
            result.rows, result.errors, unfinished, last = events.rows, events.errors, events.unfinished, events.last
            if rc == 0:
                break
            why = "timed out" if rc is None else f"the process died (exit {rc})"
            if rc is not None:  # a death: the rest of the dead item's group is skipped from now on
                dead = events.groups.get(unfinished if unfinished is not None else last)
                lost |= {dead} if dead is not None else set()
            if unfinished is not None:  # the item it was in: its error
                rows_path.write_text(rows_path.read_text() + json.dumps({"end": unfinished, "error": why}) + "\n")
                events = read_events(rows_path)
                result.rows, result.errors = events.rows, events.errors
            elif rc != LOST_DEVICE_EXIT:  # before the first item, or after an item ended
                result.errors.append(f"{part.name}: {why} " + (f"after item {last}" if last >= 0 else "before an item"))
            if rc is None or last < skip:  # out of time, or it died before reaching an item: no retry
                break
            skip = last + 1  # a fresh process, with a fresh CUDA context, from the next item
    result.seconds = time.monotonic() - start
    result.status = "timeout" if timed_out else ("errors" if result.errors else "ok")
    return result


def run_parts(parts: list[Part], log_path: Path, budget_s: float, after_each: Callable[[dict], None]) -> dict:
    """Runs every part in order within ``budget_s`` in all; calls ``after_each(results)`` after
    each (to write the tables); parts the budget leaves no time for are ``not run``."""
    deadline = time.monotonic() + budget_s
    results = {p.name: PartResult(p.name) for p in parts}
    for part in parts:
        if time.monotonic() >= deadline:
            results[part.name].errors.append(f"{part.name}: not run, the session's time ({budget_s:.0f} s) was spent")
        else:
            print(f"[parts] {part.name} (at most {min(part.timeout_s, deadline - time.monotonic()):.0f} s)", flush=True)
            kwargs = part.kwargs(results) if callable(part.kwargs) else part.kwargs
            results[part.name] = run_part(part, kwargs, log_path, deadline)
            r = results[part.name]
            print(f"[parts] {part.name}: {r.status}, {len(r.rows)} rows, {len(r.errors)} errors, "
                  f"{r.seconds:.1f} s", flush=True)
            for e in r.errors[:5]:
                print(f"[parts]   {e}", flush=True)
        after_each(results)
    return results


if __name__ == "__main__":
    sys.exit(child_main())
