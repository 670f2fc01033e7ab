#!/usr/bin/env bash
# The paper's Tables 2 and 3 on so762_dev (13 held-out speakers) at K ranks, trained until
# float32 has converged: newbob (the rate halves once the CV accuracy gains less than half a
# point) over EPOCHS epochs, 1-bit runs with the paper's cold start (the first 200k frames
# with the float32 exchange), every epoch's rank-local share shuffled in one RAM buffer of
# 1024-frame blocks. Table 2: float32, 1-bit with and without error feedback, for sigmoid
# and ReLU DNNs (440-512x3-40, global minibatch 1024). Table 3: the AdaGrad placements with
# 1-bit, float32 AdaGrad, and Adam (float32, and at the owner with 1-bit).
#   bash experiments/table23_converged_so762.sh [K] [EPOCHS]   (needs runs/so762/archive)
#   ONLY=t2 / ONLY=t3 runs one table; runs land in runs/table23c/<name>/metrics.jsonl;
#   python experiments/summarize_runs.py runs/table23c prints the table,
#   python experiments/plot_runs.py ... draws the learning curves.
set -euo pipefail
cd "$(dirname "$0")/.."
K=${1:-4}
EPOCHS=${2:-8}
export MPIR_CVAR_ENABLE_HEAVY_YIELD=1
COMMON=(data.train=runs/so762/archive/train data.cv=runs/so762/archive/cv
        "model.hidden=[512, 512, 512]" train.minibatch=1024 train.epochs="$EPOCHS"
        optim.lr=0.001 optim.momentum_tc=2048 schedule.type=newbob train.log_every_seconds=0
        train.log_every_frames=2000000 data.block_frames=1024 data.buffer_frames=600000)
ONEBIT=(exchange.aggregation=striped exchange.codec=onebit exchange.cold_start_frames=200000)
source experiments/train_run.sh
run() {   # NAME [key=value ...]
    local name=$1; shift
    train_run runs/table23c "$name" "$K" "${COMMON[@]}" "$@"
}
# ReLU at the sigmoid's rate (1e-3) gives NaN within 10 steps, at 5e-4 too: 2.5e-4 trains
for act in sigmoid relu; do
    lr=$([ $act = relu ] && echo 0.00025 || echo 0.001)
    run "t2_${act}_float32"      model.activation=$act optim.lr=$lr
    run "t2_${act}_onebit_ef"    model.activation=$act optim.lr=$lr "${ONEBIT[@]}"
    run "t2_${act}_onebit_no_ef" model.activation=$act optim.lr=$lr "${ONEBIT[@]}" \
        exchange.error_feedback=false
done
# AdaGrad's per-sample rate is ~500x plain SGD's (it divides by the gradient's RMS); Adam's
# 1e-6 per sample is PyTorch's 1e-3 per minibatch of 1024
for place in local aggregate after_momentum; do
    run "t3_onebit_adagrad_$place" "${ONEBIT[@]}" optim.adagrad=$place optim.lr=0.000002
done
run t3_float32_adagrad_aggregate optim.adagrad=aggregate optim.lr=0.000002
run t3_float32_adam optim.type=adam optim.lr=0.000001
run t3_onebit_adam_at_owner "${ONEBIT[@]}" optim.type=adam optim.lr=0.000001
