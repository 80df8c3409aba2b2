"""Tests of megatron_startrail.bridge with Megatron-Bridge itself (installed by scripts/env.sh)."""

import importlib.util
import os

import pytest


def require_bridge() -> None:
    """Skip the calling test module where Megatron-Bridge is not installed (a venv that
    scripts/env.sh has not updated, or another megatron-core's venv); in CI, where env.sh
    always installs it, its absence is an error."""
    if importlib.util.find_spec("megatron.bridge") is not None:
        return
    if os.environ.get("CI"):
        raise RuntimeError("megatron-bridge is not installed: scripts/env.sh installs it (its Bridge step)")
    pytest.skip("megatron-bridge is not installed: `source scripts/env.sh` installs it", allow_module_level=True)
