#!/usr/bin/env bash
# Packed documents, StarTrail vs Megatron: three runs of examples/pretrain_gpt.py on the same
# data, then their lm-loss columns side by side.
#   packed:   8 ranks, TP2 x CP4, StarTrail C=2, --dataloader-inter-document-masking
#             (document boundaries reach StarTrail as cu_seqlens, the sample zigzagged over CP)
#   dense:    2 ranks, TP2, CP=1, --reset-attention-mask --reset-position-ids
#             (Megatron's own attention with its dense per-document mask from EOD tokens)
#   no mask:  2 ranks, TP2, CP=1, plain causal attention across documents
# packed must equal dense (<= 1e-4 relative) and differ from no mask.
# With --multi-latent-attention among the extra arguments (e.g. --multi-latent-attention
# --qk-head-dim 32 --qk-pos-emb-head-dim 16 --v-head-dim 16 --kv-lora-rank 32 --rope-type rope)
# the CP=1 twin reads the same packed documents (--dataloader-inter-document-masking, THD)
# instead of a dense mask: MLA rotates by sequence position, not by --reset-position-ids.
# Default data: --mock-data, NullTokenizer, --vocab-size ${VOCAB:-4096}, --seq-length
# ${SEQ:-4096}. Extra arguments go to all three runs (later flags win).
# Why 4096: Megatron's MockGPTLowLevelDataset fills a document of length L (1 <= L < 4096) with
# (1, 2, ..., L-1) % vocab and then EOD = vocab-1, so with a smaller vocabulary a long document
# holds EOD ids inside it: --reset-attention-mask cuts it there, while the dataset's cu_seqlens
# (--dataloader-inter-document-masking) do not, and the two runs mask different documents
# (VOCAB=1024 shows it). With vocab >= 4096 EOD ends documents only.
# DATA=licenses: the bundled license texts instead (Megatron's indexed dataset, one document
# per license, bytes + EOD 256: no EOD inside a document at any length), the main job's data.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
source "$ROOT/scripts/env.sh"
cd "$ROOT"
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}"
OUT="${OUT:-$(mktemp -d)}"
mkdir -p "$OUT"
SEQ="${SEQ:-4096}"
if [ "${DATA:-mock}" = licenses ]; then
    DATA_ARGS=()  # examples/pretrain_gpt.py's default data
else
    DATA_ARGS=(--mock-data --tokenizer-type NullTokenizer --vocab-size "${VOCAB:-4096}")
fi
COMMON=("${DATA_ARGS[@]}"
    --seq-length "$SEQ" --max-position-embeddings "$SEQ" --tensor-model-parallel-size 2
    --num-layers 2 --hidden-size 128 --num-attention-heads 8
    --micro-batch-size 1 --global-batch-size 2 --train-iters "${ITERS:-4}"
    --lr 2e-3 --lr-warmup-iters 1 --seed 1234 --log-interval 1 "$@")
run() { local nproc=$1 log=$2; shift 2; torchrun --nproc-per-node "$nproc" examples/pretrain_gpt.py "$@" > "$OUT/$log" 2>&1; }
run 8 packed.log "${COMMON[@]}" --context-parallel-size 4 --context-parallel-algo startrail \
    --startrail-team-size 2 --dataloader-inter-document-masking
DOCUMENTS_CP1=(--reset-attention-mask --reset-position-ids) REFERENCE="dense CP=1"
for arg in "$@"; do
    if [ "$arg" = --multi-latent-attention ]; then
        DOCUMENTS_CP1=(--dataloader-inter-document-masking) REFERENCE="packed CP=1"
    fi
done
run 2 dense.log "${COMMON[@]}" --context-parallel-size 1 "${DOCUMENTS_CP1[@]}"
run 2 nomask.log "${COMMON[@]}" --context-parallel-size 1
loss() { grep -o 'iteration *[0-9]*/ *[0-9]* \|lm loss: [0-9.E+-]*' "$1" | paste - - | awk '{print $2, $6}'; }
echo "logs in $OUT"
printf '%-10s %-14s %-14s %-10s %-14s %s\n' iteration "packed TP2xCP4" "$REFERENCE" "rel.diff" "no mask CP=1" "rel.diff"
join <(loss "$OUT/packed.log") <(loss "$OUT/dense.log") | join - <(loss "$OUT/nomask.log") |
    awk 'function rel(a, b) { d = (a - b) / b; return d < 0 ? -d : d }
         { sub("/", "", $1); printf "%-10s %-14s %-14s %-10.1e %-14s %.1e\n", $1, $2, $3, rel($2, $3), $4, rel($2, $4) }'
