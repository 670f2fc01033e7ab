#!/usr/bin/env bash
# Issue 72 on Mini LibriSpeech (train-clean-5: 21 training speakers, 4.3 h; the 3 dev speakers
# for cross-validation and every tuning; the 4 reserved speakers are never read): the archive
# in LibriSpeech's own layout, the BLSTM-CTC recipe (jobs/configs/librispeech_mini_blstm_ctc.yaml),
# its 1-bit and INT4 variants, the Conformer recipes; each decoded on the dev speakers greedily
# and through a word 3-gram of the training transcripts (TLG over the BPE pieces, scales tuned
# on one half of the speakers and reported on the other), with word timestamps (--ctm).
#   LS=/path/to/LibriSpeech/train-clean-5 bash experiments/librispeech_mini.sh
#   ONLY=blstm_ctc bash experiments/librispeech_mini.sh       the runs whose name starts with ONLY
#   STAGE=decode ONLY=blstm_ctc bash experiments/librispeech_mini.sh   decode only
# Fetch the corpus as ../shared/data/librispeech_mini/README.md says. Runs in runs/ls/<name>/.
set -euo pipefail
cd "$(dirname "$0")/.."
export MPIR_CVAR_ENABLE_HEAVY_YIELD=1   # the trainer sets 1 thread per rank (2 ranks, 2 cores)
source experiments/train_run.sh
ROOT=runs/ls
A=$ROOT/archive
D=../shared/data/librispeech_mini
want() { case "$1" in "${ONLY:-}"*) return 0 ;; *) return 1 ;; esac; }
STAGE=${STAGE:-all}
if [ ! -f "$A/train/index.json" ]; then
    .venv/bin/hpcsgd prep "${LS:?set LS to LibriSpeech/train-clean-5}" "$A" --tokens bpe,chars \
        --bpe-size 256 --speakers "$D/train_speakers.txt,$D/dev_speakers.txt" \
        --cv-speakers "$D/dev_speakers.txt" --num-shards 4 | tail -3
