"""The scheduling policy every mode shares, as pure functions (docs/design.md section 4).

Decides, from counts alone: which samples are dispatched first and how many go to each worker, which
worker may be leased work, why a complete group is dropped, the order complete groups form batches in,
and which prompt is issued next. What differs between the modes (rounds, the fresh-group allowance,
aborts on a new version, whether a batch may be taken now) is each mode's `broker.modes.ModePolicy`.
The broker core (`broker.core`, through `broker.state` and `broker.dispatch`) calls these on every
event, for the broker process and `april simulate` alike. Holds no sockets, no clocks and no sample
data: only group counts, versions and ordering keys.

Counting is in groups. `accepted` is every group issued and not dropped (trained, waiting, in flight or
partial): the async admission bound (`broker.modes.asynchronous`) caps it.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence

from april.config import AlgoConfig, PromptOrder
from april.records import Group
from broker.modes import ModePolicy

NEVER_GENERATED = 1 << 62  # sort key of a sample with no tokens yet: after every partial


class CompleteGroups:
    """The complete groups waiting for a batch, in the order `take_batch` takes them: oldest token first
    (a group with no token sorts as the learner's version), then group id.

    Kept as groups complete (a complete group's versions never change), so forming a batch reads its B
    groups and the count of groups per version, O(B + versions), instead of sorting and counting every
    waiting group: with a backlog of thousands of groups that scan was a sixth of the broker's time."""

    def __init__(self) -> None:
        self._versioned: list[tuple[int, int]] = []  # (oldest token version, group id), sorted
        self._unversioned: list[int] = []  # group ids of groups with no token, sorted
        self._versions: Counter[int | None] = Counter()  # groups per oldest token version

    def __len__(self) -> int:
        return len(self._versioned) + len(self._unversioned)

    def add(self, group_id: int, min_version: int | None) -> None:
        if min_version is None:
            bisect.insort(self._unversioned, group_id)
        else:
            bisect.insort(self._versioned, (min_version, group_id))
        self._versions[min_version] += 1

    def versions(self) -> Counter[int | None]:
        """Groups per oldest token version (None: no token)."""
        return self._versions

    def oldest(self, n: int, learner_version: int) -> list[int]:
        """The group ids of the first n in batch order."""
        return [gid for _, gid, _ in itertools.islice(self._merged(learner_version), n)]

    def remove_oldest(self, n: int, learner_version: int) -> None:
        """Remove the first n in batch order (those `oldest(n, learner_version)` gives)."""
        first = list(itertools.islice(self._merged(learner_version), n))
        versioned = sum(1 for *_, has_version in first if has_version)
        for version, _, has_version in first:
            key = version if has_version else None
            self._versions[key] -= 1
            if not self._versions[key]:
                del self._versions[key]
        del self._versioned[:versioned]
        del self._unversioned[: len(first) - versioned]

    def _merged(self, learner_version: int) -> Iterator[tuple[int, int, bool]]:
        """(sort version, group id, whether it has a token) of every group, in batch order; group ids are
        distinct, so the flag never decides the order."""
        return heapq.merge(
            ((version, gid, True) for version, gid in self._versioned),
            ((learner_version, gid, False) for gid in self._unversioned),
        )


def drop_reason(group: Group, algo: AlgoConfig) -> str | None:
    """Why a complete group is not trainable, or None. Dropped groups are counted, never lost."""
    if group.failed:
        return "failed"
    if algo.dynamic_sampling and group.uniform_reward:
        return "dynamic_filter"
    return None


def serves_current_weights(worker_version: int, failed_version: int, version: int, algo: AlgoConfig) -> bool:
    """Whether a worker may be leased work now: it serves the broker's weights `version`, or it reported
    that version unloadable (it keeps serving its own, older one) and that one lags `version` by at most
    `max_staleness`. A worker still getting the version gets nothing meanwhile: every token it generated
    would be of an older policy than the learner's. One whose load failed keeps working within the
    staleness bound (a single bad announcement does not stall the run), and past it gets nothing until it
    loads a newer version."""
    if worker_version >= version:
        return True
    return failed_version >= version and version - worker_version <= algo.max_staleness


def dispatch_key(group_id: int, index: int, min_version: int | None) -> tuple[int, int, int]:
    """Order of dispatch: partials oldest-first (by the version of their oldest token), then samples
    that have no token yet in issue order."""
    return (NEVER_GENERATED if min_version is None else min_version, group_id, index)


def take_batch(
    mode: ModePolicy,
    algo: AlgoConfig,
    complete: CompleteGroups,
    learner_version: int,
    incomplete: Sequence[int | None] = (),
) -> list[int] | None:
    """The group ids of the next batch: exactly rollout_batch_size complete groups, oldest first, or
    None when there are not enough or the mode holds the batch back (`ModePolicy.batch_may_form`; async:
    only a batch that keeps the staleness bound for every group, given in `incomplete` the oldest token
    version of every untrained group not complete). Surplus groups stay for the next batch. Oldest first
    is least slack first, the choice async's rule needs.
    """
    b = algo.rollout_batch_size
    if len(complete) < b:
        return None
    if not mode.batch_may_form(algo, complete.versions(), incomplete, learner_version):
        return None
    return complete.oldest(b, learner_version)


def spread_leases(available: int, free: Sequence[int], slots: Sequence[int]) -> list[int]:
    """How many of `available` samples to lease to each worker: one at a time to the worker with the most
    free slots relative to its size ((free - given) / slots; ties: more free slots, then the earlier
    worker), never more than its free slots.

    Spreading evens the engines' active sequences: a decode step costs more with more sequences, so a
    round ends earlier when no engine holds more than its share. With work for every free slot each
    worker gets all its free slots, as when filling them one by one. O(W + n log W) for W workers and
    n = min(available, sum(free)) samples; the caller sends each worker one Lease for its share.
    """
    if len(free) != len(slots):
        raise ValueError(f"spread_leases: {len(free)} free counts for {len(slots)} workers")
    shares = [0] * len(free)
    capacity = sum(max(0, f) for f in free)
    if available >= capacity:
        return [max(0, f) for f in free]
    left = max(0, available)
    if left and len({max(1, s) for f, s in zip(free, slots, strict=True) if f > 0}) == 1:
        return _spread_equal_sizes(left, free)
    heap = [(-f / max(1, s), -f, i) for i, (f, s) in enumerate(zip(free, slots, strict=True)) if f > 0]
    heapq.heapify(heap)
    while left > 0:
        _, _, i = heap[0]
        shares[i] += 1
        left -= 1
        rest = free[i] - shares[i]
        if rest > 0:
            heapq.heapreplace(heap, (-rest / max(1, slots[i]), -rest, i))
        else:
            heapq.heappop(heap)
    return shares


def _spread_equal_sizes(left: int, free: Sequence[int]) -> list[int]:
    """`spread_leases` when every worker with free slots has the same size and 0 < left < sum of free
    slots, in O(W log W): one at a time to the most free worker, ties to the earlier one, gives each
    worker what it has above a level L (the lowest with no more than `left` slots above it), then one
    more to each of the first (in worker order) of those with exactly L free, until `left` is spent."""
    desc = sorted((f for f in free if f > 0), reverse=True)
    above = 0  # free slots of the k most free workers
    level = 0
    for k, f in enumerate(desc, start=1):
        above += f
        level = -(-(above - left) // k)  # the lowest level these k alone could be cut down to
        if level >= (desc[k] if k < len(desc) else 0):  # the next worker has no slot above it
            break
    shares = [max(0, f - level) for f in free]
    rest = left - sum(shares)
    for i, f in enumerate(free):
        if rest and f >= level:
            shares[i] += 1
            rest -= 1
    return shares


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

    def head(self, n: int) -> list[tuple[int, int]]:
        """The first `n` keys in dispatch order (the ones a dispatch of `n` samples would lease)."""
        return [key for _, key in heapq.nsmallest(n, self._heap)] if n > 0 else []

    def remove(self, keys: set[tuple[int, int]]) -> None:
        """Take `keys` out of the queue wherever they are (resume affinity leases them to their holder)."""
        if keys:
            self._heap = [entry for entry in self._heap if entry[1] not in keys]
            heapq.heapify(self._heap)


def resume_affinity(holders: Sequence[int | None], free: Sequence[int]) -> list[int | None]:
    """Where queued partials go with resume affinity (`algo.resume_affinity`): given, in dispatch order, the
    index of the worker each partial last left (None: unknown, or that worker is gone) and every worker's
    free slots, the worker each one goes back to: its holder while the holder has a free slot left, else
    None (the usual spread places it on any worker, so nothing waits for its holder). The holder's engine
    may still cache its prefix (april.sim.prefix_cache), so the resume re-prefills less there."""
    left = list(free)
    out: list[int | None] = []
    for holder in holders:
        if holder is not None and 0 <= holder < len(left) and left[holder] > 0:
            left[holder] -= 1
            out.append(holder)
        else:
            out.append(None)
    return out


def pick_prompt(
    waiting: Sequence[tuple[int, float | None]], issued: int, order: PromptOrder, window: int
) -> int:
    """Which of the drawn, not yet issued prompts to issue next: an index into `waiting`, given as
    (issue count when it was drawn, predicted response length or None) in draw order.

    `order = "issue"`: the first. Otherwise the shortest (or longest) predicted first, a prompt never seen
    counting as the median of those seen; but a prompt drawn `window` issues ago or more goes first, so
    every prompt is issued within `window` groups of its turn: the epoch's prompts and their proportions
    stay those of the data, only their order within the window changes."""
    if order == PromptOrder.ISSUE or waiting[0][0] + window <= issued:
        return 0
    known = sorted(p for _, p in waiting if p is not None)
    default = known[len(known) // 2] if known else 0.0
    sign = 1.0 if order == PromptOrder.SHORTEST_FIRST else -1.0
    return min(range(len(waiting)), key=lambda i: (sign * (waiting[i][1] or default), i))
