"""Each trained sample's own figures from one learner step, for the rollout records.

Owns `SampleStats`: per sample of the step (by its row in the `TrainBatch`), the sum of its model tokens'
log-probs under the learner, their count and the largest ratio pi_theta / pi_beh over them, written part
by part as `learner.step.train_step` runs, on the loss's device and by index, so nothing is read back per
micro-batch (the step's statistics, `learner.losses.DeviceStats`, follow the same rule); summed over
ranks (each sample is trained on one rank) and read to the host with the step's statistics, in the step's
one read. pi_theta is the learner's weights when the sample's part was forwarded (before the update of
its mini-batch). The ratio's log is clamped as the loss clamps it (`log_ratio_clamp`).

Does not compute the loss or the advantages (`learner.step` hands the advantages in) and does not decide
what is recorded (`april.rollouts`).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from learner.batching import TrainBatch

ROWS = 3  # log-prob sum, model tokens, largest ratio


class SampleStats:
    """The figures of the `size` samples of one step, on `device` until `read`."""

    def __init__(self, size: int, device: torch.device | str, log_ratio_clamp: float = 0.0) -> None:
        self.values = torch.zeros(ROWS, size, dtype=torch.float64, device=device)
        self.bound = log_ratio_clamp if log_ratio_clamp > 0 else math.inf
        self.advantage = np.full(size, np.nan)  # set by the step (computed on the host)
        self.logprob_mean = np.full(size, np.nan)  # after `read`; NaN for a sample without model tokens
        self.ratio_max = np.full(size, np.nan)

    def add(self, part: TrainBatch, logp: Tensor) -> None:
        """Record the samples of `part` from `logp` `[B, Tr]`, the learner's log-probs of their response
        tokens (nats). Model tokens are those with a version (observations and padding have -1); a sample
        the overlong filter took out of the loss keeps its figures."""
        with torch.no_grad():
            model = part.versions >= 0  # [B, Tr]
            lp = logp.detach().to(torch.float64)
            total = torch.where(model, lp, 0.0).sum(dim=1)
            count = model.sum(dim=1).to(torch.float64)
            ratio = torch.zeros_like(total)
            if lp.shape[1] > 0:  # max over an empty dimension raises
                d = torch.where(model, lp - part.behaviour_logprobs.to(torch.float64), -math.inf)
                ratio = torch.exp(d.clamp(max=self.bound).amax(dim=1))  # 0 for a sample without model tokens
            rows = part.sample_index.to(self.values.device)
            self.values[:, rows] = torch.stack([total, count, ratio]).to(self.values.device)

    def read(self, host: Tensor) -> None:
        """Take the figures from `host`, `values` (summed over ranks) as read back: `[ROWS * size]`."""
        total, count, ratio = host.view(ROWS, -1).numpy()
        has = count > 0
        self.logprob_mean = np.where(has, total / np.maximum(count, 1), np.nan)
        self.ratio_max = np.where(has, ratio, np.nan)
