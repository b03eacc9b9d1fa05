"""The broker's books: groups, the dispatch queue (partial buffer + fresh samples), leases, complete
groups, the unacked batch and the ledger.

`BrokerState` is a deterministic state machine driven by the broker core (`broker.core`): every method is
one protocol event (issue, lease, result, reclaim, batch, ack) and keeps per-group status counts up to
date so the policy's `PoolCounts` and the ledger cost O(1). It never touches sockets or clocks (times are
passed in), so it is tested directly, snapshotted whole by `broker.snapshot`, and tells its `journal`
(`broker.journal`, when it has one) each change it makes, so a restart replays what came after the
snapshot. A result for a lease it does not hold is recognised by the sample's identity and state: one
the books hold already is a duplicate (a worker sending again what it was not sure arrived); one of a
lease granted before a restart that continues a sample waiting in the queue is taken as if leased (its
lease was lost with the broker).

Lease ids are `epoch << 40 | n`: a broker restarted from a snapshot starts a new epoch, so a result for a
lease granted after the snapshot can never match a lease granted after the restart.
"""

from __future__ import annotations

import dataclasses
import enum
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

from april.config import AlgoConfig, PromptOrder
from april.data import PromptRecord, PromptSource
from april.episode import holds_live_state
from april.ledger import Ledger, LedgerError
from april.records import (
    FINISHED_CODE,
    INTERRUPTED_CODE,
    PENDING_CODE,
    RUNNING_CODE,
    Group,
    Sample,
    SampleStatus,
    new_group_samples,
)
from april.wire_records import SampleBatch
from broker import policy
from broker.journal import Journal
from broker.length_history import LengthHistory
from broker.modes import PoolCounts, policy_for
from broker.result_check import ResultRejected, check_continues, holds_already, plainly_valid
from broker.round_plan import CarriedGroup, plan_round_target

LEASE_EPOCH_SHIFT = 40
_STATUSES = len(SampleStatus)
VOUCH_MIN_SAMPLES = 16  # plainly_valid's fixed cost is about that of checking this many samples singly


class GroupState(enum.Enum):
    """Where a live group stands, from its samples' statuses."""

    IN_FLIGHT = "in_flight"  # a sample leased or queued for a first lease
    PARTIAL = "partial"  # none running, some interrupted waiting to resume
    DONE = "done"  # every sample finished or failed: about to be completed or dropped


IN_FLIGHT, PARTIAL, DONE = GroupState.IN_FLIGHT, GroupState.PARTIAL, GroupState.DONE  # read per sample


@dataclass(slots=True)
class GroupEntry:
    """A live group (issued, not yet trained or dropped) and how many of its samples are in each status."""

    group_id: int
    samples: list[Sample]
    counts: list[int] = field(default_factory=list)  # samples in each status, indexed by SampleStatus code
    cursor: int = -1  # the data cursor it was issued from (persisted; -1: unknown)
    prompt_index: int = -1  # the prompt's position in the dataset (-1: unknown), for the length history
    # min_version() until a sample changes: a complete group never does, and every batch formed asks it
    # of every complete group (O(pool) scans of the samples' segments were a tenth of the broker's time)
    _min_version: int | None = field(default=None, repr=False)
    _min_version_known: bool = field(default=False, repr=False)

    def __post_init__(self) -> None:
        # a list indexed by the plain codes, not a Counter: the books read and update these several times
        # per sample, and a Counter's missing key costs several times a list index
        counts = [0] * _STATUSES
        for s in self.samples:
            counts[s.status] += 1
        self.counts = counts

    @property
    def state(self) -> GroupState:
        c = self.counts
        if c[RUNNING_CODE] or c[PENDING_CODE]:
            return IN_FLIGHT
        if c[INTERRUPTED_CODE]:
            return PARTIAL
        return DONE

    def set(self, sample: Sample) -> None:
        old = self.samples[sample.index]
        self.counts[old.status] -= 1
        self.counts[sample.status] += 1
        self.samples[sample.index] = sample
        self._min_version_known = False

    def start(self, running: list[Sample]) -> None:
        """`set` each of its first len(running) samples, all PENDING, to their leased (RUNNING) form."""
        self.samples[: len(running)] = running
        self.counts[PENDING_CODE] -= len(running)
        self.counts[RUNNING_CODE] += len(running)
        self._min_version_known = False

    def as_group(self) -> Group:
        return Group(self.group_id, tuple(self.samples))

    def min_version(self) -> int | None:
        if not self._min_version_known:
            self._min_version = self.as_group().min_version()
            self._min_version_known = True
        return self._min_version


class LeaseEntry(NamedTuple):
    """A sample out on lease. A tuple: one is made per sample leased, at a third of a frozen dataclass's
    cost."""

    lease_id: int
    worker_id: str
    at_lease: Sample  # the sample as it was before the lease: restored if the lease is reclaimed


