"""Child processes that a test file only reads, started when the session starts.

A test file that defines ``start_children(tmp_path_factory, nice)`` returning ``{name: Child}``
has it called by ``early_children`` (tests/conftest.py) at the session's start, when any of its
tests is to run; its fixtures take them from there and :meth:`Child.wait` for them. Started at
nice 19, the children run on what the rest of the suite leaves idle of CI's two cores
(one-process tests, single-threaded subprocesses, ranks waiting on each other); by the time the
suite reaches the file, they are usually done, and the file's wait is short.

Only for children without wall-clock limits of their own: a niced child may wait long for a
core while the suite is busy (the GPU kits' self-checks, whose parts have time limits, stay in
their tests).
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _process_tree(pid: int) -> list[int]:
    """The threads of ``pid`` and of its descendants (Linux: /proc/<pid>/task/<tid>/children)."""
    tids, todo = [], [pid]
    while todo:
        pid = todo.pop()
        try:
            for task in Path(f"/proc/{pid}/task").iterdir():
                tids.append(int(task.name))
                todo += [int(c) for c in (task / "children").read_text().split()]
        except OSError:  # ended meanwhile, or no /proc
            tids.append(pid)
    return tids


class Child:
    """``argv`` started now in ``cwd`` with ``env``; its stdout and stderr go to ``log.txt`` in
    ``directory`` (where it is told to write its results). :meth:`wait` returns ``directory``
    once it exited 0 and fails with its log's tail otherwise."""

    def __init__(self, argv: list[str], directory: Path, *, env: dict | None = None, nice: int = 0,
                 cwd: Path = ROOT):
        self.directory = Path(directory)
        self.log = open(self.directory / "log.txt", "w+")  # noqa: SIM115 - open for the child's life
        self.proc = subprocess.Popen(argv, cwd=cwd, env=env, stdout=self.log, stderr=subprocess.STDOUT, text=True,
                                     preexec_fn=(lambda: os.nice(nice)) if nice else None)

    def hurry(self) -> None:
        """Back to normal priority, every thread of it and of its children (Linux's niceness is
        per thread, and threads and processes inherit it): called once the suite reaches the file
        that reads it, which stands still until it ends. Only root may lower a niceness; elsewhere
        it keeps nice 19 (on CI nothing else then competes for the cores)."""
        for tid in _process_tree(self.proc.pid):
            try:
                os.setpriority(os.PRIO_PROCESS, tid, 0)
            except (PermissionError, ProcessLookupError):
                pass

    def wait(self, timeout: float = 900) -> Path:
        self.hurry()
        code = self.proc.wait(timeout=timeout)
        self.log.seek(0)
        assert code == 0, self.log.read()[-6000:]
        return self.directory

    def stop(self) -> None:
        if self.proc.poll() is None:  # a test failed (or was deselected) before reading it
            self.proc.kill()
            self.proc.wait()
        self.log.close()
