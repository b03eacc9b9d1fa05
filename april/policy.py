"""The scheduling policy of the three modes, as pure functions (DESIGN.md section 4).

Decides, from counts alone: how many fresh groups may be issued now, when a round is complete and an
abort is due, which samples are dispatched first, and which complete groups form the next batch. The
broker calls these on every state change; `april simulate` drives the same functions in virtual time.
Holds no sockets, no clocks and no sample data: only group counts, versions and ordering keys.

Counting is in groups. `accepted` is every group issued and not dropped (trained, waiting, in flight or
partial): the async admission bound of AReaL, `accepted <= (max_staleness + version + 1) x B`, caps it.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from april.config import AlgoConfig, Mode
from april.records import Group

NEVER_GENERATED = 1 << 62  # sort key of a sample with no tokens yet: after every partial


@dataclass(frozen=True, slots=True)
class PoolCounts:
    """The groups the policy reasons about (none of them in an unacked batch)."""

    in_flight: int  # a sample leased or queued for a lease
    partial: int  # none running, some interrupted waiting to resume
    complete: int  # every sample finished, passed the filter, not handed to the learner yet
    accepted: int  # issued - dropped, including trained and handed-out groups


@dataclass(frozen=True, slots=True)
class GroupAge:
    group_id: int
    min_version: int | None  # oldest policy version among its tokens; None if no token yet


def is_round_based(mode: Mode) -> bool:
    """sync and april run rounds: generation stops while the learner trains (as in the paper)."""
    return mode in (Mode.SYNC, Mode.APRIL)


def round_target(mode: Mode, algo: AlgoConfig) -> int:
    """Groups kept in a round (in flight + partial + complete): the batch, or the over-sampled batch."""
    return algo.rollout_batch_size if mode == Mode.SYNC else algo.over_sampling_batch_size


def admission_limit(algo: AlgoConfig, version: int) -> int:
    """async: the most groups ever accepted by learner version `version`: (eta + v + 1) x B."""
    return (algo.max_staleness + version + 1) * algo.rollout_batch_size


def fresh_group_allowance(
    mode: Mode, algo: AlgoConfig, counts: PoolCounts, version: int, round_open: bool
) -> int:
    """How many new groups may be issued now (partials and queued samples are dispatched first).

    sync/april: top the round up to its target; dropped (filtered) groups are replaced, complete ones
    count toward the target, so a round never holds more than the target. async: the admission bound.
    """
    if is_round_based(mode):
        if not round_open:
            return 0
        return max(0, round_target(mode, algo) - counts.in_flight - counts.partial - counts.complete)
    return max(0, admission_limit(algo, version) - counts.accepted)


def round_complete(mode: Mode, algo: AlgoConfig, counts: PoolCounts) -> bool:
    """A round ends once a batch worth of complete groups exists (never in async)."""
    return is_round_based(mode) and counts.complete >= algo.rollout_batch_size


def abort_due(mode: Mode, algo: AlgoConfig, counts: PoolCounts, leased_samples: int) -> bool:
    """april: the round is complete and samples are still generating: interrupt them."""
    return round_complete(mode, algo, counts) and leased_samples > 0


def abort_on_new_version(mode: Mode) -> bool:
    """async: every new weight version interrupts generation so it resumes under the new weights."""
    return mode == Mode.ASYNC


def drop_reason(group: Group, algo: AlgoConfig) -> str | None:
    """Why a complete group is not trainable, or None. Dropped groups are counted, never lost."""
    if group.failed:
        return "failed"
    if algo.dynamic_sampling and group.uniform_reward:
        return "dynamic_filter"
    return None


def dispatch_key(group_id: int, index: int, min_version: int | None) -> tuple[int, int, int]:
    """Order of dispatch: partials oldest-first (by the version of their oldest token), then samples
    that have no token yet in issue order."""
    return (NEVER_GENERATED if min_version is None else min_version, group_id, index)


def is_due(min_version: int | None, learner_version: int, max_staleness: int) -> bool:
    """async: this group cannot wait for the next step without exceeding the staleness bound."""
    return min_version is not None and learner_version + 1 - min_version > max_staleness


def select_batch(
    mode: Mode,
    algo: AlgoConfig,
    complete: Sequence[GroupAge],
    learner_version: int,
    incomplete_due: int = 0,
) -> list[int] | None:
    """The group ids of the next batch: exactly rollout_batch_size complete groups, oldest first, or
    None when there are not enough. Surplus groups stay for the next batch.

    async: a batch is only formed once every due group (see `is_due`) is complete, so no sample is ever
    trained with staleness above max_staleness; the admission bound guarantees due groups fit in one batch.
    """
    b = algo.rollout_batch_size
    if len(complete) < b:
        return None
    if mode == Mode.ASYNC and incomplete_due > 0:
        return None
    ordered = sorted(
        complete,
        key=lambda g: (learner_version if g.min_version is None else g.min_version, g.group_id),
    )
    return [g.group_id for g in ordered[:b]]


class DispatchQueue:
    """Samples waiting for a lease, in dispatch order (see `dispatch_key`). Keys are (group_id, index)."""

    def __init__(self, entries: Iterable[tuple[tuple[int, int, int], tuple[int, int]]] = ()) -> None:
        self._heap: list[tuple[tuple[int, int, int], tuple[int, int]]] = list(entries)
        heapq.heapify(self._heap)

    def push(self, key: tuple[int, int], min_version: int | None) -> None:
        heapq.heappush(self._heap, (dispatch_key(key[0], key[1], min_version), key))

    def pop(self) -> tuple[int, int]:
        return heapq.heappop(self._heap)[1]

    def __len__(self) -> int:
        return len(self._heap)

    def ordered(self) -> list[tuple[int, int]]:
        return [key for _, key in sorted(self._heap)]
