#!/usr/bin/env bash
# Issue 71 on so762 (112 training, 13 held-out speakers): the Conformer-CTC recipe of
# jobs/configs/so762_conformer_ctc.yaml (Conv2d subsampling, 8 blocks of width 144, 4.0M
# parameters) on 2 ranks: float32 allreduce, the depthwise convolution's instance norm instead
# of its layer norm (what the choice of norm costs), the striped 1-bit exchange with error
# feedback after a float32 cold start, mixed precision, the transducer from the CTC model's
# encoder (jobs/configs/so762_conformer_rnnt.yaml); then every model decoded on the
# held-out speakers, greedily and through the phone 5-gram (TLG) with the scales tuned on one
# half of the speakers and reported on the other (decode --tune).
#   bash experiments/conformer_so762.sh          (needs runs/so762/archive_ctc: docs/ctc.md)
#   ONLY=cf_f32 bash experiments/conformer_so762.sh       the runs whose name starts with ONLY
#   STAGE=decode ONLY=cf_f32 bash experiments/conformer_so762.sh   decode only
# Runs in runs/conformer/<name>/; the BLSTM recipes' runs and graphs: experiments/ctc_so762.sh.
set -euo pipefail
cd "$(dirname "$0")/.."
export MPIR_CVAR_ENABLE_HEAVY_YIELD=1   # the trainer sets 1 thread per rank (2 ranks, 2 cores)
source experiments/train_run.sh
ROOT=runs/conformer
A=runs/so762/archive_ctc
CF=jobs/configs/so762_conformer_ctc.yaml
want() { case "$1" in "${ONLY:-}"*) return 0 ;; *) return 1 ;; esac; }
STAGE=${STAGE:-all}
if [ "$STAGE" != decode ]; then
    train_run "$ROOT" cf_f32 2 --config "$CF"
    # without the frame CE head on four times the steps (minibatches of 1,000 frames, Adam's
    # step 1e-3): still on CTC's plateau after 8 epochs, stopped (conformer_so762.md)
    train_run "$ROOT" cf_nofce_mb1000 2 --config "$CF" model.frame_ce=0 train.minibatch=1000 \
        optim.lr=1.0e-6
    # instance norm after the depthwise convolution (batch norm's statistics over one
    # utterance: the same at any rank count) instead of the layer norm
    train_run "$ROOT" cf_in 2 --config "$CF" "model.encoder=[conv2d 64 144, \
conformer 144 h4 f576 k15 in, conformer 144 h4 f576 k15 in, conformer 144 h4 f576 k15 in, \
conformer 144 h4 f576 k15 in, conformer 144 h4 f576 k15 in, conformer 144 h4 f576 k15 in, \
conformer 144 h4 f576 k15 in, conformer 144 h4 f576 k15 in]"
    # 1-bit after 5 epochs of float32 (the warm-up and the first fall of the loss)
    train_run "$ROOT" cf_onebit 2 --config "$CF" exchange.aggregation=striped \
        exchange.codec=onebit exchange.cold_start_frames=2750000
    # the same after 8 epochs of float32: past the plateau's exit, as the BLSTM's best 1-bit run
    train_run "$ROOT" cf_onebit_cold8 2 --config "$CF" exchange.aggregation=striped \
        exchange.codec=onebit exchange.cold_start_frames=4400000
    # mixed precision: the backoff scaler (at its old floor of 1 it sat at 1 for 11 epochs and
    # did not train), and logmax, which follows the gradients' size both ways
    train_run "$ROOT" cf_mixed 2 --config "$CF" train.precision=mixed train.loss_scale=backoff \
        train.loss_scale_min=1
    train_run "$ROOT" cf_mixed_logmax 2 --config "$CF" train.precision=mixed \
        train.loss_scale=logmax
    # float32 again at another seed: how far apart two float32 runs end
    train_run "$ROOT" cf_f32_seed2 2 --config "$CF" train.seed=2
    # ... and mixed precision (logmax) at that seed: its cost against seed 2's float32
    train_run "$ROOT" cf_mixed_seed2 2 --config "$CF" train.precision=mixed \
        train.loss_scale=logmax train.seed=2
    # trained with the normalisation a deployed recognizer applies (issue 73): the training
    # archive's statistics for every utterance, or each utterance's own
    train_run "$ROOT" cf_global 2 --config "$CF" data.cmvn_scope=global
    train_run "$ROOT" cf_utt 2 --config "$CF" data.cmvn_scope=utterance
    # global at seed 2 (seed 0's global run collapsed on CTC's plateau: conformer_so762.md)
    train_run "$ROOT" cf_global_seed2 2 --config "$CF" data.cmvn_scope=global train.seed=2
    # INT4 quantization-aware fine-tuning of the float32 model (4-bit SAWB weights per output
    # unit, 4-bit PACT inputs), 10 epochs instead of export.md's 3 (cf_int4)
    train_run "$ROOT" cf_int4_10ep 2 --config "$CF" "train.init_from=$PWD/$ROOT/cf_f32" \
        train.epochs=10 schedule.warmup_frames=0 optim.lr=2.5e-7 qat.weights=sawb \
        qat.weight_bits=4 qat.weight_scale=channel qat.activations=pact qat.activation_bits=4
    # the same with the first layer (the Conv2d front end) in float, as the IBM INT4 recipe
    train_run "$ROOT" cf_int4ff_10ep 2 --config "$CF" "train.init_from=$PWD/$ROOT/cf_f32" \
        train.epochs=10 schedule.warmup_frames=0 optim.lr=2.5e-7 qat.weights=sawb \
        qat.weight_bits=4 qat.weight_scale=channel qat.activations=pact qat.activation_bits=4 \
        qat.first_layer=float
    # the transducer, its encoder from the float32 CTC model's
    train_run "$ROOT" cf_rnnt 2 --config jobs/configs/so762_conformer_rnnt.yaml \
        "train.init_from=$PWD/$ROOT/cf_f32"
    # its INT4 quantization-aware fine-tuning (the front end in float: qat.first_layer auto
    # for an RNN-T), 4 epochs from the float transducer, for the integer ONNX export
    train_run "$ROOT" cf_rnnt_int4 2 --config jobs/configs/so762_conformer_rnnt.yaml \
        "train.init_from=$PWD/$ROOT/cf_rnnt" train.epochs=4 schedule.warmup_frames=0 \
        optim.lr=1.25e-7 qat.weights=sawb qat.weight_bits=4 qat.weight_scale=channel \
        qat.activations=pact qat.activation_bits=4
