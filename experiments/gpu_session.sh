#!/usr/bin/env bash
# The one prepared run for a session lent the GPU machine (issues 44 and 45; docs/gpu.md).
# Here, in the checkout:   ../shared/gpu/prepare
# Device tool:             run  command="bash .gpu/on-device.sh bash experiments/gpu_session.sh"
#                          carry=[".gpu"]  timeout_s=600
# Parts run in priority order, each under its own time limit, so that a hang costs one part:
#   tests     HPCSGD_TEST_GPU=1 on every GPU test file, every failure reported
#   train46m  bench train, the paper's 46M DNN, float32/mixed/bf16 beside PyTorch eager/AMP
#   small     bench train on the demo DNN with CUDA Graphs beside PyTorch eager and
#             torch.compile(reduce-overhead), then without graphs, with the host's work per
#             step (census); small2: the same for the so762 DNN and BLSTM
#   exchange  bench exchange --device cuda, 1 and 2 ranks: each codec pass against the copy
#   demo      the demo trained on 1 and 2 GPU ranks (held-out frame accuracy)
#   mixed     the demo on one GPU rank in float32, mixed (each scaler: static 256, backoff,
#             logmax) and bf16
#   ctc       issue 53: the CTC loss kernel beside PyTorch's CUDA ctc_loss (bench ctc), and
#             so762_ctc.yaml's CTC model's step (stacked frames, BLSTM) beside PyTorch's
#             LSTM/CTCLoss on the card, float32 and mixed (bench train --model ctc)
#   rnnt      issue 54: so762_rnnt.yaml's transducer step on the card (on the demo archive),
#             then beside PyTorch + torchaudio's rnnt_loss (a part of its own: it stops where
#             torchaudio is missing)
# ONLY="tests small" runs those parts only. The limits add up to more than one call's 600 s
# and a session's 15 minutes of device time (a start costs 1-2 of them), so a session runs
# ONLY="tests train46m small" first (limits 240 + 150 + 180 s; prep 120 s: give the call
# timeout_s=600; results are packed after every part, so a call cut off keeps what it did)
# and, with the time left, ONLY="exchange mixed", then small2, demo.
# Everything lands in $OUT (8 files at most): session.log (all output, with the GPU, the CPU
# and the commit) and results.tgz (the JSON files and the demo runs' metrics).
set -uo pipefail
OUT=${OUT:-runs/gpu_session}
mkdir -p "$OUT" runs/gpu_session
LOG="$OUT/session.log"
J=runs/gpu_session
ONLY=${ONLY:-"tests train46m small exchange mixed small2 demo ctc rnnt"}
want() { [[ " $ONLY " == *" $1 "* ]]; }
part() {   # part NAME SECONDS CMD...: one part, its time and exit status in the log
    local name=$1 limit=$2; shift 2
    want "$name" || return 0
    echo "=== $name: $* (limit ${limit}s, $(date -u +%H:%M:%S))" >> "$LOG"
    local t0=$SECONDS
    timeout --kill-after=10 "$limit" "$@" >> "$LOG" 2>&1
    echo "=== $name: exit $? after $((SECONDS - t0)) s" >> "$LOG"
    pack   # after every part: a call cut off at its limit still returns what was done
}
pack() {
    local files
    files=$(cd "$J" && ls *.json demo_*/metrics.jsonl 2>/dev/null)
    [ -n "$files" ] && tar czf "$OUT/results.tgz" -C "$J" $files
    return 0
}

{
    echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)"
    nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
    lscpu | grep -m1 "Model name" || true
    python -c "import numba, numba_cuda, cupy, torch; print('numba', numba.__version__, 'numba-cuda', numba_cuda.__version__, 'cupy', cupy.__version__, 'torch', torch.__version__)" || true
} > "$LOG" 2>&1

# the demo archive (bundled data): the small models' input and label sizes, and the demo runs
if want small || want small2 || want demo || want mixed || want rnnt; then
    part prep 120 hpcsgd prep data_prep/demo/so762 runs/demo/archive \
        --alignments data_prep/demo/so762/phones.ctm --labels data_prep/demo/so762/labels.txt \
        --cv-speakers 8 --num-shards 2
fi
# the so762 configs on the demo archive (the same 40 log-mel features and 40 labels)
for c in so762 so762_blstm so762_rnnt; do
    sed -e 's#runs/so762/archive/#runs/demo/archive/#' \
        -e 's#runs/so762/archive_ctc/#runs/demo/archive/#' "jobs/configs/$c.yaml" > "$J/$c.yaml"
