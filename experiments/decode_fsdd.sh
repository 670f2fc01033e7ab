#!/usr/bin/env bash
# Issue 46 on the Free Spoken Digit Dataset (../shared/data/fsdd_dev: 4 speakers, 2000
# utterances at 8 kHz): one speaker held out, a DNN (440-512x3-40, the so762 recipe's Adam and
# linear decay, 6 epochs) on the other three, 2 ranks; the digit grammar (one of the training
# transcripts' ten words per utterance, CMUdict pronunciations) made from the training
# archive; the digit error rate on the held-out speaker at the default scales and tuned.
#   bash experiments/decode_fsdd.sh        (under a minute on 2 idle cores)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=${ROOT:-runs/decode_fsdd}
DATA=${DATA:-../shared/data/fsdd_dev}
export MPIR_CVAR_ENABLE_HEAVY_YIELD=1
rm -rf "$ROOT"
mkdir -p "$ROOT"
.venv/bin/hpcsgd prep "$DATA" "$ROOT/archive" --alignments "$DATA/phn" --labels "$DATA/labels.txt" \
    --sample-rate 8000 --cv-speakers 1 --num-shards 2 | tail -3
.venv/bin/mpiexec -n 2 .venv/bin/python -m mpi4py -m hpcsgd.cli train --config jobs/configs/so762.yaml \
    "data.train=$ROOT/archive/train" "data.cv=$ROOT/archive/cv" "train.run_dir=$ROOT/float32" \
    "model.hidden=[512, 512, 512]" train.epochs=6 train.log_every_seconds=0 train.tensorboard=false \
    2>&1 | grep -E "done in|error|diverged" || true
.venv/bin/hpcsgd mkgraph "$ROOT/archive/train" "$ROOT/graph_digits" --kind digits --text "$DATA/text"
for tune in "" "--tune"; do
    .venv/bin/mpiexec -n 2 .venv/bin/python -m mpi4py -m hpcsgd.cli decode "$ROOT/float32" \
        --data "$ROOT/archive/cv" --graph "$ROOT/graph_digits" $tune \
        --out "$ROOT/float32/decode/digits${tune:+_tuned}" | grep -E "%WER|%SER|best|confidence|real-time"
done
.venv/bin/hpcsgd eval "$ROOT/float32" --data "$ROOT/archive/cv" | grep "frame accuracy"
