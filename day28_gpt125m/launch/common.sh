#!/usr/bin/env bash
# Sourced by the launch scripts beside it: the training arguments every launcher passes, as a
# named array (Megatron-LM's style). Every value can be overridden from the environment
# (STRATEGY=zero3 STEPS=100 ...); DRY_RUN=1 prints the command instead of running it.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."   # the repository root
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1}
export CUDA_DEVICE_MAX_CONNECTIONS=${CUDA_DEVICE_MAX_CONNECTIONS:-1}  # TP/SP comm order (megatron)

CONFIG=${CONFIG-day28_gpt125m/gpu.toml}  # CONFIG= (empty): the script's own CPU-sized defaults
TRAIN_ARGS=(--strategy "${STRATEGY:-fsdp2}" --steps "${STEPS:-50}")
if [ -n "$CONFIG" ]; then TRAIN_ARGS+=(--config "$CONFIG"); fi
MODEL_PARALLEL_ARGS=()
if [ -n "${TP:-}" ]; then MODEL_PARALLEL_ARGS+=(--tp "$TP"); fi
if [ -n "${PP:-}" ]; then MODEL_PARALLEL_ARGS+=(--pp "$PP"); fi

run() {   # run "$@" or, with DRY_RUN=1, print it (quoted, one line)
    if [ -n "${DRY_RUN:-}" ]; then printf '%q ' "$@"; echo; else "$@"; fi
}
