#!/usr/bin/env bash
# Issue 53 on the Free Spoken Digit Dataset (../shared/data/fsdd_dev: 4 speakers, 2000
# utterances at 8 kHz): one speaker held out (as experiments/decode_fsdd.sh), a character CTC
# model (so762_ctc.yaml's recipe: frames stacked by 3, 3 BLSTM layers of 256, SpecAugment,
# Adam, a linear decay; 20 epochs) on the other three, 2 ranks; the digit error rate on the
# held-out speaker greedily (the spelled word) and through the one-word digit grammar in
# CTC's token topology. Then a phone model (the alignment's phones, dropout 0.3, 40 epochs)
# through the digit grammar spelled in phones (CMUdict's), and the same on the archive
# speed-perturbed at prep (0.9/1.0/1.1: 9 "speakers" from 3; 20 epochs of 3x the frames);
# the phone model with a frame CE head (model.frame_ce) before that.
#   bash experiments/ctc_fsdd.sh        (about 20 minutes on 2 cores; SKIP_SP=1: not the
#                                        speed-perturbed archive)
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=${ROOT:-runs/ctc_fsdd}
DATA=${DATA:-../shared/data/fsdd_dev}
export MPIR_CVAR_ENABLE_HEAVY_YIELD=1
rm -rf "$ROOT"
mkdir -p "$ROOT"
.venv/bin/hpcsgd prep "$DATA" "$ROOT/archive" --alignments "$DATA/phn" --labels "$DATA/labels.txt" \
    --sample-rate 8000 --cv-speakers 1 --num-shards 2 --tokens phones,chars | tail -3
.venv/bin/mpiexec -n 2 .venv/bin/python -m mpi4py -m hpcsgd.cli train \
    --config jobs/configs/so762_ctc.yaml "data.train=$ROOT/archive/train" \
    "data.cv=$ROOT/archive/cv" data.tokens=chars train.epochs=20 "train.run_dir=$ROOT/chars" \
    train.log_every_seconds=0 2>&1 | grep -E "done in|error|diverged" || true
.venv/bin/hpcsgd decode "$ROOT/chars" --data "$ROOT/archive/cv" --greedy \
    | grep -E "%WER|%CER|%SER|confidence"
.venv/bin/hpcsgd mkgraph "$ROOT/archive/train" "$ROOT/tlg_digits" --kind digits --topology ctc \
    --tokens chars > /dev/null
.venv/bin/hpcsgd decode "$ROOT/chars" --data "$ROOT/archive/cv" --graph "$ROOT/tlg_digits" \
    | grep -E "%WER|%CER|%SER|confidence"
# phones: the digit words' pronunciations are the lexicon's, the frames only pick among 10
.venv/bin/mpiexec -n 2 .venv/bin/python -m mpi4py -m hpcsgd.cli train \
    --config jobs/configs/so762_ctc.yaml "data.train=$ROOT/archive/train" \
    "data.cv=$ROOT/archive/cv" data.tokens=phones model.dropout=0.3 train.epochs=40 \
    "train.run_dir=$ROOT/phones_drop03" train.log_every_seconds=0 2>&1 \
    | grep -E "done in|error|diverged" | tail -2 || true
.venv/bin/hpcsgd mkgraph "$ROOT/archive/train" "$ROOT/tlg_digits_phones" --kind digits \
    --topology ctc --tokens phones > /dev/null
.venv/bin/hpcsgd decode "$ROOT/phones_drop03" --data "$ROOT/archive/cv" \
    --graph "$ROOT/tlg_digits_phones" | grep -E "%WER|%SER|confidence"
# the same phone model with a frame CE head on the alignment's labels (model.frame_ce)
.venv/bin/mpiexec -n 2 .venv/bin/python -m mpi4py -m hpcsgd.cli train \
    --config jobs/configs/so762_ctc.yaml "data.train=$ROOT/archive/train" \
    "data.cv=$ROOT/archive/cv" data.tokens=phones model.dropout=0.3 train.epochs=40 \
    model.frame_ce=0.3 "train.run_dir=$ROOT/phones_fce03_drop03" train.log_every_seconds=0 \
    2>&1 | grep -E "done in|error|diverged" | tail -2 || true
.venv/bin/hpcsgd decode "$ROOT/phones_fce03_drop03" --data "$ROOT/archive/cv" \
    --graph "$ROOT/tlg_digits_phones" | grep -E "%WER|%SER|confidence"
[ "${SKIP_SP:-}" ] && exit 0
.venv/bin/hpcsgd prep "$DATA" "$ROOT/archive_sp" --alignments "$DATA/phn" \
    --labels "$DATA/labels.txt" --sample-rate 8000 --cv-speakers 1 --num-shards 2 \
    --tokens phones,chars --speed-perturb 0.9,1.0,1.1 | tail -2
.venv/bin/mpiexec -n 2 .venv/bin/python -m mpi4py -m hpcsgd.cli train \
    --config jobs/configs/so762_ctc.yaml "data.train=$ROOT/archive_sp/train" \
    "data.cv=$ROOT/archive/cv" data.tokens=phones model.dropout=0.3 train.epochs=20 \
    "train.run_dir=$ROOT/phones_sp_drop03" train.log_every_seconds=0 2>&1 \
    | grep -E "done in|error|diverged" | tail -2 || true
.venv/bin/hpcsgd decode "$ROOT/phones_sp_drop03" --data "$ROOT/archive/cv" \
    --graph "$ROOT/tlg_digits_phones" | grep -E "%WER|%SER|confidence"