fi
[ "$STAGE" = train ] && exit 0
G=$ROOT/tlg_phones5   # the phone 5-gram of the training speakers' transcripts
[ -f "$G/graph.json" ] || .venv/bin/hpcsgd mkgraph "$A/train" "$G" --kind phones \
    --topology ctc --tokens phones --order 5 > /dev/null
for name in cf_f32 cf_f32_seed2 cf_in cf_onebit cf_mixed cf_mixed_logmax cf_mixed_seed2 cf_global cf_utt \
        cf_global_seed2 cf_int4_10ep cf_int4ff_10ep cf_onebit_cold8; do
    want "$name" && [ -d "$ROOT/$name" ] || continue
    echo "== $name"
    .venv/bin/hpcsgd decode "$ROOT/$name" --data "$A/cv" --greedy | grep -E "^%|interval"
    .venv/bin/hpcsgd decode "$ROOT/$name" --data "$A/cv" --graph "$G" --tune \
        | grep -E "^%|interval|acoustic scale [0-9]|held out"
done
for name in cf_rnnt cf_rnnt_int4; do
    want "$name" && [ -d "$ROOT/$name" ] || continue
    echo "== $name"
    .venv/bin/hpcsgd decode "$ROOT/$name" --data "$A/cv" --greedy | grep -E "^%|interval"
    .venv/bin/hpcsgd decode "$ROOT/$name" --data "$A/cv" --beam-size 4 | grep -E "^%|interval"
done
# the deployable normalisations through the ONNX export and sherpa-onnx from the audio
# (experiments/onnx_cmvn.py: each beside hpcsgd's own greedy decode)
for name in cf_f32 cf_global cf_utt; do
    want "$name" && [ -d "$ROOT/$name" ] || continue
    OMP_NUM_THREADS=1 .venv/bin/python experiments/onnx_cmvn.py "$ROOT/$name" "$A/cv" "$A/train" \
        "${DATA:-../shared/data/so762_dev}"
done
