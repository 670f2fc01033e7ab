#!/usr/bin/env bash
# Issue 18's recipe on so762 (13 held-out speakers): the DNN of jobs/configs/so762_sgd.yaml
# (440-1024x4-40 sigmoid, minibatch 256), 2 ranks, EPOCHS epochs, with the learning rate
# decayed linearly to zero over the run (schedule.type=linear) instead of newbob: float32
# at lr 0.001 and 0.002 per sample, and 1-bit SGD (striped, error feedback) with the paper's
# cold start of 200k frames, at lr 0.001; and float32 with each rank's whole epoch in one
# shuffled RAM buffer of blocks of 1024 frames (close to a full random shuffle of the frames,
# what the PyTorch recipe of issue 18 does).
#   bash experiments/recipe_so762.sh [EPOCHS]      (needs runs/so762/archive: see jobs/configs/so762_sgd.yaml)
#   ONLY="onebit" bash experiments/recipe_so762.sh   runs whose name starts with ONLY
# Metrics in runs/recipe/<name>/metrics.jsonl; experiments/summarize_precision.py runs/recipe
# prints the table (CV accuracy and CE per epoch).
set -euo pipefail
cd "$(dirname "$0")/.."
EPOCHS=${1:-2}
export MPIR_CVAR_ENABLE_HEAVY_YIELD=1
source experiments/train_run.sh
SHOW="done in|error|cold start over|diverged"
run() {   # NAME [key=value ...]
    local name=$1; shift
    train_run runs/recipe "$name" 2 --config jobs/configs/so762_sgd.yaml train.epochs="$EPOCHS" \
        schedule.type=linear "$@"
}
ONEBIT=(exchange.aggregation=striped exchange.codec=onebit exchange.cold_start_frames=200000)
run float32_lr1e-3 optim.lr=0.001
run float32_lr2e-3 optim.lr=0.002
run onebit_lr1e-3 "${ONEBIT[@]}" optim.lr=0.001
run onebit_lr2e-3 "${ONEBIT[@]}" optim.lr=0.002
SHUFFLE=(data.block_frames=1024 data.buffer_frames=600000)
run float32_lr1e-3_shuffle optim.lr=0.001 "${SHUFFLE[@]}"
# the third round: the linear decay and the fine shuffle together, higher rates, and Adam
# (per-sample lr 3.9e-6 is PyTorch's 1e-3 at minibatch 256) with the same decay and shuffle
run float32_lr2e-3_shuffle optim.lr=0.002 "${SHUFFLE[@]}"
run float32_lr4e-3_shuffle optim.lr=0.004 "${SHUFFLE[@]}"
run adam_lr3.9e-6_shuffle optim.type=adam optim.lr=3.9e-6 "${SHUFFLE[@]}"
run adam_lr7.8e-6_shuffle optim.type=adam optim.lr=7.8e-6 "${SHUFFLE[@]}"
run onebit_lr4e-3_shuffle "${ONEBIT[@]}" optim.lr=0.004 "${SHUFFLE[@]}"
run onebit_adam_lr3.9e-6_shuffle "${ONEBIT[@]}" optim.type=adam optim.lr=3.9e-6 "${SHUFFLE[@]}"
