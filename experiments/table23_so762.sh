#!/usr/bin/env bash
# The paper's Table 2 (1-bit with/without error feedback vs float) and Table 3 (AdaGrad
# placements) on real speech: so762_dev, 13 held-out speakers, K ranks, same frames for all.
#   bash experiments/table23_so762.sh [K]      (needs runs/so762/archive: see jobs/configs/so762_sgd.yaml)
# Each run's CV frame accuracy per epoch lands in runs/table23/<name>/metrics.jsonl;
# experiments/summarize_runs.py prints the table.
set -euo pipefail
cd "$(dirname "$0")/.."
K=${1:-4}
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 NUMBA_NUM_THREADS=1 MPIR_CVAR_ENABLE_HEAVY_YIELD=1
COMMON=(data.train=runs/so762/archive/train data.cv=runs/so762/archive/cv "model.hidden=[512, 512, 512]"
        train.minibatch=1024 train.epochs=3 optim.lr=0.001 optim.momentum_tc=2048
        schedule.type=constant train.log_every_frames=500000)
run() {
    local name=$1; shift
    rm -rf "runs/table23/$name"
    echo "== $name: $*"
    .venv/bin/mpiexec -n "$K" .venv/bin/python -m mpi4py -m hpcsgd.cli train "${COMMON[@]}" \
        "train.run_dir=runs/table23/$name" "$@" 2>&1 | grep -E "done in|error" || true
}
if [ -z "${ONLY_ADAGRAD:-}" ]; then
run float32_allreduce   exchange.aggregation=allreduce
run onebit_ef           exchange.aggregation=striped exchange.codec=onebit
run onebit_no_ef        exchange.aggregation=striped exchange.codec=onebit exchange.error_feedback=false
fi
# AdaGrad normalises the per-sample gradient by its RMS, so a parameter moves ~lr*N per
# minibatch: a much smaller per-sample rate than plain SGD (2e-5 diverged; 2e-6 = 0.002/step).
for place in local aggregate after_momentum; do
    run "onebit_adagrad_$place" exchange.aggregation=striped exchange.codec=onebit \
        optim.adagrad=$place optim.lr=0.000002
done
run float32_adagrad_aggregate exchange.aggregation=allreduce optim.adagrad=aggregate optim.lr=0.000002
