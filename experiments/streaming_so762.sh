#!/usr/bin/env bash
# Issue 73 item 4 on so762 (112 training, 13 held-out speakers): what streaming costs. The
# causal recipes jobs/configs/so762_lstm_streaming_{ctc,rnnt}.yaml (frames stacked by 3, 3
# forward LSTM layers of 432 cells: the size of so762_ctc.yaml's 3 BLSTM layers of 256) on 2
# ranks with float32 allreduce and the global CMVN the streaming export folds in
# (data.cmvn_scope global), the transducer from the CTC model's encoder as
# experiments/rnnt_so762.sh starts its own; then each decoded on the held-out speakers by
# hpcsgd (greedy, beam 4) beside the offline BLSTM models of experiments/ctc_so762.sh
# (runs/ctc/f32) and experiments/rnnt_so762.sh (runs/rnnt/f32), and exported with
# `hpcsgd export --onnx --streaming` and decoded by sherpa-onnx's online recognizer from the
# audio as it arrives (experiments/onnx_streaming.py: PER, latency, real-time factor).
# la_ctc, la_rnnt: the same with 180 ms of lookahead (jobs/configs/so762_lstm_lookahead_*.yaml:
# a `conv 368 k7 ahead` over the LSTMs' outputs); ch_ctc, ch_rnnt: with a chunked BLSTM on top
# instead (jobs/configs/so762_lstm_chunked_*.yaml: `blstm 224 c10 r6`, 300 ms chunks and 180 ms
# after each); ch2_ctc: two BLSTM layers inside each window instead of one (`blstm 224 c10 r6
# l2` above 2 forward LSTMs, 4.11M: the same latency). off_ctc, off_rnnt: the offline reference trained like them: the best BLSTM
# recipe (so762_ctc.yaml, dropout 0.3, frame CE head 0.3, 40 epochs; the transducer from its
# encoder) with the global CMVN the streaming models use.
#   bash experiments/streaming_so762.sh      (needs runs/so762/archive_ctc: docs/ctc.md, and
#                                            ../shared/data/so762_dev for the audio)
#   ONLY=ctc bash experiments/streaming_so762.sh   the runs whose name starts with ONLY
#   STAGE=decode bash experiments/streaming_so762.sh   decode only (STAGE=train: train only)
# Runs in runs/streaming/<name>/: 33 min for the CTC run (40 epochs), 9 min for the RNN-T,
# about 12 min of decodes on 2 cores (2026-11-29; the figures: docs/export.md, streaming).
set -euo pipefail
cd "$(dirname "$0")/.."
export MPIR_CVAR_ENABLE_HEAVY_YIELD=1   # the trainer sets 1 thread per rank (2 ranks, 2 cores)
source experiments/train_run.sh
ROOT=runs/streaming
A=runs/so762/archive_ctc
DATA=${DATA:-../shared/data/so762_dev}
STAGE=${STAGE:-all}
if [ "$STAGE" != decode ]; then
    train_run "$ROOT" ctc 2 --config jobs/configs/so762_lstm_streaming_ctc.yaml
    train_run "$ROOT" rnnt 2 --config jobs/configs/so762_lstm_streaming_rnnt.yaml \
        train.init_from="$PWD/$ROOT/ctc"
    train_run "$ROOT" la_ctc 2 --config jobs/configs/so762_lstm_lookahead_ctc.yaml
    train_run "$ROOT" la_rnnt 2 --config jobs/configs/so762_lstm_lookahead_rnnt.yaml \
        train.init_from="$PWD/$ROOT/la_ctc"
    train_run "$ROOT" ch_ctc 2 --config jobs/configs/so762_lstm_chunked_ctc.yaml
    train_run "$ROOT" ch_rnnt 2 --config jobs/configs/so762_lstm_chunked_rnnt.yaml \
        train.init_from="$PWD/$ROOT/ch_ctc"
    train_run "$ROOT" ch2_ctc 2 --config jobs/configs/so762_lstm_chunked_ctc.yaml \
        "model.encoder=[stack 3, lstm 368, lstm 368, blstm 224 c10 r6 l2]"
    train_run "$ROOT" off_ctc 2 --config jobs/configs/so762_ctc.yaml data.cmvn_scope=global \
        model.dropout=0.3 model.frame_ce=0.3 train.epochs=40
    train_run "$ROOT" off_rnnt 2 --config jobs/configs/so762_rnnt.yaml data.cmvn_scope=global \
        train.init_from="$PWD/$ROOT/off_ctc" train.epochs=10 optim.lr=2.5e-7
fi
[ "$STAGE" = train ] && exit 0
# hpcsgd's own decodes (as each trained: the streaming models with the global CMVN), the
# offline models first when they are there
for run in runs/ctc/f32 runs/rnnt/f32 "$ROOT/ctc" "$ROOT/rnnt" "$ROOT/la_ctc" "$ROOT/la_rnnt" \
        "$ROOT/ch_ctc" "$ROOT/ch_rnnt" "$ROOT/ch2_ctc" "$ROOT/off_ctc" \
        "$ROOT/off_rnnt"; do
    case "$run" in "$ROOT/${ONLY:-}"*|runs/*/f32) ;; *) continue ;; esac
    [ -d "$run" ] || continue
    echo "== $run"
    .venv/bin/hpcsgd decode "$run" --data "$A/cv" --greedy | grep -E "^%|real-time"
    case "$run" in *rnnt*)
        .venv/bin/hpcsgd decode "$run" --data "$A/cv" --beam-size 4 | grep -E "^%|real-time"
    esac
done
# the streaming exports through sherpa-onnx's online recognizer: 300 ms chunks (the issue's
# <= 320 ms) and 600 ms (multiples of the stride's 30 ms), the audio handed over 0.32 s at a time
for name in ctc rnnt la_ctc la_rnnt ch_ctc ch_rnnt ch2_ctc; do
    case "$name" in "${ONLY:-}"*) ;; *) continue ;; esac
    [ -d "$ROOT/$name" ] || continue
    chunks="300 600"
    case "$name" in ch*) chunks=300 ;; esac   # a chunked BLSTM streams in the chunk it trained on
    for chunk in $chunks; do
        OMP_NUM_THREADS=1 .venv/bin/python experiments/onnx_streaming.py "$ROOT/$name" "$A/cv" \
            "$A/train" "$DATA" "$chunk"
    done
done
