#!/usr/bin/env bash
# Run the main job (TP2 x CP4, StarTrail C=2, 8 ranks, packed documents with
# --dataloader-inter-document-masking) and its CP=1 twin (TP2, 2 ranks, Megatron's own
# attention with its dense per-document mask, --reset-attention-mask --reset-position-ids),
# then print the two lm-loss columns side by side. Extra arguments go to both runs, e.g.
# --train-iters 10. For packed documents against no document masking on Megatron's mock
# data see scripts/compare_packed_losses.sh.
set -euo pipefail
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
OUT="${OUT:-$(mktemp -d)}"
mkdir -p "$OUT"
bash "$ROOT/scripts/run_main_job.sh" "$@" > "$OUT/startrail_tp2_cp4.log" 2>&1
DOC_MASK="--reset-attention-mask --reset-position-ids" NPROC=2 bash "$ROOT/scripts/run_main_job.sh" "$@" \
    --context-parallel-size 1 --context-parallel-algo megatron > "$OUT/tp2_cp1.log" 2>&1
loss() { grep -o 'iteration *[0-9]*/ *[0-9]* \|lm loss: [0-9.E+-]*' "$1" | paste - - | awk '{print $2, $6}'; }
echo "logs in $OUT"
printf '%-10s %-16s %-16s %s\n' iteration "TP2xCP4 C=2" "TP2 CP=1" "rel. diff"
join <(loss "$OUT/startrail_tp2_cp4.log") <(loss "$OUT/tp2_cp1.log") |
    awk '{ sub("/", "", $1); d = ($2 - $3) / $3; if (d < 0) d = -d; printf "%-10s %-16s %-16s %.1e\n", $1, $2, $3, d }'
