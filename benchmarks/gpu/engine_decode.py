"""The `engine` phase: the torch rollout engine's decode step and its continuous batching, on the device.

For each model of `params["decode"]` (the shipped `models/tiny`, or a `gpu.shapes` shape written with
random weights), `benchmarks/engine_throughput.py`'s step sweep: ms per `TorchEngine.step()` with every
row decoding after a `prompt`-token prefill, at 1, 2, 4, ... `max_rows` rows. Then, on one model, that
script's comparison: continuous batching (`TorchEngine`, a finished row refilled at once) against HF
`generate` on static batches of the same size, both generating the same long-tailed lengths; the ratio
of useful tokens/s. The model's dtype is the engine's default for the device (bf16 on CUDA).

`engine_options` are keyword arguments of `TorchEngine` for the whole phase (an engine variant, e.g.
`cuda_graphs=false` for the eager step), checked against its signature first and handed to
engine_throughput.py, whose own arguments they override. Each engine's rows hold the longest request it
is given; its KV cache plan is recorded with its figures.
"""

from __future__ import annotations

import argparse
import inspect
import tempfile
from pathlib import Path
from typing import Any

from april.hf import set_torch_threads
from gpu.record import PhaseRecord
from gpu.shapes import SHAPES, write_model_dir

REPO = Path(__file__).resolve().parents[2]


def check_options(options: dict[str, Any]) -> dict[str, Any]:
    """`options`, if `TorchEngine` takes them (ValueError naming them otherwise)."""
    from actors.engines.torch_engine import TorchEngine

    try:
        inspect.signature(TorchEngine).bind_partial(Path("."), 1, None, **options)
    except TypeError as exc:
        raise ValueError(
            f"engine option(s) {sorted(options)}: TorchEngine does not take them ({exc})"
        ) from exc
    return options


def model_dir(spec: dict[str, str], scratch: Path, device: str) -> Path:
    """The directory of a model spec: `{"dir": ...}` as it is, `{"shape": ...}` written once."""
    if "dir" in spec:
        return REPO / spec["dir"]
    from april.hf import resolve_dtype

    path = scratch / spec["name"]
    if not path.exists():
        write_model_dir(SHAPES[spec["shape"]], path, device, resolve_dtype("auto", device))
    return path


def decode_sweep(path: Path, params: dict[str, Any]) -> dict[str, Any]:
    import engine_throughput

    ns = argparse.Namespace(
        max_active=params["max_rows"],
        step_prompt=params["prompt"],
        step_repeats=params["repeats"],
        seed=0,
        device=params["device"],
        dtype="auto",
        cuda_graphs=True,
        engine_options=params["engine_options"],
    )
    rows, how = engine_throughput.step_sweep(path, ns)
    return {
        "prompt": params["prompt"],
        "repeats": params["repeats"],
        **how,
        "rows": rows,
        "ms_at": {str(r["active"]): r["ms_per_step"] for r in rows},
    }


def batching(path: Path, params: dict[str, Any]) -> dict[str, Any]:
    import engine_throughput
    import numpy as np

    from april.hf import load_model

    spec = params["batching"]
    ns = argparse.Namespace(
        **spec,
        seed=0,
        device=params["device"],
        dtype="auto",
        cuda_graphs=True,
        engine_options=params["engine_options"],
    )
    prompts, lengths = engine_throughput.workload(ns)
    continuous = engine_throughput.run_engine(path, ns, spec["slots"], prompts, lengths)
    model = load_model(path, params["device"])
    static = engine_throughput.run_generate(model, ns, spec["slots"], prompts, lengths)
    arr = np.array(lengths)
    return {
        **spec,
        "lengths": {
            "median": float(np.median(arr)),
            "p99": float(np.percentile(arr, 99)),
            "max": int(arr.max()),
            "total": int(arr.sum()),
        },
        "continuous": continuous,
        "static_generate": static,
        "ratio": continuous["tokens_per_s"] / static["tokens_per_s"],
    }


def run(params: dict[str, Any], record: PhaseRecord) -> None:
    record.put("engine_options", check_options(params["engine_options"]))
    if params.get("threads"):
        set_torch_threads(params["threads"])
    decode: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="april-gpu-engine-") as tmp:
        paths = {}
        for spec in params["decode"]:
            try:
                paths[spec["name"]] = model_dir(spec, Path(tmp), params["device"])
                decode[spec["name"]] = decode_sweep(paths[spec["name"]], params)
            except Exception as exc:  # the next model is measured all the same
                record.error(f"decode {spec['name']}", exc)
            record.put("decode", decode)
        name = params["batching"]["model"]
        if name not in paths:
            raise RuntimeError(f"batching: its model {name!r} did not load (see the decode error)")
        record.put("batching", batching(paths[name], params))
