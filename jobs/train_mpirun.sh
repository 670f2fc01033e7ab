#!/bin/bash
# Data-parallel training without Slurm: the MPI's own mpirun/mpiexec over the hosts of a hostfile.
# The same run as jobs/train.sbatch; run it from the repository (or where the config and data are).
#
#   NP=2 jobs/train_mpirun.sh                                   # this machine only, no hostfile
#   HOSTFILE=hosts NP=16 jobs/train_mpirun.sh train.epochs=12   # key=value arguments override the config
#   CONFIG=jobs/configs/demo.yaml NP=4 jobs/train_mpirun.sh
#
# Hostfile: one host per line with its slot count (ranks it may take). MPICH's hydra: "node1:8";
# Open MPI: "node1 slots=8". Every host needs password-less ssh from this one and the repository,
# VENV and data at the same paths (a shared file system). Per-rank logs, metrics and checkpoints
# go to the run directory (train.run_dir).
#
# Stop: `kill -USR1 <pid of this script>` (or TERM, or Ctrl-C): the signal is forwarded to the
# ranks, which agree at the next step boundary, write a checkpoint and exit 75; the script exits
# 75 too. Run the same command again to resume (train.resume=auto): the result is the same, bit
# for bit, as an uninterrupted run. A rank that dies ends the run at once (both launchers end the
# others); one that hangs is aborted by the trainer's watchdog (train.watchdog_s).
set -uo pipefail   # not -e: the launcher's exit code is examined below

# ---- knobs (environment)
CONFIG=${CONFIG:-jobs/configs/so762.yaml}   # YAML config; key=value arguments override it
NP=${NP:-2}                                 # ranks in all
HOSTFILE=${HOSTFILE:-}                      # empty: all ranks on this machine
THREADS=${THREADS:-}                        # threads per rank (empty: the trainer decides: cores / ranks per host)
MPIEXEC=${MPIEXEC:-mpiexec}                 # which launcher (path if not the first on PATH)
MPIEXEC_ARGS=${MPIEXEC_ARGS:-}              # more launcher options, e.g. Open MPI: "--map-by ppr:4:node"
VENV=${VENV:-.venv}                         # environment with hpcsgd installed (same path on every host)
EXIT_REQUEUE=75                             # hpcsgd.train.EXIT_REQUEUE: stopped with a checkpoint

say() { printf '%(%F %T)T train_mpirun.sh: %s\n' -1 "$*"; }

# shellcheck disable=SC1091
source "$VENV/bin/activate"
export PYTHONUNBUFFERED=1 HDF5_USE_FILE_LOCKING=FALSE
# Network and GPU settings (UCX_*, FI_PROVIDER, NCCL_*, MPIR_CVAR_ENABLE_HEAVY_YIELD) go here as
# in jobs/train.sbatch, which documents them. GPU ranks: every rank sees all GPUs of its host and
# takes (local rank mod GPUs): MPI_LOCALRANKID under hydra, OMPI_COMM_WORLD_LOCAL_RANK under Open MPI.

mpi_family=$(python - <<'EOF'
import mpi4py
mpi4py.rc.initialize = False       # only ask which library mpi4py loads; no MPI_Init here
from mpi4py import MPI
print(MPI.get_vendor()[0])
EOF
) || { say "error: cannot import mpi4py from $VENV"; exit 1; }

# `python -m mpi4py`: an exception on any rank aborts them all (exit 75 stays 75: see train.sbatch).
RANK_CMD=(python -m mpi4py -m hpcsgd.cli train --config "$CONFIG" ${THREADS:+train.threads=$THREADS} "$@")
# shellcheck disable=SC2206
EXTRA=($MPIEXEC_ARGS)
case "$mpi_family" in
    "Open MPI")
        # Open MPI passes only the variables named with -x to remote hosts. --bind-to none: its
        # default binds each rank to one core, which would pin all THREADS of a rank to it.
        EXPORTS=()
        for v in PATH LD_LIBRARY_PATH VIRTUAL_ENV MPI4PY_LIBMPI OMP_NUM_THREADS OPENBLAS_NUM_THREADS \
                 NUMBA_NUM_THREADS PYTHONUNBUFFERED HDF5_USE_FILE_LOCKING; do
            [[ -n "${!v:-}" ]] && EXPORTS+=(-x "$v")
        done
        LAUNCH=("$MPIEXEC" -n "$NP" --bind-to none ${HOSTFILE:+--hostfile "$HOSTFILE"} "${EXPORTS[@]}"
                "${EXTRA[@]}" "${RANK_CMD[@]}") ;;
    *)  # MPICH's hydra (also Intel MPI, MVAPICH): the whole environment goes to every rank.
        LAUNCH=("$MPIEXEC" -n "$NP" ${HOSTFILE:+-f "$HOSTFILE"} "${EXTRA[@]}" "${RANK_CMD[@]}") ;;
esac
say "$NP rank(s) on ${HOSTFILE:-this machine}, $mpi_family, launcher $MPIEXEC"

# Signals: forwarded to the launcher, which passes them to every rank (hydra and Open MPI both
# forward SIGUSR1 and SIGTERM). bash runs a trap only between commands, hence the background
# launcher and the wait loop.
STEP_PID="" STOP_SIGNAL=""
forward() {
    STOP_SIGNAL=$1
    [[ -n "$STEP_PID" ]] || return 0
    say "got SIG$1: forwarding to the ranks (they checkpoint at the next step and exit $EXIT_REQUEUE)"
    kill -s "$1" "$STEP_PID" 2>/dev/null
}
trap 'forward USR1' USR1
trap 'forward TERM' TERM
trap 'forward TERM' INT   # Ctrl-C: a clean stop with a checkpoint, like TERM

"${LAUNCH[@]}" &
STEP_PID=$!
[[ -n "$STOP_SIGNAL" ]] && kill -s "$STOP_SIGNAL" "$STEP_PID" 2>/dev/null
while true; do
    wait "$STEP_PID"
    rc=$?
    kill -0 "$STEP_PID" 2>/dev/null || break   # still running: the wait was cut short by a trap
done
STEP_PID=""

case $rc in
    0)  say "training finished" ;;
    "$EXIT_REQUEUE") say "stopped with a checkpoint; run the same command again to resume" ;;
    4)  say "exit 4: a rank made no progress for train.watchdog_s and aborted the run (see the rank logs)" ;;
    *)  say "launcher exited $rc (see above: hydra reports a rank killed by signal N as exit N)" ;;
esac
exit "$rc"
