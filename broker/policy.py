"""The scheduling policy of the three modes, as pure functions (docs/design.md section 4).

Decides, from counts alone: how many fresh groups may be issued now, when a round is complete and an
abort is due, which samples are dispatched first and how many go to each worker, and which complete
groups form the next batch (async: only one that keeps every group within the staleness bound). The
broker core (`broker.core`, through `broker.state` and `broker.dispatch`) calls these on every event,
for the broker process and `april simulate` alike.
Holds no sockets, no clocks and no sample data: only group counts, versions and ordering keys.

Counting is in groups. `accepted` is every group issued and not dropped (trained, waiting, in flight or
partial): the async admission bound of AReaL, `accepted <= (max_staleness + version + 1) x B`, caps it.
"""

from __future__ import annotations

import bisect
import heapq
import itertools
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from april.config import AlgoConfig, Mode, PromptOrder
from april.records import Group

NEVER_GENERATED = 1 << 62  # sort key of a sample with no tokens yet: after every partial


@dataclass(frozen=True, slots=True)
class PoolCounts:
    """The groups the policy reasons about (none of them in an unacked batch)."""

    in_flight: int  # a sample leased or queued for a lease
    partial: int  # none running, some interrupted waiting to resume
    complete: int  # every sample finished, passed the filter, not handed to the learner yet
    accepted: int  # issued - dropped, including trained and handed-out groups


