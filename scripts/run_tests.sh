#!/usr/bin/env bash
# The test command: installs what it needs into .venv (first run only), then runs pytest.
# Extra arguments go to pytest, e.g. `bash scripts/run_tests.sh -k topology`.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/env.sh"
cd "$ROOT"
exec python -m pytest "$@"
