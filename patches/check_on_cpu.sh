#!/usr/bin/env bash
# Reproduce the check of patches/megatron-lm-core_v0.19.0-startrail.patch on a CPU machine:
# apply it to a Megatron-LM checkout at the named commit, build Megatron's dataset helper,
# train 3 iterations with TP2 x CP4 StarTrail C=2 on 8 ranks and with TP2 CP=1 on 2 ranks
# (mock data), and print both loss columns.
#   bash patches/check_on_cpu.sh /path/to/Megatron-LM
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MLM="$(cd "$1" && pwd)"
COMMIT=5be9626709af2722333bf54797c954c09edeada3
source "$ROOT/scripts/env.sh"
pip install -q pybind11
git -C "$MLM" checkout -q "$COMMIT"
git -C "$MLM" apply "$ROOT/patches/megatron-lm-core_v0.19.0-startrail.patch"
( cd "$MLM/megatron/core/datasets" &&
  g++ -O3 -shared -std=c++17 -fPIC helpers.cpp $(python -m pybind11 --includes) \
      -o "helpers_cpp$(python -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')" )
FLAGS="--num-layers 2 --hidden-size 128 --num-attention-heads 8 --seq-length 256 --max-position-embeddings 256
  --micro-batch-size 1 --global-batch-size 2 --train-iters 3 --lr 1e-3 --seed 1234 --mock-data
  --tokenizer-type NullTokenizer --vocab-size 256 --transformer-impl local --distributed-backend gloo
  --no-gradient-accumulation-fusion --no-persist-layer-norm --no-masked-softmax-fusion --no-bias-gelu-fusion
  --no-bias-dropout-fusion --no-rope-fusion --attention-dropout 0 --hidden-dropout 0
  --log-interval 1 --eval-iters 0 --eval-interval 1000"
export MEGATRON_LM="$MLM"
OUT=$(mktemp -d)
torchrun --nproc-per-node 8 "$ROOT/patches/run_on_cpu.py" $FLAGS --tensor-model-parallel-size 2 \
    --context-parallel-size 4 --context-parallel-algo startrail --startrail-team-size 2 > "$OUT/startrail.log" 2>&1
torchrun --nproc-per-node 2 "$ROOT/patches/run_on_cpu.py" $FLAGS --tensor-model-parallel-size 2 \
    --context-parallel-size 1 > "$OUT/cp1.log" 2>&1
loss() { grep -o 'lm loss: [0-9.E+-]*' "$1" | awk '{print $3}'; }
echo "iteration  TP2xCP4-StarTrail-C2  TP2-CP1   (logs in $OUT)"
paste <(seq 1 3) <(loss "$OUT/startrail.log") <(loss "$OUT/cp1.log")
