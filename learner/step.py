"""One learner step on one batch: advantages, log-probs, the configured loss, backward, optimizer step.

Owns the order of operations and the micro-batch bookkeeping between `learner.batching` (tensors),
`learner.losses` (the objective) and `learner.engine` (the optimizer). The batch is split into exactly
`micro_batches` parts balanced by tokens: losses are normalised over the whole batch, so the parts'
gradients add up to the full-batch gradient, and the engine's own 1/accumulation scaling is undone.
"""

from __future__ import annotations

from typing import Any

import torch

from learner.advantages import group_advantages
from learner.batching import (
    TrainBatch,
    response_logprobs,
    response_logprobs_and_entropy,
    select,
    with_advantages,
)
from learner.engine import TrainEngine
from learner.losses import LossConfig, LossStats, merge_stats, needs_proximal, policy_loss


def balanced_parts(batch: TrainBatch, parts: int) -> list[TrainBatch]:
    """Exactly `parts` micro-batches (fewer only if there are fewer samples), greedy longest-first into
    the part with the fewest tokens; each keeps the full batch's normalisers."""
    lengths = (batch.prompt_lens + batch.response_lens).tolist()
    bins: list[list[int]] = [[] for _ in range(min(parts, batch.size))]
    load = [0] * len(bins)
    for i in sorted(range(batch.size), key=lambda i: -lengths[i]):
        k = load.index(min(load))
        bins[k].append(i)
        load[k] += lengths[i]
    return [select(batch, sorted(rows)) for rows in bins]


def train_step(
    engine: TrainEngine,
    batch: TrainBatch,
    cfg: LossConfig,
    *,
    version: int,
    temperature: float,
    reference: Any = None,
) -> dict[str, float]:
    """Train on one exactly-N batch with the weights of `version`; returns the step's statistics."""
    module = engine.module  # the bare model: forwards without gradients
    model = engine.model  # what gradients flow through (the DeepSpeed engine under ZeRO-3)
    device = next(module.parameters()).device
    batch = with_advantages(batch, group_advantages(batch.group_rewards(), cfg.algorithm).reshape(-1))
    accum = engine.settings.grad_accum_steps
    parts = [p.to(device) for p in balanced_parts(batch, accum)]
    proximal: list[torch.Tensor | None] = [None] * len(parts)
    if needs_proximal(cfg.offpolicy):  # the weights before this update: the proximal policy
        with torch.no_grad():
            proximal = [response_logprobs(module, p, temperature) for p in parts]
    stats: list[LossStats] = []
    for part, prox in zip(parts, proximal, strict=True):
        logp, entropy = response_logprobs_and_entropy(model, part, temperature)
        ref = None
        if reference is not None and cfg.kl_coef > 0:
            with torch.no_grad():
                ref = response_logprobs(reference, part, temperature)
        loss, part_stats = policy_loss(
            logp,
            part.behaviour_logprobs,
            prox,
            part.advantages,
            part.response_mask,
            part.versions,
            version,
            cfg,
            num_samples=part.global_samples,
            num_tokens=part.global_tokens,
            logp_ref=ref,
            entropy=entropy,
        )
        engine.backward(loss * accum)  # the engine divides by accum; our normalisers are already global
        stats.append(part_stats)
    for _ in range(accum - len(parts)):  # fewer samples than micro-batches: a zero-weighted forward keeps
        # the engine's micro-batch count and, under ZeRO-3, every rank's collectives in step
        engine.backward(response_logprobs(model, parts[-1], temperature).sum() * 0.0)
    grad_norm = engine.step()
    metrics = merge_stats(stats).metrics()
    metrics["grad_norm"] = grad_norm
    metrics["lr"] = engine.lr
    return metrics
