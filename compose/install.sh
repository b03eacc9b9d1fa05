#!/bin/sh
# Install april into a new virtual environment: the build stage of compose/Dockerfile.
#
#   install.sh VARIANT SRC WHEELHOUSE VENV
#
# VARIANT cpu or gpu; SRC april's sources (pyproject.toml and the five packages); WHEELHOUSE a folder of
# wheels (`make wheelhouse`) or an empty one; VENV where the environment goes.
# With wheels in WHEELHOUSE, pip installs from there only (--no-index): the image then needs no registry.
# Without, from the registries: the CPU torch from PyTorch's index (TORCH_INDEX), DeepSpeed built against
# that torch, sglang (and the CUDA torch it pins) for the GPU variant.
set -eu
variant=$1 src=$2 wheelhouse=$3 venv=$4
case "$variant" in
    cpu) extras=worker,learner ;;
    gpu) extras=worker,learner,sglang ;;
    *) echo "april-install: VARIANT must be cpu or gpu, got '$variant'" >&2; exit 1 ;;
esac
python3 -c 'import sys; sys.exit(sys.version_info < (3, 11) and "april-install: the base image has Python " + sys.version.split()[0] + ", april needs 3.11+")'
python3 -m venv "$venv" || { echo "april-install: python3 -m venv failed: the base image needs Python's venv module (Debian: python3-venv)" >&2; exit 1; }
pip="$venv/bin/python -m pip"
if ls "$wheelhouse"/*.whl >/dev/null 2>&1; then
    made_for=$(cat "$wheelhouse/python-version" 2>/dev/null || echo unknown)
    here=$(python3 -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    if [ "$made_for" != "$here" ]; then
        echo "april-install: the wheelhouse was made for Python $made_for, the base image has $here: use a base image with Python $made_for, or make the wheelhouse with Python $here" >&2
        exit 1
    fi
    echo "april-install: from the wheelhouse ($(ls "$wheelhouse"/*.whl | wc -l) wheels), no registry"
    # a non-editable install: the sources are not in the image, only the environment
    $pip install --no-index --find-links "$wheelhouse" "$src[$extras]"
else
    echo "april-install: from the registries (no wheels in the wheelhouse)"
    $pip install --upgrade pip setuptools wheel
    if [ "$variant" = cpu ]; then
        # pinned and from the CPU index: a bare `torch` requirement pulls several GB of CUDA wheels
        $pip install "torch==${TORCH_VERSION:-2.13.0}" --index-url "${TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"
    else
        $pip install "sglang>=0.5.6"
    fi
    # DeepSpeed builds from source: without --no-build-isolation pip would build it against a fresh (CUDA)
    # torch in an isolated environment instead of the one installed above.
    $pip install --no-build-isolation "deepspeed>=0.15"
    $pip install "$src[$extras]"
fi
# What never runs in the image: torch's C++ test programs (torch/test, the test binaries in torch/bin) and,
# in the CPU image, which has no compiler to build extensions with, torch's C++ headers.
torch_dir=$($venv/bin/python -c 'import os, torch; print(os.path.dirname(torch.__file__))')
rm -rf "$torch_dir/test" "$torch_dir"/bin/test_* "$torch_dir"/bin/*Test
if [ "$variant" = cpu ]; then rm -rf "$torch_dir/include"; fi
$venv/bin/python -c 'import april, broker, actors.engines, learner, cli, torch; print("april-install: torch", torch.__version__)'
