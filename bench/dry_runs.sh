#!/usr/bin/env bash
# The big layouts of docs/dry_run.md ("The big layouts", then the interleaved case of
# "What the dry run found"), dry-run one after the other on this machine: per rank the
# dry run's step peak beside the planner's, and each run's wall time and peak resident
# memory. About 7 minutes on 2 cores.
#
#     bash bench/dry_runs.sh
set -euo pipefail
cd "$(dirname "$0")/.."
M=examples/model_configs
python=${PYTHON:-.venv/bin/python}
dry() {
    echo "=== $*"
    /usr/bin/time -f "wall %e s, peak RSS %M KB" "$python" -W ignore -m meshtrain dryrun "$@" \
        2>&1 | grep -E "^(dp|rank |  step_peak|wall|error)"
}
dry --model $M/llama-3.1-8b.json --devices 8 --device h100 --seq-len 8192 --global-batch 8 \
    --bf16 --dp 8 --tp 1 --pp 1 --sdp 8
dry --model $M/llama-3.1-70b.json --devices 256 --device h100 --seq-len 8192 --global-batch 32 \
    --bf16 --dp 32 --tp 8 --pp 1 --sdp 32 --activation-checkpointing full
for schedule in 1f1b interleaved_1f1b; do
    dry --model $M/llama-3.1-405b.json --devices 512 --device h100 --seq-len 8192 \
        --global-batch 64 --bf16 --dp 8 --tp 8 --pp 8 --sdp 8 --schedule $schedule \
        --memory-margin 0
done
dry --model $M/llama-3.2-3b.json --devices 32 --device trn1 --seq-len 4096 --global-batch 32 \
    --bf16 --dp 4 --tp 4 --pp 2
# Interleaved past one round of microbatches (4 on pp2): every chunk's gradients unsharded.
dry --model $M/llama-3.2-3b.json --devices 16 --device h100 --seq-len 4096 --global-batch 64 \
    --bf16 --dp 8 --tp 1 --pp 2 --sdp 8 --schedule interleaved_1f1b \
    --activation-checkpointing full --memory-margin 0
