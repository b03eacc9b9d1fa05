"""DeepSpeed's compiled ops on the learner's path: which it may build, where, and with what arch list.

DeepSpeed builds its C++/CUDA ops with torch's JIT the first time they are used. The learner needs at
most one: FusedAdam, on CUDA with `learner.adam_impl = "deepspeed"` (the default, torch's fused AdamW,
needs none; the ops of ZeRO++'s quantizer and of the CPU and NVMe offloads are not on the learner's
path). Owns keeping DeepSpeed from building the shared-memory op training never uses, naming its CPU
accelerator where torch sees no GPU (else it warns at every start), the build directory per Python
environment, the architecture list a build is given, and building FusedAdam up
front so that a failure is one `StartupError` line with its fix, not a traceback from inside
`deepspeed.initialize` that `april up` would restart three times.

The arch list: DeepSpeed 0.19.8 parses TORCH_CUDA_ARCH_LIST as numbers
(`op_builder/builder.py`, `compute_capability_args`: `int("0a")` raises) while torch and Hopper images
use arch suffixes ("9.0a"). `deepspeed_arch_list` hands DeepSpeed the same list without them ("9.0")
for the build only, says so in the log, and gives the variable back unchanged.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from april.startup import StartupError

log = logging.getLogger("april.learner")

ARCH_LIST = "TORCH_CUDA_ARCH_LIST"
# one entry of an arch list as torch takes it: "9.0", "9.0a", "10.0f", "8.6+PTX"
_ARCH = re.compile(r"(\d+)\.(\d+)[a-zA-Z]*(\+PTX)?")


def skip_shared_memory_comm_op() -> None:
    """Keep DeepSpeed from compiling its CPU shared-memory communication op, which training never uses.

    DeepSpeed's communication backend (`deepspeed.comm.torch.TorchBackend`) builds the `deepspeed_shm_comm`
    C++ op whenever it is created, at any world size: a JIT compile of 30 s to minutes on a small machine,
    repeated whenever another environment compiled it last. The op serves only `inference_all_reduce`
    (tensor-parallel inference); ZeRO's collectives go through torch.distributed (gloo, NCCL). DeepSpeed
    skips the build for an op its compatibility table marks unusable, so we mark this one. A DeepSpeed
    without that table (or that op) is left alone: it builds as before.
    """
    import deepspeed.ops  # type: ignore[import-untyped]
    from deepspeed.accelerator import get_accelerator  # type: ignore[import-untyped]

    builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
    compatible = getattr(deepspeed.ops, "__compatible_ops__", None)
    if builder is not None and isinstance(compatible, dict):
        compatible[builder.NAME] = False


def extensions_dir(prefix: str, cache_root: Path) -> Path:
    """This Python environment's own directory for compiled torch extensions, under `cache_root`.

    torch keeps one directory per op for every environment of a user; an op compiled by another
    environment has other include paths, so each environment rebuilds what the last one built. One
    directory per environment (named by its `sys.prefix`) builds each op once per environment.
    """
    digest = hashlib.sha256(os.path.realpath(prefix).encode()).hexdigest()[:12]
    return cache_root / f"{Path(prefix).name.lstrip('.') or 'env'}-{digest}"


def name_a_cpu_accelerator() -> None:
    """On a machine where torch sees no GPU, name DeepSpeed's accelerator (`DS_ACCELERATOR=cpu`) before
    DeepSpeed is imported: it would pick the CPU one anyway, and say "Setting accelerator to CPU. If you
    have GPU or other accelerator, we were unable to detect it." as a warning at every start. A name
    already given is kept; a machine with a GPU is left to DeepSpeed's own choice."""
    import torch

    if "DS_ACCELERATOR" not in os.environ and not torch.cuda.is_available():
        os.environ["DS_ACCELERATOR"] = "cpu"


def use_environment_extensions_dir() -> None:
    """Compile DeepSpeed's ops (e.g. FusedAdam on CUDA) into this environment's own directory, unless
    TORCH_EXTENSIONS_DIR already names one."""
    if "TORCH_EXTENSIONS_DIR" in os.environ:
        return
    from torch.utils.cpp_extension import get_default_build_root

    os.environ["TORCH_EXTENSIONS_DIR"] = str(extensions_dir(sys.prefix, Path(get_default_build_root())))


def builder_arch_list(value: str) -> str:
    """`value` (a TORCH_CUDA_ARCH_LIST) as DeepSpeed's builder can parse it: each "X.Y<suffix>" entry
    without its suffix ("9.0a" -> "9.0", "8.6+PTX" kept), duplicates dropped, ";"-separated. An entry of
    another form is kept as it is (DeepSpeed then names it in its own error)."""
    entries: list[str] = []
    for entry in value.replace(" ", ";").split(";"):
        entry = entry.strip()
        match = _ARCH.fullmatch(entry)
        plain = f"{match[1]}.{match[2]}{match[3] or ''}" if match else entry
        if plain and plain not in entries:
            entries.append(plain)
    return ";".join(entries)


@contextmanager
def deepspeed_arch_list() -> Iterator[None]:
    """While DeepSpeed builds an op, TORCH_CUDA_ARCH_LIST in a form its builder parses; afterwards exactly
    what it was (DeepSpeed's own builder rewrites the variable as it builds, too)."""
    given = os.environ.get(ARCH_LIST)
    usable = builder_arch_list(given) if given is not None else None
    if given is None or usable == given.strip():
        yield
        return
    log.info(
        "%s=%r is given to DeepSpeed's op builds as %r (DeepSpeed %s parses no arch suffix); "
        "everything else sees it unchanged",
        ARCH_LIST,
        given,
        usable,
        _deepspeed_version(),
    )
    os.environ[ARCH_LIST] = usable or ""
    try:
        yield
    finally:
        os.environ[ARCH_LIST] = given


def _deepspeed_version() -> str:
    import deepspeed

    return str(getattr(deepspeed, "__version__", "?"))


def build_fused_adam(builder: Any = None) -> None:
    """Build (or load, once built) DeepSpeed's FusedAdam op now, with a parseable arch list; any failure
    is a StartupError naming the cause and the fix (`learner.adam_impl = "torch"`, which builds nothing).
    `deepspeed.initialize` then finds the op loaded. `builder`: the op builder (default: the one
    DeepSpeed's accelerator gives, `deepspeed.ops.op_builder.fused_adam.FusedAdamBuilder` on CUDA)."""
    from deepspeed.accelerator import get_accelerator

    given = os.environ.get(ARCH_LIST)
    try:
        with deepspeed_arch_list():
            (builder or get_accelerator().create_op_builder("FusedAdamBuilder")).load()
    except Exception as exc:  # a build fails in many ways (ValueError, RuntimeError, OSError, ImportError)
        cause = " ".join(str(exc).split())[:300] or type(exc).__name__
        arch = f" with {ARCH_LIST}={given!r}" if given is not None else ""
        raise StartupError(
            f"learner: DeepSpeed could not build FusedAdam{arch}: {cause}; "
            'set learner.adam_impl="torch" (torch\'s fused AdamW: nothing to build)'
        ) from exc
