#!/usr/bin/env bash
# One node, 2 GPUs: torchrun --standalone. STRATEGY=ddp|fsdp2|zero3 (tp_pp / megatron: TP=2).
#   bash day28_gpt125m/launch/train_2gpu.sh [--more-flags]
source "$(dirname "$0")/common.sh"
run torchrun --standalone --nproc_per_node "${GPUS_PER_NODE:-2}" -m day28_gpt125m.train \
    "${TRAIN_ARGS[@]}" "${MODEL_PARALLEL_ARGS[@]}" "$@"
