#!/usr/bin/env bash
# README's "megatron-core 0.16.1: core attention, groups and GPT", checked: a venv of its own
# (torch 2.13.0 CPU, megatron-core 0.16.1, the light dependencies, this package editable),
# then the tests of what 0.16.1 supports. MLA and HybridModel need megatron-core >= 0.19
# (refused with a message naming it: megatron_startrail/megatron/versions.py), and 0.16.1's
# wheel has no megatron.training (parse_args, pretrain, examples/pretrain_gpt.py).
#   bash scripts/check_megatron_016.sh [extra pytest arguments]
# The venv is made once at $VENV016 (default /tmp/venv016) and reused.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV016:-/tmp/venv016}"
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
STAMP="$VENV/.startrail-megatron016-v1"
if [ ! -f "$STAMP" ]; then
  echo "[check_megatron_016] creating $VENV with $($PYTHON --version 2>&1)"
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
  "$VENV/bin/pip" install -q "torch==2.13.0"
  "$VENV/bin/pip" install -q --no-deps --ignore-requires-python "megatron-core==0.16.1"
  "$VENV/bin/pip" install -q numpy "packaging>=24.2" einops typing_extensions pytest pytest-timeout psutil
  "$VENV/bin/pip" install -q --no-deps -e "$ROOT"
  touch "$STAMP"
fi
"$VENV/bin/python" -c "import megatron.core.package_info as p; assert p.__version__.startswith('0.16.'), p.__version__"
cd "$ROOT"
exec "$VENV/bin/python" -m pytest -q -p no:warnings \
  tests/megatron/test_megatron_core_versions.py \
  tests/megatron/test_core_attention.py \
  tests/megatron/test_parallel_state.py \
  tests/megatron/test_cpu_patches.py \
  tests/megatron/test_gpt_startrail.py "$@"
