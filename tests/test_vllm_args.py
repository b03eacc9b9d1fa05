"""The vLLM engine's arguments per device and its log-prob mode, as pure functions (no vllm needed), and
checked against vLLM's own `AsyncEngineArgs` where vllm is installed (the `vllm`-marked test)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import pytest

from actors.engine import EngineError, SamplingParams
from actors.engines.vllm_engine import (
    VLLMEngine,
    VLLMSettings,
    cuda_visible_devices,
    engine_args,
    logprobs_mode,
)
from actors.factory import vllm_settings
from april.config import ConfigError, WorkerConfig

TINY = Path(__file__).resolve().parents[1] / "models" / "tiny"  # a bfloat16 checkpoint
GIB = 1 << 30


def args_for(settings: VLLMSettings, sampling: SamplingParams | None = None) -> dict[str, object]:
    return engine_args(str(TINY), 8, sampling or SamplingParams(), settings)


def test_cpu_gets_float32_eager_and_a_bounded_kv_cache() -> None:
    args = args_for(VLLMSettings())
    assert args == {
        "model": str(TINY),
        "skip_tokenizer_init": True,
        "max_num_seqs": 8,
        "logprobs_mode": "processed_logprobs",
        "disable_log_stats": True,
        "dtype": "float32",
        "enforce_eager": True,
        "kv_cache_memory_bytes": GIB,
    }
    tuned = args_for(
        VLLMSettings(kv_cache_gib=0, dtype="bfloat16", max_model_len=512, gpu_memory_utilization=0.3)
    )
    assert "kv_cache_memory_bytes" not in tuned  # 0: vLLM's own CPU default
    assert "gpu_memory_utilization" not in tuned  # a CUDA setting
    assert tuned["dtype"] == "bfloat16" and tuned["max_model_len"] == 512 and tuned["enforce_eager"] is True


def test_cuda_keeps_vllms_gpu_defaults_unless_asked() -> None:
    args = args_for(VLLMSettings(device="cuda", kv_cache_gib=4.0))
    # no dtype (vLLM's "auto"), no enforce_eager (CUDA graphs), no KV size (gpu_memory_utilization sizes it)
    assert args == {
        "model": str(TINY),
        "skip_tokenizer_init": True,
        "max_num_seqs": 8,
        "logprobs_mode": "processed_logprobs",
        "disable_log_stats": True,
    }
    asked = args_for(
        VLLMSettings(device="cuda:1", gpu_memory_utilization=0.45, dtype="float16", enforce_eager=True)
    )
    assert asked["gpu_memory_utilization"] == 0.45 and asked["dtype"] == "float16"
    assert asked["enforce_eager"] is True and "kv_cache_memory_bytes" not in asked
    assert "tensor_parallel_size" not in asked  # one GPU: vLLM's default
    assert args_for(VLLMSettings(device="cuda", tensor_parallel_size=2))["tensor_parallel_size"] == 2


def test_logprobs_mode_matches_the_learner_where_vllm_can() -> None:
    # no truncation: log_softmax after temperature is the learner's at any temperature
    assert logprobs_mode(SamplingParams(temperature=0.7)) == ("processed_logprobs", "")
    # truncation at temperature 1: the raw log-probs (before truncation) are the learner's
    assert logprobs_mode(SamplingParams(top_p=0.9)) == ("raw_logprobs", "")
    assert logprobs_mode(SamplingParams(top_k=50)) == ("raw_logprobs", "")
    # truncation at another temperature: no exact mode, one warning line
    mode, warning = logprobs_mode(SamplingParams(temperature=0.7, top_p=0.9))
    assert mode == "processed_logprobs"
    assert "\n" not in warning and "top_p=0.9" in warning and "temperature 0.7" in warning
    assert args_for(VLLMSettings(), SamplingParams(top_k=20))["logprobs_mode"] == "raw_logprobs"


@pytest.mark.parametrize("device", ["xpu", "cpu:0", "cuda:", "cuda:x", "CUDA", ""])
def test_a_device_vllm_does_not_run_on_is_one_line(device: str) -> None:
    with pytest.raises(EngineError, match=r"worker.device = .*'cpu', 'cuda' or 'cuda:N'"):
        VLLMSettings(device=device)
    for engine in ("vllm", "torch"):  # the config refuses it for every engine, before anything starts
        with pytest.raises(ConfigError, match=r"worker\.device = .*'auto', 'cpu', 'cuda' or 'cuda:N'"):
            WorkerConfig(engine=engine, device=device)


def test_its_placement_is_its_device_and_whether_it_captures_cuda_graphs() -> None:
    """`VLLMEngine.placement` reads its settings only: checked without starting vLLM."""

    def placement(settings: VLLMSettings) -> str:
        return str(VLLMEngine.placement.fget(SimpleNamespace(settings=settings)))  # type: ignore[attr-defined]

    assert placement(VLLMSettings("cuda:1")) == "cuda:1, cuda graphs"
    assert placement(VLLMSettings("cuda", enforce_eager=True)) == "cuda, eager"
    assert placement(VLLMSettings()) == "cpu, eager"  # always eager on CPU


def test_cuda_n_narrows_the_visible_devices() -> None:
    assert cuda_visible_devices("cuda:1", None) == "1"
    assert cuda_visible_devices("cuda:1", "4,6") == "6"
    assert cuda_visible_devices("cuda", "4,6") is None  # every visible device, as it is
    assert cuda_visible_devices("cpu", "4,6") is None
    with pytest.raises(EngineError, match=r"'cuda:2', but CUDA_VISIBLE_DEVICES = '4,6' has 2"):
        cuda_visible_devices("cuda:2", "4,6")


def test_worker_config_maps_onto_the_settings() -> None:
    cfg = WorkerConfig(
        engine="vllm",
        device="cuda",
        vllm_kv_cache_gib=0.0,
        vllm_gpu_memory_utilization=0.5,
        vllm_dtype="bfloat16",
        vllm_enforce_eager=True,
        max_seq_len=2048,
    )
    assert vllm_settings(cfg, "cuda") == VLLMSettings("cuda", 0.0, 0.5, "bfloat16", True, 2048)
    assert vllm_settings(WorkerConfig(), "cpu") == VLLMSettings()  # the defaults agree
    for field, value in [
        ("vllm_gpu_memory_utilization", 1.5),
        ("vllm_gpu_memory_utilization", -0.1),
        ("vllm_kv_cache_gib", -1.0),
        ("vllm_dtype", "fp8"),
    ]:
        with pytest.raises(ConfigError, match=f"worker.{field}"):
            WorkerConfig(**{field: value})


@pytest.mark.vllm
def test_the_args_are_vllms_own() -> None:
    """Every argument is a field of vLLM's `AsyncEngineArgs` and validates against its declared type, and
    vLLM resolves each device's arguments into the config we mean (on this CPU build the CUDA arguments
    are resolved on the CPU platform, which still shows vLLM's own defaults holding)."""
    pytest.importorskip("vllm")
    pydantic = pytest.importorskip("pydantic")
    import vllm.engine.arg_utils as arg_utils
    from vllm.engine.arg_utils import AsyncEngineArgs

    fields = {f.name: f for f in dataclasses.fields(AsyncEngineArgs)}

    def declared(name: str) -> object:
        hint = fields[name].type  # a string under `from __future__ import annotations`
        # vLLM's own annotation text, evaluated where vLLM wrote it (get_type_hints fails on other fields)
        return eval(hint, vars(arg_utils)) if isinstance(hint, str) else hint  # noqa: S307

    sampling = SamplingParams(top_p=0.9)  # raw_logprobs: both modes we use are checked, with the one below
    cpu = VLLMSettings(max_model_len=512)
    cuda = VLLMSettings(device="cuda", max_model_len=512)
    tuned = VLLMSettings(device="cuda", gpu_memory_utilization=0.5, dtype="float16", enforce_eager=True)
    for settings in (cpu, cuda, tuned):
        for s in (SamplingParams(), sampling):
            args = args_for(settings, s)
            assert set(args) <= set(fields), set(args) - set(fields)
            for name, value in args.items():
                pydantic.TypeAdapter(declared(name)).validate_python(value, strict=True)

    on_cpu = AsyncEngineArgs(**args_for(cpu)).create_engine_config()
    on_cuda = AsyncEngineArgs(**args_for(cuda, sampling)).create_engine_config()
    asked = AsyncEngineArgs(**args_for(tuned)).create_engine_config()
    assert str(on_cpu.model_config.dtype) == "torch.float32" and on_cpu.model_config.enforce_eager
    assert on_cpu.cache_config.kv_cache_memory_bytes == GIB
    assert on_cpu.model_config.logprobs_mode == "processed_logprobs"
    assert str(on_cuda.model_config.dtype) == "torch.bfloat16"  # "auto": the checkpoint's dtype
    assert not on_cuda.model_config.enforce_eager and on_cuda.cache_config.kv_cache_memory_bytes is None
    assert on_cuda.cache_config.gpu_memory_utilization == AsyncEngineArgs.gpu_memory_utilization
    assert on_cuda.model_config.logprobs_mode == "raw_logprobs" and on_cuda.model_config.max_model_len == 512
    assert str(asked.model_config.dtype) == "torch.float16" and asked.model_config.enforce_eager
    assert asked.cache_config.gpu_memory_utilization == 0.5
