#!/usr/bin/env bash
# Issue 18 on so762 (13 held-out speakers): the paper's cold start and Adam at the owner. The
# DNN and recipe of jobs/configs/so762_sgd.yaml (440-1024x4-40 sigmoid, minibatch 256, newbob), 2
# ranks, EPOCHS epochs: 1-bit SGD (striped, error feedback) without and with a cold start of
# 50k and 200k frames (9% and 36% of an epoch); Adam (per-sample lr 1e-3 / 256, PyTorch's
# default rate at this minibatch) with the float32 allreduce and with 1-bit at the owner.
# The float32 baseline is experiments/precision_so762.sh's float32 run (the same recipe).
#   bash experiments/coldstart_so762.sh [EPOCHS]    (needs runs/so762/archive: see jobs/configs/so762_sgd.yaml)
#   ONLY="adam" bash experiments/coldstart_so762.sh 2     runs whose name starts with ONLY
# Metrics in runs/coldstart/<name>/metrics.jsonl; experiments/summarize_precision.py
# runs/coldstart prints the table (CV accuracy and CE per epoch).
set -euo pipefail
cd "$(dirname "$0")/.."
EPOCHS=${1:-2}
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 NUMBA_NUM_THREADS=1 MPIR_CVAR_ENABLE_HEAVY_YIELD=1
source experiments/train_run.sh
SHOW="done in|error|cold start over|diverged"
run() {   # NAME [key=value ...]
    local name=$1; shift
    train_run runs/coldstart "$name" 2 --config jobs/configs/so762_sgd.yaml \
        train.epochs="$EPOCHS" train.log_every_frames=50000 "$@"
}
ONEBIT=(exchange.aggregation=striped exchange.codec=onebit)
run onebit_cold0 "${ONEBIT[@]}"
run onebit_cold50k "${ONEBIT[@]}" exchange.cold_start_frames=50000
run onebit_cold200k "${ONEBIT[@]}" exchange.cold_start_frames=200000
run adam_float32 optim.type=adam optim.lr=0.0000039
run adam_onebit "${ONEBIT[@]}" optim.type=adam optim.lr=0.0000039
