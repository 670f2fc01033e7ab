#!/usr/bin/env bash
# Issue 6's accuracy results on real speech: double buffering on/off, and automatic
# minibatch-size selection against fixed sizes, on so762_dev (13 held-out speakers), K ranks,
# the same frames (3 epochs) for every run; striped 1-bit SGD with error feedback.
#   bash experiments/db_probe_so762.sh [K]     (needs runs/so762/archive: see jobs/configs/so762_sgd.yaml)
#   ONLY="mb4096_db_lr5e-4" bash experiments/db_probe_so762.sh   (some runs only)
#   python experiments/summarize_runs.py runs/db_probe     (the table in docs/results.md)
set -euo pipefail
cd "$(dirname "$0")/.."
K=${1:-2}
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 NUMBA_NUM_THREADS=1 MPIR_CVAR_ENABLE_HEAVY_YIELD=1
COMMON=(data.train=runs/so762/archive/train data.cv=runs/so762/archive/cv "model.hidden=[512, 512, 512]"
        train.epochs=3 optim.lr=0.001 optim.momentum_tc=2048 schedule.type=constant
        train.log_every_frames=500000 exchange.aggregation=striped exchange.codec=onebit)
# probing: every ~1/4 epoch (the paper: every 24 h of data), 30k frames per candidate
PROBE=(train.probe_every_frames=150000 train.probe_frames=30000 train.probe_max_minibatch=8192)
run() {
    local name=$1; shift
    [[ -n "${ONLY:-}" && " $ONLY " != *" $name "* ]] && return 0   # ONLY="a b": just those runs
    rm -rf "runs/db_probe/$name"
    echo "== $name: $*"
    .venv/bin/mpiexec -n "$K" .venv/bin/python -m mpi4py -m hpcsgd.cli train "${COMMON[@]}" \
        "train.run_dir=runs/db_probe/$name" "$@" 2>&1 | grep -E "done in|probe at|error" || true
}
run mb1024            train.minibatch=1024
run mb1024_db         train.minibatch=1024 exchange.double_buffering=true
run mb4096            train.minibatch=4096
run mb4096_db         train.minibatch=4096 exchange.double_buffering=true
run mb256             train.minibatch=256
run probe_from1024    train.minibatch=1024 "${PROBE[@]}"
run probe_from1024_db train.minibatch=1024 "${PROBE[@]}" exchange.double_buffering=true
# double buffering's delayed update lowers the largest stable step: the same run at half the lr
run mb4096_db_lr5e-4  train.minibatch=4096 exchange.double_buffering=true optim.lr=0.0005
run mb4096_lr5e-4     train.minibatch=4096 optim.lr=0.0005
