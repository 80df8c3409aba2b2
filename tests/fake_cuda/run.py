"""Start a process under fake CUDA (parent side): the shim preloaded, the package on the path.

``run_fake_cuda(shim, "tests.fake_cuda.matrix", "--json", path)`` runs ``python -m`` that module
with ``LD_PRELOAD`` set, so torch registers the shim's CUDA device guard and hooks before it
asks for them (it asks once per process: a shim loaded after ``import torch`` comes too late).
:func:`fake_cuda_child` starts one and does not wait (tests/children.py: started with the session).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.children import Child

ROOT = Path(__file__).resolve().parents[2]


def _env(shim: Path) -> dict:
    env = dict(os.environ, LD_PRELOAD=str(shim), PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


def run_fake_cuda(shim: Path, module: str, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=_env(shim), capture_output=True,
                          text=True, timeout=timeout)


def fake_cuda_child(shim: Path, directory: Path, module: str, *args: str, nice: int = 0) -> Child:
    """``python -m module *args`` under fake CUDA, started and not waited for (a
    :class:`tests.children.Child`: its output in ``directory``/log.txt)."""
    return Child([sys.executable, "-m", module, *args], directory, env=_env(shim), nice=nice)