class CompleteGroups:
    """The complete groups waiting for a batch, in the order `select_batch` takes them: oldest token first
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


def is_round_based(mode: Mode) -> bool:
    """sync and april run rounds: generation stops while the learner trains (as in the paper)."""
    return mode in (Mode.SYNC, Mode.APRIL)


def round_target(mode: Mode, algo: AlgoConfig, planned: int | None = None) -> int:
    """Groups kept in a round (in flight + partial + complete): the batch, or the over-sampled batch
    (`over_sampling = "auto"`: the round's `planned` target, see broker/round_plan.py)."""
    if mode == Mode.SYNC:
        return algo.rollout_batch_size
    return algo.over_sampling_batch_size if planned is None else planned


def admission_limit(algo: AlgoConfig, version: int) -> int:
    """async: the most groups ever accepted by learner version `version`: (eta + v + 1) x B."""
    return (algo.max_staleness + version + 1) * algo.rollout_batch_size


def fresh_group_allowance(
    mode: Mode,
    algo: AlgoConfig,
    counts: PoolCounts,
    version: int,
    round_open: bool,
    planned: int | None = None,
) -> int:
    """How many new groups may be issued now (partials and queued samples are dispatched first).

    sync/april: top the round up to its target; dropped (filtered) groups are replaced, complete ones
    count toward the target, so a round never holds more than the target. async: the admission bound.
    """
    if is_round_based(mode):
        if not round_open:
            return 0
        target = round_target(mode, algo, planned)
        return max(0, target - counts.in_flight - counts.partial - counts.complete)
    return max(0, admission_limit(algo, version) - counts.accepted)


def round_complete(mode: Mode, algo: AlgoConfig, counts: PoolCounts) -> bool:
    """A round ends once a batch worth of complete groups exists (never in async)."""
    return is_round_based(mode) and counts.complete >= algo.rollout_batch_size


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


def slack(min_version: int | None, learner_version: int, max_staleness: int) -> int:
    """async: how many later batches this group may still wait, 0..eta (0: it is due: the next batch
    must take it).

    A group whose oldest token is of version m must be trained at a version <= m + eta (its deadline); its
    slack is deadline - learner_version. A group with no token yet gets its first under the learner's
    version or later: slack eta. An overdue group (left by an earlier setting or a restart) counts as due.
    """
    oldest = learner_version if min_version is None else min_version
    return min(max_staleness, max(0, oldest + max_staleness - learner_version))


def keeps_staleness_bound(
    algo: AlgoConfig,
    complete: Iterable[int | None],
    incomplete: Iterable[int | None],
    learner_version: int,
) -> bool:
    """async: whether a batch taken now (the B complete groups of least slack) leaves every untrained group
    a batch in time. Groups are given by their oldest token version (None: no token yet).

    One batch of B groups is trained per version. Let N(k) be the untrained groups (complete or not, none
    in the unacked batch) with slack <= k, C(k) the complete ones. The rule: for every k in 0..eta,

        C(k) >= min(B, N(k) - k x B)

    (the groups due within k versions that the k later batches cannot hold must be in this one, so they
    must be complete). Proof that no trained group ever exceeds max_staleness, by the invariant
    I: N(k) <= (k + 1) x B for k = 0..eta, whenever the learner waits for a batch at version v:
      - k = eta, always: every untrained group has slack <= eta, and admission keeps them at most
        accepted - trained <= (eta + v + 1) x B - v x B = (eta + 1) x B.
      - k < eta: N(k) counts only groups holding a token older than v. While v stands no event adds one
        (new tokens are of version v; completing and dropping only remove), so I is kept between batches.
      - Taking the B complete groups of least slack puts min(B, C(k)) groups of slack <= k in the batch for
        every k at once (no choice puts more), so after it N'(k) = N(k) - min(B, C(k)) <= max(N(k) - B,
        k x B) <= k x B by the rule and I. At v + 1 every slack drops by one: N(k - 1) <= k x B, which is I.
      - At k = 0, N'(0) <= 0: every due group is in the batch, so none is trained after its deadline.
    The learner never waits for fresh work: under I the rule holds as soon as B groups are complete and
    every group with slack < eta (one holding a token older than v) is complete. With eta <= 1 the rule is
    just "every due group is complete" (admission alone makes due groups fit in one batch); with eta >= 2
    it also keeps a batch from being filled with young groups while older ones run, after which more than
    a batch of them could fall due at one version. The proof assumes tokens are generated under the
    learner's version (async relays new weights and aborts before leasing again); if I is broken anyway,
    min(B, .) asks for at most a batch of the most urgent groups, so batches still form.
    """
    return _keeps_bound(algo, Counter(complete), Counter(incomplete), learner_version)


def _keeps_bound(
    algo: AlgoConfig,
    complete: Counter[int | None],
    incomplete: Counter[int | None],
    learner_version: int,
) -> bool:
    """`keeps_staleness_bound` with the groups counted by oldest token version: O(versions)."""
    b, eta = algo.rollout_batch_size, algo.max_staleness
    total: Counter[int] = Counter()  # untrained groups by slack
    ready: Counter[int] = Counter()  # complete ones by slack
    for m, count in complete.items():
        k = slack(m, learner_version, eta)
        total[k] += count
        ready[k] += count
    for m, count in incomplete.items():
        total[slack(m, learner_version, eta)] += count
    # Between two slack values that occur, N(k) and C(k) stay put while min(B, N(k) - k x B) only falls,
    # so the rule need only be checked at k = 0 and where a group's slack is: O(groups), whatever eta
    # (a list per k in 0..eta made a large max_staleness cost gigabytes and minutes per batch).
    n = c = 0
    for k in sorted(total.keys() | {0}):
        n, c = n + total[k], c + ready[k]
        if c < min(b, n - k * b):
            return False
    return True


def select_batch(
    mode: Mode,
    algo: AlgoConfig,
    complete: CompleteGroups,
    learner_version: int,
    incomplete: Sequence[int | None] = (),
) -> list[int] | None:
    """The group ids of the next batch: exactly rollout_batch_size complete groups, oldest first, or
    None when there are not enough. Surplus groups stay for the next batch.

    async: `incomplete` holds the oldest token version (None: no token yet) of every untrained group that
    is not complete. A batch is only formed when it keeps the staleness bound for every group, this batch's
    and the later ones' (`keeps_staleness_bound`), so no sample is ever trained with staleness above
    max_staleness. Oldest first is least slack first, the choice that rule needs.
    """
    b = algo.rollout_batch_size
    if len(complete) < b:
        return None
    if mode == Mode.ASYNC and not _keeps_bound(
        algo, complete.versions(), Counter(incomplete), learner_version
    ):
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
    may still cache its prefix (april.prefix_cache), so the resume re-prefills less there."""
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
