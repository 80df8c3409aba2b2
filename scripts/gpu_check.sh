#!/usr/bin/env bash
# The GPU validation kit: one command for a machine with one CUDA GPU and PyTorch
# (no megatron, flash-attn or Transformer Engine needed; they are used when importable).
# Checks every block kernel against float64 (fwd+bwd), times them against torch SDPA, runs
# one StarTrail rank at 128K tokens through torch's no-op process group and the NCCL transport
# on one GPU; each part in its own process with a time limit (a CUDA fault keeps the other
# parts' rows); writes benchmarks/results/gpu_check.md and .json after each part. Exit status 1
# if any kernel check fails or any part reports an error.
#
#   bash scripts/gpu_check.sh                  # full check on cuda:0
#   bash scripts/gpu_check.sh --cpu-selfcheck  # toy sizes on the CPU: checks the kit only
#   PYTHON=/path/to/python bash scripts/gpu_check.sh --skip-rank
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}"
exec "${PYTHON:-python3}" -m benchmarks.gpu.check "$@"
