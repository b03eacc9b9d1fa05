"""What the broker has seen of response lengths: per prompt, and over the run's recent samples.

Owns `LengthHistory`, fed one finished sample at a time (its prompt's dataset index and its total response
length) and read by the scheduling policy:
  - `predict(prompt)`: the expected response length of a prompt seen before (prompts recur every epoch;
    a response's length is mostly a property of its prompt, which is what RhymeRL's and Seer's length
    prediction rests on), or None for a prompt never seen;
  - `recent()`: the last `RECENT` finished lengths of the whole run, the distribution `april.round_plan`
    draws from to predict a round.

Per prompt it keeps an exponential moving average of log length (lengths are heavy-tailed: a log scale
keeps one 16k response from swamping a prompt whose answers are 2k) and the number seen. The whole
history is persisted in the broker's snapshot (`to_wire` / `from_wire`), so a restarted broker keeps
predicting. Holds no sample data and no clocks; knows nothing of engines or modes.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from april.codec import Float64Array, Int64Array

RECENT = 4096  # finished lengths kept for the run-wide distribution
EMA_WEIGHT = 0.5  # weight of the newest length in a prompt's average of log lengths
MAX_PROMPTS = 1 << 20  # prompts remembered; the least recently seen is forgotten beyond this


class LengthHistory:
    def __init__(self) -> None:
        self._log_mean: dict[int, float] = {}  # prompt index -> EMA of log(length); insertion = recency
        self._seen: dict[int, int] = {}
        self._recent: deque[int] = deque(maxlen=RECENT)

    def __len__(self) -> int:
        return len(self._log_mean)

    def record(self, prompt: int, length: int) -> None:
        """One finished sample of `prompt` with `length` response tokens (>= 0)."""
        value = math.log(max(1, length))
        old = self._log_mean.pop(prompt, None)
        self._log_mean[prompt] = value if old is None else (1 - EMA_WEIGHT) * old + EMA_WEIGHT * value
        self._seen[prompt] = self._seen.pop(prompt, 0) + 1
        if len(self._log_mean) > MAX_PROMPTS:
            oldest = next(iter(self._log_mean))
            del self._log_mean[oldest], self._seen[oldest]
        self._recent.append(max(0, length))

    def predict(self, prompt: int) -> float | None:
        """The predicted response length of `prompt` (geometric mean of what it gave), None if unseen."""
        value = self._log_mean.get(prompt)
        return None if value is None else math.exp(value)

    def seen(self, prompt: int) -> int:
        return self._seen.get(prompt, 0)

    def recent(self) -> npt.NDArray[np.int64]:
        """The last `RECENT` finished lengths, oldest first."""
        return np.fromiter(self._recent, dtype=np.int64, count=len(self._recent))

    def to_wire(self) -> HistoryWire:
        """Arrays for the snapshot codec (taken on the broker's poll loop at every snapshot: read straight
        from the dicts, no lookups; `record` moves a prompt to the end of both and evicts from the front
        of both, so they hold the prompts in the same order)."""
        n = len(self._log_mean)
        return HistoryWire(
            prompts=np.fromiter(self._log_mean.keys(), dtype=np.int64, count=n),
            log_mean=np.fromiter(self._log_mean.values(), dtype=np.float64, count=n),
            seen=np.fromiter(self._seen.values(), dtype=np.int64, count=n),
            recent=self.recent(),
        )

    @staticmethod
    def from_wire(wire: HistoryWire) -> LengthHistory:
        if not wire.prompts.shape == wire.log_mean.shape == wire.seen.shape:
            raise ValueError(
                f"length history: {wire.prompts.shape[0]} prompts, {wire.log_mean.shape[0]} means, "
                f"{wire.seen.shape[0]} counts"
            )
        h = LengthHistory()
        for p, m, n in zip(wire.prompts.tolist(), wire.log_mean.tolist(), wire.seen.tolist(), strict=True):
            h._log_mean[p] = m
            h._seen[p] = n
        h._recent.extend(wire.recent.tolist())
        return h


@dataclass(frozen=True, slots=True)
class HistoryWire:
    """`LengthHistory` as the snapshot stores it (the codec's struct)."""

    prompts: Int64Array
    log_mean: Float64Array
    seen: Int64Array
    recent: Int64Array
