#!/usr/bin/env bash
# Two nodes x 8 GPUs, torchrun's c10d rendezvous: run this same line on both nodes.
#   node 0: NODE_RANK=0 MASTER_ADDR=<node 0> bash day28_gpt125m/launch/train_2node.sh
#   node 1: NODE_RANK=1 MASTER_ADDR=<node 0> bash day28_gpt125m/launch/train_2node.sh
# (NCCL_SOCKET_IFNAME / NCCL_IB_HCA select the network if the default is wrong; NCCL_DEBUG=INFO
# prints what it picked: day 16.)
source "$(dirname "$0")/common.sh"
run torchrun --nnodes "${NUM_NODES:-2}" --nproc_per_node "${GPUS_PER_NODE:-8}" \
    --node_rank "${NODE_RANK:?set NODE_RANK}" --rdzv_backend c10d \
    --rdzv_endpoint "${MASTER_ADDR:?set MASTER_ADDR}:${MASTER_PORT:-29500}" --rdzv_id "${RDZV_ID:-day28}" \
    -m day28_gpt125m.train "${TRAIN_ARGS[@]}" "${MODEL_PARALLEL_ARGS[@]}" "$@"
