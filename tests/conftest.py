import os
import sys

import pytest

# Tests import helpers as ``tests.<module>``; make the repository root importable.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The whole suite runs in NCCL-rules mode (megatron_startrail/nccl_rules.py): gloo then
# obeys and is checked against what NCCL requires. STARTRAIL_CHECK_NCCL_RULES=0 turns it off.
os.environ.setdefault("STARTRAIL_CHECK_NCCL_RULES", "1")


def pytest_ignore_collect(collection_path, config):
    """tests/bridge runs in a pytest process of its own (tests/test_bridge.py): importing
    Megatron-Bridge imports megatron-core modules while Transformer Engine's stand-ins are in
    place, and those modules keep "TE is here" for the life of the process, which every later
    forked test would inherit. Collected here only when asked for by path."""
    bridge = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bridge")
    if str(collection_path) != bridge:
        return None
    asked = any(os.path.abspath(str(arg).split("::")[0]).startswith(bridge) for arg in config.args)
    return None if asked else True


@pytest.fixture(scope="session", autouse=True)
def early_children(request, tmp_path_factory):
    """``{module name: what its start_children returned}`` for each test file collected for this
    session that defines ``start_children(tmp_path_factory, nice)``, called now, at the session's
    start, with nice 19 (tests/children.py): its long children run beside the rest of the suite
    (the fake-CUDA rehearsal's took 224 s of a 2-core run's wall time while the suite waited).
    A file run alone, or a -k choice, starts only what its chosen tests read. A value is
    ``{name: Child}``, or None where the children cannot run here (the file's fixture skips
    and says why); every child still running at the session's end is stopped."""
    modules = {item.module for item in request.session.items
               if hasattr(getattr(item, "module", None), "start_children")}
    started = {m.__name__: m.start_children(tmp_path_factory, nice=19)
               for m in sorted(modules, key=lambda m: m.__name__)}
    yield started
    for children in started.values():
        for child in (children or {}).values():
            child.stop()
