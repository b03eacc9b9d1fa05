"""The `device` phase: which accelerator this is, its dense bf16 peak, and a large matrix product timed.

Identity: the name, memory, multiprocessors and compute capability torch reports, the driver (nvidia-smi),
torch's CUDA, and the versions of the libraries the other phases use. The vendor's dense bf16 peak comes
from `DENSE_BF16_TFLOPS`, matched by name; the measured peak is the best of `rounds` rounds of `reps`
n x n x n products (bf16 on CUDA, float32 on the CPU), timed between synchronisations, in the same run as
the phases that are set against it. Also `arch_list_for_deepspeed`: the parent's fix of an environment
DeepSpeed's op builder cannot read. Knows nothing of april.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import time
from typing import Any

from april.provenance import package_version
from gpu.record import PhaseRecord

# Dense (no sparsity) bf16 tensor-core TFLOP/s from NVIDIA's data sheets, by a part of the name torch
# reports; the first match wins, so the longer names come first (H100 SXM is "NVIDIA H100 80GB HBM3").
DENSE_BF16_TFLOPS: tuple[tuple[str, float], ...] = (
    ("GH200", 989.4),
    ("H200 NVL", 835.5),
    ("H200", 989.4),
    ("H100 NVL", 835.5),
    ("H100 PCIe", 756.0),
    ("H100", 989.4),
    ("A100", 312.0),
    ("L40S", 362.1),
    ("L40", 181.0),
    ("L4", 121.0),
)
LIBRARIES = ("torch", "transformers", "deepspeed", "pydantic", "pyzmq", "numpy")


def dense_bf16_peak(name: str) -> float | None:
    for part, tflops in DENSE_BF16_TFLOPS:
        if part in name:
            return tflops
    return None


def arch_list_for_deepspeed(value: str) -> str | None:
    """`TORCH_CUDA_ARCH_LIST` without letter suffixes ("9.0a" -> "9.0"), or None when it has none:
    DeepSpeed's op builder reads every entry as numbers (`int("0a")` fails) before it builds FusedAdam."""
    fixed = re.sub(r"(\d+\.\d+)[a-z]+", r"\1", value)
    return fixed if fixed != value else None


def driver_version() -> str | None:
    if shutil.which("nvidia-smi") is None:
        return None
    done = subprocess.run(
        ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    lines = done.stdout.strip().splitlines()
    return lines[0].strip() if done.returncode == 0 and lines else None


def identity(device: str) -> dict[str, Any]:
    import platform

    import torch

    info: dict[str, Any] = {
        "device": device,
        "cuda_available": torch.cuda.is_available(),
        "gpus": torch.cuda.device_count(),
        "torch_cuda": torch.version.cuda,
        "python": platform.python_version(),
        "libraries": {name: package_version(name) for name in LIBRARIES},
    }
    if device.startswith("cuda") and torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.device(device))
        info.update(
            name=props.name,
            memory_gib=props.total_memory / 2**30,
            multiprocessors=props.multi_processor_count,
            capability=f"{props.major}.{props.minor}",
            driver=driver_version(),
            dense_bf16_tflops_spec=dense_bf16_peak(props.name),
        )
    else:
        info.update(name=f"CPU ({platform.processor() or platform.machine()})", dense_bf16_tflops_spec=None)
    return info


def matmul_tflops(device: str, n: int, reps: int, rounds: int) -> dict[str, Any]:
    """The best of `rounds` rounds of `reps` n x n x n products, as TFLOP/s (2 n^3 FLOPs each)."""
    import torch

    on_gpu = device.startswith("cuda")
    dtype = torch.bfloat16 if on_gpu else torch.float32
    gen = torch.Generator(device=device).manual_seed(0)
    a = torch.randn(n, n, device=device, dtype=dtype, generator=gen)
    b = torch.randn(n, n, device=device, dtype=dtype, generator=gen)

    def sync() -> None:
        if on_gpu:
            torch.cuda.synchronize(device)

    for _ in range(3):  # warm-up: cuBLAS picks its kernel, clocks rise
        a @ b
    sync()
    best = float("inf")
    for _ in range(rounds):
        started = time.perf_counter()
        for _ in range(reps):
            a @ b
        sync()
        best = min(best, time.perf_counter() - started)
    return {
        "n": n,
        "dtype": str(dtype).removeprefix("torch."),
        "reps": reps,
        "rounds": rounds,
        "tflops": 2.0 * n**3 * reps / best / 1e12,
    }


def run(params: dict[str, Any], record: PhaseRecord) -> None:
    device = params["device"]
    record.put("identity", identity(device))
    if device.startswith("cuda") and not record.result["identity"]["cuda_available"]:
        raise RuntimeError(f"device {device}: torch sees no CUDA device (torch {package_version('torch')})")
    record.put("matmul", matmul_tflops(device, params["matmul_n"], params["matmul_reps"], params["rounds"]))
