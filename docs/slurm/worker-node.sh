#!/bin/bash
# One worker node of docs/slurm/april.sbatch, run by srun on that node:
#
#   worker-node.sh keys   unpack this node's client key directory (a tar on stdin) into its local disk
#   worker-node.sh run    an SGLang server per GPU, then `april worker` driving them
#
# Everything the node keeps is under LOCAL, on its own disk: the keys and the weights cache (versions
# fetched from the learner, the newest weights.keep kept; the servers load them from there).
# HEAD, MODEL, CONFIG, GPUS_PER_NODE come from the environment (srun passes the batch script's on).
set -euo pipefail
LOCAL=${TMPDIR:-/tmp}/april-$SLURM_JOB_ID

case "${1:-}" in
keys)
    umask 077
    mkdir -p "$LOCAL/keys"
    tar -C "$LOCAL/keys" -xf -
    ;;
run)
    : "${HEAD:?}" "${MODEL:?}" "${CONFIG:?}" "${GPUS_PER_NODE:?}"
    SLOTS_PER_GPU=${SLOTS_PER_GPU:-64}
    mkdir -p "$LOCAL/logs"
    urls=()
    for ((gpu = 0; gpu < GPUS_PER_NODE; gpu++)); do
        port=$((30000 + gpu))
        CUDA_VISIBLE_DEVICES=$gpu python3 -m sglang.launch_server --model-path "$MODEL" \
            --host 127.0.0.1 --port "$port" --skip-tokenizer-init \
            --max-running-requests "$SLOTS_PER_GPU" --weight-version 0 \
            >"$LOCAL/logs/sglang-$gpu.log" 2>&1 &
        urls+=("http://127.0.0.1:$port")
    done
    for url in "${urls[@]}"; do # a server that never answers fails the step instead of hanging it
        timeout 900 bash -c 'until curl -sf "$0/server_info" >/dev/null; do sleep 5; done' "$url"
    done
    exec april worker --config "$CONFIG" --model "$MODEL" --broker "tcp://$HEAD:5555" \
        --slots $((GPUS_PER_NODE * SLOTS_PER_GPU)) \
        --set worker.sglang_urls="$(IFS=,; echo "${urls[*]}")" \
        --set broker.curve_keys_dir="$LOCAL/keys" --set weights.cache_dir="$LOCAL/weights"
    ;;
*)
    echo "worker-node.sh: expected 'keys' or 'run', got '${1:-}'" >&2
    exit 2
    ;;
esac
