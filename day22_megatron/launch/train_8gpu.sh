#!/usr/bin/env bash
# 8 GPUs, one node: TP 2 x PP 2 with interleaving (3 layers per virtual stage: v = 2) x DP 2,
# the distributed optimizer sharding Adam's state over the 2 DP ranks.
#   bash day22_megatron/launch/train_8gpu.sh [--more-flags]
source "$(dirname "$0")/common.sh"
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NUM_NODES=1
MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size 2
    --pipeline-model-parallel-size 2
    --num-layers-per-virtual-pipeline-stage 3
    --sequence-parallel
    --use-distributed-optimizer
)
launch "$@"
