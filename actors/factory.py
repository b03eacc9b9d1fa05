"""Building the engine and tokenizer a worker was configured with, importing only the one asked for."""

from __future__ import annotations

from typing import Any

from actors.engine import ENGINES, Engine, EngineError, SamplingParams
from actors.engines.sim_engine import Identify
from actors.tokenizer import ByteTokenizer, HFTokenizer, Tokenizer
from april.config import WorkerConfig


def make_tokenizer(cfg: WorkerConfig) -> Tokenizer:
    if cfg.model:
        return HFTokenizer(cfg.model)
    if cfg.engine in ("torch", "vllm"):
        raise EngineError(f"worker.model is required with engine {cfg.engine!r} (an HF model directory)")
    return ByteTokenizer()


def make_engine(cfg: WorkerConfig, sampling: SamplingParams, identify: Identify, version: int) -> Engine:
    """The configured engine, its heavy imports done here and nowhere else."""
    if cfg.engine == "sim":
        from actors.engines.sim_engine import SimEngine

        stop = sampling.stop_token_ids[0] if sampling.stop_token_ids else 2
        return SimEngine(
            cfg.sim_lengths,
            slots=cfg.slots,
            seed=sampling.seed,
            time_scale=cfg.sim_time_scale,
            stop_token_id=stop,
            version=version,
            identify=identify,
        )
    if cfg.engine == "torch":
        from actors.engines.torch_engine import TorchEngine
        from actors.hf import set_torch_threads

        set_torch_threads(cfg.torch_threads)
        return TorchEngine(cfg.model, cfg.slots, sampling, device=cfg.device, version=version)
    if cfg.engine == "sglang":
        from actors.engines.sglang_engine import SGLangEngine

        urls = [u.strip() for u in cfg.sglang_urls.split(",") if u.strip()]
        if not urls:
            raise EngineError("engine sglang needs worker.sglang_urls (comma-separated server URLs)")
        return SGLangEngine(urls, slots=cfg.slots, sampling=sampling, version=version)
    if cfg.engine == "vllm":
        from actors.engines.vllm_engine import VLLMEngine

        args: dict[str, Any] = {"kv_cache_memory_bytes": int(cfg.vllm_kv_cache_gib * (1 << 30))}
        if cfg.vllm_max_model_len:
            args["max_model_len"] = cfg.vllm_max_model_len
        if cfg.device == "cpu":  # fp32 and no torch.compile warm-up: start-up in seconds on a CPU
            args.update(dtype="float32", enforce_eager=True)
        return VLLMEngine(cfg.model, cfg.slots, sampling, version=version, **args)
    raise EngineError(f"unknown engine {cfg.engine!r} (expected one of {', '.join(ENGINES)})")
