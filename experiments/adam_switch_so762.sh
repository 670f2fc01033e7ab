#!/usr/bin/env bash
# What the 1-bit exchange does to Adam's second moment at the owner, paired: so762's CTC recipe
# (jobs/configs/so762_ctc.yaml, seed 1, 2 ranks) trained 10 epochs in float32, then the same
# checkpoint continued 2 epochs two ways -- float32 allreduce, and the striped 1-bit exchange
# with error feedback (the optimizer state re-striped, residuals from zero) -- and Adam's
# moments of the two compared weight by weight (experiments/adam_moments.py). The same
# weights, the same batches: what differs is the exchange.
#   bash experiments/adam_switch_so762.sh      (needs runs/so762/archive_ctc: docs/ctc.md)
set -euo pipefail
cd "$(dirname "$0")/.."
export MPIR_CVAR_ENABLE_HEAVY_YIELD=1
ROOT=runs/adam_switch
EPOCH=548339                      # frames of an epoch of the archive's training speakers
train() {   # RUN_DIR [key=value ...]
    local dir=$1; shift
    .venv/bin/mpiexec -n 2 .venv/bin/python -m mpi4py -m hpcsgd.cli train \
        --config jobs/configs/so762_ctc.yaml train.seed=1 train.log_every_seconds=0 \
        "train.run_dir=$PWD/$dir" "$@" 2>&1 | grep -E "done in|error|re-striped" || true
}
rm -rf "$ROOT" && mkdir -p "$ROOT"
train "$ROOT/f32_10" "train.stop_after_frames=$((10 * EPOCH))"
for name in f32 onebit; do
    cp -r "$ROOT/f32_10" "$ROOT/$name"
done
train "$ROOT/f32" "train.stop_after_frames=$((12 * EPOCH))"
train "$ROOT/onebit" "train.stop_after_frames=$((12 * EPOCH))" exchange.aggregation=striped \
    exchange.codec=onebit
.venv/bin/python experiments/adam_moments.py "$ROOT/f32" "$ROOT/onebit"
