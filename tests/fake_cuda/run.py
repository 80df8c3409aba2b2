"""Start a process under fake CUDA (parent side): the shim preloaded, the package on the path.

``run_fake_cuda(shim, "tests.fake_cuda.matrix", "--json", path)`` runs ``python -m`` that module
with ``LD_PRELOAD`` set, so torch registers the shim's CUDA device guard and hooks before it
asks for them (it asks once per process: a shim loaded after ``import torch`` comes too late).
The rehearsal starts its children itself (``tests/early.py``) with :func:`fake_cuda_command`
under :func:`fake_cuda_env`.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def fake_cuda_env(shim: Path) -> dict:
    """This process's environment with the shim preloaded and the package on the path."""
    env = dict(os.environ, LD_PRELOAD=str(shim), PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


def fake_cuda_command(module: str, *args: str) -> list[str]:
    """``python -m module args`` (this interpreter), to run under :func:`fake_cuda_env` from ROOT."""
    return [sys.executable, "-m", module, *args]


def run_fake_cuda(shim: Path, module: str, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run(fake_cuda_command(module, *args), cwd=ROOT, env=fake_cuda_env(shim),
                          capture_output=True, text=True, timeout=timeout)