done

GPU_TESTS="tests/test_codecs_cuda.py tests/test_model_cuda.py tests/test_lstm_cuda.py
           tests/test_quantize_cuda.py tests/test_gpu_ranks.py tests/test_eval_cuda.py
           tests/test_graphs.py tests/test_mixed_cuda.py tests/test_bf16_cuda.py
           tests/test_ctc_cuda.py tests/test_ctc_model_cuda.py tests/test_rnnt_cuda.py
           tests/test_rnnt_model_cuda.py"
part tests 240 env HPCSGD_TEST_GPU=1 python -m pytest -q -rf -p no:cacheprovider $GPU_TESTS

STEPS=(--steps 20 --warmup 5 --rounds 3)
part train46m 150 hpcsgd bench train --device cuda --ranks 1 --exchange allreduce \
    --double-buffering off --precision float32,mixed,bf16 --pytorch "${STEPS[@]}" \
    --json "$J/train_46m.json"
# small: the demo DNN with CUDA Graphs beside PyTorch eager and torch.compile, then without
# graphs; small2: the so762 DNN and BLSTM the same way
for c in jobs/configs/demo.yaml "$J/so762.yaml" "$J/so762_blstm.yaml"; do
    name=$(basename "$c" .yaml)
    group=$([ "$name" = demo ] && echo small || echo small2)
    part "$group" 120 hpcsgd bench train --device cuda --config "$c" --ranks 1 \
        --exchange allreduce,onebit --double-buffering off --cuda-graphs --pytorch \
        --pytorch-compile "${STEPS[@]}" --json "$J/train_${name}_graphs.json"
    part "$group" 60 hpcsgd bench train --device cuda --config "$c" --ranks 1 \
        --exchange allreduce,onebit --double-buffering off "${STEPS[@]}" \
        --json "$J/train_${name}_eager.json"
done
part exchange 120 hpcsgd bench exchange --device cuda --ranks 1,2 \
    --codecs onebit,kbit4,dettmers,float16,float32 --repeats 5 --json "$J/exchange.json"
for k in 1 2; do
    part demo 120 mpiexec -n "$k" python -m mpi4py -m hpcsgd.cli train \
        --config jobs/configs/demo.yaml train.device=cuda "train.run_dir=$J/demo_k$k"
    part demo 30 hpcsgd eval "$J/demo_k$k" --data runs/demo/archive/cv --device cuda \
        --json "$J/demo_k${k}_eval.json"
done
# issue 45: GPU mixed against GPU float32 at equal frames, with each scaler (the demo corpus:
# so762's archive is not on the GPU machine)
# (static at 256: summed gradients overflow 1024 at the start, experiments/precision_so762.md)
for v in "float32 none" "mixed static train.loss_scale_init=256" "mixed backoff" \
         "mixed logmax" "bf16 none"; do
    set -- $v
    part mixed 120 python -m mpi4py -m hpcsgd.cli train --config jobs/configs/demo.yaml \
        train.device=cuda train.precision=$1 train.loss_scale=$2 ${3:-} \
        "train.run_dir=$J/demo_$1_$2"
    part mixed 30 hpcsgd eval "$J/demo_$1_$2" --data runs/demo/archive/cv --device cuda \
        --json "$J/demo_$1_$2_eval.json"
done
part ctc 90 hpcsgd bench ctc --device cuda --json "$J/ctc_loss.json"
part ctc 150 hpcsgd bench train --device cuda --model ctc --ranks 1 --exchange allreduce \
    --double-buffering off --precision float32,mixed --pytorch "${STEPS[@]}" \
    --json "$J/train_ctc.json"
part rnnt 120 hpcsgd bench train --device cuda --config "$J/so762_rnnt.yaml" --ranks 1 \
    --exchange allreduce --double-buffering off "${STEPS[@]}" --json "$J/train_rnnt.json"
part rnnt 150 hpcsgd bench train --device cuda --config "$J/so762_rnnt.yaml" --ranks 1 \
    --exchange allreduce --double-buffering off --pytorch "${STEPS[@]}" \
    --json "$J/train_rnnt_pytorch.json"
grep -h "NumbaPerformanceWarning" "$J"/demo_k*/logs/*.log >> "$LOG" 2>/dev/null \
    && echo "(the lines above: NumbaPerformanceWarning in a training log)" >> "$LOG"
pack
echo "done $(date -u +%H:%M:%S)" >> "$LOG"
