"""The lent GPU machine's Python packages, and the GPU check's `packages` preflight over them.

Owns what the image has (the project's GPU-MACHINE.md notes, 2026-11-27), what `make gpu-wheels` carries
there, what stays absent and what that costs, and which packages each phase of the check imports. Two
uses: `preflight` says, one line per phase and before any phase runs, what this Python lacks for it;
`absent_modules` gives the import names of this environment's distributions that the image would not have
(neither its packages nor their requirements, nor carried), which a CPU test blocks to import as there.
Knows nothing of how the wheels are made (`gpu.wheels`) or how the phases run.
"""

from __future__ import annotations

import importlib.util
import re
import sys
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

# The image's Python packages (distribution names), besides the standard library.
IMAGE_HAS = frozenset(
    {
        "einops",
        "msgpack",
        "ninja",
        "numpy",
        "nvidia-ml-py",
        "packaging",
        "psutil",
        "py-cpuinfo",
        "sympy",
        "torch",
        "tqdm",
        "mpmath",
        "transformers",
        "safetensors",
        "rich",
        "typer",
        "pytest",
    }
)
# The image's Python as requirement markers see it (CPython 3.12.3 on x86-64 Linux, no extras)
IMAGE_MARKERS = {
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "extra": "",
}
# What april imports that the image lacks, carried by `make gpu-wheels` (typing-extensions: pydantic needs
# a recent one); DeepSpeed, an sdist, is built into a wheel there.
CARRIED = (
    "pyzmq",
    "pydantic",
    "pydantic-core",
    "annotated-types",
    "typing-inspection",
    "typing-extensions",
    "hjson",
    "math-verify",
    "latex2sympy2-extended",
    "antlr4-python3-runtime",
)
BUILT = "deepspeed"
# Absent there and not carried, by import name: what is lost without them.
NOT_CARRIED = {
    "pyarrow": "no Parquet or Arrow dataset: its wheel is more than a device call carries; use JSONL",
    "datasets": "nothing: april reads Arrow datasets with pyarrow alone",
    "uvicorn": "tests/test_sglang_engine.py, whose fake server needs it, is not collected",
    "fastapi": "tests/test_sglang_engine.py, whose fake server needs it, is not collected",
    "hypothesis": "no property test: none is marked gpu",
    "sglang": "the real SGLang server test skips",
    "vllm": "the vLLM tests skip",
}


@dataclass(frozen=True, slots=True)
class Needs:
    """What a phase imports beyond the standard library: `must` (the phase cannot run without them) and
    `may` (without them part of it skips)."""

    must: tuple[str, ...]
    may: tuple[str, ...] = ()


# By phase module (benchmarks/gpu/MODULE.py), import names.
PHASE_NEEDS = {
    "hardware": Needs(("torch",)),
    "learner_scale": Needs(("torch", "transformers", "numpy", "deepspeed", "pydantic", "hjson")),
    "up_run": Needs(
        (
            "torch",
            "transformers",
            "numpy",
            "safetensors",
            "deepspeed",
            "zmq",
            "msgpack",
            "math_verify",
            "rich",
        )
    ),
    "engine_decode": Needs(("torch", "transformers", "numpy", "safetensors")),
    "gpu_tests": Needs(("pytest", "torch", "transformers", "zmq"), ("sglang", "vllm", "uvicorn", "fastapi")),
}


def lacking(modules: tuple[str, ...]) -> list[str]:
    """The import names among `modules` that this Python cannot find (nothing is imported)."""
    return [m for m in modules if importlib.util.find_spec(m) is None]


def preflight_line(phase: str, needs: Needs) -> tuple[list[str], str]:
    """(what `phase` must have and lacks, its one line)."""
    must, may = lacking(needs.must), lacking(needs.may)
    text = f"lacks {', '.join(must)} (carried by make gpu-wheels: installed?)" if must else "ok"
    if may:
        text += "; without " + "; ".join(f"{m} ({NOT_CARRIED.get(m, 'part of it skips')})" for m in may)
    return must, f"packages: {phase}: {text}"


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def image_distributions() -> set[str]:
    """The image's distributions as this environment's metadata sees them: its packages, the carried
    ones, and their requirements, transitively (no extras; markers as for CPython 3.12 on x86-64 Linux)."""
    from packaging.requirements import Requirement

    env = dict(IMAGE_MARKERS)
    seen: set[str] = set()
    todo = [*IMAGE_HAS, *CARRIED, BUILT]
    while todo:
        name = canonical(todo.pop())
        if name in seen:
            continue
        seen.add(name)
        try:
            requires = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        for line in requires:
            req = Requirement(line)
            if req.marker is None or req.marker.evaluate(env):
                todo.append(req.name)
    return seen


def absent_modules(own: str = "april-rl") -> list[str]:
    """Top-level import names of this environment's distributions that the image lacks (`own`, this
    project's distribution, and the installers that every Python has are not counted)."""
    keep = image_distributions() | {canonical(own), "pip", "setuptools", "wheel"}
    absent: set[str] = set()
    present: set[str] = set()  # a name a kept distribution installs too stays importable
    for dist in installed_distributions():
        names = top_level_names(dist)
        (present if canonical(dist.metadata["Name"]) in keep else absent).update(names)
    return sorted(name for name in absent - present if name.isidentifier())


def installed_distributions() -> list[metadata.Distribution]:
    """The distributions on this interpreter's path, without the copies a package vendors for itself
    (setuptools puts its `_vendor` folder on sys.path once imported; those go wherever setuptools goes)."""
    paths = [p for p in sys.path if "_vendor" not in Path(p).parts]
    return list(metadata.distributions(path=paths))


def top_level_names(dist: metadata.Distribution) -> set[str]:
    """The top-level import names a distribution installs: its top_level.txt, else its files' first parts."""
    declared = (dist.read_text("top_level.txt") or "").split()
    if declared:
        return set(declared)
    names = set()
    for file in dist.files or ():
        first = file.parts[0] if len(file.parts) > 1 else file.name.removesuffix(".py")
        if not first.endswith((".dist-info", ".egg-info", ".data")) and first not in ("..", "__pycache__"):
            names.add(first.removesuffix(".py"))
    return names
