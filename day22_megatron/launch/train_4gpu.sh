#!/usr/bin/env bash
# 4 GPUs, one node: TP 2 x PP 2 (dp 1), 1F1B over global/micro = 16 micro-batches.
#   bash day22_megatron/launch/train_4gpu.sh [--more-flags]
source "$(dirname "$0")/common.sh"
GPUS_PER_NODE=${GPUS_PER_NODE:-4}
NUM_NODES=1
MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size 2
    --pipeline-model-parallel-size 2
    --sequence-parallel
)
launch "$@"
