"""The two round-based modes: sync (the baseline) and april (active partial rollouts).

Both run rounds (generation stops while the learner trains, as in the paper): a round keeps its target of
groups in flight, partial or complete, replacing dropped ones, and ends once a batch worth is complete.
sync keeps the batch itself in a round, so its round ends with nothing in flight; april over-samples
(`algo.over_sampling_batch_size`, or a planned target with `over_sampling = "auto"`) and the round's
unfinished samples are aborted and resumed in the next round. Neither aborts on a new weight version.
"""

from __future__ import annotations

from typing import ClassVar

from april.config import AlgoConfig, OverSampling
from broker.modes.base import ModePolicy, PoolCounts


class RoundMode(ModePolicy):
    """A mode that runs rounds; its round's target is the subclass's."""

    round_based: ClassVar[bool] = True
    abort_on_new_version: ClassVar[bool] = False

    def fresh_group_allowance(
        self, algo: AlgoConfig, counts: PoolCounts, version: int, round_open: bool, planned: int | None = None
    ) -> int:
        """Top the open round up to its target: complete groups count toward it, dropped ones are
        replaced, so a round never holds more than the target; nothing while it is closed."""
        if not round_open:
            return 0
        target = self.round_target(algo, planned)
        return max(0, target - counts.in_flight - counts.partial - counts.complete)


class Sync(RoundMode):
    """The baseline: a round is the batch, and every sample of it runs to the end."""

    name: ClassVar[str] = "sync"

    def round_target(self, algo: AlgoConfig, planned: int | None = None) -> int:
        return algo.rollout_batch_size


class April(RoundMode):
    """Active partial rollouts: a round over-samples, and ends once a batch is complete."""

    name: ClassVar[str] = "april"

    def round_target(self, algo: AlgoConfig, planned: int | None = None) -> int:
        return algo.over_sampling_batch_size if planned is None else planned

    def plans_rounds(self, algo: AlgoConfig) -> bool:
        return algo.over_sampling == OverSampling.AUTO
