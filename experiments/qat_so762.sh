#!/usr/bin/env bash
# Issue 20 on so762 (112 training, 13 held-out speakers): quantization-aware fine-tuning of the
# DNN of jobs/configs/so762_sgd.yaml (440-1024x4-40 sigmoid) and the BLSTM of
# jobs/configs/so762_blstm.yaml from their float32 runs, 2 ranks, float32 allreduce unless
# said otherwise:
#   float32 runs (EPOCHS epochs, the configs' newbob), then from each FINE epochs of linear
#   decay from lr0 = half the config's rate (the paper's recipe): float32 (the control: the
#   same extra epochs unquantized), INT8 (MAX weights and inputs), INT4 with MAX, SAWB
#   (weights and inputs), PACT and BAC inputs (SAWB weights); INT4 BAC trained from scratch
#   for EPOCHS epochs (how fast fine-tuning gets there); for the DNN also BAC + 1-bit SGD.
#   bash experiments/qat_so762.sh [EPOCHS] [FINE]    (needs runs/so762/archive: see jobs/configs/so762_sgd.yaml)
#   ONLY="dnn" bash experiments/qat_so762.sh           runs whose name starts with ONLY
# Metrics in runs/qat/<name>/metrics.jsonl; experiments/summarize_qat.py runs/qat prints the
# table, with the post-training quantized float models and the exported integer models.
set -euo pipefail
cd "$(dirname "$0")/.."
EPOCHS=${1:-6}
FINE=${2:-3}
export MPIR_CVAR_ENABLE_HEAVY_YIELD=1   # the trainer sets 1 thread per rank (2 ranks, 2 cores)
source experiments/train_run.sh
run() {   # NAME CONFIG EPOCHS [key=value ...]
    local name=$1 config=$2 epochs=$3; shift 3
    train_run runs/qat "$name" 2 --config "$config" train.epochs="$epochs" "$@"
}
ONEBIT=(exchange.aggregation=striped exchange.codec=onebit)
qat() {   # weights rule+bits, inputs rule+bits
    echo "qat.weights=$1" "qat.weight_bits=$2" "qat.activations=$3" "qat.activation_bits=$4"
}
for model in dnn blstm; do
    config=jobs/configs/so762_sgd.yaml
    [ "$model" = blstm ] && config=jobs/configs/so762_blstm.yaml
    lr=$(.venv/bin/python -c "from hpcsgd import config; print(config.load('$config')['optim.lr'] / 2)")
    run "${model}_float32" "$config" "$EPOCHS"
    tune=("train.init_from=$PWD/runs/qat/${model}_float32" schedule.type=linear "optim.lr=$lr")
    run "${model}_tune_float32" "$config" "$FINE" "${tune[@]}"
    run "${model}_tune_int8_max" "$config" "$FINE" "${tune[@]}" $(qat max 8 max 8)
    run "${model}_tune_int4_bac" "$config" "$FINE" "${tune[@]}" $(qat sawb 4 bac 4)
    run "${model}_tune_int4_max" "$config" "$FINE" "${tune[@]}" $(qat max 4 max 4)
    run "${model}_tune_int4_sawb" "$config" "$FINE" "${tune[@]}" $(qat sawb 4 sawb 4)
    run "${model}_tune_int4_pact" "$config" "$FINE" "${tune[@]}" $(qat sawb 4 pact 4)
    run "${model}_scratch_int4_bac" "$config" "$EPOCHS" $(qat sawb 4 bac 4)
    [ "$model" = blstm ] && continue   # the BLSTM: no 1-bit run (time)
    run "${model}_tune_int4_bac_onebit" "$config" "$FINE" "${tune[@]}" $(qat sawb 4 bac 4) \
        "${ONEBIT[@]}"
done
