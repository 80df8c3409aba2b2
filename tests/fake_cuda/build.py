"""Builds ``shim.cpp`` into ``libfakecuda.so`` against the installed torch (parent side).

A C++ compiler and torch's headers are all it takes (about 2 s); where either is missing,
:func:`why_not_buildable` says which, and the rehearsal tests skip with that reason.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("shim.cpp")


def _torch_dir() -> Path:
    return Path(torch.__file__).parent


def compiler() -> str | None:
    return os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++")


def why_not_buildable() -> str | None:
    """None when the shim can be built here, else why not (a skip reason)."""
    if compiler() is None:
        return "no C++ compiler (c++, g++ or $CXX) to build tests/fake_cuda/shim.cpp"
    if not (_torch_dir() / "include" / "ATen" / "detail" / "CUDAHooksInterface.h").exists():
        return f"torch {torch.__version__} ships no C++ headers (include/ATen) to build the fake-CUDA shim against"
    if torch.cuda.is_available():
        return "a real GPU is present: the rehearsal is for CPU builds (run the device checks instead)"
    return None


# Built once per process: the suite's three users (the rehearsal, the Megatron step, the memory
# model's GPU-scale check) each ask with their own directory; the first build serves them all.
_BUILT: dict[str, Path] = {}


def build_shim(out_dir: Path) -> Path:
    """``libfakecuda.so`` in ``out_dir`` (rebuilt when the source or torch changes), or the
    one this process built already."""
    tag = hashlib.sha1(SOURCE.read_bytes() + torch.__version__.encode()).hexdigest()[:12]
    if tag in _BUILT and _BUILT[tag].exists():
        return _BUILT[tag]
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    lib = Path(out_dir) / f"libfakecuda-{tag}.so"
    if lib.exists():
        return lib
    torch_lib = _torch_dir() / "lib"
    cmd = [compiler(), "-shared", "-fPIC", "-O1", "-std=c++20", "-w", f"-I{_torch_dir() / 'include'}",
           str(SOURCE), "-o", str(lib), f"-L{torch_lib}", "-Wl,--no-as-needed", "-lc10", "-ltorch_cpu",
           f"-Wl,-rpath,{torch_lib}"]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"building the fake-CUDA shim failed ({' '.join(cmd)}):\n{done.stderr[-4000:]}")
    _BUILT[tag] = lib
    return lib
