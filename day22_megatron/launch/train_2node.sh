#!/usr/bin/env bash
# 2 nodes x 8 GPUs: TP inside each node (NVLink; TP=4 by default, so DP 2 per node), PP 2 across
# the nodes (one activation per micro-batch crosses the network). Run the same line on both nodes:
#   RDZV_HOST=<node 0's address> bash day22_megatron/launch/train_2node.sh
# The c10d rendezvous numbers the nodes; no --node_rank. The repository, and the data folder
# (DTL_CACHE, ~/.cache/dtl by default), must be at the same path on both nodes.
# TP=8 (DP 1) needs a model whose heads split over 8: GPT-2's 12 do not.
source "$(dirname "$0")/common.sh"
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
NUM_NODES=${NUM_NODES:-2}
MODEL_PARALLEL_ARGS=(
    --tensor-model-parallel-size "${TP:-4}"
    --pipeline-model-parallel-size 2
    --sequence-parallel
    --use-distributed-optimizer
)
launch "$@"
