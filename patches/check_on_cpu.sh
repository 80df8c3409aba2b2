#!/usr/bin/env bash
# Reproduce the check of patches/megatron-lm-core_v0.19.2-startrail.patch on a CPU machine:
# apply it to a Megatron-LM checkout at the named commit, build Megatron's dataset helper,
# then run the patched pretrain_gpt.py for 3 iterations:
#   1. mock data: TP2 x CP4 StarTrail C=2 on 8 ranks vs TP2 CP=1 on 2 ranks;
#   2. packed documents (short synthetic documents in Megatron's indexed format, from
#      examples/data/make_indexed_dataset.py): TP2 x CP4 StarTrail C=2 with
#      --dataloader-inter-document-masking on 8 ranks vs TP2 CP=1 with Megatron's dense
#      per-document mask (--reset-attention-mask --reset-position-ids) on 2 ranks, and the
#      StarTrail run again with --startrail-regather-in-backward (the flag the patch once dropped);
# and print the loss columns.
#   bash patches/check_on_cpu.sh /path/to/Megatron-LM
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
MLM="$(cd "$1" && pwd)"
# The core_r0.19.0 release branch head: its megatron/training is megatron-core 0.19.2's
# (pretrain_gpt.py is the same at the core_v0.19.0 tag, 5be9626709af).
COMMIT=f8837c04ef6cbef6cdefb8de001aad63178aebbf
source "$ROOT/scripts/env.sh"
pip install -q pybind11
git -C "$MLM" checkout -q "$COMMIT"
git -C "$MLM" apply "$ROOT/patches/megatron-lm-core_v0.19.2-startrail.patch"
( cd "$MLM/megatron/core/datasets" &&
  g++ -O3 -shared -std=c++17 -fPIC helpers.cpp $(python -m pybind11 --includes) \
      -o "helpers_cpp$(python -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')" )
FLAGS="--num-layers 2 --hidden-size 128 --num-attention-heads 8 --seq-length 256 --max-position-embeddings 256
  --micro-batch-size 1 --global-batch-size 2 --train-iters 3 --lr 1e-3 --seed 1234
  --tokenizer-type NullTokenizer --transformer-impl local --distributed-backend gloo
  --no-gradient-accumulation-fusion --no-persist-layer-norm --no-masked-softmax-fusion --no-bias-gelu-fusion
  --no-bias-dropout-fusion --no-rope-fusion --attention-dropout 0 --hidden-dropout 0
  --log-interval 1 --eval-iters 0 --eval-interval 1000 --tensor-model-parallel-size 2"
STARTRAIL="--context-parallel-size 4 --context-parallel-algo startrail --startrail-team-size 2"
export MEGATRON_LM="$MLM"
OUT=$(mktemp -d)
PYTHONPATH="$ROOT" python "$ROOT/examples/data/make_indexed_dataset.py" --short-documents 400 \
    --output-prefix "$OUT/docs" > /dev/null
MOCK="--mock-data --vocab-size 256"
PACKED="--data-path $OUT/docs --split 100,0,0 --vocab-size 257"
run() { local nproc=$1 log=$2; shift 2; torchrun --nproc-per-node "$nproc" "$ROOT/patches/run_on_cpu.py" "$@" > "$OUT/$log" 2>&1; }
run 8 startrail.log $FLAGS $MOCK $STARTRAIL
run 2 cp1.log $FLAGS $MOCK --context-parallel-size 1
run 8 packed_startrail.log $FLAGS $PACKED $STARTRAIL --dataloader-inter-document-masking
run 2 packed_cp1_dense_mask.log $FLAGS $PACKED --context-parallel-size 1 --reset-attention-mask --reset-position-ids
run 8 packed_regather.log $FLAGS $PACKED $STARTRAIL --dataloader-inter-document-masking --startrail-regather-in-backward
loss() { grep -o 'lm loss: [0-9.E+-]*' "$1" | awk '{print $3}'; }
echo "logs in $OUT"
grep -h "^> startrail:" "$OUT/startrail.log" "$OUT/packed_regather.log"
echo "iteration  mock:TP2xCP4-StarTrail-C2  mock:TP2-CP1  packed:TP2xCP4-StarTrail-C2  packed:TP2-CP1-dense-mask  packed:StarTrail-C2-regather"
paste <(seq 1 3) <(loss "$OUT/startrail.log") <(loss "$OUT/cp1.log") \
    <(loss "$OUT/packed_startrail.log") <(loss "$OUT/packed_cp1_dense_mask.log") <(loss "$OUT/packed_regather.log")
