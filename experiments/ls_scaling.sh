#!/usr/bin/env bash
# Issue 72 item 4, how cost grows with the work (docs/benchmarks.md "How cost grows with the
# corpus"; notes: experiments/ls_scaling.md):
#   1. prep wall time, peak memory and archive size at 1x, 4x and 16x Mini LibriSpeech's 21
#      training speakers (4.3 h): 1x the recipe's archive (experiments/librispeech_mini.sh);
#      4x the same with --speed-perturb 0.9,0.95,1.0,1.1 (4 copies, 17.5 h); 16x a Kaldi data
#      directory listing the training speakers' FLAC files 4 times under r0- .. r3- ids
#      (experiments/ls_scaling_copies.py, no audio copied) with the same speed perturbation
#      (70 h). The dev speakers once each (the cv part, not timed apart); the same prep options
#      otherwise (BPE 256 learnt from each scale's training text, 4 shards); and prep's peak
#      memory writing one of 64 shards of the 16x corpus (shards of the 1x archive's size);
#   2. `hpcsgd bench loader` on each archive's training part (the whole-utterance loader the
#      CTC and Conformer models read, whole epochs, one core): frames/s and peak resident memory;
#   3. `hpcsgd bench train` of the BLSTM-CTC recipe at 1, 2 and 4 ranks (4 ranks on 2 cores:
#      oversubscribed, 1 thread each);
#   4. `hpcsgd bench plan` for the Conformer-CTC recipe on 16 nodes of InfiniBand HDR (100
#      and 200 Gbit/s, 2 us): T_frm from `bench train` of the Conformer at 1 rank, T_upd and the
#      codec's passes from `bench exchange --parameters` at the Conformer's size.
# One thing at a time on an otherwise idle machine (a busy core slows a 2-thread rank 7-fold);
# about 15 min on 2 cores (Zen 4), 5.4 GB of disk.
# It needs runs/ls/archive (experiments/librispeech_mini.sh's prep, its first command): the
# configs of 3 and 4 read its index for the input and token sizes.
#   LS=/path/to/LibriSpeech/train-clean-5 bash experiments/ls_scaling.sh
# Writes runs/ls_scale/: x1, x4, x16 (archives), *.prep.log, loader_x*.json, train_*.json,
# exchange_conformer.json, plan_conformer.json.
set -euo pipefail
cd "$(dirname "$0")/.."
export MPIR_CVAR_ENABLE_HEAVY_YIELD=1   # 4 ranks on 2 cores: waiting ranks yield the core
LS=${LS:?set LS to LibriSpeech/train-clean-5}
D=../shared/data/librispeech_mini
S=runs/ls_scale
HPCSGD=${HPCSGD:-.venv/bin/hpcsgd}
PY=${PY:-.venv/bin/python}
mkdir -p "$S"
stamp() { echo "$(date -u '+%F %H:%M:%S UTC'), commit $(git rev-parse --short HEAD)," \
    "$(lscpu | grep -m1 'Model name' | sed 's/  */ /g'), load $(cut -d' ' -f1-3 /proc/loadavg)"; }
prep() {   # NAME DATA_DIR CV_SPEAKERS [options]: timed, then the archive's size
    local name=$1 data=$2 cv=$3; shift 3
    [ -f "$S/$name/train/index.json" ] && return 0
    stamp > "$S/$name.prep.log"
    /usr/bin/time -v "$HPCSGD" prep "$data" "$S/$name" --tokens bpe,chars --bpe-size 256 \
        --cv-speakers "$cv" --num-shards 4 "$@" >> "$S/$name.prep.log" 2>&1
    grep -E "real time|index.json|Elapsed|Maximum resident" "$S/$name.prep.log"
    du -sb "$S/$name/train" "$S/$name/cv"
}
prep x1 "$LS" "$D/dev_speakers.txt" --speakers "$D/train_speakers.txt,$D/dev_speakers.txt"
prep x4 "$LS" "$D/dev_speakers.txt" --speakers "$D/train_speakers.txt,$D/dev_speakers.txt" \
    --speed-perturb 0.9,0.95,1.0,1.1
[ -f "$S/data_r4/wav.scp" ] || PYTHONPATH=. "$PY" experiments/ls_scaling_copies.py "$LS" \
    "$D/train_speakers.txt" "$D/dev_speakers.txt" 4 "$S/data_r4"
prep x16 "$S/data_r4" "$S/data_r4/cv_speakers.txt" --speed-perturb 0.9,0.95,1.0,1.1
# prep's memory with shards of the 1x size: the 16x corpus in 64 shards, the first one alone
/usr/bin/time -v "$HPCSGD" prep "$S/data_r4" "$S/x16_64" --tokens bpe,chars --bpe-size 256 \
    --cv-speakers "$S/data_r4/cv_speakers.txt" --num-shards 64 --shard-index 0 \
    --speed-perturb 0.9,0.95,1.0,1.1 > "$S/x16_64shards_one.prep.log" 2>&1
grep -E "wrote .*/train/|Maximum resident" "$S/x16_64shards_one.prep.log"
rm -rf "$S/x16_64"

for x in x1 x4 x16; do   # the page cache holds all three archives (5.3 GB)
    stamp
    "$HPCSGD" bench loader "$S/$x/train" --seconds 3 --json "$S/loader_$x.json" | tail -6
done

stamp
"$HPCSGD" bench train --config jobs/configs/librispeech_mini_blstm_ctc.yaml --ranks 1,2,4 \
    --exchange allreduce,onebit --rounds 5 --steps 2 --json "$S/train_blstm_ctc.json" | tail -22

CF=jobs/configs/librispeech_mini_conformer_ctc.yaml
stamp
"$HPCSGD" bench train --config "$CF" --ranks 1 --minibatch 2000,4000,8000 \
    --exchange allreduce --rounds 3 --steps 2 --json "$S/train_conformer_k1.json" | tail -12
M=$("$PY" -c "import json; print(json.load(open('$S/train_conformer_k1.json'))['params'])")
stamp
"$HPCSGD" bench exchange --parameters "$M" --ranks 2 --codecs onebit \
    --json "$S/exchange_conformer.json" | tail -12
# 960 h = 345M frames; N = 128000 frames a step: 8000 (the recipe's) per node at K = 16
"$HPCSGD" bench plan --train-json "$S/train_conformer_k1.json" \
    --exchange-json "$S/exchange_conformer.json" --link-gbps 100,200 --latency-us 2 \
    --minibatch 32000,128000 --kmax 32 --json "$S/plan_conformer.json" > "$S/plan_conformer.log"
head -12 "$S/plan_conformer.log"
