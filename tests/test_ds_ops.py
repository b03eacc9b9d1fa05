"""DeepSpeed's op builds on the learner's path (`learner.ds_ops`), with the real DeepSpeed installed.

The crash found on the lent H200: DeepSpeed 0.19.8 builds FusedAdam at first use and parses
TORCH_CUDA_ARCH_LIST, which Hopper images set to "9.0a", as numbers (`int("0a")`, in
`op_builder/builder.py`'s `compute_capability_args`). It parses the variable before it looks for a
GPU, so the real CUDA builder (`deepspeed.ops.op_builder.fused_adam.FusedAdamBuilder`) shows the crash
on this CPU machine. Past the parsing the builder hands the sources to torch's JIT
(`torch.utils.cpp_extension.load`), which needs nvcc: the tests replace that one call with a recorder,
so they stop at the compiler's door and see what DeepSpeed would have compiled with.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import pytest

pytest.importorskip("deepspeed")

import torch.utils.cpp_extension
from deepspeed.ops.op_builder.builder import OpBuilder
from deepspeed.ops.op_builder.fused_adam import FusedAdamBuilder

from april.startup import StartupError
from learner.ds_ops import ARCH_LIST, build_fused_adam, builder_arch_list, deepspeed_arch_list


class Compiler:
    """Stands in for torch.utils.cpp_extension.load: records the arch list DeepSpeed set for the build."""

    def __init__(self, fails: str = "") -> None:
        self.arch_lists: list[str | None] = []
        self.fails = fails

    def __call__(self, **kwargs: Any) -> object:
        self.arch_lists.append(os.environ.get(ARCH_LIST))
        if self.fails:
            raise RuntimeError(self.fails)
        return object()  # the "loaded module"


@pytest.fixture
def compiler(monkeypatch: pytest.MonkeyPatch) -> Compiler:
    made = Compiler()
    monkeypatch.setattr(torch.utils.cpp_extension, "load", made)
    monkeypatch.setattr(OpBuilder, "_loaded_ops", {})  # DeepSpeed caches loaded ops per process
    return made


@pytest.mark.parametrize(
    ("given", "usable"),
    [
        ("9.0a", "9.0"),
        ("9.0", "9.0"),
        ("8.0;9.0a", "8.0;9.0"),
        ("7.5 8.6 9.0a 10.0f 12.0a", "7.5;8.6;9.0;10.0;12.0"),
        ("9.0a+PTX", "9.0+PTX"),
        ("9.0;9.0a", "9.0"),  # the suffix gone, one entry is enough
        (" 8.9 ; 9.0a ", "8.9;9.0"),
        ("sm_90", "sm_90"),  # not an arch entry: DeepSpeed names it in its own error
    ],
)
def test_the_arch_list_deepspeed_is_given(given: str, usable: str) -> None:
    assert builder_arch_list(given) == usable


def test_deepspeeds_builder_crashes_on_an_arch_suffix_and_the_learners_build_does_not(
    compiler: Compiler, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(ARCH_LIST, "9.0a")
    with pytest.raises(ValueError, match=r"invalid literal for int\(\) with base 10: '0a'"):
        FusedAdamBuilder().load()  # DeepSpeed as it is: what the learner died of, three times
    assert compiler.arch_lists == []  # it never got to the compiler
    assert os.environ[ARCH_LIST] == "9.0a"

    with caplog.at_level(logging.INFO, logger="april.learner"):
        build_fused_adam(FusedAdamBuilder())  # the same builder, through the learner's preparation
    assert compiler.arch_lists == ["9.0+PTX"]  # parsed: DeepSpeed's own form of "9.0"
    assert os.environ[ARCH_LIST] == "9.0a"  # everything after it sees what the user set
    said = [r.getMessage() for r in caplog.records]
    assert any("TORCH_CUDA_ARCH_LIST='9.0a' is given to DeepSpeed's op builds as '9.0'" in m for m in said)
    build_fused_adam(FusedAdamBuilder())  # built once per process: DeepSpeed's cache answers
    assert compiler.arch_lists == ["9.0+PTX"]


def test_an_arch_list_deepspeed_parses_is_left_alone(
    compiler: Compiler, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv(ARCH_LIST, "8.0;9.0")
    with caplog.at_level(logging.INFO, logger="april.learner"):
        build_fused_adam(FusedAdamBuilder())
    assert compiler.arch_lists == ["8.0;9.0+PTX"] and os.environ[ARCH_LIST] == "8.0;9.0"
    assert not [r for r in caplog.records if ARCH_LIST in r.getMessage()]  # nothing done, nothing said


def test_the_arch_list_comes_back_even_when_deepspeed_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ARCH_LIST, "9.0a")
    with pytest.raises(KeyError), deepspeed_arch_list():
        assert os.environ[ARCH_LIST] == "9.0"
        raise KeyError("inside DeepSpeed")
    assert os.environ[ARCH_LIST] == "9.0a"
    monkeypatch.delenv(ARCH_LIST)
    with deepspeed_arch_list():
        assert ARCH_LIST not in os.environ  # unset stays unset
    assert ARCH_LIST not in os.environ


def test_a_failed_build_is_one_startup_line_with_the_fix(
    compiler: Compiler, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(ARCH_LIST, "9.0a")
    compiler.fails = "Error building extension 'fused_adam'"
    with pytest.raises(StartupError) as err:
        build_fused_adam(FusedAdamBuilder())
    assert str(err.value) == (
        "learner: DeepSpeed could not build FusedAdam with TORCH_CUDA_ARCH_LIST='9.0a': Error building "
        "extension 'fused_adam'; set learner.adam_impl=\"torch\" (torch's fused AdamW: nothing to build)"
    )
    assert os.environ[ARCH_LIST] == "9.0a"
    monkeypatch.setenv(ARCH_LIST, "sm_90")  # a list the learner cannot make parseable: DeepSpeed's error
    with pytest.raises(StartupError, match=r"TORCH_CUDA_ARCH_LIST='sm_90': invalid literal .*adam_impl"):
        build_fused_adam(FusedAdamBuilder())


# the accelerator where torch sees no GPU: named, so that a normal start says no warning


FIRST_IMPORT = (
    "import logging, sys\n"
    "logging.basicConfig(stream=sys.stdout, level=logging.INFO)\n"
    "from learner.ds_ops import name_a_cpu_accelerator\n"
    "if sys.argv[1] == 'named': name_a_cpu_accelerator()\n"
    "import deepspeed\n"
    "from deepspeed.accelerator import get_accelerator\n"
    "print('accelerator', get_accelerator()._name)\n"
)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a machine with a GPU is DeepSpeed's to name")
def test_on_a_machine_without_a_gpu_deepspeed_picks_the_cpu_without_a_warning() -> None:
    """Found by a user: the learner's log of every start said "Setting accelerator to CPU. If you have GPU
    or other accelerator, we were unable to detect it." (DeepSpeed's warning, on a machine with none)."""
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "DS_ACCELERATOR"}
    said = {}
    for how in ("named", "not named"):
        done = subprocess.run(
            [sys.executable, "-c", FIRST_IMPORT, how], capture_output=True, text=True, env=env, timeout=300
        )
        assert done.returncode == 0, done.stderr
        said[how] = done.stdout + done.stderr
    assert "accelerator cpu" in said["named"] and "accelerator cpu" in said["not named"]
    assert "Setting accelerator to CPU" in said["not named"]  # what it said before
    assert "Setting accelerator to CPU" not in said["named"]
