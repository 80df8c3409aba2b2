"""Subprocesses that a test reads, started when the pytest session starts.

Why: a CI run of the suite on 2 cores kept 1.6 of them busy on average (user + sys 2505 s over
1557 s of wall time on 16bc3e0): single-process tests and the ranks' start-ups leave a core
idle. Some tests wait on long subprocesses of their own, which used to start at the test's
turn: the fake-CUDA rehearsal's four children (~110 s of wall time, both cores), the GPU
session's and the GPU kit's CPU self-checks (~45 s and ~20 s, one core), the memory model's
fake-CUDA run (~16 s). Started at the start of the session at the lowest CPU priority
(:data:`NICE`), they run in that idle time, and the test reads what they wrote when its turn
comes.

A test module registers its start function with :func:`recipe`; ``tests/conftest.py`` calls
:func:`start_selected` once collection is done, which starts the recipes that a selected test
reads (so ``pytest -k something_else`` starts nothing), and :func:`stop_all` at the end of the
session. A test's first call to :func:`started` starts its run where the session has not
(the same run, only later).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import tempfile
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]


# The lowest CPU priority: a started run takes only the CPU that the running tests leave idle.
# So a run started here must hold no wall-clock limit of its own that its test does not set:
# while the tests keep both cores busy it may get ~1.5% of one for minutes (CFS weight 15 against
# 1024). Multi-rank gloo runs (their peers' 60 s timeouts) are started here only with those limits
# lifted (APART_ENV below); the GPU kit's and session's self-checks give a part 1200 s (benchmarks/gpu/check.py).
# (At the default priority, a CI run that started them with the session took 7% more CPU and
# 1.9 minutes more wall time: the tests at the start of the suite keep both cores busy, and
# tests/megatron/test_compile_megatron.py's 2-rank worlds ran 3x slower beside four children.)
NICE = ["nice", "-n", "19"] if shutil.which("nice") else []


class Process:
    """One subprocess with its output in ``directory/log.txt`` (a pipe left unread would stall
    it), at the lowest CPU priority."""

    def __init__(self, argv: list[str], env: dict, directory: Path):
        directory.mkdir(parents=True, exist_ok=True)
        self.directory = directory
        self.log = open(directory / "log.txt", "w+")
        # A process group of its own, so that stop() also ends what it started (the GPU session's
        # script runs each part as a child). Not a session of its own (start_new_session): with
        # the kernel's autogroups that would be a scheduling group of its own, and the nice value
        # would no longer rank it below the tests.
        self.proc = subprocess.Popen([*NICE, *argv], cwd=ROOT, env=env, stdout=self.log, stderr=subprocess.STDOUT,
                                     text=True, process_group=0)

    def finish(self, timeout: float) -> tuple[int, str]:
        """Its exit code and everything it printed, once it has ended."""
        code = self.proc.wait(timeout=timeout)
        self.log.seek(0)
        return code, self.log.read()

    def stop(self) -> None:
        if self.proc.poll() is None:  # its test failed (or the session was stopped) before reading it
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        self.log.close()


# Test modules run apart (tests/test_apart.py): each in a pytest process of its own, started with
# the session like the runs above, read by a test that the session puts last. For multi-rank modules
# whose worlds keep both cores busy at their turn: run apart, at nice 19, their ranks work in the
# time the other tests leave idle, with their wall-clock limits lifted (APART_ENV: a starved rank may
# wait minutes for a peer). tests/conftest.py then leaves them out of the session's own collection.
APART = {"test_compile_megatron": "tests/megatron/test_compile_megatron.py"}  # by the module's name: -k finds it
APART_ENV = {"STARTRAIL_TEST_PG_TIMEOUT": "3600", "STARTRAIL_TEST_TIMEOUT_SCALE": "10"}


def runs_apart(path: str | Path, args: list[str]) -> bool:
    """Whether the test module at ``path`` is one of :data:`APART` and this session runs it apart:
    it collects tests/test_apart.py (the whole suite, or that file), not the module by its own path."""
    path = Path(path).resolve()
    if path not in {(ROOT / module).resolve() for module in APART.values()}:
        return False
    tests = ROOT / "tests"
    asked = [Path(str(arg).split("::")[0]).resolve() for arg in args]
    if any(a == path or (a in path.parents and tests in a.parents) for a in asked):
        return False  # asked for by its path, or by a folder of it below tests/: collected as it is
    return any(a in (ROOT, tests, tests / "test_apart.py") for a in asked)


# name -> (the test module's file, the names of the tests that read it (None: every test of the
# module), start(directory) -> what the tests read: Process objects in any structure)
_RECIPES: dict[str, tuple[str, tuple[str, ...] | None, Callable[[Path], Any]]] = {}
_STARTED: dict[str, Any] = {}
_DIRECTORY: list[Path] = []


def recipe(name: str, module_file: str, tests: tuple[str, ...] | None = None):
    """Register ``start(directory)`` under ``name`` (a directory's name: no spaces, which would
    split an ``LD_PRELOAD`` path) for the tests ``tests`` (function names; None: all) of the
    test module ``module_file``."""
    def register(start: Callable[[Path], Any]):
        _RECIPES[name] = (str(Path(module_file).resolve()), tests, start)
        return start
    return register


def _directory() -> Path:
    if not _DIRECTORY:
        _DIRECTORY.append(Path(tempfile.mkdtemp(prefix="startrail_early_")))
    return _DIRECTORY[0]


def started(name: str) -> Any:
    """What ``name``'s start function returned: started at the session's start, or now."""
    if name not in _STARTED:
        _STARTED[name] = _RECIPES[name][2](_directory() / name)
    return _STARTED[name]


def start_selected(selected: list[tuple[str, str]]) -> list[str]:
    """Start every recipe that a selected test reads (``selected``: (module file, test function
    name) per test); the names started."""
    names = [name for name, (module, tests, _) in _RECIPES.items() if name not in _STARTED and
             any(file == module and (tests is None or test in tests) for file, test in selected)]
    for name in names:
        started(name)
    return names


def _processes(value: Any):
    if isinstance(value, Process):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _processes(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _processes(item)


def stop_all() -> None:
    for value in _STARTED.values():
        for process in _processes(value):
            process.stop()
    _STARTED.clear()
    for directory in _DIRECTORY:
        shutil.rmtree(directory, ignore_errors=True)
    _DIRECTORY.clear()
