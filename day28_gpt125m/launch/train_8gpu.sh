#!/usr/bin/env bash
# One node, 8 GPUs. STRATEGY=zero3 (DP 8) or STRATEGY=tp_pp TP=2 PP=2 (DP 2), megatron the same.
#   STRATEGY=tp_pp TP=2 PP=2 bash day28_gpt125m/launch/train_8gpu.sh
source "$(dirname "$0")/common.sh"
run torchrun --standalone --nproc_per_node "${GPUS_PER_NODE:-8}" -m day28_gpt125m.train \
    "${TRAIN_ARGS[@]}" "${MODEL_PARALLEL_ARGS[@]}" "$@"
