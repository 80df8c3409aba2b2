"""The test modules of tests/early.py's ``APART``, each in a pytest process of its own.

Why (issue 56): tests/megatron/test_compile_megatron.py's worlds (2 and 4 ranks of dynamo tracing)
keep both of CI's 2 cores busy for ~100 s at their turn, while the suite as a whole leaves a
fifth of its CPU time idle (single-process tests, rank start-ups). Started with the session at
nice 19 (tests/early.py), such a module's own pytest runs in that idle time; its wall-clock limits
are lifted there (``early.APART_ENV``: the process groups' timeout and ``run_ranks``' deadlines,
since a starved rank may wait minutes for its peer, and pytest-timeout's limit). This test, which
tests/conftest.py puts last in the session, reads how it ended: every test of the module passed.

A module asked for by its own path (``pytest tests/megatron/test_compile_megatron.py``) runs in the
session as before, and so does every module when this file is not collected.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from tests import early


def _start(module: str):
    def start(directory):
        env = dict(os.environ, **early.APART_ENV)
        return early.Process([sys.executable, "-m", "pytest", module, "-q", "-rs", "--timeout", "7200",
                              "-p", "no:warnings"], env, directory)
    return start


for _name, _module in early.APART.items():
    early.recipe(_name, __file__)(_start(_module))


# How long this test waits for a run still going at its turn, when the machine is the run's alone
# (the module takes ~100 s of both cores): below pytest.ini's limit, so that a hang ends here with
# the run's output so far; the session's end then kills it (early.stop_all).
WAIT_S = 540


@pytest.mark.parametrize("name", list(early.APART))
def test_the_module_passes_in_a_process_of_its_own(name):
    process = early.started(name)
    try:
        code, out = process.finish(timeout=WAIT_S)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{early.APART[name]} still running {WAIT_S} s after its turn (a hang?); its output so far:\n"
                    + (process.directory / "log.txt").read_text()[-6000:])
    lines = out.strip().splitlines()
    summary = lines[-1] if lines else ""  # pytest's "N passed in ..." line
    print(f"{early.APART[name]}: {summary}")
    assert code == 0 and re.search(r"\b\d+ passed\b", summary), out[-6000:]
    assert not re.search(r"\b(failed|error|errors|skipped)\b", summary), out[-6000:]
