#!/usr/bin/env bash
# The test command: installs what it needs into .venv (first run only), then runs pytest.
# Extra arguments go to pytest, e.g. `bash scripts/run_tests.sh -k topology`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/env.sh"
cd "$ROOT"
# The suite starts Python processes of its own (the rehearsal's and the GPU scripts' children,
# the modules run apart, the documented commands, the emulated cluster's ranks); with
# PYTHONDONTWRITEBYTECODE (set on these machines) each compiles the package and its test modules
# from source again, and pytest rewrites every test module's asserts again (measured: collecting
# tests/ took 13.5 CPU-s without the cached bytecode, __pycache__ (git-ignored), 10.0 with it).
unset PYTHONDONTWRITEBYTECODE
exec python -m pytest "$@"