@dataclass(slots=True)
class PendingBatch:
    """A batch handed to the learner and remembered until it is acked."""

    batch_id: int
    step: int
    version: int
    group_ids: list[int]
    samples: list[Sample]
    stats: dict[str, float]
    sends: int = 0  # times handed to a learner (more than once if it crashed before acking)


@dataclass(frozen=True, slots=True)
class WaitingPrompt:
    """A prompt drawn from the source ahead of its issue (`algo.prompt_order`)."""

    cursor: int
    drawn_at: int  # groups issued when it was drawn
    prompt_index: int


@dataclass(slots=True)
class RoundCounters:
    """Figures for the next Batch's stats; reset when a batch is formed."""

    aborted: int = 0  # samples returned interrupted
    resumed: int = 0  # samples leased with a partial response
    tokens_generated: int = 0  # new model tokens received (an episode's observations are not generated)
    samples_finished: int = 0
    restarted: int = 0  # pinned partials restarted from their prompt (their worker was lost)
    tokens_restarted: int = 0  # the model tokens those partials held, dropped


@dataclass(frozen=True, slots=True)
class BooksView:
    """The books' figures at one moment, for the status (`BrokerState.view`)."""

    mode: str  # run.mode
    version: int
    epoch: int
    cursor: int
    round_open: bool
    in_flight_groups: int
    partial_groups: int
    complete_groups: int
    leased_samples: int
    queued_samples: int
    partial_buffer: int  # interrupted samples waiting to resume (pinned ones included)
    pinned: dict[str, int]  # pinned partials waiting for their worker, per worker
    restarts: dict[str, int]  # pinned partials restarted from their prompt over the run, by cause
    partial_staleness: dict[int, int]  # partials with tokens, by staleness against `version`
    leases: dict[str, int]  # leases held per worker (with the evaluation's given to `view`)
    unacked: PendingBatch | None
    ledger: Ledger
    totals: RoundCounters


