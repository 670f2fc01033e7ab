#!/usr/bin/env bash
# Issue 53 on so762 (112 training, 13 held-out speakers): the CTC recipe of
# jobs/configs/so762_ctc.yaml (frames stacked by 3, 3 BLSTM layers of 256, phone tokens,
# SpecAugment, Adam with a linear decay, 30 epochs) on 2 ranks: float32 allreduce, the striped
# 1-bit exchange with error feedback (after a float32 cold start of 6 epochs, with Adam's
# variance moving or frozen, and of 10 epochs, past the CTC plateau's exit),
# mixed precision (float16 with a backoff loss scale), characters instead of phones; 1-bit
# and float32 with Adam's second moment on each rank (optim.adam_variance=local); dropout; the
# Wave2Letter-like all-convolutional model (so762_w2l.yaml; in_w2l: each convolution
# instance-normalized); then every model decoded on the
# held-out speakers, greedily and through a phone bigram (TLG), the character model through
# a word bigram too; the longest run's last checkpoints averaged (hpcsgd average).
#   bash experiments/ctc_so762.sh            (needs runs/so762/archive_ctc: docs/ctc.md)
#   ONLY="f32" bash experiments/ctc_so762.sh  the runs whose name starts with ONLY
#   STAGE=decode ONLY=f32 bash experiments/ctc_so762.sh   decode only (STAGE=train: train only)
# Runs in runs/ctc/<name>/ (metrics.jsonl, decode/); experiments/summarize_ctc.py runs/ctc
# prints the table. The PyTorch peer on the same recipe: experiments/pytorch_ctc.py.
set -euo pipefail
cd "$(dirname "$0")/.."
export MPIR_CVAR_ENABLE_HEAVY_YIELD=1   # the trainer sets 1 thread per rank (2 ranks, 2 cores)
source experiments/train_run.sh
ROOT=runs/ctc
A=runs/so762/archive_ctc
run() {   # NAME CONFIG [key=value ...]
    train_run "$ROOT" "$@"
}
want() { case "$1" in "${ONLY:-}"*) return 0 ;; *) return 1 ;; esac; }
STAGE=${STAGE:-all}
# the cold start lasts through CTC's plateau (the float32 run leaves it in its 6th epoch, at
# about 3M frames; with 200k frames of cold start 1-bit was still in it after 21 epochs)
ONEBIT=(exchange.aggregation=striped exchange.codec=onebit exchange.cold_start_frames=3300000)
if [ "$STAGE" != decode ]; then
    run f32 2 --config jobs/configs/so762_ctc.yaml
    run onebit 2 --config jobs/configs/so762_ctc.yaml "${ONEBIT[@]}"
    # the same with Adam's second moment frozen at the cold start's end (1-bit Adam's rule:
    # in the 1-bit phase the decoded squares are the codec's, not each weight's)
    run onebit_freeze 2 --config jobs/configs/so762_ctc.yaml "${ONEBIT[@]}" \
        optim.adam_freeze_variance=true
    # a cold start past the plateau's exit: 10 epochs (5.5M frames; float32's token error
    # rate is 61% there and falling slowly)
    run onebit_cold10 2 --config jobs/configs/so762_ctc.yaml "${ONEBIT[@]}" \
        exchange.cold_start_frames=5500000
    run mixed 2 --config jobs/configs/so762_ctc.yaml train.precision=mixed train.loss_scale=backoff
    run chars 2 --config jobs/configs/so762_ctc.yaml data.tokens=chars
    # the first Wave2Letter-like recipe (a stride-2 convolution of kernel 11 in front, kernels
    # 11-17): on CTC's plateau for 30 epochs, with or without instance norms
    run w2l 2 --config jobs/configs/so762_w2l.yaml "model.encoder=[conv 256 k11 s2, \
conv 256 k11, conv 256 k11, conv 256 k13, conv 256 k13, conv 384 k17 d2, conv 512 k1]"
    run in_w2l 2 --config jobs/configs/so762_w2l.yaml "model.encoder=[conv 256 k11 s2 in, \
conv 256 k11 in, conv 256 k11 in, conv 256 k13 in, conv 256 k13 in, conv 384 k17 d2 in, \
conv 512 k1 in]"
    # so762_w2l.yaml as it is: frames stacked by 3 in front, kernels of 5 (it learns)
    run conv_w2l 2 --config jobs/configs/so762_w2l.yaml
    # ... with dropout for twice the epochs (it ends overfitting, its error rate still falling)
    run conv_w2l_drop02_e60 2 --config jobs/configs/so762_w2l.yaml model.dropout=0.2 \
        train.epochs=60
    # the noise of one run: float32 and mixed precision again from seed 1 (the weights'
    # initialisation, the buckets' order, SpecAugment's draws)
    run seed1_f32 2 --config jobs/configs/so762_ctc.yaml train.seed=1
    run seed1_mixed 2 --config jobs/configs/so762_ctc.yaml train.seed=1 train.precision=mixed \
        train.loss_scale=backoff
    run seed1_onebit_cold10 2 --config jobs/configs/so762_ctc.yaml "${ONEBIT[@]}" \
        exchange.cold_start_frames=5500000 train.seed=1
    # ... and a third pair from seed 2 (mixed against float32 was +0.78 greedy, +1.37 through
    # the bigram over seeds 0 and 1)
    run seed2_f32 2 --config jobs/configs/so762_ctc.yaml train.seed=2
    run seed2_mixed 2 --config jobs/configs/so762_ctc.yaml train.seed=2 train.precision=mixed \
        train.loss_scale=backoff
    # Adam's second moment from each rank's float32 gradient, before the codec
    # (optim.adam_variance=local): the 1-bit sums' error never enters it
    run seed1_onebit_local 2 --config jobs/configs/so762_ctc.yaml "${ONEBIT[@]}" \
        exchange.cold_start_frames=5500000 train.seed=1 optim.adam_variance=local
    run onebit_local 2 --config jobs/configs/so762_ctc.yaml "${ONEBIT[@]}" \
        exchange.cold_start_frames=5500000 optim.adam_variance=local
    # ... and float32 with it: what the placement alone does
    run seed1_f32_local 2 --config jobs/configs/so762_ctc.yaml train.seed=1 \
        optim.adam_variance=local
    # dropout between the encoder's layers (model.dropout): the model overfits this corpus
    run f32_drop03 2 --config jobs/configs/so762_ctc.yaml model.dropout=0.3
    # ... lighter, on the 1-bit recipe with the local second moment (which overfits more)
    run onebit_local_drop015 2 --config jobs/configs/so762_ctc.yaml "${ONEBIT[@]}" \
        exchange.cold_start_frames=5500000 optim.adam_variance=local model.dropout=0.15
    # dropout 0.3 was still gaining at the 30th epoch (token error rate 50.5% -> 49.6% in the
    # last 3): the same for 60 epochs, the linear decay stretched over them
    run f32_drop03_e60 2 --config jobs/configs/so762_ctc.yaml model.dropout=0.3 train.epochs=60
    # it still overfit (training loss 1.19 per token, CV 1.88): more dropout, 50 epochs
    run f32_drop04_e50 2 --config jobs/configs/so762_ctc.yaml model.dropout=0.4 train.epochs=50
    # dropout 0.3's error rate was still falling at epoch 60 (46.8% at 49, 46.2% at 59): 100
    # epochs, the last 40 checkpoints kept for averaging (hpcsgd average)
    run f32_drop03_e100 2 --config jobs/configs/so762_ctc.yaml model.dropout=0.3 \
        train.epochs=100 train.keep_checkpoints=40
    # the best recipe (dropout 0.3, 60 epochs) with a frame CE head on the alignment's
    # labels beside the CTC loss (model.frame_ce: multi-task CTC + CE, weight 0.3)
    run fce03_drop03_e60 2 --config jobs/configs/so762_ctc.yaml model.dropout=0.3 \
        train.epochs=60 model.frame_ce=0.3 train.keep_checkpoints=20
    # the head at weight 1 (its CE per output step then outweighs CTC's about 4 to 1):
    # stopped after 9 epochs, behind weight 0.3 by 9-18 points of token error rate
    run fce10_drop03_e60 2 --config jobs/configs/so762_ctc.yaml model.dropout=0.3 \
        train.epochs=60 model.frame_ce=1.0 train.keep_checkpoints=20
    # weight 0.3 over 40 epochs: does the head's faster start reach the 60-epoch PER sooner?
    run fce03_drop03_e40 2 --config jobs/configs/so762_ctc.yaml model.dropout=0.3 \
        train.epochs=40 model.frame_ce=0.3 train.keep_checkpoints=20
    # the control: the same 40 epochs without the head
    run f32_drop03_e40 2 --config jobs/configs/so762_ctc.yaml model.dropout=0.3 \
        train.epochs=40
    # the same 40 epochs with twice SpecAugment's time masks (4 of up to 40 frames each):
    # stopped after 16 epochs, 0.4-7.6 points of token error rate behind the 2 masks
    run fce03_tm4_drop03_e40 2 --config jobs/configs/so762_ctc.yaml model.dropout=0.3 \
        train.epochs=40 model.frame_ce=0.3 data.specaug_time_masks=4 train.keep_checkpoints=20
    # speed perturbation (0.9, 1.0, 1.1: three times the frames) for 12 epochs, 1.2x the
    # frames of the 30-epoch runs; its archive (the same CV speakers):
    #   hpcsgd prep ../shared/data/so762_dev runs/so762/archive_ctc_sp --alignments \
    #     ../shared/data/so762_dev/phones.ctm --labels ../shared/data/so762_dev/labels.txt \
    #     --cv-speakers 13 --num-shards 4 --tokens phones,chars --speed-perturb 0.9,1.0,1.1
    if [ -d runs/so762/archive_ctc_sp ]; then
        run sp 2 --config jobs/configs/so762_ctc.yaml \
            data.train=runs/so762/archive_ctc_sp/train train.epochs=12
        # with dropout 0.3, as long as f32_drop03_e60 in frames (20 x 1.66M = 60 x 0.55M)
        run sp_drop03 2 --config jobs/configs/so762_ctc.yaml \
            data.train=runs/so762/archive_ctc_sp/train train.epochs=20 model.dropout=0.3
    fi
