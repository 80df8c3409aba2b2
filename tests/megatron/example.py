"""examples/pretrain_gpt.py as a module, and one rank of it run inside a forked test rank.

Imported in the pytest process (after the CPU import shims) so that forked ranks inherit
the example and megatron.training instead of importing them again.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import os

from tests.megatron.utils import cpu_patches  # noqa: F401  (import shims before megatron.training)
from megatron.training import argument_utils, arguments  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Megatron's parser reads each config dataclass's field docstrings from its source
# (inspect.getsource + ast.parse) every time it is built: about a third of a small example
# rank's CPU, two parses per rank. The docstrings depend on the class only: cached, and
# filled here once, so that every forked rank inherits them. (Test harness only; the
# parser it builds is the same.)
_read_field_docstrings = argument_utils.ArgumentGroupFactory._get_field_docstrings
_field_docstrings: dict[type, dict[str, str]] = {}


def _cached_field_docstrings(factory, cls: type) -> dict[str, str]:
    if cls not in _field_docstrings:
        _field_docstrings[cls] = _read_field_docstrings(factory, cls)
    return dict(_field_docstrings[cls])


argument_utils.ArgumentGroupFactory._get_field_docstrings = _cached_field_docstrings
arguments.add_megatron_arguments(argparse.ArgumentParser())

# Megatron builds its tokenizer (NullTokenizer here) through megatron.core.tokenizers.text, whose
# package imports every tokenizer library it wraps: with `transformers` installed (Megatron-Bridge's
# tests need it) that is ~1,000 modules, 3-7 s of CPU in every forked rank of every run, the
# largest item of an 8-rank example run's profile. Imported once here, inherited by the forks.
import megatron.core.tokenizers.text  # noqa: E402,F401

_spec = importlib.util.spec_from_file_location("pretrain_gpt", os.path.join(ROOT, "examples", "pretrain_gpt.py"))
pretrain_gpt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pretrain_gpt)


def run_example_rank(rank: int, world_size: int, argv: list[str]) -> str:
    """Run the example as rank ``rank`` of ``world_size`` (in an initialized gloo world);
    return what it printed (Megatron's log lines). A run that Megatron ends with
    ``sys.exit(0)`` (``--exit-interval``, after saving) counts as finished."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world_size))
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            pretrain_gpt.main(argv)
    except SystemExit as e:
        if e.code not in (0, None):
            raise
    return out.getvalue()
