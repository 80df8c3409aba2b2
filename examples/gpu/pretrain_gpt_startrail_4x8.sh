#!/usr/bin/env bash
# Upstream Megatron-LM's pretrain_gpt.py (patched: see patches/README.md) on 4 nodes x 8 GPUs:
# tensor parallel 2 x context parallel 16 with StarTrail teams of 2.
#
# Choosing C (and U): C*C must divide CP/U. Megatron orders ranks tp-cp-ep-dp-pp, so with
# TP=2 the CP ranks of one CP group are every other GPU (4 per node); StarTrail teams are
# C consecutive CP ranks, inside one node: team collectives stay on NVLink. With CP=16 and
# C=2 a sub-ring is 4 CP ranks at stride 2 within a team group of 8 consecutive CP ranks
# (2 nodes), so 2 of its 4 hops cross nodes, for 3 steps of 2C chunks, instead of ring
# attention's 15 steps. `python -m megatron_startrail.planning ...` (or
# --startrail-team-size auto) predicts the best C for your links and sequence length.
#
# Run on every node with NODE_RANK=0..3 and MASTER_ADDR set to node 0.
set -euo pipefail
MEGATRON_LM=${MEGATRON_LM:-$HOME/Megatron-LM}
DATA_PATH=${DATA_PATH:?set DATA_PATH to a Megatron indexed dataset prefix}
TOKENIZER_MODEL=${TOKENIZER_MODEL:?set TOKENIZER_MODEL}
export CUDA_DEVICE_MAX_CONNECTIONS=1

cd "$MEGATRON_LM"
torchrun --nnodes 4 --nproc-per-node 8 --node-rank "${NODE_RANK:?}" \
    --master-addr "${MASTER_ADDR:?}" --master-port "${MASTER_PORT:-6000}" \
    pretrain_gpt.py \
    --tensor-model-parallel-size 2 --pipeline-model-parallel-size 1 \
    --context-parallel-size 16 \
    --context-parallel-algo startrail --startrail-team-size 2 \
    --sequence-parallel --use-distributed-optimizer \
    --num-layers 32 --hidden-size 4096 --num-attention-heads 32 --ffn-hidden-size 11008 \
    --seq-length 131072 --max-position-embeddings 131072 --position-embedding-type rope \
    --normalization RMSNorm --swiglu --untie-embeddings-and-output-weights --disable-bias-linear \
    --attention-dropout 0 --hidden-dropout 0 \
    --micro-batch-size 1 --global-batch-size 8 --train-iters 1000 \
    --lr 3e-4 --min-lr 3e-5 --lr-decay-style cosine --lr-warmup-iters 50 --clip-grad 1.0 --bf16 \
    --transformer-impl transformer_engine \
    --data-path "$DATA_PATH" --tokenizer-type HuggingFaceTokenizer --tokenizer-model "$TOKENIZER_MODEL" \
    --log-interval 1 --eval-iters 0 --eval-interval 1000

# Variant: Ulysses inside CP. U=2 consecutive CP ranks exchange heads (all-to-all on
# NVLink), StarTrail runs over the S=CP/U=8 groups across them (C*C must divide 8: C=2):
#   --context-parallel-size 16 --ulysses-degree-in-cp 2 --context-parallel-algo startrail --startrail-team-size 2
