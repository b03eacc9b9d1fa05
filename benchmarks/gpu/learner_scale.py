"""The `learner-*` phases: the learner's step at scale, one optimizer implementation a phase.

A model of `params["shape"]` (random weights, bf16 on CUDA, float32 on the CPU) goes into the training
engine as the learner sets it up (`learner.model_trainer`: DeepSpeed, the `learner.*` defaults, one
sample a micro-batch count), then `learner.step.train_step` (GRPO, the default layout: log-probs a
chunk at a time, micro-batches cut to the token budget) on synthetic batches of `samples` x (prompt +
response) tokens (`benchmarks/learner_memory.py`'s). Per size (samples, response tokens, warm-up
steps, timed steps): the untimed steps, then the timed ones (synchronised), the peak CUDA memory over
them and the step's model FLOPs (`gpu.flops`). The seconds to build the model and to set up the engine
(DeepSpeed, the optimizer's kernels) are recorded too.

`adam_impl` names the optimizer (`learner.adam_impl`: "torch" fused AdamW or "deepspeed" FusedAdam);
where `TrainSettings` has no such field yet, only the implementation the engine uses anyway on that
device runs, and the other is skipped with the reason. The optimizer classes the engine really holds
are recorded, whatever was asked.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from typing import Any

from april.hf import set_torch_threads
from gpu.flops import attention_flops, matmul_weights, weight_flops
from gpu.record import PhaseRecord
from gpu.shapes import SHAPES, Qwen3Shape, build

GIB = 2**30


def optimizer_chain(engine: Any) -> list[str]:
    """Class names from the engine's optimizer inwards (DeepSpeed wraps the AdamW it was given)."""
    names: list[str] = []
    opt = getattr(engine.model, "optimizer", None)
    while opt is not None and len(names) < 4:
        names.append(type(opt).__name__)
        opt = getattr(opt, "optimizer", None)
    return names


def make_engine(model: Any, device: str, adam_impl: str) -> Any:
    """The training engine as `learner.model_trainer` builds it from the `learner.*` defaults."""
    from april.config import LearnerConfig
    from learner.engine import TrainEngine, TrainSettings

    return TrainEngine(
        model, TrainSettings.of(LearnerConfig(), device, backend="deepspeed", adam_impl=adam_impl)
    )


def measure_size(
    engine: Any, shape: Qwen3Shape, weights: int, params: dict[str, Any], size: list[int]
) -> dict[str, Any]:
    """`warmup` untimed then `steps` timed train steps on `samples` x (prompt + `length`) tokens."""
    import torch
    from learner_memory import layouts, synthetic_batch

    from april.config import AlgoConfig
    from learner.losses import LossConfig, needs_proximal
    from learner.step import Layout, train_step

    samples, length, warmup, steps = size
    device, group = params["device"], params["group"]
    spec = argparse.Namespace(
        samples=samples, group=group, prompt=params["prompt"], vocab=shape.vocab, seed=0
    )
    batch = synthetic_batch(spec, length)
    keys = layouts()["after"]  # the learner's defaults
    layout = Layout(
        micro_batches=keys["micro_batches"],
        max_tokens=keys["max_tokens_per_micro_batch"],
        chunk_tokens=keys["logprob_chunk_tokens"],
        packed=keys["pack_sequences"],
    )
    cfg = LossConfig.from_algo(AlgoConfig(n_samples_per_prompt=group))
    on_gpu = device.startswith("cuda")

    def step() -> tuple[float, dict[str, float]]:
        started = time.perf_counter()
        metrics = train_step(engine, batch, cfg, version=0, temperature=1.0, group_size=group, layout=layout)
        if on_gpu:
            torch.cuda.synchronize()
        return time.perf_counter() - started, metrics

    if on_gpu:
        torch.cuda.reset_peak_memory_stats()
    warmup_s = [step()[0] for _ in range(warmup)]
    timed = [step() for _ in range(steps)]
    step_s = [t for t, _ in timed]
    lengths = (batch.prompt_lens + batch.response_lens).tolist()
    median = statistics.median(step_s)
    return {
        "samples": samples,
        "response_len": length,
        "prompt_len": params["prompt"],
        "tokens": batch.tokens,
        "response_tokens": int(batch.response_lens.sum()),
        "micro_batches": engine.accumulation,
        "proximal_forward": needs_proximal(cfg.offpolicy),  # an extra no-grad forward, not in model FLOPs
        "warmup_s": warmup_s,
        "step_s": step_s,
        "median_s": median,
        "tokens_per_s": batch.tokens / median,
        "response_tokens_per_s": int(batch.response_lens.sum()) / median,
        "weight_flops": weight_flops(weights, batch.tokens),
        "attention_flops": attention_flops(shape.layers, shape.heads, shape.head_dim, lengths),
        "peak_allocated_gib": torch.cuda.max_memory_allocated() / GIB if on_gpu else None,
        "peak_reserved_gib": torch.cuda.max_memory_reserved() / GIB if on_gpu else None,
        "loss": timed[-1][1]["loss"],
    }


def run(params: dict[str, Any], record: PhaseRecord) -> None:
    import torch

    device, shape = params["device"], SHAPES[params["shape"]]
    if params.get("threads"):
        set_torch_threads(params["threads"])
    started = time.perf_counter()
    model = build(shape, device, torch.bfloat16 if device.startswith("cuda") else torch.float32)
    weights = matmul_weights(model)
    record.put(
        "model",
        {
            "shape": params["shape"],
            **dataclasses.asdict(shape),
            "parameters": sum(p.numel() for p in model.parameters()),
            "matmul_weights": weights,
            "dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
            "build_s": time.perf_counter() - started,
        },
    )
    started = time.perf_counter()
    engine = make_engine(model, device, params["adam_impl"])
    record.put(
        "engine",
        {
            "adam_impl": params["adam_impl"],
            "optimizer": optimizer_chain(engine),
            "setup_s": time.perf_counter() - started,
        },
    )
    rows: list[dict[str, Any]] = []
    for size in params["sizes"]:
        try:
            rows.append(measure_size(engine, shape, weights, params, size))
        except torch.OutOfMemoryError as exc:  # the next size may still fit, and is still worth knowing
            record.error(f"{size[0]} x {size[1]}", exc)
            torch.cuda.empty_cache()
        record.put("sizes", rows)
    engine.close()
