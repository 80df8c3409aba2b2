import os
import sys

# Tests import helpers as ``tests.<module>``; make the repository root importable.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The whole suite runs in NCCL-rules mode (megatron_startrail/nccl_rules.py): gloo then
# obeys and is checked against what NCCL requires. STARTRAIL_CHECK_NCCL_RULES=0 turns it off.
os.environ.setdefault("STARTRAIL_CHECK_NCCL_RULES", "1")


def pytest_ignore_collect(collection_path, config):
    """tests/bridge runs in a pytest process of its own (tests/test_bridge.py): importing
    Megatron-Bridge imports megatron-core modules while Transformer Engine's stand-ins are in
    place, and those modules keep "TE is here" for the life of the process, which every later
    forked test would inherit. Collected here only when asked for by path. The modules of
    tests/early.py's APART run in a pytest process of their own too (tests/test_apart.py) where the
    session collects that file."""
    from tests import early  # noqa: PLC0415

    if early.runs_apart(str(collection_path), config.args):
        return True
    bridge = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bridge")
    if str(collection_path) != bridge:
        return None
    asked = any(os.path.abspath(str(arg).split("::")[0]).startswith(bridge) for arg in config.args)
    return None if asked else True


def pytest_collection_modifyitems(session, config, items):
    """tests/test_apart.py's tests last: they read runs started with the session (tests/early.py),
    which have had the whole session's idle time by then."""
    items.sort(key=lambda item: item.path.name == "test_apart.py")  # stable: the rest keep their order


def pytest_collection_finish(session):
    """Start the subprocesses that selected tests will read (tests/early.py), now, so that they
    run while the tests before theirs leave a core idle."""
    from tests import early  # noqa: PLC0415

    if session.config.option.collectonly:
        return
    early.start_selected([(str(item.path.resolve()), getattr(item, "originalname", item.name))
                          for item in session.items])


def pytest_sessionfinish(session, exitstatus):
    from tests import early  # noqa: PLC0415

    early.stop_all()
