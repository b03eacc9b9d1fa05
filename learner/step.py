"""One learner step on one batch: advantages, log-probs, the configured loss, backward, optimizer steps.

Owns the order of operations and the batch bookkeeping between `learner.batching` (tensors),
`learner.losses` (the objective) and `learner.engine` (the optimizer):
- advantages are computed once over the whole batch (groups are never split for them);
- the batch is cut into `updates` mini-batches of whole groups, one optimizer step each; each mini-batch
  is normalised on its own (its samples, its tokens), as PPO-style mini-batching does;
- a mini-batch is split into `micro_batches x world_size` parts balanced by tokens; rank r trains parts
  r, r + world, ... Losses carry the mini-batch's normalisers, so the parts' gradients add up to the
  mini-batch gradient: the engine's 1/accumulation and DeepSpeed's 1/world averaging are undone.
- the proximal policy (`decoupled`) is the weights before the first update, for every mini-batch.
Every rank must call `train_step` with the same batch (`learner.ranks.share_batch`).
"""

from __future__ import annotations

import dataclasses
import itertools
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
from learner.ranks import reduce_stats


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


def mini_batches(batch: TrainBatch, updates: int, group_size: int) -> list[TrainBatch]:
    """`updates` mini-batches of whole groups (contiguous, sizes differing by at most one group), each
    normalised on its own samples and tokens. One update: the batch itself."""
    if updates == 1:
        return [batch]
    groups = batch.size // group_size
    if not 1 <= updates <= groups:
        raise ValueError(f"updates_per_batch = {updates}: expected 1..{groups} (the batch's groups)")
    bounds = [round(u * groups / updates) for u in range(updates + 1)]
    out = []
    for lo, hi in itertools.pairwise(bounds):
        part = select(batch, range(lo * group_size, hi * group_size))
        out.append(
            # the mask, not the lengths: samples filtered out of the loss (learner.overlong) have no tokens
            dataclasses.replace(part, global_samples=part.size, global_tokens=int(part.response_mask.sum()))
        )
    return out


def rank_parts(batch: TrainBatch, accum: int, rank: int, world: int) -> list[TrainBatch]:
    """This rank's share of `accum x world` token-balanced parts (may be fewer than `accum`, or none)."""
    return balanced_parts(batch, accum * world)[rank::world]


def train_step(
    engine: TrainEngine,
    batch: TrainBatch,
    cfg: LossConfig,
    *,
    version: int,
    temperature: float,
    group_size: int,
    updates: int = 1,
    reference: Any = None,
) -> dict[str, float]:
    """Train on one exactly-N batch with the weights of `version` (`updates` optimizer steps); returns
    the step's statistics over all ranks."""
    module = engine.module  # the bare model: forwards without gradients
    device = next(module.parameters()).device
    batch = with_advantages(batch, group_advantages(batch.group_rewards(), cfg.algorithm).reshape(-1))
    accum, rank, world = engine.settings.grad_accum_steps, engine.rank, engine.world_size
    plan = [
        (mb, [p.to(device) for p in rank_parts(mb, accum, rank, world)])
        for mb in mini_batches(batch, updates, group_size)
    ]
    proximal: list[list[torch.Tensor | None]] = [[None] * len(parts) for _, parts in plan]
    if needs_proximal(cfg.offpolicy):  # the weights before this batch's first update: the proximal policy
        with torch.no_grad():
            proximal = [[response_logprobs(module, p, temperature) for p in parts] for _, parts in plan]
    stats: list[LossStats] = []
    grad_norms: list[float] = []
    for (mb, parts), prox in zip(plan, proximal, strict=True):
        for part, part_prox in zip(parts, prox, strict=True):
            stats.append(_backward_part(engine, part, part_prox, cfg, version, temperature, reference))
        filler = parts[-1] if parts else select(mb, [0]).to(device)
        for _ in range(accum - len(parts)):  # fewer parts than micro-batches on this rank: zero-weighted
            # forwards keep the engine's micro-batch count and every rank's collectives in step
            engine.backward(response_logprobs(engine.model, filler, temperature).sum() * 0.0)
        grad_norms.append(engine.step())
    merged = reduce_stats(merge_stats(stats))
    metrics = merged.metrics()
    for name in ("loss", "pg_loss", "kl_loss", "entropy_loss"):  # mean over the updates, not their sum
        metrics[name] = metrics[name] / len(plan)
    metrics["grad_norm"] = max(grad_norms)
    metrics["lr"] = engine.lr
    metrics["updates"] = float(len(plan))
    return metrics


def _backward_part(
    engine: TrainEngine,
    part: TrainBatch,
    proximal: torch.Tensor | None,
    cfg: LossConfig,
    version: int,
    temperature: float,
    reference: Any,
) -> LossStats:
    """Loss and backward of one part; its loss is scaled so the engine's averaging gives the sum."""
    logp, entropy = response_logprobs_and_entropy(engine.model, part, temperature)
    ref = None
    if reference is not None and cfg.kl_coef > 0:
        with torch.no_grad():
            ref = response_logprobs(reference, part, temperature)
    loss, stats = policy_loss(
        logp,
        part.behaviour_logprobs,
        proximal,
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
    engine.backward(loss * engine.settings.grad_accum_steps * engine.world_size)
    return stats
