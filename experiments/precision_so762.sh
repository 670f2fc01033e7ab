#!/usr/bin/env bash
# Mixed precision (issue 21) on real speech: so762 (13 held-out speakers for CV), the DNN of
# jobs/configs/so762_sgd.yaml (440-1024x4-40 sigmoid, minibatch 256, newbob), 2 ranks, allreduce,
# EPOCHS epochs: float32 against mixed precision with no loss scaling and with each scaler,
# the same data, seed, model and rate (equal frames).
#   bash experiments/precision_so762.sh [EPOCHS]     (needs runs/so762/archive: see jobs/configs/so762_sgd.yaml)
#   ONLY="mixed_logmax" bash experiments/precision_so762.sh 2     runs whose name starts with ONLY
#   CONFIG=jobs/configs/so762_blstm.yaml ROOT=runs/precision_blstm bash experiments/precision_so762.sh 2
#                                                               the BLSTM (static scale: not run)
# Each run's metrics land in $ROOT/<name>/metrics.jsonl (default runs/precision);
# experiments/summarize_precision.py prints the table.
set -euo pipefail
cd "$(dirname "$0")/.."
EPOCHS=${1:-2}
CONFIG=${CONFIG:-jobs/configs/so762_sgd.yaml}
ROOT=${ROOT:-runs/precision}
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 NUMBA_NUM_THREADS=1 MPIR_CVAR_ENABLE_HEAVY_YIELD=1
source experiments/train_run.sh
SHOW="done in|error|skipped steps|diverged"
run() {   # NAME [key=value ...]
    local name=$1; shift
    train_run "$ROOT" "$name" 2 --config "$CONFIG" train.epochs="$EPOCHS" \
        train.log_every_frames=50000 "$@"
}
run float32
run mixed_none train.precision=mixed
# static: the gradients are sums over the frames, large (backoff settles at 512-2048 and
# overflows above 1024 in the first steps): 1024 skips every step, 256 trains
[ "$CONFIG" = jobs/configs/so762_sgd.yaml ] && \
    run mixed_static train.precision=mixed train.loss_scale=static train.loss_scale_init=256
run mixed_backoff train.precision=mixed train.loss_scale=backoff
run mixed_logmax train.precision=mixed train.loss_scale=logmax
