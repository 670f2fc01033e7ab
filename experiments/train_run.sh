# Sourced by the experiments' shell scripts: one training run of an experiment.
#   train_run ROOT NAME RANKS --config CONFIG [key=value ...]
# Skipped unless NAME starts with $ONLY (ONLY="" runs everything); ROOT/NAME cleared first;
# the log's lines matching $SHOW (default: epoch ends, errors, divergence) shown; the wall time
# after. Run from the repository root, with .venv set up (bin/setup).
train_run() {
    local root=$1 name=$2 ranks=$3; shift 3
    case "$name" in "${ONLY:-}"*) ;; *) return 0 ;; esac
    rm -rf "$root/$name"
    echo "== $name: $*"
    local t0=$SECONDS
    .venv/bin/mpiexec -n "$ranks" .venv/bin/python -m mpi4py -m hpcsgd.cli train "$@" \
        train.log_every_seconds=0 "train.run_dir=$PWD/$root/$name" 2>&1 \
        | grep -E "${SHOW:-done in|error|diverged}" || true
    echo "   $name: $((SECONDS - t0)) s wall"
}
