#!/usr/bin/env bash
# The MQGrad experiment (issue 23) on real speech: so762 (1.5 h, 13 held-out speakers for CV;
# the 440-512x3-40 DNN, 0.77M parameters: an epoch in 3-4 min per run across the link),
# K ranks across the emulated cluster at 1 Gbit/s per host, where bits cost time: fixed 2, 4, 8
# bits (kbit, per-column min/max), Oland & Raj (reconstruction), MQGrad, and 1-bit SGD, each with
# and without error feedback (MQGrad's own quantizer had none). Same data, seed, model, rate.
#   bash experiments/bits_so762.sh [K] [EPOCHS]   (root: bin/emucluster; needs runs/so762/archive)
#   ONLY="mqgradx" bash experiments/bits_so762.sh 2 4     runs whose name starts with ONLY
# (mqgradx: MQGrad with the reward's time = the exchange's own seconds, bits_time=exchange;
#  mqgradm: the authors' code's time model 5 + 5 bits, bits_time=model)
# Each run's metrics land in runs/bits/<name>/metrics.jsonl; experiments/summarize_bits.py
# prints the table (CE and CV accuracy against wall time and frames, bits over time).
set -euo pipefail
cd "$(dirname "$0")/.."
K=${1:-2}; EPOCHS=${2:-1}
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1 NUMBA_NUM_THREADS=1 MPIR_CVAR_ENABLE_HEAVY_YIELD=1
COMMON=(--config jobs/configs/so762_sgd.yaml "model.hidden=[512, 512, 512]" train.epochs=$EPOCHS schedule.type=constant
        train.log_every_frames=50000 train.log_every_seconds=0 exchange.aggregation=striped)
run() {
    local name=$1; shift
    case "$name" in "${ONLY:-}"*) ;; *) return 0 ;; esac
    rm -rf "runs/bits/$name"
    echo "== $name: $*"
    bin/emucluster --hosts "$K" --gbps 1 -- -n "$K" "$PWD/.venv/bin/python" -m mpi4py -m hpcsgd.cli \
        train "${COMMON[@]}" "train.run_dir=$PWD/runs/bits/$name" "$@" 2>&1 \
        | grep -E "done in|bit width: |error" || true
}
for ef in true false; do
    tag=$([ $ef = true ] && echo ef || echo noef)
    for b in 2 4 8; do
        run "kbit${b}_$tag" exchange.codec=kbit exchange.bits=$b exchange.error_feedback=$ef
    done
    run "oland_raj_$tag" exchange.codec=kbit exchange.bits=oland_raj exchange.bits_start=4 \
        exchange.error_feedback=$ef
    run "mqgrad_$tag" exchange.codec=kbit exchange.bits=mqgrad exchange.error_feedback=$ef
    run "mqgradx_$tag" exchange.codec=kbit exchange.bits=mqgrad exchange.bits_time=exchange \
        exchange.error_feedback=$ef
    run "mqgradm_$tag" exchange.codec=kbit exchange.bits=mqgrad exchange.bits_time=model \
        exchange.error_feedback=$ef
    run "onebit_$tag" exchange.codec=onebit exchange.error_feedback=$ef
done
