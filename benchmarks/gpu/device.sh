#!/bin/sh
# `make gpu-check` on the lent GPU machine: install the carried wheels (made by `make gpu-wheels`) into
# GPU_SITE with the image's python3, then run the check from this source tree on PYTHONPATH. No network,
# no virtual environment. Usage: sh benchmarks/gpu/device.sh OUT_DIR  (GPU_CHECK_ARGS: extra options)
set -eu
out=${1:?usage: sh benchmarks/gpu/device.sh OUT_DIR}
wheels=${GPU_WHEELS:-.gpu-wheels}
site=${GPU_SITE:-/tmp/site}
if ! ls "$wheels"/*.whl >/dev/null 2>&1; then
    echo "gpu-check: error: no wheels in $wheels (run make gpu-wheels on the CPU machine, carry $wheels)" >&2
    exit 2
fi
python3 -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target "$site" "$wheels"/*.whl
PYTHONPATH="$site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 \
    exec python3 benchmarks/gpu_check.py --out "$out" --source-stamp "$wheels/source.json" ${GPU_CHECK_ARGS:-}
