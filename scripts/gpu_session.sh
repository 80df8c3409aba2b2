#!/usr/bin/env bash
# One prepared command for a lent GPU (docs/gpus.md, "A GPU session"): the kit (accuracy,
# per-call timing), one rank at 128K and 1M (time, efficiency, memory vs the model and the
# rehearsal), a profiler kernel table, sync debug mode, NCCL on one GPU, and the rehearsal's
# Megatron GPT step on the device; each part in its own process with a time limit, 450 s in
# all; at most 5 result files under $OUT (else benchmarks/results/gpu/).
#
#   bash scripts/gpu_session.sh --fetch-wheels   # here, once: megatron-core's cp312 wheel into .whl/
#   bash scripts/gpu_session.sh                  # on the GPU machine (the device tool carries .whl)
#   bash scripts/gpu_session.sh --cpu-selfcheck  # every part at toy sizes on the CPU (CI runs it)
#   PYTHON=/path/to/python bash scripts/gpu_session.sh --parts accuracy,timing
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python3}"
WHEELS="$ROOT/.whl"  # git-ignored (.gitignore): it travels only as the device tool's carry path
MEGATRON_WHEEL="megatron-core==0.19.2"

if [[ "${1:-}" == "--fetch-wheels" ]]; then
    # The GPU image has Python 3.12 and no megatron-core; its needs (torch, numpy, packaging) are there.
    exec "$PY" -m pip download "$MEGATRON_WHEEL" --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 -d "$WHEELS"
fi

export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
if [[ " $* " != *" --cpu-selfcheck "* ]] && ! "$PY" -c "import megatron.core" 2>/dev/null; then
    wheel=$(ls "$WHEELS"/megatron_core-*.whl 2>/dev/null | head -1 || true)
    if [[ -n "$wheel" ]]; then  # into a folder of its own: the image's python stays as it was
        "$PY" -m pip install -q --no-index --no-deps --no-compile --target /tmp/gpu_session_site "$wheel"
        export PYTHONPATH="$PYTHONPATH:/tmp/gpu_session_site"
    else
        echo "[gpu_session] no megatron-core and no $WHEELS/megatron_core-*.whl: the gpt part will report it" >&2
    fi
fi
exec "$PY" -m benchmarks.gpu.session "$@"
