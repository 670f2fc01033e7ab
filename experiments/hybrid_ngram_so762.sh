#!/usr/bin/env bash
# The hybrids against the CTC models in the same search (issue 53): decode_so762.sh's DNN
# (jobs/configs/so762.yaml, float32) and BLSTM (so762_blstm.yaml) trained on the CTC archive
# (its frame labels; the same 112 training and 13 held-out speakers as ctc_so762.sh), then
# decoded through a phone bigram and a phone 5-gram HLG of the training archive, with the
# scales tuned (--tune) at each insertion penalty of -1 .. 3 (a hybrid's --tune keeps the
# penalty it is given; the CTC models' bonuses of -3 and -2 made the DNN insert 400-2000
# phones through the bigram: 68.26 and 114.55 PER). The CTC models' figures: ctc_so762.sh.
#   bash experiments/hybrid_ngram_so762.sh     (needs runs/so762/archive_ctc: docs/ctc.md)
set -euo pipefail
cd "$(dirname "$0")/.."
export MPIR_CVAR_ENABLE_HEAVY_YIELD=1   # the trainer sets 1 thread per rank (2 ranks, 2 cores)
source experiments/train_run.sh
ROOT=runs/hybrid_ngram
A=runs/so762/archive_ctc
STAGE=${STAGE:-all}
if [ "$STAGE" != decode ]; then
    train_run "$ROOT" dnn 2 --config jobs/configs/so762.yaml "data.train=$A/train" \
        "data.cv=$A/cv" train.tensorboard=false
    train_run "$ROOT" blstm 2 --config jobs/configs/so762_blstm.yaml "data.train=$A/train" \
        "data.cv=$A/cv" train.tensorboard=false
fi
[ -f "$ROOT/hlg_phones/graph.json" ] || .venv/bin/hpcsgd mkgraph "$A/train" "$ROOT/hlg_phones" \
    --kind phones > /dev/null
[ -f "$ROOT/hlg_phones5/graph.json" ] || .venv/bin/hpcsgd mkgraph "$A/train" \
    "$ROOT/hlg_phones5" --kind phones --order 5 > /dev/null
for name in ${MODELS:-dnn blstm}; do
    for graph in ${GRAPHS:-hlg_phones hlg_phones5}; do
        for p in ${PENALTIES:--1 0 1 2 3}; do
            echo "== $name $graph insertion penalty $p"
            .venv/bin/hpcsgd decode "$ROOT/$name" --data "$A/cv" --graph "$ROOT/$graph" \
                --tune --insertion-penalty "$p" --out "$ROOT/$name/decode/${graph}_p$p" \
                | grep -E "^%PER|interval|held out"
        done
    done
done
