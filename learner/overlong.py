"""DAPO's overlong handling of one step's train batch (DAPO paper, section 3.4), before advantages.

Owns `apply_overlong`: the soft overlong punishment (`learner.advantages.overlong_penalty`, a reward term
that depends only on the response length) added to each sample's reward, and overlong filtering, which
takes samples cut off by the token budget (finish reason `length`) out of the loss. Both are `[algo]`
settings (`overlong_buffer`, `overlong_penalty`, `overlong_filter`; the buffer defaults on for `dapo`).

Does not own the penalty formula (`learner.advantages`), the batch layout (`learner.batching`) or the loss
(`learner.losses`): a filtered sample is a sample whose response mask is empty, so it adds nothing to the
loss and its tokens leave the token normaliser; its reward still counts in its group's baseline.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from april.config import AlgoConfig
from april.records import FinishReason, Sample
from learner.advantages import overlong_penalty
from learner.batching import TrainBatch


@dataclass(frozen=True, slots=True)
class OverlongStats:
    """What `apply_overlong` did to one batch, for the step's metrics (`learner/overlong_*`)."""

    penalty_mean: float  # mean reward term over the batch's samples (<= 0)
    penalised: int  # samples with a nonzero penalty
    filtered: int  # truncated samples taken out of the loss

    def metrics(self) -> dict[str, float]:
        return {
            "overlong_penalty_mean": self.penalty_mean,
            "overlong_penalised": float(self.penalised),
            "overlong_filtered": float(self.filtered),
        }


def truncated_rows(samples: Sequence[Sample], batch: TrainBatch) -> torch.Tensor:
    """`[B]` bool: which rows of `batch` (built by `build_train_batch` from `samples`) ran out of budget.

    `build_train_batch` orders rows group by group (groups in order of first appearance) and by `index`
    within a group; the response lengths are checked against the batch so a change of that order fails
    loudly instead of filtering the wrong samples.
    """
    first_seen: dict[int, int] = {}
    for s in samples:
        first_seen.setdefault(s.group_id, len(first_seen))
    ordered = sorted(samples, key=lambda s: (first_seen[s.group_id], s.index))
    lengths = [s.response_len for s in ordered]
    if lengths != batch.response_lens.tolist():
        raise ValueError(
            "truncated_rows: the samples are not in the batch's row order (response lengths differ)"
        )
    flags = [s.finish_reason == FinishReason.LENGTH for s in ordered]
    return torch.tensor(flags, dtype=torch.bool, device=batch.response_mask.device)


def apply_overlong(
    batch: TrainBatch, truncated: torch.Tensor, algo: AlgoConfig
) -> tuple[TrainBatch, OverlongStats]:
    """The batch with DAPO's soft overlong punishment added to `rewards` (when the resolved buffer is
    > 0) and, with `algo.overlong_filter`, the `truncated` rows' response masks emptied (and the token
    normaliser `global_tokens` recounted). A full batch only: the punishment feeds the group baselines."""
    if batch.size != batch.global_samples:
        raise ValueError(f"apply_overlong: a micro-batch ({batch.size} of {batch.global_samples} samples)")
    if tuple(truncated.shape) != (batch.size,):
        raise ValueError(
            f"apply_overlong: truncated of shape {tuple(truncated.shape)}, expected ({batch.size},)"
        )
    buffer = algo.overlong_buffer_tokens
    penalty = torch.zeros_like(batch.rewards)
    if buffer > 0:
        lengths = batch.response_lens.cpu()
        term = overlong_penalty(lengths, algo.max_new_tokens, buffer, algo.overlong_penalty)
        penalty = term.to(batch.rewards.device, batch.rewards.dtype)
    response_mask, filtered = batch.response_mask, 0
    if algo.overlong_filter:
        response_mask = batch.response_mask & ~truncated[:, None]
        filtered = int(truncated.sum())
    shaped = dataclasses.replace(
        batch,
        rewards=batch.rewards + penalty,
        response_mask=response_mask,
        global_tokens=int(response_mask.sum()),
    )
    stats = OverlongStats(float(penalty.mean()), int((penalty != 0).sum()), filtered)
    return shaped, stats
