#!/usr/bin/env bash
# Issue 19 on so762 (112 training, 13 held-out speakers): the BLSTM of
# jobs/configs/so762_blstm.yaml (40-BLSTM 256x2-40, chunks of 40 + 10/10 context, 64 chunks
# per step, lr 2.5e-4 per sample, newbob, clipping 2.0/frame) against the DNN of
# jobs/configs/so762_sgd.yaml (440-1024x4-40 sigmoid, minibatch 256), EPOCHS epochs each (the same
# labelled training frames), float32 allreduce and 1-bit SGD (striped, error feedback), 2 ranks.
#   bash experiments/lstm_so762.sh [EPOCHS]      (needs runs/so762/archive: see jobs/configs/so762_sgd.yaml)
#   ONLY="blstm" bash experiments/lstm_so762.sh   runs whose name starts with ONLY
# Metrics in runs/lstm/<name>/metrics.jsonl; experiments/summarize_precision.py runs/lstm
# prints the table (CV accuracy and CE per epoch).
set -euo pipefail
cd "$(dirname "$0")/.."
EPOCHS=${1:-6}
export MPIR_CVAR_ENABLE_HEAVY_YIELD=1   # the trainer sets 1 thread per rank (2 ranks, 2 cores)
source experiments/train_run.sh
SHOW="done in|error|diverged|clipped"
run() {   # NAME CONFIG [key=value ...]
    local name=$1 config=$2; shift 2
    train_run runs/lstm "$name" 2 --config "$config" train.epochs="$EPOCHS" "$@"
}
ONEBIT=(exchange.aggregation=striped exchange.codec=onebit)
run blstm_float32 jobs/configs/so762_blstm.yaml
run blstm_onebit jobs/configs/so762_blstm.yaml "${ONEBIT[@]}"
run dnn_float32 jobs/configs/so762_sgd.yaml
run dnn_onebit jobs/configs/so762_sgd.yaml "${ONEBIT[@]}"
