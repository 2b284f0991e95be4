#!/usr/bin/env bash
# The deepspeed launcher (pdsh/ssh to every host in the hostfile), ZeRO-3 by default. It runs
# the script by path and passes --local_rank, which train.py accepts (and ignores: it reads
# LOCAL_RANK, as under torchrun).
#   bash day28_gpt125m/launch/deepspeed.sh                 (HOSTFILE=... to use another)
STRATEGY=${STRATEGY:-zero3}
source "$(dirname "$0")/common.sh"
run deepspeed --hostfile "${HOSTFILE:-day28_gpt125m/launch/hostfile}" \
    --num_gpus "${GPUS_PER_NODE:-8}" day28_gpt125m/train.py "${TRAIN_ARGS[@]}" "$@"
