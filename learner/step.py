"""One learner step on one batch: advantages, log-probs, the configured loss, backward, optimizer steps.

Owns the order of operations and the batch bookkeeping between `learner.batching` (tensors),
`learner.losses` (the objective) and `learner.engine` (the optimizer):
- advantages are computed once over the whole batch (groups are never split for them);
- the batch is cut into `updates` mini-batches of whole groups, one optimizer step each; each mini-batch
  is normalised on its own (its samples, its tokens), as PPO-style mini-batching does;
- a mini-batch is split into `k x world_size` parts balanced by tokens; rank r trains parts r, r + world,
  ... k is `Layout.micro_batches`, or with a token budget (`Layout.max_tokens`) the least k >= it whose
  parts each fit the budget (a part of one sample may not). Every rank derives the same k from the same
  batch. Losses carry the mini-batch's normalisers, so the parts' gradients add up to the mini-batch
  gradient: the engine's 1/accumulation and DeepSpeed's 1/world averaging are undone.
- the entropy's graph is built only when the loss has an entropy term; otherwise it is a metric.
- the proximal policy (`decoupled`) is the weights before the first update, for every mini-batch.
- given a `learner.sample_stats.SampleStats`, each sample's own figures are kept as its part is
  forwarded, and read back with the step's statistics, in the step's one read.
Every rank must call `train_step` with the same batch (`learner.ranks.share_batch`).
"""

from __future__ import annotations

import dataclasses
import itertools
import math
from dataclasses import dataclass
from typing import Any

import torch

from april.config import DEFAULT_LOGPROB_CHUNK_TOKENS
from learner.advantages import group_advantages
from learner.batching import (
    TrainBatch,
    response_logprobs,
    response_logprobs_and_entropy,
    select,
    with_advantages,
)
from learner.engine import TrainEngine
from learner.losses import DeviceStats, LossConfig, merge_stats, needs_proximal, policy_loss
from learner.ranks import reduce_stats, sum_over_ranks
from learner.sample_stats import SampleStats


@dataclass(frozen=True, slots=True)
class Layout:
    """How a mini-batch becomes micro-batches and how each is forwarded (the `learner.*` keys of the same
    meaning). `micro_batches` 0 means the engine's configured accumulation."""

    micro_batches: int = 0  # parts per rank: exactly this (max_tokens 0), or at least this
    max_tokens: int = 0  # token budget of a part (padded B x T; packed: its tokens); 0: no budget
    chunk_tokens: int = DEFAULT_LOGPROB_CHUNK_TOKENS  # response positions per log-prob chunk; 0: full logits
    packed: bool = False  # forward each part as one padding-free row


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


def part_cost(part: TrainBatch, packed: bool) -> int:
    """Tokens a forward of `part` computes over: its tokens packed, rows x longest sequence padded."""
    return part.tokens if packed else part.padded_tokens


