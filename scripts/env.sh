#!/usr/bin/env bash
# Create (once) and activate the project's virtual environment in .venv.
#
# Sourced by scripts/run_tests.sh and scripts/run_main_job.sh so that each of them
# works on a fresh machine by itself. Pins:
#   torch==2.13.0          the CPU build pip finds locally (any other pin downloads a CUDA build)
#   megatron-core==0.19.2  its wheel says Python>=3.12 but runs on 3.11; installed with
#                          --no-deps so pip does not try a numpy source build, plus the
#                          light dependencies it really needs (psutil: Megatron's
#                          checkpoint writer).
#   megatron-bridge==0.6.2 (tests/bridge, docs/bridge.md): a second step with a stamp of its own,
#                          so venvs made before it get it too; see below.
# Transformer Engine / flash-attn / apex are GPU-only extras and are never installed here.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${STARTRAIL_VENV:-$ROOT/.venv}"
# Another megatron-core for a venv of its own (scripts/check_megatron_016.sh: 0.16.1).
MCORE="${STARTRAIL_MEGATRON_CORE:-0.19.2}"
PYTHON="${PYTHON:-python3.11}"
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
STAMP="$VENV/.startrail-env-v1"
[ "$MCORE" = "0.19.2" ] || STAMP="$VENV/.startrail-env-v1-mcore-$MCORE"

if [ ! -f "$STAMP" ]; then
  echo "[env] creating $VENV with $($PYTHON --version 2>&1)"
  "$PYTHON" -m venv "$VENV"
  "$VENV/bin/pip" install -q --upgrade pip
  "$VENV/bin/pip" install -q "torch==2.13.0"
  "$VENV/bin/pip" install -q --no-deps --ignore-requires-python "megatron-core==$MCORE"
  "$VENV/bin/pip" install -q numpy "packaging>=24.2" einops typing_extensions \
      pytest pytest-timeout matplotlib psutil
  "$VENV/bin/pip" install -q --no-deps -e "$ROOT"
  touch "$STAMP"
fi
# Megatron's torch_dist checkpoint writer (--save) needs psutil; venvs made before it was listed lack it.
"$VENV/bin/python" -c "import psutil" 2>/dev/null || "$VENV/bin/pip" install -q psutil
# Megatron-Bridge 0.6.2 for tests/bridge. Its wheel asks for Python >= 3.12 (it runs on 3.11)
# and lists megatron-core unpinned plus ~30 GPU and multimodal packages (Transformer Engine,
# flashinfer, diffusers, ...): installed with --no-deps so that megatron-core stays at the pin
# above and torch at 2.13.0. Of its dependencies, what `import megatron.bridge` needs on the
# GPT pretraining path, all pure Python or small wheels: transformers (every model bridge
# imports it) and hydra-core / omegaconf (its config container). The GPU-only ones that it
# only imports are stand-ins inside the tests (tests/bridge/standins.py).
BRIDGE_STAMP="$VENV/.startrail-bridge-v1"
if [ "$MCORE" = "0.19.2" ] && [ ! -f "$BRIDGE_STAMP" ]; then
  echo "[env] installing megatron-bridge 0.6.2 into $VENV"
  # --no-warn-conflicts: pip would list every one of Bridge's requirements left out on purpose.
  "$VENV/bin/pip" install -q --no-warn-conflicts "transformers==5.12.1" "hydra-core==1.3.8" "omegaconf==2.3.1" \
      rich six regex pyyaml tqdm
  "$VENV/bin/pip" install -q --no-warn-conflicts --no-deps --ignore-requires-python "megatron-bridge==0.6.2"
  # None of these depends on torch or megatron-core; checked, as a changed pin would be a silent swap.
  "$VENV/bin/python" -c "import importlib.metadata as m, sys; v = (m.version('torch'), m.version('megatron-core')); \
sys.exit(0 if v[0].startswith('2.13.0') and v[1] == '$MCORE' else f'[env] megatron-bridge step changed the pins: {v}')"
  touch "$BRIDGE_STAMP"
fi
# shellcheck disable=SC1091
source "$VENV/bin/activate"