class BrokerState:
    def __init__(self, mode: str, algo: AlgoConfig, source: PromptSource, epoch: int = 0) -> None:
        self.mode = mode
        self.mode_policy = policy_for(mode)  # the mode's rules, chosen once (broker.modes)
        self.algo = algo
        self.source = source
        self.epoch = epoch
        self.version = 0
        self.weights_uri = ""
        self.weights_sha256 = ""
        self.cursor = 0  # prompts drawn from the source
        self.waiting: list[WaitingPrompt] = []  # drawn, not issued yet (prompt_order), in draw order
        self.next_group_id = 0
        self.next_batch_id = 0
        self.next_lease = epoch << LEASE_EPOCH_SHIFT
        self.groups: dict[int, GroupEntry] = {}
        # the groups of `groups` still generating (in flight or partial): neither complete nor handed out.
        # What is asked of them once a batch (the staleness rule, the ledger's recount) is asked of these,
        # not of every group: in a run with thousands of complete groups waiting, the scan of them all was
        # a tenth of the broker's time
        self.unfinished: dict[int, GroupEntry] = {}
        self.queue = policy.DispatchQueue()
        self.leases: dict[int, LeaseEntry] = {}
        self.complete: dict[int, None] = {}  # complete, filter-passing groups in completion order
        self.batch_order = policy.CompleteGroups()  # the same groups, in the order batches take them
        self.batch: PendingBatch | None = None
        self.issued = 0
        self.trained = 0
        self.dropped: Counter[str] = Counter()
        self.in_flight = 0  # groups (maintained by _moved)
        self.partial = 0
        self.max_live_samples = 1 << 62  # bound on samples held (broker.max_buffered_samples)
        self.round_open = True  # sync/april: generation allowed in this round
        self.round = RoundCounters()
        self.totals = RoundCounters()
        self.history = LengthHistory()  # response lengths seen, per prompt (persisted in the snapshot)
        self.planned_target: int | None = None  # over_sampling auto: this round's target (None: the cap)
        # the worker each queued partial came back from (resume affinity), until it is leased again. Not
        # in snapshots: after a restart partials resume anywhere
        self.holders: dict[tuple[int, int], str] = {}
        # pinned partials: interrupted samples whose environment state lives in one worker's memory
        # (`april.episode.holds_live_state`), waiting, outside the dispatch queue, for that worker. Not in
        # snapshots as such: the sample names its worker (its last lease span), so a restore finds them
        self.pinned: dict[tuple[int, int], str] = {}
        self.restarts: Counter[str] = Counter()  # pinned partials restarted from their prompt, by cause
        self.abort_rounds = 0  # abort rounds begun in the run (the last one's id)
        self.aborts_done = 0  # abort rounds every worker confirmed
        self.journal: Journal | None = None  # told every change (the server's; None: nobody listens)

    # ------------------------------------------------------------------ counts and ledger

    def counts(self) -> PoolCounts:
        return PoolCounts(
            in_flight=self.in_flight,
            partial=self.partial,
            complete=len(self.complete),
            accepted=self.issued - sum(self.dropped.values()),
        )

    def ledger(self) -> Ledger:
        handed_out = len(self.batch.group_ids) if self.batch else 0
        return Ledger(
            issued=self.issued,
            trained=self.trained,
            complete_waiting=len(self.complete) + handed_out,
            in_flight=self.in_flight,
            partial=self.partial,
            dropped=dict(self.dropped),
        )

    def check_ledger(self, where: str = "") -> Ledger:
        """Check the books two ways: the identity, and the counters against a full recount."""
        ledger = self.ledger()
        ledger.check(where)
        states = Counter(g.state for g in self.unfinished.values())
        handed = len(self.batch.group_ids) if self.batch else 0
        recount = (states[IN_FLIGHT], states[PARTIAL])
        if recount != (self.in_flight, self.partial) or states[DONE]:
            raise LedgerError(
                f"group counters drifted {where}: counted {(self.in_flight, self.partial)}, "
                f"recount of the unfinished groups { ({k.value: n for k, n in states.items()}) }"
            )
        if len(self.unfinished) + len(self.complete) + handed != len(self.groups):
            raise LedgerError(
                f"groups drifted {where}: {len(self.unfinished)} unfinished, {len(self.complete)} complete "
                f"and {handed} handed out of {len(self.groups)}"
            )
        if len(self.batch_order) != len(self.complete):
            raise LedgerError(
                f"batch order drifted {where}: {len(self.batch_order)} groups, {len(self.complete)} complete"
            )
        return ledger

    def restore_complete(self, order: Sequence[int]) -> None:
        """The complete groups of a snapshot, in completion order (their entries restored already)."""
        self.complete = dict.fromkeys(order)
        self.batch_order = policy.CompleteGroups()
        for gid in order:
            self.batch_order.add(gid, self.groups[gid].min_version())

    def restore_unfinished(self, entry: GroupEntry) -> None:
        """A snapshot's group that is still generating (its entry in `groups` already): counted, and its
        samples that wait for a lease queued."""
        self.unfinished[entry.group_id] = entry
        self._moved(DONE, entry.state)
        for s in entry.samples:
            if s.status in (SampleStatus.PENDING, SampleStatus.INTERRUPTED):
                self._wait(s)

    def _moved(self, before: GroupState, after: GroupState) -> None:
        if before is after:
            return
        for state, delta in ((before, -1), (after, 1)):
            if state is IN_FLIGHT:
                self.in_flight += delta
            elif state is PARTIAL:
                self.partial += delta

    def _update(self, entry: GroupEntry, sample: Sample) -> GroupState:
        """Put `sample` in its group and count the group's move; returns the group's new state."""
        before = entry.state
        entry.set(sample)
        after = entry.state
        self._moved(before, after)
        return after

    @property
    def leased_samples(self) -> int:
        return len(self.leases)

    def view(self, other_leases: Counter[str] | None = None) -> BooksView:
        """The figures the status shows; `other_leases`: leases held outside the books (evaluations)."""
        partials = self.partial_samples()
        staleness = Counter(s.staleness(self.version) for s in partials if s.response_len)
        pinned = Counter(self.pinned.values())
        leases = Counter(lease.worker_id for lease in self.leases.values())
        leases.update(other_leases or {})
        return BooksView(
            mode=self.mode,
            version=self.version,
            epoch=self.epoch,
            cursor=self.cursor,
            round_open=self.round_open,
            in_flight_groups=self.in_flight,
            partial_groups=self.partial,
            complete_groups=len(self.complete),
            leased_samples=len(self.leases),
            queued_samples=len(self.queue),
            partial_buffer=len(partials),
            pinned=dict(sorted(pinned.items())),
            restarts=dict(sorted(self.restarts.items())),
            partial_staleness=dict(sorted(staleness.items())),
            leases=dict(leases),
            unacked=self.batch,
            ledger=self.ledger(),
            totals=dataclasses.replace(self.totals),
        )

    def buffered_tokens(self) -> int:
        """Model tokens held (as `tokens_generated` counts them): partials, complete groups, an unacked
        batch. O(samples held)."""
        return sum(s.model_tokens for g in self.groups.values() for s in g.samples)

    def partial_samples(self) -> list[Sample]:
        """Interrupted samples waiting to resume: the queued ones in dispatch order, then the pinned."""
        queued = [
            self.groups[g].samples[i]
            for g, i in self.queue.ordered()
            if self.groups[g].samples[i].status == SampleStatus.INTERRUPTED
        ]
        return queued + [self.groups[g].samples[i] for g, i in self.pinned]

    # ------------------------------------------------------------------ issuing and leasing

    def issue_group(self) -> GroupEntry:
        entry = self._issue()
        for s in entry.samples:
            self.queue.push(s.key, None)
        return entry

    def _issue(self) -> GroupEntry:
        """A new group of PENDING samples from the next prompt, counted in flight but not queued yet."""
        cursor, record = self._next_prompt()
        gid = self.next_group_id
        self.next_group_id += 1
        samples = new_group_samples(
            gid, self.algo.n_samples_per_prompt, record.prompt_ids, record.text, record.metadata
        )
        entry = GroupEntry(gid, samples, cursor=cursor, prompt_index=record.prompt_index)
        self.groups[gid] = entry
        self.unfinished[gid] = entry
        self.issued += 1
        self.in_flight += 1
        if self.journal is not None:
            self.journal.issue(gid, cursor, self.cursor)
        return entry

    def replay_issue(self, gid: int, cursor: int, drawn: int) -> None:
        """The journal's issue of group `gid` from data `cursor`, the source drawn up to `drawn`: the group
        and the prompts waiting as `_issue` left them."""
        for c in range(self.cursor, drawn):
            self.waiting.append(WaitingPrompt(c, self.issued, self.source.get(c).prompt_index))
        self.cursor = max(self.cursor, drawn)
        chosen = [i for i, w in enumerate(self.waiting) if w.cursor == cursor]
        if not chosen:
            raise ValueError(f"journal: group {gid} issued from prompt {cursor}, which is not waiting")
        self.waiting.pop(chosen[0])
        record = self.source.get(cursor)
        samples = new_group_samples(
            gid, self.algo.n_samples_per_prompt, record.prompt_ids, record.text, record.metadata
        )
        entry = GroupEntry(gid, samples, cursor=cursor, prompt_index=record.prompt_index)
        self.groups[gid] = entry
        self.unfinished[gid] = entry
        self.next_group_id = max(self.next_group_id, gid + 1)
        self.issued += 1
        self.in_flight += 1

    def _next_prompt(self) -> tuple[int, PromptRecord]:
        """The cursor and record of the prompt to issue next (`policy.pick_prompt` over the window of
        drawn prompts `self.waiting`, topped up to `prompt_window` from the source)."""
        if self.algo.prompt_order == PromptOrder.ISSUE:
            if self.waiting:  # drawn ahead under another order before a restart: those go first, in order
                chosen = self.waiting.pop(0)
                return chosen.cursor, self.source.get(chosen.cursor)
            self.cursor += 1
            return self.cursor - 1, self.source.get(self.cursor - 1)
        while len(self.waiting) < self.algo.prompt_window:
            self.waiting.append(
                WaitingPrompt(self.cursor, self.issued, self.source.get(self.cursor).prompt_index)
            )
            self.cursor += 1
        candidates = [(w.drawn_at, self.history.predict(w.prompt_index)) for w in self.waiting]
        chosen = self.waiting.pop(
            policy.pick_prompt(candidates, self.issued, self.algo.prompt_order, self.algo.prompt_window)
        )
        return chosen.cursor, self.source.get(chosen.cursor)

    def dispatch_allowed(self) -> bool:
        return self.round_open or not self.mode_policy.round_based

    def leasable_samples(self) -> int:
        """Samples `take_work` could lease now, to workers of any version: the queued ones, and those of
        the fresh groups the policy allows and `max_live_samples` leaves room for. O(1)."""
        if not self.dispatch_allowed():
            return 0
        n = self.algo.n_samples_per_prompt
        allowance = self.mode_policy.fresh_group_allowance(
            self.algo, self.counts(), self.version, self.round_open, self.planned_target
        )
        room = (self.max_live_samples - len(self.groups) * n) // n
        return len(self.queue) + n * max(0, min(allowance, room))

    def take_work(
        self, worker_id: str, credit: int, worker_version: int | None = None
    ) -> list[tuple[int, int, Sample]]:
        """Lease up to `credit` samples to a worker: queued samples first, then fresh groups as the policy
        allows. A partial whose last segment is newer than `worker_version` is left for another worker
        (versions along a response never decrease). Returns (lease_id, budget, leased sample) triples."""
        out: list[tuple[int, int, Sample]] = []
        if not self.dispatch_allowed():
            return out
        skipped: list[Sample] = []
        try:
            self._take(worker_id, credit, worker_version, out, skipped)
        finally:
            for sample in skipped:
                self.queue.push(sample.key, sample.min_version)
        return out

    def _take(
        self,
        worker_id: str,
        credit: int,
        worker_version: int | None,
        out: list[tuple[int, int, Sample]],
        skipped: list[Sample],
    ) -> None:
        while len(out) < credit:
            if not self.queue:
                allowance = self.mode_policy.fresh_group_allowance(
                    self.algo, self.counts(), self.version, self.round_open, self.planned_target
                )
                live = len(self.groups) * self.algo.n_samples_per_prompt
                if allowance <= 0 or live + self.algo.n_samples_per_prompt > self.max_live_samples:
                    break
                self._lease_fresh(worker_id, self._issue(), credit - len(out), out)
                continue
            gid, idx = self.queue.pop()
            entry = self.groups[gid]
            before = entry.samples[idx]
            if (
                worker_version is not None
                and before.segments
                and before.segments[-1].version > worker_version
            ):
                skipped.append(before)
                continue
            out.append(self._lease(worker_id, entry, before))

    def _lease(self, worker_id: str, entry: GroupEntry, before: Sample) -> tuple[int, int, Sample]:
        """Lease `before`, out of the queue already, to `worker_id`."""
        lease_id = self.new_lease_id()
        leased = self._hold(lease_id, worker_id, entry, before)
        return (lease_id, leased.budget(self.algo.max_new_tokens), leased)

    def _hold(self, lease_id: int, worker_id: str, entry: GroupEntry, before: Sample) -> Sample:
        """Lease `before` (out of the queue) as `lease_id`; returns the sample as leased."""
        self.holders.pop(before.key, None)
        self.pinned.pop(before.key, None)
        leased = before.resumed()
        self.leases[lease_id] = LeaseEntry(lease_id, worker_id, before)
        self._update(entry, leased)
        if before.response_len:
            self.round.resumed += 1
            self.totals.resumed += 1
        if self.journal is not None:
            self.journal.lease(lease_id, worker_id, before.key)
        return leased

    def replay_lease(self, lease_id: int, worker_id: str, key: tuple[int, int]) -> None:
        """The journal's lease of sample `key`, waiting in the books, to `worker_id` (the dispatch queue is
        rebuilt once the journal is applied: `requeue_waiting`)."""
        entry = self.groups.get(key[0])
        before = entry.samples[key[1]] if entry is not None and key[1] < len(entry.samples) else None
        if entry is None or before is None or before.status not in (PENDING_CODE, INTERRUPTED_CODE):
            raise ValueError(f"journal: lease {lease_id} of sample {key}, which is not waiting")
        self._hold(lease_id, worker_id, entry, before)

    def requeue_waiting(self) -> None:
        """The dispatch queue rebuilt from the books: every sample of a generating group that waits."""
        self.queue = policy.DispatchQueue()
        self.pinned = {}
        for entry in self.unfinished.values():
            for sample in entry.samples:
                if sample.status in (PENDING_CODE, INTERRUPTED_CODE):
                    self._wait(sample)

    def _wait(self, sample: Sample, worker_id: str = "") -> None:
        """Let a sample that waits for a lease (PENDING or INTERRUPTED) be leased again: pinned to the
        worker whose memory holds its environment state (`worker_id`, or the one that returned it last),
        or queued for anyone."""
        if sample.status == INTERRUPTED_CODE and sample.episode and holds_live_state(sample.episode):
            holder = worker_id or (sample.leases[-1].worker if sample.leases else "")
            if holder:
                self.pinned[sample.key] = holder
                return
        self.queue.push(sample.key, sample.min_version)

    def _lease_fresh(
        self, worker_id: str, entry: GroupEntry, count: int, out: list[tuple[int, int, Sample]]
    ) -> None:
        """Lease the first `count` samples of `entry`, a group just issued into an empty dispatch queue, to
        `worker_id` and queue the rest: what issuing it and popping the queue would do (its samples
        are the queue's only ones, in index order; none has a token, so no worker version skips one),
        without a heap push and pop per sample. The group stays in flight (PENDING and RUNNING both are
        in flight); a new group's samples have no holder and no response (no resume counted)."""
        pending = entry.samples[:count]
        budget = max(0, self.algo.max_new_tokens)  # Sample.budget of a sample with no response
        running = [before.resumed() for before in pending]
        first = self.next_lease  # new_lease_id, once for the lot
        self.next_lease += len(running)
        leases = self.leases
        journal = self.journal
        for lease_id, before, leased in zip(range(first, self.next_lease), pending, running, strict=True):
            leases[lease_id] = LeaseEntry(lease_id, worker_id, before)
            out.append((lease_id, budget, leased))
            if journal is not None:
                journal.lease(lease_id, worker_id, before.key)
        entry.start(running)
        for s in entry.samples[len(running) :]:
            self.queue.push(s.key, None)

    def take_held_partials(
        self, worker_ids: list[str], free: list[int], versions: list[int | None]
    ) -> list[list[tuple[int, int, Sample]]]:
        """Resume affinity: lease each worker (up to its `free` slots) the partials it last held among
        the first sum(free) of the dispatch queue, the ones this dispatch leases anyway
        (`policy.resume_affinity`), so affinity changes who resumes a partial, never which partials are
        resumed now. A partial newer than its holder's `versions` entry stays queued. Returns one list of
        (lease_id, budget, leased sample) per worker; the caller spreads the rest as usual."""
        out: list[list[tuple[int, int, Sample]]] = [[] for _ in worker_ids]
        if not self.holders or not self.dispatch_allowed():
            return out
        index = {w: i for i, w in enumerate(worker_ids)}
        keys = [k for k in self.queue.head(sum(free)) if k in self.holders]
        picks = policy.resume_affinity([index.get(self.holders[k]) for k in keys], free)
        taken: set[tuple[int, int]] = set()
        for (gid, idx), i in zip(keys, picks, strict=True):
            if i is None:
                continue
            entry = self.groups[gid]
            before = entry.samples[idx]
            version = versions[i]
            if version is not None and before.segments and before.segments[-1].version > version:
                continue
            taken.add((gid, idx))
            out[i].append(self._lease(worker_ids[i], entry, before))
        self.queue.remove(taken)
        return out

    def take_pinned(
        self, worker_ids: list[str], free: list[int], versions: list[int | None]
    ) -> list[list[tuple[int, int, Sample]]]:
        """Pinned partials: lease each worker (up to its `free` slots) those pinned to it, oldest issued
        first; no other worker is ever leased one (`docs/protocol.md`, "Pinned partials"). One list of
        (lease_id, budget, leased sample) per worker."""
        out: list[list[tuple[int, int, Sample]]] = [[] for _ in worker_ids]
        if not self.pinned or not self.dispatch_allowed():
            return out
        index = {w: i for i, w in enumerate(worker_ids)}
        left = list(free)
        for key in sorted(k for k, w in self.pinned.items() if w in index):
            i = index[self.pinned[key]]
            entry = self.groups[key[0]]
            before = entry.samples[key[1]]
            version = versions[i]
            newer = version is not None and before.segments and before.segments[-1].version > version
            if left[i] <= 0 or newer:
                continue
            left[i] -= 1
            out[i].append(self._lease(worker_ids[i], entry, before))
        return out

    def pinned_of(self, worker_id: str) -> list[tuple[int, int]]:
        return [key for key, holder in self.pinned.items() if holder == worker_id]

    def restart(self, key: tuple[int, int], cause: str) -> int:
        """Restart pinned partial `key` from its prompt (its state was lost with its worker): its tokens are
        dropped, counted under `cause`, and it waits in the queue as issued. Returns the tokens dropped."""
        self.pinned.pop(key, None)
        entry = self.groups[key[0]]
        sample = entry.samples[key[1]]
        if sample.status != INTERRUPTED_CODE:
            raise ValueError(f"restart of sample {key}, which is {sample.status.name}, not a waiting partial")
        if self.journal is not None:
            self.journal.restart(key, cause)
        self.queue.remove({key})  # (a pinned partial is not queued; a replayed one may be)
        tokens = sample.model_tokens
        for counters in (self.round, self.totals):
            counters.restarted += 1
            counters.tokens_restarted += tokens
        self.restarts[cause] += 1
        self._update(entry, self._as_issued(entry, sample))
        self.queue.push(key, None)
        return tokens

    def _as_issued(self, entry: GroupEntry, sample: Sample) -> Sample:
        """The sample as its group was issued (PENDING, no response, no episode)."""
        if entry.cursor >= 0:
            record = self.source.get(entry.cursor)
            return new_group_samples(
                entry.group_id, sample.index + 1, record.prompt_ids, record.text, record.metadata
            )[sample.index]
        return new_group_samples(
            entry.group_id, sample.index + 1, sample.prompt_ids, sample.prompt_text, sample.metadata
        )[sample.index]

    def new_lease_id(self) -> int:
        """The next lease id of this epoch (also for evaluation leases, so ids never collide)."""
        lease_id = self.next_lease
        self.next_lease += 1
        return lease_id

    def leases_of(self, worker_id: str) -> list[int]:
        return [lid for lid, lease in self.leases.items() if lease.worker_id == worker_id]

    def reclaim(self, lease_id: int) -> None:
        """Put a leased sample back in the queue as it was leased (its worker died or left)."""
        lease = self.leases.pop(lease_id)
        if self.journal is not None:
            self.journal.reclaim(lease_id)
        self._requeue_as_leased(lease)

    def _requeue_as_leased(self, lease: LeaseEntry) -> None:
        restored = lease.at_lease  # PENDING or INTERRUPTED, exactly as it was queued
        self._update(self.groups[restored.group_id], restored)
        self._wait(restored, lease.worker_id)  # a pinned partial stays with the worker it was leased to

    # ------------------------------------------------------------------ results

    def vouch(self, worker_id: str, lease_ids: Sequence[int], samples: SampleBatch) -> list[bool]:
        """For each sample of one SampleResult, whether `result_check.plainly_valid` vouches for it
        against the lease `worker_id` holds (then `accept_result` need not check it again). A result of
        few samples is not looked at: its array operations cost more than checking them one by one."""
        if len(samples) < VOUCH_MIN_SAMPLES:
            return [False] * len(samples)
        leased = [self.leases.get(lease_id) for lease_id in lease_ids]
        before = [None if le is None or le.worker_id != worker_id else le.at_lease for le in leased]
        return plainly_valid(before, samples, self.algo.max_new_tokens, self.version)

    def accept_result(self, worker_id: str, lease_id: int, sample: Sample, vouched: bool = False) -> int:
        """Take one returned sample; returns the count of new model tokens it brings. Raises
        ResultRejected (the lease is then reclaimed by the caller, or unknown) when it does not continue
        what was leased. `vouched`: `vouch` passed it against this lease, so it is not checked again."""
        lease = self.leases.get(lease_id)
        if lease is None or lease.worker_id != worker_id:
            lease = self._recognise(worker_id, lease_id, sample)
        elif not vouched:
            check_continues(lease.at_lease, sample, self.algo.max_new_tokens, self.version)
        if self.journal is not None:
            self.journal.result(lease_id, worker_id, sample)
        del self.leases[lease_id]
        entry = self.groups[sample.group_id]
        at_lease = lease.at_lease
        length, status = sample.response_len, sample.status
        if (
            status == INTERRUPTED_CODE
            and length == at_lease.response_len
            and sample.episode == at_lease.episode
        ):
            # returned with nothing generated (its worker's engine was still starting or went down, or an
            # abort beat the first token): the lease comes back as it was leased, which is no abort. An
            # episode whose state moved on (a tool step run, its observation empty) has changed: kept
            self._requeue_as_leased(lease)
            if at_lease.response_len:  # a partial: its prefix (if cached anywhere) is on that worker
                self.holders[sample.key] = worker_id
            return 0
        sample = sample.returned_by(worker_id, at_lease.leases)  # which worker, and where an abort cut
        new_tokens = sample.model_tokens - at_lease.model_tokens
        self.round.tokens_generated += new_tokens
        self.totals.tokens_generated += new_tokens
        after = self._update(entry, sample)
        if status == INTERRUPTED_CODE:
            self.round.aborted += 1
            self.totals.aborted += 1
            self._wait(sample, worker_id)
            if sample.key not in self.pinned:
                self.holders[sample.key] = worker_id
        else:
            self.round.samples_finished += 1
            self.totals.samples_finished += 1
            if status == FINISHED_CODE:
                self.history.record(entry.prompt_index, length)
            if after is DONE:
                self._complete_group(entry)
        return new_tokens

    def _recognise(self, worker_id: str, lease_id: int, sample: Sample) -> LeaseEntry:
        """A result for a lease `worker_id` does not hold: a `duplicate` if the books hold this state of
        the sample (or a later one); else, for a lease of an earlier epoch (granted by a broker that died
        before its journal of the lease reached the disk, or reclaimed since the restart), taken as the
        return of a lease of the sample as it waits in the queue, if it continues it (the lease is made
        again under its id); else `not_leased`."""
        entry = self.groups.get(sample.group_id)
        if entry is None or sample.index >= len(entry.samples):
            raise ResultRejected("not_leased", f"lease {lease_id} is not held by {worker_id}")
        current = entry.samples[sample.index]
        if holds_already(current, sample):
            raise ResultRejected("duplicate", f"sample {sample.key}: the books hold this result already")
        refused = f"lease {lease_id} is not held by {worker_id}"
        if lease_id >> LEASE_EPOCH_SHIFT >= self.epoch or lease_id in self.leases:
            raise ResultRejected("not_leased", refused)
        if current.status not in (PENDING_CODE, INTERRUPTED_CODE):  # granted before a restart, lost with it
            raise ResultRejected("not_leased", f"{refused} (sample {sample.key} is {current.status.name})")
        try:  # it must continue the sample as it waits, the same task and prompt
            check_continues(current, sample, self.algo.max_new_tokens, self.version)
        except ResultRejected as exc:
            raise ResultRejected("not_leased", f"{refused} ({exc.reason}: {exc})") from None
        self.queue.remove({current.key})  # (or pinned: `_hold` unpins it)
        self._hold(lease_id, worker_id, entry, current)
        return self.leases[lease_id]

    def _complete_group(self, entry: GroupEntry) -> None:
        del self.unfinished[entry.group_id]
        reason = policy.drop_reason(entry.as_group(), self.algo)
        if reason is None:
            self.complete[entry.group_id] = None
            self.batch_order.add(entry.group_id, entry.min_version())
        else:
            self.dropped[reason] += 1
            del self.groups[entry.group_id]

    # ------------------------------------------------------------------ rounds (sync / april)

    def round_complete(self) -> bool:
        return self.mode_policy.round_complete(self.algo, self.counts())

    def close_round_if_complete(self) -> bool:
        """Close the round once it is complete; True if it was just closed."""
        if self.mode_policy.round_based and self.round_open and self.round_complete():
            self.round_open = False
            if self.journal is not None:
                self.journal.close_round()
            return True
        return False

    def park_queued_samples(self) -> None:
        """End of an april round: queued samples that never started wait, like partials, for the next."""
        if self.journal is not None:
            self.journal.park()
        for gid, idx in self.queue.ordered():
            s = self.groups[gid].samples[idx]
            if s.status == SampleStatus.PENDING:
                self._update(self.groups[gid], dataclasses.replace(s, status=SampleStatus.INTERRUPTED))

    # ------------------------------------------------------------------ batches

    def incomplete_versions(self) -> list[int | None]:
        """The oldest token version (None: no token yet) of every untrained group that is not complete, for
        `policy.take_batch`, where the mode asks for them (async); else none."""
        if not self.mode_policy.needs_incomplete_versions:
            return []
        return [g.min_version() for g in self.unfinished.values()]

    def batch_worth_complete(self) -> bool:
        """A batch worth of groups is complete: a batch forms now unless the mode holds it back
        (`ModePolicy.batch_may_form`)."""
        return len(self.complete) >= self.algo.rollout_batch_size

    def form_batch(self, step: int) -> PendingBatch | None:
        """Hand out the next batch if one can be formed (and none is unacked)."""
        if self.batch is not None:
            return self.batch
        if not self.batch_worth_complete():
            return None  # take_batch needs a batch worth of complete groups: skip the O(groups) scan
        incomplete = self.incomplete_versions()
        chosen = policy.take_batch(self.mode_policy, self.algo, self.batch_order, self.version, incomplete)
        if chosen is None:
            return None
        samples = [s for gid in chosen for s in self.groups[gid].samples]
        self.batch_order.remove_oldest(len(chosen), self.version)
        for gid in chosen:
            del self.complete[gid]
        self.batch = PendingBatch(
            self.next_batch_id, step, self.version, chosen, samples, self._batch_stats(samples)
        )
        self.next_batch_id += 1
        self.round = RoundCounters()
        return self.batch

    def _batch_stats(self, samples: list[Sample]) -> dict[str, float]:
        staleness = [s.staleness(self.version) for s in samples]
        tokens = sum(s.model_tokens for s in samples)
        offpolicy = sum(
            seg.end - seg.start for s in samples for seg in s.segments if seg.version < self.version
        )
        return {
            "aborted": float(self.round.aborted),
            "resumed": float(self.round.resumed),
            "tokens_generated": float(self.round.tokens_generated),
            "partial_buffer": float(len(self.partial_samples())),
            "in_flight": float(self.in_flight),
            "staleness_max": float(max(staleness, default=0)),
            "staleness_mean": float(np.mean(staleness)) if staleness else 0.0,
            "offpolicy_token_frac": offpolicy / tokens if tokens else 0.0,
        }

    def ack_batch(self, batch_id: int, slots: int = 0) -> bool:
        """The learner trained the batch: count it and forget it. False if no such batch is pending.
        `slots`: the workers' slots now, for planning the next round (`over_sampling = "auto"`)."""
        if self.batch is None or self.batch.batch_id != batch_id:
            return False
        if self.journal is not None:
            self.journal.ack(batch_id, slots)
        for gid in self.batch.group_ids:
            del self.groups[gid]
        self.trained += len(self.batch.group_ids)
        self.batch = None
        if self.mode_policy.round_based:
            self.round_open = True  # the next round runs on the weights published before the ack
            self.plan_round(slots, seed=batch_id)
        return True

    def plan_round(self, slots: int, seed: int) -> None:
        """Where the mode plans its rounds (april with `over_sampling = "auto"`): choose the opening round's
        target (broker/round_plan.py) from the live groups, the observed lengths and `slots`; otherwise the
        configured one."""
        if not self.mode_policy.plans_rounds(self.algo):
            self.planned_target = None
            return
        carried = [
            CarriedGroup(tuple(s.response_len for s in g.samples if s.status != SampleStatus.FINISHED))
            for g in self.groups.values()
            if g.group_id not in self.complete
        ]
        self.planned_target = plan_round_target(
            self.algo.rollout_batch_size,
            self.algo.over_sampling_batch_size,
            len(self.complete),
            carried,
            self.algo.n_samples_per_prompt,
            slots,
            self.history.recent(),
            seed,
        )

    def set_weights(self, version: int, uri: str, sha256: str) -> bool:
        """A newer weight version was published. False if it is not newer (a replay)."""
        if version <= self.version:
            return False
        self.version, self.weights_uri, self.weights_sha256 = version, uri, sha256
        if self.journal is not None:
            self.journal.weights(version, uri, sha256)
        return True

    # ------------------------------------------------------------------ abort rounds

    def begin_abort(self) -> int:
        """A new abort round; returns its id (1, 2, ... over the run)."""
        self.abort_rounds += 1
        if self.journal is not None:
            self.journal.abort_begun(self.abort_rounds)
        return self.abort_rounds

    def end_abort(self) -> None:
        """Every worker of the abort round confirmed it (or was dropped)."""
        self.aborts_done += 1
        if self.journal is not None:
            self.journal.abort_ended()