fi
[ "$STAGE" = train ] && exit 0
# the graphs, from the training speakers only: a phone bigram and 5-gram, a word bigram
# spelled in characters
[ -f "$ROOT/tlg_phones/graph.json" ] || .venv/bin/hpcsgd mkgraph "$A/train" "$ROOT/tlg_phones" \
    --kind phones --topology ctc --tokens phones > /dev/null
[ -f "$ROOT/tlg_phones5/graph.json" ] || .venv/bin/hpcsgd mkgraph "$A/train" \
    "$ROOT/tlg_phones5" --kind phones --topology ctc --tokens phones --order 5 > /dev/null
[ -f "$ROOT/tlg_words/graph.json" ] || .venv/bin/hpcsgd mkgraph "$A/train" "$ROOT/tlg_words" \
    --kind words --topology ctc --tokens chars > /dev/null
for name in f32 onebit onebit_freeze onebit_cold10 mixed w2l in_w2l conv_w2l chars seed1_f32 \
        seed1_mixed seed2_f32 seed2_mixed seed1_onebit_cold10 seed1_onebit_local onebit_local seed1_f32_local f32_drop03 \
        onebit_local_drop015 f32_drop03_e60 f32_drop03_e100 fce03_drop03_e60 fce03_drop03_e40 f32_drop03_e40 fce03_tm4_drop03_e40 f32_drop04_e50 conv_w2l_drop02_e60 sp sp_drop03; do
    want "$name" && [ -d "$ROOT/$name" ] || continue
    graph=tlg_phones
    [ "$name" = chars ] && graph=tlg_words
    .venv/bin/hpcsgd decode "$ROOT/$name" --data "$A/cv" --greedy | grep -E "^%|interval"
    .venv/bin/hpcsgd decode "$ROOT/$name" --data "$A/cv" --graph "$ROOT/$graph" --tune \
        | grep -E "^%|interval|acoustic scale [0-9]|held out"
    [ "$graph" = tlg_phones ] || continue
    .venv/bin/hpcsgd decode "$ROOT/$name" --data "$A/cv" --graph "$ROOT/tlg_phones5" --tune \
        | grep -E "^%|interval|acoustic scale [0-9]|held out"
done
# a run's last N checkpoints averaged (hpcsgd average), decoded greedily and through the
# phone 5-gram as the runs above
decode_average() {   # NAME N
    local model="$ROOT/$1/avg$2.h5"
    .venv/bin/hpcsgd average "$ROOT/$1" --last "$2" --out "$model"
    .venv/bin/hpcsgd decode "$model" --data "$A/cv" --greedy | grep -E "^%|interval"
    .venv/bin/hpcsgd decode "$model" --data "$A/cv" --graph "$ROOT/tlg_phones5" --tune \
        | grep -E "^%|interval|acoustic scale [0-9]|held out"
}
# the 100-epoch run's last 10, 20 (the recipe's choice: a fifth of the epochs) and 40; the
# frame CE runs' last third of their epochs
for name in f32_drop03_e100:10 f32_drop03_e100:20 f32_drop03_e100:40 fce03_drop03_e60:20 \
        fce03_drop03_e40:13 fce03_tm4_drop03_e40:13; do
    n=${name#*:} name=${name%:*}
    want "$name" && [ -d "$ROOT/$name" ] || continue
    decode_average "$name" "$n"
done
