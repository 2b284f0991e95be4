#!/usr/bin/env bash
# Two nodes x 8 GPUs, torchrun's c10d rendezvous: run this same line on both nodes.
#   RDZV_HOST=<node 0's address> bash day28_gpt125m/launch/train_2node.sh
# The rendezvous numbers the nodes (torchrun ignores --node_rank under c10d). The data shards and
# the checkpoints are written once and read by every node: out_dir and the data folder must be
# on a file system both nodes see (the run checks it at start and stops with one line if not).
# (NCCL_SOCKET_IFNAME / NCCL_IB_HCA select the network if the default is wrong; NCCL_DEBUG=INFO
# prints what it picked: day 16.)
source "$(dirname "$0")/common.sh"
ENDPOINT="${RDZV_HOST:?set RDZV_HOST}:${RDZV_PORT:-29500}"
# every node checks itself and meets the others before torchrun: one line per problem, exit 1
run python -m dtl.preflight --nnodes "${NUM_NODES:-2}" --endpoint "$ENDPOINT" --folders outputs
run torchrun --nnodes "${NUM_NODES:-2}" --nproc_per_node "${GPUS_PER_NODE:-8}" \
    --rdzv_backend c10d --rdzv_endpoint "$ENDPOINT" \
    --rdzv_id "${RDZV_ID:-day28}" \
    -m day28_gpt125m.train "${TRAIN_ARGS[@]}" "${MODEL_PARALLEL_ARGS[@]}" "$@"
