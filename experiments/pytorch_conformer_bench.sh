#!/usr/bin/env bash
# The Conformer-CTC training step beside PyTorch: jobs/configs/so762_conformer_ctc.yaml's model
# (conv2d 64 144 + 8 x conformer 144 h4 f576 k15, CTC over the so762 phones, dropout 0.1; 4.0M
# parameters) timed by `hpcsgd bench train --pytorch` at 1 rank x 2 threads and 2 ranks x 1
# thread, measured the way docs/benchmarks.md's CTC rows were ("A CTC model's step beside
# PyTorch (issue 53)": --exchange allreduce,onebit --double-buffering off --pytorch --rounds 5
# --steps 3; utterances of 400 frames, N = 4000 frames a step from the config). The PyTorch
# side is hpcsgd/bench/pytorch.py's CTCModel (nn.Conv2d, nn.LayerNorm, nn.Linear, rotary q/k,
# F.scaled_dot_product_attention with a key-padding mask, nn.Conv1d(groups=D), nn.CTCLoss
# summed; SGD with momentum; DDP over gloo at 2 ranks), checked against hpcsgd's layers by
# experiments/pytorch_conformer_parity.py (run first here: it takes seconds).
#
# Not run by the commit that wrote it: it needs an idle machine (stop any training run beside
# it, e.g. kill -STOP, for the few minutes it takes), the so762 CTC archive
# (runs/so762/archive_ctc: docs/ctc.md) and PyTorch beside hpcsgd
# (.venv/bin/pip install torch==2.13.0).
#   bash experiments/pytorch_conformer_bench.sh
#   OUT=/tmp/cf BLSTM=1 bash experiments/pytorch_conformer_bench.sh
# OUT: where the JSON files and the log go (default docs/bench); BLSTM=1 also reruns the
# so762_ctc.yaml BLSTM rows of issue 53 in the same window (their table's command, at the
# same two layouts), so the two models' ratios come from one sitting.
# --threads is given explicitly: on a machine of more than 2 cores the default (cores // K)
# would not be the 1 x 2 and 2 x 1 layouts of the existing rows. OPENBLAS_CORETYPE is left
# as the environment has it (the CTC rows did not change it); the log records it.
set -euo pipefail
cd "$(dirname "$0")/.."
OUT=${OUT:-docs/bench}
CF=jobs/configs/so762_conformer_ctc.yaml
HPCSGD=${HPCSGD:-.venv/bin/hpcsgd}
PY=${PY:-.venv/bin/python}
[ -d runs/so762/archive_ctc/train ] || { echo "runs/so762/archive_ctc missing: docs/ctc.md" >&2; exit 1; }
mkdir -p "$OUT"
LOG="$OUT/train_conformer_ctc.log"
{
    echo "commit $(git rev-parse --short HEAD)$(git diff --quiet || echo ' (dirty)'), $(date -u '+%F %H:%M UTC')"
    lscpu | grep -m1 "Model name" || true
    echo "cores $(nproc), load average $(cut -d' ' -f1-3 /proc/loadavg)," \
        "OPENBLAS_CORETYPE=${OPENBLAS_CORETYPE:-unset}"
    "$PY" -c "import numpy, numba, torch; print('numpy', numpy.__version__, 'numba', numba.__version__, 'torch', torch.__version__)"
} | tee "$LOG"

# the torch model computes what hpcsgd's does (float32 and float64, both norms)
for a in "" "--norm in" "--dtype float64"; do
    echo "== python experiments/pytorch_conformer_parity.py $a" >> "$LOG"
    "$PY" experiments/pytorch_conformer_parity.py $a | tee -a "$LOG" | tail -1 \
        | sed "s/^/parity ${a:-float32 ln}: /"   # FAIL stops the script (the details are in the log)
done

# the step beside PyTorch: 1 rank x 2 threads, then 2 ranks x 1 thread
COMMON=(--exchange allreduce,onebit --double-buffering off --pytorch --rounds 5 --steps 3)
"$HPCSGD" bench train --config "$CF" --ranks 1 --threads 2 "${COMMON[@]}" \
    --json "$OUT/train_conformer_ctc_1x2.json" 2>&1 | tee -a "$LOG"
"$HPCSGD" bench train --config "$CF" --ranks 2 --threads 1 "${COMMON[@]}" \
    --json "$OUT/train_conformer_ctc_2x1.json" 2>&1 | tee -a "$LOG"

if [ "${BLSTM:-0}" = 1 ]; then   # issue 53's BLSTM CTC rows, the same window
    "$HPCSGD" bench train --config jobs/configs/so762_ctc.yaml --ranks 1 --threads 2 \
        "${COMMON[@]}" --json "$OUT/train_ctc_beside_conformer_1x2.json" 2>&1 | tee -a "$LOG"
    "$HPCSGD" bench train --config jobs/configs/so762_ctc.yaml --ranks 2 --threads 1 \
        "${COMMON[@]}" --json "$OUT/train_ctc_beside_conformer_2x1.json" 2>&1 | tee -a "$LOG"
fi
echo "load average at the end $(cut -d' ' -f1-3 /proc/loadavg)" | tee -a "$LOG"
grep -h "x pytorch" "$LOG" || true   # the side-by-side lines: hpcsgd ÷ PyTorch at each layout
