#!/bin/bash
# One learner node of docs/slurm/april.sbatch (one srun task per node): torchrun starts a rank per GPU.
# Node rank = the node's index in the step, so global rank 0 (the one that talks to the broker, writes
# the run directory and serves the weights) is on the step's first node, the head.
#
#   learner-node.sh RUN_DIR KEYS_DIR     (HEAD, MODEL, CONFIG, GPUS_PER_NODE from the environment)
set -euo pipefail
RUN_DIR=$1
KEYS=$2
: "${HEAD:?}" "${MODEL:?}" "${CONFIG:?}" "${GPUS_PER_NODE:?}"

exec torchrun --nnodes="$SLURM_NNODES" --node-rank="$SLURM_NODEID" --nproc-per-node="$GPUS_PER_NODE" \
    --master-addr="$HEAD" --master-port=29500 \
    "$(command -v april)" learner --run-dir "$RUN_DIR" --config "$CONFIG" --model "$MODEL" \
    --broker "tcp://$HEAD:5556" --set broker.curve_keys_dir="$KEYS"
