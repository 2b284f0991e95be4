#!/usr/bin/env bash
# 2 GPUs, one node: TP 2 (a 124M model fits one GPU; this is the smallest TP layout to study).
#   bash day22_megatron/launch/train_2gpu.sh [--more-flags]
source "$(dirname "$0")/common.sh"
GPUS_PER_NODE=${GPUS_PER_NODE:-2}
NUM_NODES=1
MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size 2
    --sequence-parallel
)
launch "$@"
