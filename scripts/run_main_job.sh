#!/usr/bin/env bash
# The main job: a small GPT trained on CPU with StarTrail context parallelism on packed
# documents. 8 ranks: tensor parallel 2 x context parallel 4, StarTrail teams of 2, 2048-token
# samples split across the 4 CP ranks. Data: the thirteen license texts of examples/data/, one
# document each, in Megatron's indexed format (built on first use), read by Megatron's
# GPTDataset with --dataloader-inter-document-masking: a sample that spans two licenses
# attends within each license only (cu_seqlens reach StarTrail's core attention).
# Installs what it needs into .venv on first use. Extra arguments are appended (later flags
# win), e.g. --train-iters 10; NPROC sets the number of ranks (default 8); DOC_MASK replaces
# the document-masking flag (scripts/compare_losses.sh gives its CP=1 twin Megatron's dense
# mask, --reset-attention-mask --reset-position-ids).
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/env.sh"
cd "$ROOT"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
# shellcheck disable=SC2086  # DOC_MASK is a list of flags
exec torchrun --nproc-per-node "${NPROC:-8}" examples/pretrain_gpt.py \
    --tensor-model-parallel-size 2 --context-parallel-size 4 \
    --context-parallel-algo startrail --startrail-team-size 2 \
    --num-layers 2 --hidden-size 128 --num-attention-heads 8 \
    --seq-length 2048 --max-position-embeddings 2048 \
    --micro-batch-size 1 --global-batch-size 4 --train-iters 30 \
    --lr 2e-3 --min-lr 2e-4 --lr-warmup-iters 5 --lr-decay-style cosine \
    --attention-dropout 0 --hidden-dropout 0 --seed 1234 --log-interval 1 \
    ${DOC_MASK---dataloader-inter-document-masking} "$@"
