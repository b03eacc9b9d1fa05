"""Devices: the form of `worker.device` / `learner.device` checked with the config, their availability
checked against what torch sees (`april.devices`), "auto" resolved, and CUDA started at a role's start.

This machine has torch without CUDA: "cuda" is really unavailable here, and starting CUDA really fails
(`init_cuda`). A machine with GPUs is imitated by replacing `april.devices.gpu_count` (a count of GPUs
torch would report), which is all `check_device` and `resolve_device` ask of torch.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from april import devices
from april.config import ConfigError, LearnerConfig, WorkerConfig, load_config
from april.devices import DeviceError, check_device, init_cuda, resolve_device
from april.startup import StartupError

REPO = Path(__file__).resolve().parents[1]
GOOD = ["auto", "cpu", "cuda", "cuda:0", "cuda:7"]
BAD = ["bogus", "gpu", "cuda:", "cuda:x", "cuda0", "CUDA", "cpu:0", "xpu", "", "auto:0", " cuda"]


@pytest.mark.parametrize("value", GOOD)
def test_every_device_form_is_taken_by_the_config(value: str) -> None:
    assert WorkerConfig(device=value).device == value
    assert LearnerConfig(device=value).device == value


@pytest.mark.parametrize("value", BAD)
def test_a_bad_device_is_one_config_error_naming_the_field(value: str) -> None:
    for section, cls in (("worker", WorkerConfig), ("learner", LearnerConfig)):
        with pytest.raises(ConfigError) as err:
            cls(device=value)
        assert str(err.value) == f"{section}.device = {value!r}: expected 'auto', 'cpu', 'cuda' or 'cuda:N'"
    with pytest.raises(ConfigError, match=r"worker\.device = 'bogus'"):  # as `--set` gives it
        load_config(env={}, overrides={"worker.device": "bogus"})


def test_the_default_is_auto() -> None:
    assert WorkerConfig().device == "auto" and LearnerConfig().device == "auto"


def test_auto_resolves_to_what_torch_sees(monkeypatch: pytest.MonkeyPatch) -> None:
    assert resolve_device("auto", "worker.device") == "cpu"  # this machine's torch: no CUDA
    monkeypatch.setattr(devices, "gpu_count", lambda: 2)
    assert resolve_device("auto", "worker.device") == "cuda"
    assert resolve_device("cpu", "worker.device") == "cpu"  # what was asked for stays
    assert resolve_device("cuda:1", "worker.device") == "cuda:1"


def test_cuda_where_torch_sees_no_gpu_names_the_field_and_why() -> None:
    for value in ("cuda", "cuda:0"):
        with pytest.raises(DeviceError) as err:
            check_device(value, "learner.device")
        line = str(err.value)
        assert line.startswith(f"learner.device = {value!r}: torch sees no CUDA GPU (torch ")
        assert "built without CUDA" in line and line.endswith("expected 'auto' or 'cpu'")
        with pytest.raises(DeviceError, match="torch sees no CUDA GPU"):
            resolve_device(value, "learner.device")
    check_device("auto", "learner.device")  # always usable
    check_device("cpu", "learner.device")


def test_cuda_n_past_the_gpus_torch_sees(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(devices, "gpu_count", lambda: 1)
    with pytest.raises(DeviceError) as err:
        check_device("cuda:1", "worker.device")
    assert str(err.value) == (
        "worker.device = 'cuda:1': torch sees GPU cuda:0; expected one of those, 'cuda' or 'auto'"
    )
    monkeypatch.setattr(devices, "gpu_count", lambda: 4)
    with pytest.raises(DeviceError, match=r"'cuda:4': torch sees 4 GPUs, cuda:0 to cuda:3"):
        check_device("cuda:4", "worker.device")
    for value in ("cuda", "cuda:0", "cuda:3"):
        check_device(value, "worker.device")


def test_a_device_error_is_a_config_error() -> None:
    """The commands print ConfigErrors as one line with exit 2: a device torch does not see is one."""
    assert issubclass(DeviceError, ConfigError)


def test_auto_and_cpu_are_checked_without_importing_torch() -> None:
    """`april up`'s pre-flight checks the default devices without loading torch in the supervisor."""
    code = (
        "import sys; from april.devices import check_device; "
        "check_device('auto', 'worker.device'); check_device('cpu', 'learner.device'); "
        "print('torch' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.strip() == "False", out.stderr


def test_cuda_that_cannot_start_is_one_startup_line() -> None:
    """Where torch's CUDA cannot start (here: torch is built without it), the role's start says so in one
    line naming the device and the fix, instead of failing in the middle of loading the model."""
    with pytest.raises(StartupError) as err:
        init_cuda("cuda:0", "worker")
    line = str(err.value)
    assert line.startswith("worker: CUDA could not start on 'cuda:0': ") and "\n" not in line
    assert line.endswith('or set worker.device = "cpu"')


def test_a_worker_runs_where_its_device_resolves(monkeypatch: pytest.MonkeyPatch) -> None:
    """`on_device`, at a worker's start: the torch and vLLM engines get the resolved device, the engines
    that run on no device of the worker's keep theirs untouched (and start no CUDA)."""
    from actors.factory import on_device

    assert on_device(WorkerConfig(engine="torch")).device == "cpu"  # auto, on this machine
    assert on_device(WorkerConfig(engine="vllm", device="auto")).device == "cpu"
    for engine in ("sim", "sglang"):
        assert on_device(WorkerConfig(engine=engine, device="cuda")).device == "cuda"  # not theirs to use
    monkeypatch.setattr(devices, "gpu_count", lambda: 1)
    assert on_device(WorkerConfig(engine="vllm")).device == "cuda"  # vLLM starts CUDA in its processes
    with pytest.raises(StartupError, match=r"^worker: CUDA could not start on 'cuda'"):
        on_device(WorkerConfig(engine="torch"))  # the torch engine's CUDA starts with the worker


def test_the_torch_engine_is_built_on_the_resolved_device() -> None:
    from actors.engine import SamplingParams
    from actors.factory import make_engine

    model = str(REPO / "models" / "tiny")
    engine = make_engine(WorkerConfig(engine="torch", model=model, slots=1), SamplingParams(), None, 0)  # type: ignore[arg-type]
    try:
        assert engine.placement == "cpu"
    finally:
        engine.close()
    short = WorkerConfig(engine="torch", model=model, slots=1, max_seq_len=96)
    engine = make_engine(short, SamplingParams(), None, 0)  # type: ignore[arg-type]
    try:
        assert engine.row_tokens == 96  # worker.max_seq_len: a row of that many tokens, not the context
    finally:
        engine.close()


def test_the_learner_runs_where_its_device_resolves(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The learner's engine settings: auto resolved; under a launcher "cuda" is the rank's own GPU."""
    from learner.model_trainer import ModelTrainer

    def settings(**over: str) -> str:
        config = load_config(env={}, overrides={f"learner.{k}": v for k, v in over.items()})
        return ModelTrainer(config, tmp_path).settings().device

    assert settings() == "cpu"
    monkeypatch.setattr(devices, "gpu_count", lambda: 4)
    assert settings() == "cuda" and settings(device="cuda:2") == "cuda:2"
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert settings() == "cuda:3" and settings(device="cuda") == "cuda:3"
    assert settings(device="cuda:1") == "cuda:3"  # each rank its own GPU, whatever one index says
