"""tests/early.py: a recipe starts only for a selected test that reads it, a test run alone
starts it at its first read, and the session's end kills what is still running."""

import sys
from pathlib import Path

from tests import early


def test_recipes_start_for_their_selected_tests_and_stop_at_the_end(monkeypatch):
    monkeypatch.setattr(early, "_RECIPES", {})
    monkeypatch.setattr(early, "_STARTED", {})
    monkeypatch.setattr(early, "_DIRECTORY", [])
    here = str(Path(__file__).resolve())

    def sleeper(directory):
        return {"a": early.Process([sys.executable, "-c", "import time; time.sleep(60)"], {}, directory)}

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
    assert running.proc.poll() is None and directory.exists()
    early.stop_all()
    assert running.proc.poll() is not None and not directory.exists() and early._STARTED == {}
