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
# The project's own environment script, pointed at another venv and megatron-core.
STARTRAIL_VENV="$VENV" STARTRAIL_MEGATRON_CORE=0.16.1 source "$ROOT/scripts/env.sh"
"$VENV/bin/python" -c "import megatron.core.package_info as p; assert p.__version__.startswith('0.16.'), p.__version__"
cd "$ROOT"
exec "$VENV/bin/python" -m pytest -q -p no:warnings \
  tests/megatron/test_megatron_core_versions.py \
  tests/megatron/test_core_attention.py \
  tests/megatron/test_parallel_state.py \
  tests/megatron/test_cpu_patches.py \
  tests/megatron/test_gpt_startrail.py "$@"