fi
BLSTM=jobs/configs/librispeech_mini_blstm_ctc.yaml
if [ "$STAGE" != decode ]; then
    train_run "$ROOT" blstm_ctc 2 --config "$BLSTM"
    # 1-bit after 6 epochs of float32 (so762's BLSTM wanted the plateau's exit first)
    train_run "$ROOT" blstm_ctc_onebit 2 --config "$BLSTM" exchange.aggregation=striped \
        exchange.codec=onebit exchange.cold_start_frames=9300000
    # INT4 as the paper does it (SAWB weights, BAC activations, the first layer float), fine-tuned
    # from the float32 model for 4 epochs at half the rate (experiments/rnnt_so762.sh's int4)
    train_run "$ROOT" blstm_ctc_int4 2 --config "$BLSTM" "train.init_from=$PWD/$ROOT/blstm_ctc" \
        train.epochs=4 optim.lr=2.5e-7 qat.weights=sawb qat.activations=bac qat.weight_bits=4 \
        qat.activation_bits=4 qat.first_layer=float
    # the Conformer's frame CE targets: the BLSTM-CTC model's forced alignment of every
    # utterance's BPE pieces (hpcsgd align --fill: each piece up to the next), prepped as frame
    # labels beside the same features, tokens and BPE model (archive_ali)
    if want conformer_ctc && [ ! -f "$ROOT/archive_ali/train/index.json" ]; then
        mkdir -p "$ROOT/align"
        for part in train cv; do
            .venv/bin/hpcsgd align "$ROOT/blstm_ctc" --data "$A/$part" \
                --ctm "$ROOT/align/$part.ctm" --fill
        done
        cat "$ROOT/align/train.ctm" "$ROOT/align/cv.ctm" > "$ROOT/align/all.ctm"
        .venv/bin/hpcsgd prep "${LS:?set LS to LibriSpeech/train-clean-5}" "$ROOT/archive_ali" \
            --tokens bpe,chars --token-inventory "$A/train" --alignments "$ROOT/align/all.ctm" \
            --speakers "$D/train_speakers.txt,$D/dev_speakers.txt" \
            --cv-speakers "$D/dev_speakers.txt" --num-shards 4 | tail -3
    fi
    train_run "$ROOT" conformer_ctc 2 --config jobs/configs/librispeech_mini_conformer_ctc.yaml
    # the same at twice the rate (Adam's step 4e-3, the BLSTM recipe's): the frame CE head's
    # loss as flat as CTC's for 4 epochs, stopped
    train_run "$ROOT" conformer_ctc_fce_lr4e3 2 \
        --config jobs/configs/librispeech_mini_conformer_ctc.yaml optim.lr=5.0e-7
    # without the frame CE head, on the archive without frame labels, a 12-epoch schedule (28
    # min alone on 2 cores): 6 epochs on CTC's blank plateau, stopped; then at half the rate
    NOCE="data.train=$A/train data.cv=$A/cv model.frame_ce=0"
    train_run "$ROOT" conformer_ctc_short 2 --config jobs/configs/librispeech_mini_conformer_ctc.yaml \
        $NOCE train.epochs=12
    train_run "$ROOT" conformer_ctc_halflr 2 --config jobs/configs/librispeech_mini_conformer_ctc.yaml \
        $NOCE train.epochs=12 optim.lr=2.5e-7
    # its encoder from so762's phone Conformer-CTC (experiments/conformer_so762.sh's cf_f32:
    # the same encoder and features), the BPE output layer from its init; 10 epochs (on the
    # plateau after 2, stopped: experiments/librispeech_mini.md)
    train_run "$ROOT" conformer_ctc_from_so762 2 \
        --config jobs/configs/librispeech_mini_conformer_ctc.yaml $NOCE train.epochs=10 \
        "train.init_from=$PWD/runs/conformer/cf_f32" train.init_from_part=encoder
    train_run "$ROOT" conformer_rnnt 2 --config jobs/configs/librispeech_mini_conformer_rnnt.yaml \
        "train.init_from=$PWD/$ROOT/conformer_ctc"
    # the same on a 5-epoch schedule (what one session's time allowed)
    train_run "$ROOT" conformer_rnnt_e5 2 \
        --config jobs/configs/librispeech_mini_conformer_rnnt.yaml \
        "train.init_from=$PWD/$ROOT/conformer_ctc" train.epochs=5
fi
[ "$STAGE" = train ] && exit 0
G=$ROOT/tlg_bpe_w3   # a word 3-gram of the training speakers' transcripts, over the BPE pieces
[ -f "$G/graph.json" ] || .venv/bin/hpcsgd mkgraph "$A/train" "$G" --kind words \
    --topology ctc --tokens bpe --order 3 > /dev/null
for name in blstm_ctc blstm_ctc_onebit blstm_ctc_int4 conformer_ctc conformer_ctc_short \
        conformer_ctc_halflr conformer_ctc_from_so762; do
    want "$name" && [ -d "$ROOT/$name" ] || continue
    echo "== $name"
    .venv/bin/hpcsgd decode "$ROOT/$name" --data "$A/cv" --greedy --ctm \
        | grep -E "^%|interval|training transcripts"
    .venv/bin/hpcsgd decode "$ROOT/$name" --data "$A/cv" --graph "$G" --tune --ctm \
        | grep -E "^%|interval|acoustic scale [0-9]|held out|vocabulary"
done
for name in conformer_rnnt conformer_rnnt_e5; do
    want "$name" && [ -d "$ROOT/$name" ] || continue
    echo "== $name"
    .venv/bin/hpcsgd decode "$ROOT/$name" --data "$A/cv" --greedy --ctm | grep -E "^%|interval"
    .venv/bin/hpcsgd decode "$ROOT/$name" --data "$A/cv" --beam-size 4 | grep -E "^%|interval"
    .venv/bin/hpcsgd decode "$ROOT/$name" --data "$A/cv" --beam-size 4 --lm-order 4 \
        --tune | grep -E "^%|interval|held out"
done
