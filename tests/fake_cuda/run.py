"""Start a process under fake CUDA (parent side): the shim preloaded, the package on the path.

``run_fake_cuda(shim, "tests.fake_cuda.matrix", "--json", path)`` runs ``python -m`` that module
with ``LD_PRELOAD`` set, so torch registers the shim's CUDA device guard and hooks before it
asks for them (it asks once per process: a shim loaded after ``import torch`` comes too late).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _env(shim: Path) -> dict:
    env = dict(os.environ, LD_PRELOAD=str(shim), PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]))
    env.pop("CUDA_VISIBLE_DEVICES", None)
    return env


def run_fake_cuda(shim: Path, module: str, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], cwd=ROOT, env=_env(shim), capture_output=True,
                          text=True, timeout=timeout)


def start_fake_cuda(shim: Path, module: str, *args: str, log) -> subprocess.Popen:
    """The same, started and not waited for (children side by side on the machine's cores);
    stdout and stderr go to the open file ``log`` (a pipe left unread would stall the child)."""
    return subprocess.Popen([sys.executable, "-m", module, *args], cwd=ROOT, env=_env(shim), stdout=log,
                            stderr=subprocess.STDOUT, text=True)
