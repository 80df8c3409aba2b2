#!/usr/bin/env bash
# The main job: a small GPT trained on CPU with StarTrail context parallelism.
# 8 ranks: tensor parallel 2 x context parallel 4, StarTrail teams of 2, a 2048-token
# sequence split across the 4 CP ranks. Installs what it needs into .venv on first use.
# Extra arguments are appended (later flags win), e.g. --train-iters 10; NPROC sets the
# number of ranks (default 8).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/env.sh"
cd "$ROOT"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
exec torchrun --nproc-per-node "${NPROC:-8}" examples/pretrain_gpt.py \
    --tensor-model-parallel-size 2 --context-parallel-size 4 \
    --context-parallel-algo startrail --startrail-team-size 2 \
    --num-layers 2 --hidden-size 128 --num-attention-heads 8 \
    --seq-length 2048 --max-position-embeddings 2048 \
    --micro-batch-size 1 --global-batch-size 4 --train-iters 30 \
    --lr 2e-3 --min-lr 2e-4 --lr-warmup-iters 5 --lr-decay-style cosine \
    --attention-dropout 0 --hidden-dropout 0 --seed 1234 --log-interval 1 "$@"
