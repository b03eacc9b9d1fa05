"""What a scheduling mode decides: the questions the broker core, its books and the simulator ask of one.

A mode (`run.mode`: sync, april, async, docs/design.md section 4) is one `ModePolicy` object, chosen once
when the books are made (`broker.modes.policy_for`), and asked, from group counts alone: whether generation
runs in rounds that end with a batch, how many fresh groups may be issued now, when a round is complete,
whether a new weight version aborts what is leased, whether a batch of complete groups may be taken now,
and whether a round's target is planned. Nothing outside the policies tests which mode runs.

Holds no sockets, clocks, samples or books: pure answers, as `broker.policy`'s mode-free rules (dispatch
order, lease spreading, batch order, prompt order), which every mode shares.
"""

from __future__ import annotations

import abc
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar

from april.config import AlgoConfig


@dataclass(frozen=True, slots=True)
class PoolCounts:
    """The groups the policy reasons about (none of them in an unacked batch)."""

    in_flight: int  # a sample leased or queued for a lease
    partial: int  # none running, some interrupted waiting to resume
    complete: int  # every sample finished, passed the filter, not handed to the learner yet
    accepted: int  # issued - dropped, including trained and handed-out groups


class ModePolicy(abc.ABC):
    """One scheduling mode. Stateless: every answer is a function of its arguments."""

    name: ClassVar[str]  # the value of `run.mode` that chooses it
    # Generation runs in rounds: a round closes once a batch of groups is complete, its leased samples are
    # aborted and its queued ones parked, and no training work is leased until the batch is acked.
    round_based: ClassVar[bool]
    # Every new weight version aborts what is leased, so that it resumes under the new weights.
    abort_on_new_version: ClassVar[bool]
    # `batch_may_form` reads the oldest token versions of the groups not complete yet (an O(groups) scan
    # the books skip when no mode asks for it).
    needs_incomplete_versions: ClassVar[bool] = False

    @abc.abstractmethod
    def round_target(self, algo: AlgoConfig, planned: int | None = None) -> int:
        """Groups kept in a round (in flight + partial + complete); `planned`: the round's planned target."""

    @abc.abstractmethod
    def fresh_group_allowance(
        self, algo: AlgoConfig, counts: PoolCounts, version: int, round_open: bool, planned: int | None = None
    ) -> int:
        """How many new groups may be issued now (partials and queued samples are dispatched first)."""

    def round_complete(self, algo: AlgoConfig, counts: PoolCounts) -> bool:
        """A round ends once a batch worth of complete groups exists (a mode without rounds: never)."""
        return self.round_based and counts.complete >= algo.rollout_batch_size

    def batch_may_form(
        self,
        algo: AlgoConfig,
        complete_versions: Counter[int | None],
        incomplete_versions: Sequence[int | None],
        learner_version: int,
    ) -> bool:
        """Whether the oldest batch worth of complete groups may be taken now, given every complete and
        (with `needs_incomplete_versions`) not complete untrained group's oldest token version (None: no
        token). By default: yes."""
        return True

    def plans_rounds(self, algo: AlgoConfig) -> bool:
        """Whether each round's target is planned when it opens (broker/round_plan.py)."""
        return False

    def held_by_admission(self, algo: AlgoConfig, counts: PoolCounts, version: int) -> bool:
        """Whether an admission bound, not generation, keeps fresh groups back now (the simulator's label
        for why the learner waits)."""
        return False
