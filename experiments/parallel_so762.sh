#!/usr/bin/env bash
# Issue 22 on so762 (112 training, 13 held-out speakers): the DNN of jobs/configs/so762_sgd.yaml
# (440-1024x4-40 sigmoid, minibatch 256, newbob) on one process (1 x 1, 2 threads) and split
# over a model group of 2 ranks (1 x 2, 1 thread each) with float32, 8-bit (Dettmers' dynamic
# tree, abs-max per row) and float16 activations; EPOCHS epochs each, the same global
# minibatches (D = 1 in every run).
#   bash experiments/parallel_so762.sh [EPOCHS]     (needs runs/so762/archive: see jobs/configs/so762_sgd.yaml)
#   ONLY="mp2" bash experiments/parallel_so762.sh     runs whose name starts with ONLY
# Metrics in runs/parallel/<name>/metrics.jsonl; experiments/summarize_precision.py
# runs/parallel prints the table (CV accuracy and CE per epoch).
set -euo pipefail
cd "$(dirname "$0")/.."
EPOCHS=${1:-4}
export MPIR_CVAR_ENABLE_HEAVY_YIELD=1
source experiments/train_run.sh
run() {   # NAME RANKS [key=value ...]
    local name=$1 ranks=$2; shift 2
    train_run runs/parallel "$name" "$ranks" --config jobs/configs/so762_sgd.yaml \
        train.epochs="$EPOCHS" "$@"
}
run mp1_float32 1
run mp2_float32 2 model.parallel=2
run mp2_dettmers 2 model.parallel=2 model.activation_codec=dettmers
run mp2_float16 2 model.parallel=2 model.activation_codec=float16
