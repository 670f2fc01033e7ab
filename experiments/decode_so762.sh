#!/usr/bin/env bash
# Issue 46 on so762 (112 training, 13 held-out speakers): the models of the shipped recipes
# decoded with hpcsgd's own graphs, PER and WER beside frame accuracy. 2 ranks each:
#   float32   jobs/configs/so762.yaml (DNN 440-1024x4-40, Adam, linear decay, 2 epochs)
#   onebit    the same with 1-bit SGD (striped, error feedback, the config's cold start)
#   mixed     the same in mixed precision (float16 emulated, backoff loss scaling)
#   int4      float32 fine-tuned 2 epochs with INT4 QAT (SAWB weights, BAC inputs, half the
#             rate, linear decay), exported as INT4 codes (`hpcsgd export --int4`)
#   blstm     jobs/configs/so762_blstm.yaml (40-BLSTM 256x2-40, 6 epochs)
# Graphs from the training archive only: phones (bigram) and words (CMUdict + word bigram of
# the training transcripts). Then experiments/summarize_decode.py runs the decodes and prints
# the table (docs/results.md, "Recognition error rates on so762").
#   bash experiments/decode_so762.sh                (needs runs/so762/archive: see jobs/configs/so762.yaml)
#   ONLY="blstm" bash experiments/decode_so762.sh   runs whose name starts with ONLY
set -euo pipefail
cd "$(dirname "$0")/.."
ROOT=${ROOT:-runs/decode}
TEXT=${TEXT:-../shared/data/so762_dev/text}
export MPIR_CVAR_ENABLE_HEAVY_YIELD=1   # the trainer sets 1 thread per rank (2 ranks, 2 cores)
source experiments/train_run.sh
train() {   # NAME CONFIG [key=value ...]
    local name=$1 config=$2; shift 2
    train_run "$ROOT" "$name" 2 --config "$config" train.tensorboard=false "$@"
}
mkdir -p "$ROOT"
.venv/bin/hpcsgd mkgraph runs/so762/archive/train "$ROOT/graph_phones" --kind phones
.venv/bin/hpcsgd mkgraph runs/so762/archive/train "$ROOT/graph_words" --kind words --text "$TEXT"
train float32 jobs/configs/so762.yaml
train onebit jobs/configs/so762.yaml exchange.aggregation=striped exchange.codec=onebit
train mixed jobs/configs/so762.yaml train.precision=mixed train.loss_scale=backoff
train int4 jobs/configs/so762.yaml "train.init_from=$PWD/$ROOT/float32" \
    qat.weights=sawb qat.weight_bits=4 qat.activations=bac qat.activation_bits=4 optim.lr=1.95e-6
case int4 in "${ONLY:-}"*) .venv/bin/hpcsgd export "$ROOT/int4" --int4 --out "$ROOT/int4/model_int4.h5" ;; esac
train blstm jobs/configs/so762_blstm.yaml
