#!/usr/bin/env bash
# Sourced by the launch scripts beside it: the argument arrays every run shares, in the style of
# Megatron-LM's examples (examples/gpt3/train_gpt3_175b_distributed.sh). A script sets
# GPUS_PER_NODE, NUM_NODES and MODEL_PARALLEL_ARGS, then calls `launch`. Every value can be
# overridden from the environment (MODEL=tiny SEQ_LENGTH=32 ... for a CPU try-out);
# DRY_RUN=1 prints the torchrun command instead of running it.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/../.."   # the repository root: the module is day22_megatron

# Megatron sets this for TP/SP: one hardware queue, so a layer's communication kernels run in
# the order they were issued and overlap with compute as planned
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}

MODEL_ARGS=(
    --model "${MODEL:-gpt2-124m}"            # dtl.model preset: 12 layers, 12 heads, 768 wide
    --seq-length "${SEQ_LENGTH:-1024}"
)
TRAINING_ARGS=(
    --micro-batch-size "${MICRO_BATCH_SIZE:-4}"
    --global-batch-size "${GLOBAL_BATCH_SIZE:-64}"   # = dp x micro-batches x micro-batch size
    --train-iters "${TRAIN_ITERS:-50}"
    --lr "${LR:-6e-4}"
    --weight-decay 0.1
    --clip-grad 1.0
)

launch() {
    local distributed_args=(
        --nproc_per_node "$GPUS_PER_NODE"
        --nnodes "$NUM_NODES"
    )
    if [ "$NUM_NODES" -gt 1 ]; then   # every node runs this same line, unchanged
        # c10d: the rendezvous hands out the node ranks (torchrun ignores --node_rank with it);
        # its store runs in the agent on the endpoint's host, so give that host's address
        distributed_args+=(
            --rdzv_backend c10d
            --rdzv_endpoint "${RDZV_HOST:?set RDZV_HOST to the address of one node}:${RDZV_PORT:-29500}"
            --rdzv_id "${RDZV_ID:-day22}"
        )
    else
        distributed_args+=(--standalone)
    fi
    local cmd=(torchrun "${distributed_args[@]}" -m day22_megatron.train_megatron
        "${MODEL_ARGS[@]}" "${TRAINING_ARGS[@]}" "${MODEL_PARALLEL_ARGS[@]}" "$@")
    if [ -n "${DRY_RUN:-}" ]; then
        printf '%q ' "${cmd[@]}"
        echo
    else
        "${cmd[@]}"
    fi
}