def budget_accumulation(batch: TrainBatch, least: int, max_tokens: int, world: int, packed: bool) -> int:
    """The least k >= `least` such that `k x world` token-balanced parts each cost <= `max_tokens`
    (or hold one sample); `least` itself when `max_tokens` is 0."""
    if max_tokens <= 0:
        return least
    k = max(least, math.ceil(batch.tokens / (max_tokens * world)))
    while k * world < batch.size:
        if all(p.size == 1 or part_cost(p, packed) <= max_tokens for p in balanced_parts(batch, k * world)):
            break
        k += 1
    return k


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
    layout: Layout | None = None,
    per_sample: SampleStats | None = None,
) -> dict[str, float]:
    """Train on one exactly-N batch with the weights of `version` (`updates` optimizer steps); returns
    the step's statistics over all ranks, and fills `per_sample` (sized for the batch) when given."""
    module = engine.module  # the bare model: forwards without gradients
    device = next(module.parameters()).device
    layout = layout or Layout()
    least = layout.micro_batches or engine.settings.grad_accum_steps
    advantages = group_advantages(batch.group_rewards(), cfg.algorithm).reshape(-1)
    batch = with_advantages(batch, advantages)
    if per_sample is not None:
        per_sample.advantage = advantages.to(torch.float64).cpu().numpy()  # computed on the host
    rank, world = engine.rank, engine.world_size
    plan = []  # (mini-batch, micro-batches per rank, this rank's parts)
    for mb in mini_batches(batch, updates, group_size):
        accum = budget_accumulation(mb, least, layout.max_tokens, world, layout.packed)
        plan.append((mb, accum, [p.to(device) for p in rank_parts(mb, accum, rank, world)]))
    proximal: list[list[torch.Tensor | None]] = [[None] * len(parts) for _, _, parts in plan]
    if needs_proximal(cfg.offpolicy):  # the weights before this batch's first update: the proximal policy
        with torch.no_grad():
            proximal = [[_logprobs(module, p, temperature, layout) for p in parts] for _, _, parts in plan]
    stats: list[DeviceStats] = []  # on the device: nothing is read back until the step is done
    grad_norms: list[float] = []
    for (mb, accum, parts), prox in zip(plan, proximal, strict=True):
        engine.set_accumulation(accum)
        for part, part_prox in zip(parts, prox, strict=True):
            loss_stats = _backward_part(
                engine, part, part_prox, cfg, version, temperature, reference, layout, per_sample
            )
            stats.append(loss_stats)
        filler = parts[-1] if parts else select(mb, [0]).to(device)
        for _ in range(accum - len(parts)):  # fewer parts than micro-batches on this rank: zero-weighted
            # forwards keep the engine's micro-batch count and every rank's collectives in step
            engine.backward(_logprobs(engine.model, filler, temperature, layout).sum() * 0.0)
        grad_norms.append(engine.step())
    metrics = _read_back(reduce_stats(merge_stats(stats)), per_sample)
    for name in ("loss", "pg_loss", "kl_loss", "entropy_loss"):  # mean over the updates, not their sum
        metrics[name] = metrics[name] / len(plan)
    metrics["grad_norm"] = max(grad_norms)
    metrics["lr"] = engine.lr
    metrics["updates"] = float(len(plan))
    return metrics


def _read_back(stats: DeviceStats, per_sample: SampleStats | None) -> dict[str, float]:
    """The step's one read of its statistics (and of each sample's figures, summed over ranks)."""
    if per_sample is None:
        return stats.metrics()
    figures = sum_over_ranks(per_sample.values).to(stats.values.device).reshape(-1)
    host = torch.cat([stats.values, figures]).cpu()
    fields = stats.values.shape[0]
    per_sample.read(host[fields:])
    return DeviceStats(host[:fields]).metrics()


def _logprobs(model: Any, part: TrainBatch, temperature: float, layout: Layout) -> torch.Tensor:
    return response_logprobs(model, part, temperature, packed=layout.packed, chunk_tokens=layout.chunk_tokens)


def _backward_part(
    engine: TrainEngine,
    part: TrainBatch,
    proximal: torch.Tensor | None,
    cfg: LossConfig,
    version: int,
    temperature: float,
    reference: Any,
    layout: Layout,
    per_sample: SampleStats | None,
) -> DeviceStats:
    """Loss and backward of one part; its loss is scaled so the engine's averaging gives the sum."""
    logp, entropy = response_logprobs_and_entropy(
        engine.model,
        part,
        temperature,
        packed=layout.packed,
        chunk_tokens=layout.chunk_tokens,
        entropy_grad=cfg.entropy_coef > 0,  # otherwise a metric: no [tokens, V] graph kept for it
    )
    ref = None
    if reference is not None and cfg.kl_coef > 0:
        with torch.no_grad():
            ref = _logprobs(reference, part, temperature, layout)
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
    if per_sample is not None:
        per_sample.add(part, logp)
    engine.backward(loss * engine.accumulation * engine.world_size)
    return stats
