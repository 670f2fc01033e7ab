#!/usr/bin/env bash
# Issue 54 on so762 (112 training, 13 held-out speakers): the phone RNN-T of
# jobs/configs/so762_rnnt.yaml (so762_ctc.yaml's encoder, an LSTM prediction network, an
# additive joint) on 2 ranks with float32 allreduce and with the striped 1-bit exchange (a
# cold start of one epoch); INT4 QAT fine-tunes of the float32 one (the paper's recipe and the
# naive one); then greedy and beam-4 decodes of the held-out speakers
# (PER beside the CTC models': docs/results.md).
#   bash experiments/rnnt_so762.sh            (needs runs/so762/archive_ctc: docs/ctc.md)
#   ONLY=f32 bash experiments/rnnt_so762.sh    the runs whose name starts with ONLY
# Runs in runs/rnnt/<name>/ (metrics.jsonl, decode/).
set -euo pipefail
cd "$(dirname "$0")/.."
export MPIR_CVAR_ENABLE_HEAVY_YIELD=1   # the trainer sets 1 thread per rank (2 ranks, 2 cores)
source experiments/train_run.sh
ROOT=runs/rnnt
A=runs/so762/archive_ctc
STAGE=${STAGE:-all}
# INT4 as the paper does it (SAWB weights, BAC activations, the first encoder layer and the
# joint float, the prediction network quantized), fine-tuned from f32 for 4 epochs at half
# the rate, decaying; and the naive INT4 it is compared with (MAX everywhere, first layer too)
INT4=(train.init_from=runs/rnnt/f32 train.epochs=4 optim.lr=2.5e-7 qat.weight_bits=4
      qat.activation_bits=4)
# from scratch the transducer overfits so762 within a few epochs (its prediction network
# learns the training sentences: experiments/rnnt_so762.md), so the float32 run starts from the CTC
# model's encoder (experiments/ctc_so762.sh's f32) and trains 10 epochs at half the rate;
# ONLY=scratch: the run from scratch; chars: the character transducer
if [ "$STAGE" != decode ]; then
    train_run "$ROOT" scratch 2 --config jobs/configs/so762_rnnt.yaml
    train_run "$ROOT" f32 2 --config jobs/configs/so762_rnnt.yaml train.init_from=runs/ctc/f32 \
        train.epochs=10 optim.lr=2.5e-7
    train_run "$ROOT" onebit 2 --config jobs/configs/so762_rnnt.yaml \
        train.init_from=runs/ctc/f32 train.epochs=10 optim.lr=2.5e-7 \
        exchange.aggregation=striped exchange.codec=onebit exchange.cold_start_frames=548000
    # characters (CER/WER, words split at the space token), from the character CTC model's
    # encoder (experiments/ctc_so762.sh's chars) as f32 is from the phone one
    train_run "$ROOT" chars 2 --config jobs/configs/so762_rnnt.yaml data.tokens=chars \
        train.init_from=runs/ctc/chars train.epochs=10 optim.lr=2.5e-7
    train_run "$ROOT" int4 2 --config jobs/configs/so762_rnnt.yaml "${INT4[@]}" \
        qat.weights=sawb qat.activations=bac
    train_run "$ROOT" naive4 2 --config jobs/configs/so762_rnnt.yaml "${INT4[@]}" \
        qat.weights=max qat.activations=max qat.first_layer=quantized
fi
[ "$STAGE" = train ] && exit 0
for name in scratch f32 onebit chars int4 naive4; do
    case "$name" in "${ONLY:-}"*) ;; *) continue ;; esac
    [ -d "$ROOT/$name" ] || continue
    .venv/bin/hpcsgd decode "$ROOT/$name" --data "$A/cv" --greedy \
        | grep -E "^%|interval|real-time"
    .venv/bin/hpcsgd decode "$ROOT/$name" --data "$A/cv" --beam-size 4 \
        | grep -E "^%|interval|real-time"
done
