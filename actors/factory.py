"""Building the engine and tokenizer a worker was configured with, importing only the one asked for, on the
device `worker.device` names (resolved and checked by `april.devices`)."""

from __future__ import annotations

import dataclasses
import json
import zlib
from pathlib import Path

from actors.engine import ENGINES, Engine, EngineError, SamplingParams
from actors.engines.sim_engine import Identify
from actors.engines.vllm_engine import VLLMSettings
from actors.tokenizer import HFTokenizer, Tokenizer
from april.config import ResumeKV, WorkerConfig
from april.devices import check_device, init_cuda, resolve_device
from april.hf import check_model_dir
from april.sim.byte_tokenizer import ByteTokenizer
from april.sim.episode_plans import EpisodePlans

DEVICE_ENGINES = ("torch", "vllm")  # engines on worker.device (sim runs on none, sglang on its servers')


def check_worker(cfg: WorkerConfig) -> None:
    """What would otherwise fail only once a worker holds leases, checked before it connects (or before
    `april up` starts one): an unknown engine (EngineError), an incomplete model directory (ModelError),
    a device torch does not see (DeviceError; "auto" is always usable and imports nothing)."""
    if cfg.engine not in ENGINES:
        raise EngineError(f"unknown engine {cfg.engine!r} (expected one of {', '.join(ENGINES)})")
    if cfg.model:  # the worker's tokenizer comes from it, whatever the engine
        check_model_dir(cfg.model)
    if cfg.engine in DEVICE_ENGINES:
        check_device(cfg.device, "worker.device")
    if cfg.resume_kv is ResumeKV.REUSE and not engine_class(cfg.engine).can_reuse_kv:
        raise EngineError(
            f"worker.resume_kv = 'reuse': engine {cfg.engine!r} cannot keep its prefix cache across a weight "
            "update (it flushes it, or has none); expected 'recompute'"
        )


def engine_class(name: str) -> type[Engine]:
    """The class of engine `name`, imported only now (torch's imports torch)."""
    if name == "sim":
        from actors.engines.sim_engine import SimEngine

        return SimEngine
    if name == "torch":
        from actors.engines.torch_engine import TorchEngine

        return TorchEngine
    if name == "sglang":
        from actors.engines.sglang_engine import SGLangEngine

        return SGLangEngine
    from actors.engines.vllm_engine import VLLMEngine

    return VLLMEngine


def on_device(cfg: WorkerConfig) -> WorkerConfig:
    """`cfg` with its device resolved ("auto": cuda when torch sees a GPU) and, for the torch engine on
    CUDA, CUDA started (StartupError: one line, at the worker's start). Unchanged for the engines that
    run on no device of this process (sim, sglang); vLLM starts CUDA in its own processes."""
    if cfg.engine not in DEVICE_ENGINES:
        return cfg
    device = resolve_device(cfg.device, "worker.device")
    if cfg.engine == "torch" and device.startswith("cuda"):
        init_cuda(device, "worker")
    return dataclasses.replace(cfg, device=device)


def vllm_settings(cfg: WorkerConfig, device: str) -> VLLMSettings:
    """The vLLM engine's settings from the worker's, on `device` (resolved; no vllm import)."""
    return VLLMSettings(
        device=device,
        kv_cache_gib=cfg.vllm_kv_cache_gib,
        gpu_memory_utilization=cfg.vllm_gpu_memory_utilization,
        dtype=cfg.vllm_dtype,
        enforce_eager=cfg.vllm_enforce_eager,
        max_model_len=cfg.max_seq_len,
        tensor_parallel_size=cfg.gpus_per_engine,
    )


def make_tokenizer(cfg: WorkerConfig) -> Tokenizer:
    if cfg.model:
        return HFTokenizer(cfg.model)
    if cfg.engine in ("torch", "vllm"):
        raise EngineError(f"worker.model is required with engine {cfg.engine!r} (an HF model directory)")
    return ByteTokenizer()


SIM_VOCAB_SIZE = 32000  # sim token ids without a model: a common LLM vocabulary size


def model_vocab_size(model_dir: str) -> int:
    """`vocab_size` from an HF model's config.json (no torch): sim tokens a real learner can train on."""
    path = Path(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
        config = config.get("text_config", config)
        return int(config["vocab_size"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise EngineError(
            f"worker.model = {model_dir!r}: cannot read vocab_size from {path}: {exc}"
        ) from None


def worker_seed(seed: int, worker_id: str) -> int:
    """The run's seed salted with the worker id: reproducible per worker, different between workers."""
    return (seed * 1_000_003 + zlib.crc32(worker_id.encode("utf-8"))) % (1 << 63)


def make_engine(
    cfg: WorkerConfig,
    sampling: SamplingParams,
    identify: Identify,
    version: int,
    plans: EpisodePlans | None = None,
) -> Engine:
    """The configured engine, its heavy imports done here and nowhere else; the sim engine plays `plans`'
    episodes when given (env.name = "sim")."""
    if cfg.engine == "sim":
        from actors.engines.sim_engine import SimEngine

        stop = sampling.stop_token_ids[0] if sampling.stop_token_ids else 2
        return SimEngine(
            cfg.sim_lengths,
            slots=cfg.slots,
            vocab_size=model_vocab_size(cfg.model) if cfg.model else SIM_VOCAB_SIZE,
            seed=sampling.seed,
            time_scale=cfg.sim_time_scale,
            cost=cfg.sim_cost,
            stop_token_id=stop,
            version=version,
            identify=identify,
            prompt_corr=cfg.sim_prompt_corr,
            keep_kv_across_updates=cfg.resume_kv is ResumeKV.REUSE,
            plans=plans,
        )
    if cfg.engine == "torch":
        from actors.engines.torch_engine import TorchEngine
        from april.hf import set_torch_threads

        set_torch_threads(cfg.torch_threads)
        # one generator per engine: salted with the worker id, or two workers would draw the same noise
        sampling = dataclasses.replace(sampling, seed=worker_seed(sampling.seed, cfg.worker_id))
        device = resolve_device(cfg.device, "worker.device")
        return TorchEngine(
            cfg.model,
            cfg.slots,
            sampling,
            device=device,
            version=version,
            memory_fraction=cfg.gpu_memory_fraction,
            max_seq_len=cfg.max_seq_len or None,
        )
    if cfg.engine == "sglang":
        from actors.engines.sglang_engine import SGLangEngine

        urls = [u.strip() for u in cfg.sglang_urls.split(",") if u.strip()]
        if not urls:
            raise EngineError("engine sglang needs worker.sglang_urls (comma-separated server URLs)")
        weights_dir = cfg.sglang_weights_dir or None  # the servers must see it: on this host
        return SGLangEngine(
            urls, slots=cfg.slots, sampling=sampling, version=version, weights_dir=weights_dir
        )
    if cfg.engine == "vllm":
        from actors.engines.vllm_engine import VLLMEngine

        settings = vllm_settings(cfg, resolve_device(cfg.device, "worker.device"))
        return VLLMEngine(cfg.model, cfg.slots, sampling, version=version, settings=settings)
    raise EngineError(f"unknown engine {cfg.engine!r} (expected one of {', '.join(ENGINES)})")
