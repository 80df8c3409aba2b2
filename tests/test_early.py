"""tests/early.py: a recipe starts only for a selected test that reads it, a test run alone
starts it at its first read, and the session's end kills what is still running."""

import os
import sys
import time
from pathlib import Path

from tests import early


def test_recipes_start_for_their_selected_tests_and_stop_at_the_end(monkeypatch):
    monkeypatch.setattr(early, "_RECIPES", {})
    monkeypatch.setattr(early, "_STARTED", {})
    monkeypatch.setattr(early, "_DIRECTORY", [])
    here = str(Path(__file__).resolve())

    def sleeper(directory):  # a shell whose child sleeps: stop() ends both
        return {"a": early.Process(["sh", "-c", f"sleep 60 & echo $! > {directory}/child.pid; wait"], dict(os.environ),
                                   directory)}

    early.recipe("sleeper", __file__, tests=("test_reads_it",))(sleeper)
    early.recipe("printer", __file__)(
        lambda directory: early.Process([sys.executable, "-c", "print('done')"], {}, directory))
    assert early.start_selected([(here, "test_other")]) == ["printer"]  # every test of the module reads it
    assert early.start_selected([("/elsewhere/test_x.py", "test_reads_it")]) == []
    assert early.start_selected([(here, "test_reads_it")]) == ["sleeper"]
    assert early.start_selected([(here, "test_reads_it")]) == []  # started once
    code, log = early.started("printer").finish(timeout=60)
    assert (code, log) == (0, "done\n")
    running = early.started("sleeper")["a"]
    directory = early._DIRECTORY[0]
    for _ in range(100):
        if (running.directory / "child.pid").exists() and (running.directory / "child.pid").read_text().strip():
            break
        time.sleep(0.05)
    child = int((running.directory / "child.pid").read_text())
    assert running.proc.poll() is None and directory.exists() and _alive(child)
    assert os.getpriority(os.PRIO_PROCESS, child) == 19 if early.NICE else True
    early.stop_all()
    assert running.proc.poll() is not None and not directory.exists() and early._STARTED == {}
    for _ in range(100):
        if not _alive(child):
            break
        time.sleep(0.05)
    assert not _alive(child)


def _alive(pid: int) -> bool:
    """``pid`` runs (not ended, and not a zombie waiting for its parent)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_an_apart_module_runs_apart_only_where_the_session_collects_test_apart():
    module = early.ROOT / "tests/megatron/test_compile_megatron.py"
    assert str(module.relative_to(early.ROOT)) in early.APART.values()
    for args, apart in (([str(early.ROOT / "tests")], True), ([str(early.ROOT)], True),
                        ([str(early.ROOT / "tests/test_apart.py")], True),
                        ([str(module)], False), ([f"{module}::test_compiled_megatron_modules_equal_eager"], False),
                        ([str(early.ROOT / "tests/megatron")], False), ([str(early.ROOT / "tests/test_early.py")], False)):
        assert early.runs_apart(module, args) == apart, args
    assert not early.runs_apart(early.ROOT / "tests/megatron/test_mtp.py", [str(early.ROOT / "tests")])
