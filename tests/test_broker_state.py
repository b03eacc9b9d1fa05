"""Tests for broker.state (the broker's books) and broker.snapshot, driven directly without sockets.

A `Driver` plays the workers and the learner: it leases work, "generates" tokens for leased samples
(tagged with the broker's current version, as a worker on those weights would) and returns them finished,
interrupted or failed. `check_ledger()` runs after every step, so a counter drifting anywhere fails at the
step that broke it.
"""

from __future__ import annotations

import dataclasses
import math
import random
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from april import codec
from april.config import AlgoConfig, Mode
from april.data import SyntheticPromptSource
from april.episode import holds_live_state
from april.records import FinishReason, LeaseSpan, Sample, SampleStatus, Segment, new_group_samples
from april.wire_records import SampleBatch
from broker import complete_log, snapshot
from broker.modes import asynchronous, policy_for
from broker.snapshot import SnapshotError
from broker.snapshot_writer import SnapshotWriter
from broker.state import LEASE_EPOCH_SHIFT, BrokerState, GroupEntry, PendingBatch, ResultRejected

MAX_NEW = 8


def source() -> SyntheticPromptSource:
    return SyntheticPromptSource(size=500, seed=0, prompt_len_min=3, prompt_len_max=6, vocab_size=50)


def algo(
    b: int = 2, over: int = 4, n: int = 2, eta: int = 1, dynamic: bool = False, max_new: int = MAX_NEW
) -> AlgoConfig:
    return AlgoConfig(
        rollout_batch_size=b,
        over_sampling_batch_size=over,
        n_samples_per_prompt=n,
        max_new_tokens=max_new,
        max_staleness=eta,
        dynamic_sampling=dynamic,
    )


def make_state(
    mode: Mode,
    b: int = 2,
    over: int = 4,
    n: int = 2,
    eta: int = 1,
    dynamic: bool = False,
    max_new: int = MAX_NEW,
) -> BrokerState:
    return BrokerState(mode, algo(b, over, n, eta, dynamic, max_new), source())


def assert_samples_equal(a: Sample, b: Sample) -> None:
    """Field by field: arrays by value, NaN rewards equal."""
    for f in dataclasses.fields(Sample):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, np.ndarray):
            assert np.array_equal(x, y), f"{a.key} {f.name}: {x} vs {y}"
        elif isinstance(x, float) and math.isnan(x):
            assert isinstance(y, float) and math.isnan(y), f"{a.key} {f.name}: {x} vs {y}"
        else:
            assert x == y, f"{a.key} {f.name}: {x!r} vs {y!r}"


class Driver:
    """Workers and learner in one: remembers what it holds under each lease, checks the books each step."""

    def __init__(self, state: BrokerState) -> None:
        self.state = state
        self.held: dict[int, tuple[str, Sample, int]] = {}  # lease id -> (worker, leased sample, budget)
        self.trained_keys: set[tuple[int, int]] = set()
        self.trained_groups: set[int] = set()
        self.batches: list[PendingBatch] = []

    def check(self) -> None:
        """The ledger, plus the structure behind it: the queue holds exactly the waiting samples (once
        each), the leases exactly the running ones, and the driver holds exactly the broker's leases."""
        state = self.state
        state.check_ledger()
        queued = state.queue.ordered()
        live = [s for g in state.groups.values() for s in g.samples]
        waiting = {s.key for s in live if s.status in (SampleStatus.PENDING, SampleStatus.INTERRUPTED)}
        assert len(set(queued)) == len(queued) and not set(queued) & set(state.pinned)
        assert set(queued) | set(state.pinned) == waiting
        for key in state.pinned:  # pinned: exactly the waiting partials whose state is in a worker's memory
            assert holds_live_state(state.groups[key[0]].samples[key[1]].episode)
        assert not any(holds_live_state(state.groups[g].samples[i].episode) for g, i in queued if
                       state.groups[g].samples[i].status == SampleStatus.INTERRUPTED)  # fmt: skip
        running = {s.key for s in live if s.status == SampleStatus.RUNNING}
        assert running == {lease.at_lease.key for lease in state.leases.values()}
        assert len(running) == len(state.leases)
        assert set(self.held) == set(state.leases)

    def take(self, credit: int = 1000, worker: str = "w0") -> list[tuple[int, int, Sample]]:
        (work,) = self.state.take_pinned([worker], [credit], [None])  # first, as broker.dispatch does
        assert all(s.key not in self.state.pinned for _, _, s in work)
        work += self.state.take_work(worker, credit - len(work))
        assert len(work) <= credit
        for lease_id, budget, sample in work:
            assert lease_id not in self.held
            assert sample.status == SampleStatus.RUNNING
            assert budget == sample.budget(self.state.algo.max_new_tokens)
            self.held[lease_id] = (worker, sample, budget)
        self.check()
        return work

    def _tokens(self, sample: Sample, k: int) -> tuple[list[int], list[float]]:
        start = sample.response_len
        return [10 + (start + i) % 30 for i in range(k)], [-0.5] * k

    def result(
        self,
        lease_id: int,
        tokens: int = 2,
        finish: FinishReason = FinishReason.STOP,
        reward: float | None = None,
    ) -> Sample:
        worker, sample, budget = self.held.pop(lease_id)
        ids, lps = self._tokens(sample, min(tokens, budget))
        out = sample.extend(ids, lps, version=self.state.version, finish_reason=finish)
        if finish in (FinishReason.STOP, FinishReason.LENGTH):
            out = out.scored(float(sample.index % 2) if reward is None else reward)
        self.state.accept_result(worker, lease_id, out)
        self.check()
        return out

    def finish(self, lease_id: int, tokens: int = 2, reward: float | None = None) -> Sample:
        return self.result(lease_id, tokens, FinishReason.STOP, reward)

    def interrupt(self, lease_id: int, tokens: int = 2) -> Sample:
        return self.result(lease_id, tokens, FinishReason.ABORT)

    def fail(self, lease_id: int) -> Sample:
        worker, sample, _ = self.held.pop(lease_id)
        out = sample.failed("reward timeout")
        self.state.accept_result(worker, lease_id, out)
        self.check()
        return out

    def reclaim(self, lease_id: int) -> None:
        self.held.pop(lease_id)
        self.state.reclaim(lease_id)
        self.check()

    def lose(self, worker: str) -> int:
        """`worker` is lost, as broker.core has it: its leases reclaimed, its pinned partials restarted
        from their prompt. Returns how many were restarted."""
        for lease_id in [lid for lid, (w, _, _) in self.held.items() if w == worker]:
            self.reclaim(lease_id)
        keys = self.state.pinned_of(worker)
        for key in keys:
            self.state.restart(key, "worker_lost")
            assert key not in self.state.pinned
            assert self.state.groups[key[0]].samples[key[1]].response_len == 0
        self.check()
        return len(keys)

    def lease_of(self, key: tuple[int, int]) -> int:
        (lease_id,) = [lid for lid, (_, s, _) in self.held.items() if s.key == key]
        return lease_id

    def finish_all(self, tokens: int = 2) -> None:
        for lease_id in sorted(self.held):
            self.finish(lease_id, tokens)

    def interrupt_all(self, tokens: int = 2) -> None:
        for lease_id in sorted(self.held):
            self.interrupt(lease_id, tokens)

    def end_round(self) -> bool:
        """What the server does at a round's end: close it, abort what is leased, park the queue."""
        closed = self.state.close_round_if_complete()
        self.check()
        if closed:
            self.interrupt_all()
            self.state.park_queued_samples()
            self.check()
        return closed

    def train(self, step: int = 0, publish: bool = True) -> PendingBatch | None:
        """The learner: take a batch, check it, ack it, publish the next version."""
        batch = self.state.form_batch(step)
        self.check()
        if batch is None:
            return None
        b, n = self.state.algo.rollout_batch_size, self.state.algo.n_samples_per_prompt
        assert len(batch.group_ids) == b and len(set(batch.group_ids)) == b
        assert len(batch.samples) == b * n
        keys = [s.key for s in batch.samples]
        assert sorted(keys) == sorted((g, i) for g in batch.group_ids for i in range(n))
        assert all(s.status == SampleStatus.FINISHED for s in batch.samples)
        assert not self.trained_keys & set(keys), "a sample trained twice"
        self.trained_keys |= set(keys)
        self.trained_groups |= set(batch.group_ids)
        self.batches.append(batch)
        assert self.state.ack_batch(batch.batch_id)
        self.check()
        if publish:
            assert self.state.set_weights(self.state.version + 1, f"v{self.state.version + 1}", "sha")
            if policy_for(self.state.mode).abort_on_new_version:
                self.interrupt_all()
        return batch


def group_samples(state: BrokerState, gid: int) -> list[Sample]:
    return state.groups[gid].samples


# ---------------------------------------------------------------------------------------------------
# sync


def test_sync_round_leases_exactly_the_batch_and_trains_it() -> None:
    state = make_state(Mode.SYNC, b=2, n=3)
    d = Driver(state)
    for step in range(3):
        work = d.take(credit=100)
        assert len(work) == 2 * 3
        assert d.take(credit=100) == []  # the round holds exactly B groups
        assert state.ledger().in_flight == 2
        leases = sorted(d.held)
        for lease_id in leases[:-1]:
            d.finish(lease_id)
            assert not state.close_round_if_complete()
        d.finish(leases[-1])
        assert state.close_round_if_complete()
        assert not state.round_open and d.take(credit=100) == []
        ledger = state.ledger()
        assert (ledger.complete_waiting, ledger.in_flight, ledger.partial) == (2, 0, 0)
        batch = d.train(step, publish=False)
        assert batch is not None and batch.step == step
        assert state.round_open
        assert state.trained == 2 * (step + 1)
    ledger = state.check_ledger()
    assert ledger.issued == ledger.trained == 6
    assert ledger.dropped == {}
    assert len(d.trained_keys) == 6 * 3


def test_leasable_samples_counts_what_take_work_can_lease() -> None:
    state = make_state(Mode.SYNC, b=2, n=2)
    d = Driver(state)
    assert state.leasable_samples() == 4  # two fresh groups of two
    d.take(credit=3)
    assert state.leasable_samples() == 1  # the rest of the second group, queued
    d.take()
    d.finish_all()
    assert state.leasable_samples() == 0
    assert d.end_round() and state.leasable_samples() == 0  # the round is closed

    capped = make_state(Mode.ASYNC, b=2, n=2, eta=1)  # admission: 4 groups
    capped.max_live_samples = 5  # room for 2 groups of 2
    assert capped.leasable_samples() == 4
    assert len(Driver(capped).take()) == 4 and capped.leasable_samples() == 0


def test_sync_take_work_respects_credit() -> None:
    state = make_state(Mode.SYNC, b=2, n=2)
    d = Driver(state)
    assert len(d.take(credit=3)) == 3
    assert state.issued == 2  # the second group was issued to fill the credit
    assert len(d.take(credit=3)) == 1
    assert d.take(credit=3) == []
    assert d.take(credit=0) == []


class QueueEveryGroup(BrokerState):
    """The reference: a group issued while leasing goes into the dispatch queue whole and is leased from
    it, as before `_lease_fresh` leased such a group's samples without queueing them."""

    def _lease_fresh(self, worker_id: str, entry: GroupEntry, count: int, out: list[Any]) -> None:
        for s in entry.samples:
            self.queue.push(s.key, None)


@pytest.mark.parametrize("mode", [Mode.SYNC, Mode.APRIL, Mode.ASYNC])
@pytest.mark.parametrize("credits", [(1, 1, 9), (2, 5), (3, 3, 3), (7,), (4, 0, 100)])
def test_groups_issued_while_leasing_are_leased_as_the_queue_would(
    mode: Mode, credits: tuple[int, ...]
) -> None:
    """take_work leases a group it issues into an empty queue without queueing it: the same leases (ids,
    budgets, samples, order), books and queue as putting it in the queue and leasing from there, through
    results and (april) aborted partials that queue ahead of fresh samples."""
    states = [cls(mode, algo(b=2, over=3, n=3, eta=1), source()) for cls in (BrokerState, QueueEveryGroup)]
    drivers = [Driver(state) for state in states]
    for step in range(3):
        for credit in credits:
            got, expected = (d.take(credit, worker=f"w{credit}") for d in drivers)
            assert [(lid, budget) for lid, budget, _ in got] == [(lid, budget) for lid, budget, _ in expected]
            for (_, _, x), (_, _, y) in zip(got, expected, strict=True):
                assert_samples_equal(x, y)
            assert_same_books(*states)
            for gid, entry in states[0].groups.items():
                assert entry.counts == states[1].groups[gid].counts
                assert entry.min_version() == states[1].groups[gid].min_version()
            assert (states[0].in_flight, states[0].partial) == (states[1].in_flight, states[1].partial)
            assert (states[0].round, states[0].totals) == (states[1].round, states[1].totals)
        for d in drivers:  # finish half the leases; april: abort the rest at the round's end (partials)
            leases = sorted(d.held)
            for lease_id in leases[: len(leases) // 2]:
                d.finish(lease_id, tokens=1 + lease_id % 3)
            if mode != Mode.APRIL:
                d.finish_all()
            d.end_round()
            d.train(step, publish=True)
        assert_same_books(*states)
    assert states[0].issued == states[1].issued > 3


# ---------------------------------------------------------------------------------------------------
# april


def test_april_round_oversamples_aborts_parks_and_resumes_partials_first() -> None:
    state = make_state(Mode.APRIL, b=2, over=4, n=2)
    d = Driver(state)
    work = d.take(credit=7)  # 4 groups issued, (3, 1) stays queued and never starts
    assert [s.key for _, _, s in work] == [(g, i) for g in range(4) for i in range(2)][:7]
    assert state.issued == 4  # never more than over_sampling_batch_size groups

    for key in [(0, 0), (0, 1), (1, 0)]:
        d.finish(d.lease_of(key))
    assert not state.close_round_if_complete()
    d.finish(d.lease_of((1, 1)))
    assert state.close_round_if_complete()
    assert d.take() == []  # the round is closed: nothing is dispatched

    d.interrupt(d.lease_of((2, 0)), tokens=3)
    d.finish(d.lease_of((2, 1)))
    d.interrupt(d.lease_of((3, 0)), tokens=0)  # aborted before its first token
    assert state.partial == 1 and state.in_flight == 1  # group 3 still has (3, 1) PENDING in the queue
    state.park_queued_samples()
    d.check()
    assert group_samples(state, 3)[1].status == SampleStatus.INTERRUPTED
    assert state.partial == 2 and state.in_flight == 0
    assert [s.key for s in state.partial_samples()] == [(2, 0), (3, 0), (3, 1)]

    batch = d.train(step=0)
    assert batch is not None and batch.group_ids == [0, 1]
    assert state.version == 1 and state.round_open

    work = d.take(credit=100)
    keys = [s.key for _, _, s in work]
    assert keys[:3] == [(2, 0), (3, 0), (3, 1)]  # partials first: tokens first, then never started
    assert keys[3:] == [(4, 0), (4, 1), (5, 0), (5, 1)]  # topped up to over_sampling_batch_size
    lid, budget, resumed = work[0]
    assert resumed.resumes == 1 and resumed.response_len == 3 and budget == MAX_NEW - 3
    assert [w[2].resumes for w in work[1:3]] == [0, 0]  # nothing generated yet: not a resume
    assert state.round.resumed == 1

    out = d.finish(lid, tokens=2)
    assert out.segments == (Segment(0, 0, 3), Segment(1, 3, 5))
    assert state.groups[2].samples[0].segments == out.segments
    assert 2 in state.complete  # (2, 1) finished last round; the group is complete now


def test_april_partials_resume_oldest_version_first() -> None:
    """A partial with older tokens goes before a partial of a lower group id with newer tokens."""
    state = make_state(Mode.APRIL, b=1, over=3, n=2)
    d = Driver(state)
    d.take()  # groups 0, 1, 2
    for key in [(1, 0), (1, 1)]:
        d.reclaim(d.lease_of(key))  # their worker died: group 1 goes back untouched
    d.finish(d.lease_of((0, 0)))
    d.finish(d.lease_of((0, 1)))
    assert d.end_round()  # group 2 interrupted with v0 tokens, group 1 parked
    d.train()
    assert state.version == 1

    keys = [s.key for _, _, s in d.take()]
    assert keys == [(2, 0), (2, 1), (1, 0), (1, 1), (3, 0), (3, 1)]
    for key in [(1, 0), (1, 1)]:
        d.interrupt(d.lease_of(key), tokens=2)  # group 1's first tokens: version 1
    d.finish(d.lease_of((3, 0)))
    d.finish(d.lease_of((3, 1)))
    assert d.end_round()  # group 2 interrupted again
    d.train()

    work = d.take()
    assert [s.key for _, _, s in work][:4] == [(2, 0), (2, 1), (1, 0), (1, 1)]
    assert [s.resumes for _, _, s in work[:4]] == [2, 2, 1, 1]
    assert work[0][2].segments == (Segment(0, 0, 2), Segment(1, 2, 4))
    assert [b for _, b, _ in work[:4]] == [MAX_NEW - 4, MAX_NEW - 4, MAX_NEW - 2, MAX_NEW - 2]


def test_april_surplus_complete_groups_are_kept_for_the_next_batch() -> None:
    state = make_state(Mode.APRIL, b=1, over=3, n=2)
    d = Driver(state)
    d.take()
    d.finish_all()  # all three groups complete: two more than a batch
    assert d.end_round()
    first = d.train()
    assert first is not None and first.group_ids == [0]
    assert list(state.complete) == [1, 2] and state.ledger().complete_waiting == 2
    assert state.round_open
    # the surplus counts toward the round: only one fresh group would be allowed, but the round is
    # already complete, so the server closes it before dispatching anything
    assert policy_for(state.mode).fresh_group_allowance(state.algo, state.counts(), state.version, True) == 1
    assert d.end_round()
    assert d.take() == []
    second = d.train()
    assert second is not None and second.group_ids == [1]
    assert d.end_round()
    third = d.train()
    assert third is not None and third.group_ids == [2]
    assert not state.complete and state.round_open
    assert [s.key[0] for _, _, s in d.take()] == [3, 3, 4, 4, 5, 5]
    assert state.trained == 3 and state.dropped == {}
    assert d.trained_groups == {0, 1, 2}


# ---------------------------------------------------------------------------------------------------
# async


def test_async_admission_bound() -> None:
    state = make_state(Mode.ASYNC, b=2, n=2, eta=1)
    d = Driver(state)
    assert len(d.take()) == 2 * 2 * 2  # (eta + 0 + 1) * B groups
    assert d.take() == []
    d.finish_all()
    assert d.take() == []  # complete groups still count as accepted
    batch = d.train(publish=False)
    assert batch is not None
    assert d.take() == []  # trained groups count as accepted too
    assert state.set_weights(1, "v1", "sha")
    assert len(d.take()) == 2 * 2  # one more batch worth of groups per version
    assert d.take() == []
    assert state.counts().accepted == asynchronous.admission_limit(state.algo, 1) == 6


def test_async_batch_waits_for_a_due_group() -> None:
    state = make_state(Mode.ASYNC, b=1, n=2, eta=1)
    d = Driver(state)
    d.take()  # groups 0 and 1 at version 0
    d.finish(d.lease_of((0, 0)))
    d.finish(d.lease_of((0, 1)))
    d.interrupt(d.lease_of((1, 0)), tokens=2)
    first = d.train()  # group 1 is not due at version 0: the batch forms; publishing v1 aborts the rest
    assert first is not None and first.group_ids == [0]
    assert state.version == 1 and state.partial == 1

    work = d.take()
    assert [s.key for _, _, s in work] == [(1, 0), (1, 1), (2, 0), (2, 1)]
    d.finish(d.lease_of((2, 0)))
    d.finish(d.lease_of((2, 1)))
    assert state.incomplete_versions() == [0]  # group 1: tokens of v0, due at v1
    assert state.form_batch(1) is None  # group 2 is complete but group 1 (v0 tokens) is due
    d.finish(d.lease_of((1, 0)))
    assert state.form_batch(1) is None
    d.finish(d.lease_of((1, 1)))
    batch = d.train(step=1)
    assert batch is not None and batch.group_ids == [1]  # the oldest first
    assert batch.stats["staleness_max"] == 1 and max(s.staleness(1) for s in batch.samples) == 1


def test_async_eta_2_keeps_young_groups_waiting_for_old_ones() -> None:
    """B=1, eta 2: at v1 groups 1 and 2 hold v0 tokens and run, group 3 (v1) is complete. Training group 3
    first would leave both old groups due at v2 with one batch for two; so the batch waits for one."""
    state = make_state(Mode.ASYNC, b=1, n=1, eta=2)
    d = Driver(state)
    assert len(d.take()) == 3  # (eta + 0 + 1) x B groups
    d.finish(d.lease_of((0, 0)))
    d.interrupt(d.lease_of((1, 0)))
    d.interrupt(d.lease_of((2, 0)))
    first = d.train()
    assert first is not None and first.group_ids == [0]
    assert [s.key for _, _, s in d.take()] == [(1, 0), (2, 0), (3, 0)]
    d.finish(d.lease_of((3, 0)))
    assert sorted(state.incomplete_versions(), key=str) == [0, 0]
    assert state.form_batch(1) is None  # group 3 is complete, but groups 1 and 2 need two batches by v2
    d.finish(d.lease_of((1, 0)))
    trained = [d.train(step=1)]
    assert trained[0] is not None and trained[0].group_ids == [1]
    assert [s.key for _, _, s in d.take()] == [(2, 0), (4, 0)]  # v2 aborted group 2: resumed first
    d.finish(d.lease_of((2, 0)))
    trained += [d.train(step=2), d.train(step=3)]
    assert [(b.group_ids, b.version) for b in trained if b] == [([1], 1), ([2], 2), ([3], 3)]
    assert all(b.stats["staleness_max"] <= 2 for b in trained if b)


@pytest.mark.parametrize("eta", [0, 1, 2, 3])
def test_async_staleness_never_exceeds_the_bound(eta: int) -> None:
    """A scripted run: random lengths, a learner that trains whenever it can, an abort per version."""
    rng = random.Random(eta)
    state = make_state(Mode.ASYNC, b=2, n=2, eta=eta, max_new=6)
    d = Driver(state)
    step = 0
    for _ in range(400):
        d.take(credit=rng.randint(0, 4), worker=f"w{rng.randint(0, 2)}")
        assert state.counts().accepted <= asynchronous.admission_limit(state.algo, state.version)
        for lease_id in list(d.held):
            r = rng.random()
            if r < 0.3:
                d.finish(lease_id, tokens=rng.randint(1, 6))
            elif r < 0.4:
                d.interrupt(lease_id, tokens=rng.randint(0, 3))
        if rng.random() < 0.5:
            version = state.version
            batch = d.train(step)
            if batch is not None:
                step += 1
                assert batch.version == version
                assert max(s.staleness(version) for s in batch.samples) <= eta
                assert batch.stats["staleness_max"] <= eta
    assert step >= 10  # the run made progress
    ledger = state.check_ledger()
    assert ledger.trained == 2 * step


# ---------------------------------------------------------------------------------------------------
# dropping: dynamic sampling and failures


@pytest.mark.parametrize("mode", [Mode.SYNC, Mode.APRIL])
def test_dynamic_sampling_drops_uniform_group_and_tops_up(mode: Mode) -> None:
    state = make_state(mode, b=1, over=1, n=2, dynamic=True)
    d = Driver(state)
    d.take()
    d.finish(d.lease_of((0, 0)), reward=1.0)
    d.finish(d.lease_of((0, 1)), reward=1.0)
    assert state.dropped == {"dynamic_filter": 1}
    assert state.ledger().dropped == {"dynamic_filter": 1}
    assert 0 not in state.groups and not state.complete
    assert not state.close_round_if_complete()
    work = d.take()  # the round tops up with a new group
    assert [s.key for _, _, s in work] == [(1, 0), (1, 1)]
    d.finish_all()  # rewards 0 and 1: mixed, kept
    assert d.end_round()
    assert d.train() is not None
    ledger = state.check_ledger()
    assert (ledger.issued, ledger.trained, ledger.dropped) == (2, 1, {"dynamic_filter": 1})


def test_uniform_rewards_are_kept_without_dynamic_sampling() -> None:
    state = make_state(Mode.SYNC, b=1, n=2, dynamic=False)
    d = Driver(state)
    d.take()
    d.finish(d.lease_of((0, 0)), reward=1.0)
    d.finish(d.lease_of((0, 1)), reward=1.0)
    assert state.dropped == {} and list(state.complete) == [0]


@pytest.mark.parametrize("mode", list(Mode), ids=str)
def test_failed_sample_drops_its_group(mode: Mode) -> None:
    state = make_state(mode, b=1, over=2, n=3)
    d = Driver(state)
    d.take()
    d.fail(d.lease_of((0, 1)))
    assert state.in_flight == (2 if mode != Mode.SYNC else 1) and not state.dropped  # siblings still run
    d.finish(d.lease_of((0, 0)))
    d.finish(d.lease_of((0, 2)))
    assert state.dropped == {"failed": 1} and 0 not in state.groups
    assert state.ledger().dropped == {"failed": 1}


# ---------------------------------------------------------------------------------------------------
# reclaim and duplicate results


def april_with_partial() -> tuple[Driver, int, Sample]:
    """An april state in its second round with (2, 0) resumed under lease `lease_id` (3 tokens, v0)."""
    state = make_state(Mode.APRIL, b=2, over=3, n=2)
    d = Driver(state)
    d.take()
    for g in (0, 1):
        for i in (0, 1):
            d.finish(d.lease_of((g, i)))
    d.interrupt(d.lease_of((2, 0)), tokens=3)
    d.interrupt(d.lease_of((2, 1)), tokens=1)
    assert d.end_round()
    d.train()
    work = d.take()
    lease_id, _, resumed = work[0]
    assert resumed.key == (2, 0) and resumed.resumes == 1
    return d, lease_id, resumed


def test_reclaim_restores_the_sample_exactly_as_before_the_lease() -> None:
    d, lease_id, _ = april_with_partial()
    state = d.state
    before = state.leases[lease_id].at_lease
    assert before.status == SampleStatus.INTERRUPTED and before.resumes == 0
    partial_before = state.partial
    d.reclaim(lease_id)
    restored = state.groups[2].samples[0]
    assert_samples_equal(restored, before)
    assert restored.segments == (Segment(0, 0, 3),) and restored.response_len == 3
    assert (2, 0) in state.queue.ordered() and lease_id not in state.leases
    assert state.partial == partial_before  # (2, 1) is still leased: the group stays in flight
    # the reclaimed lease is gone: its result is refused and counts nothing
    late = _extend(restored.resumed(), 2, version=1)
    with pytest.raises(ResultRejected) as exc:
        state.accept_result("w0", lease_id, late)
    assert exc.value.reason == "not_leased"
    d.check()
    # leased again: the next lease resumes it once more, from the same three tokens
    again = [w for w in d.take() if w[2].key == (2, 0)]
    assert len(again) == 1 and again[0][2].resumes == 1 and again[0][1] == MAX_NEW - 3


def test_a_lease_returned_with_nothing_generated_is_requeued_as_leased_and_is_no_abort() -> None:
    """A worker whose engine was still starting (or went down) sends leases straight back, INTERRUPTED
    with no tokens: that is the lease returned as it was leased (a fresh sample or a partial), not an
    aborted sample. Sync mode aborts nothing, whatever its workers' engines do."""
    sync = Driver(make_state(Mode.SYNC, b=1, n=2))
    (fresh_lease, _, _), _ = sync.take()
    partial, partial_lease, _ = april_with_partial()
    for d, lease_id in ((sync, fresh_lease), (partial, partial_lease)):
        before = d.state.leases[lease_id].at_lease
        totals, in_round, buffered = d.state.totals.aborted, d.state.round.aborted, d.state.partial
        d.interrupt(lease_id, tokens=0)
        assert (d.state.totals.aborted, d.state.round.aborted) == (totals, in_round)
        assert_samples_equal(d.state.groups[before.group_id].samples[before.index], before)
        assert before.key in d.state.queue.ordered() and d.state.partial == buffered
        (again,) = [lid for lid, _, s in d.take() if s.key == before.key]
        d.interrupt(again, tokens=1)  # with a token generated, an interruption is an abort
        assert d.state.totals.aborted == totals + 1


def test_the_books_record_which_worker_returned_each_lease_and_where_it_ended() -> None:
    """Each lease that comes back changed adds a span (the worker, the response's length then), whatever
    the worker sent in that column; one that comes back as leased adds none. The spans travel with the
    sample: in its next lease, and in the batch."""
    d = Driver(make_state(Mode.APRIL, b=1, over=1, n=1))
    ((lease_id, _, _),) = d.take(worker="w0")
    d.interrupt(lease_id, tokens=3)
    ((lease_id, _, leased),) = d.take(worker="w1")
    assert leased.leases == (LeaseSpan("w0", 3),)
    d.interrupt(lease_id, tokens=0)  # nothing generated: as leased, no span
    ((lease_id, _, leased),) = d.take(worker="w1")
    _, held, _ = d.held.pop(lease_id)
    out = held.extend([5, 6], [-0.5, -0.5], d.state.version, FinishReason.STOP).scored(1.0)
    d.state.accept_result("w1", lease_id, dataclasses.replace(out, leases=(LeaseSpan("liar", 99),)))
    kept = d.state.groups[out.group_id].samples[0]
    assert kept.leases == (LeaseSpan("w0", 3), LeaseSpan("w1", 5))
    batch = d.train()
    assert batch is not None and batch.samples[0].leases == kept.leases
    assert SampleBatch.from_samples(batch.samples).to_samples()[0].leases == kept.leases


def test_second_result_for_a_lease_is_not_counted_twice() -> None:
    """A result sent again (a worker that reconnected and was not sure the first arrived) is recognised
    as one the books hold: a duplicate, counted nowhere else; a different one for the same lease is
    not_leased."""
    state = make_state(Mode.SYNC, b=1, n=2)
    d = Driver(state)
    (l0, _, _), _ = d.take()
    out = d.finish(l0)
    tokens = state.totals.tokens_generated
    with pytest.raises(ResultRejected) as exc:
        state.accept_result("w0", l0, out)
    assert exc.value.reason == "duplicate"
    other = out.scored(0.5)  # the same tokens, settled otherwise: not what the books hold
    with pytest.raises(ResultRejected) as exc:
        state.accept_result("w0", l0, other)
    assert exc.value.reason in ("not_leased", "duplicate")
    assert state.totals.samples_finished == 1 and state.totals.tokens_generated == tokens
    d.check()


def test_result_from_another_worker_is_not_leased() -> None:
    state = make_state(Mode.SYNC, b=1, n=1)
    d = Driver(state)
    ((lease_id, _, s),) = d.take(worker="w0")
    out = s.extend([1], [-0.1], 0, FinishReason.STOP).scored(1.0)
    with pytest.raises(ResultRejected) as exc:
        state.accept_result("w1", lease_id, out)
    assert exc.value.reason == "not_leased"
    assert lease_id in state.leases
    d.finish(lease_id)


# ---------------------------------------------------------------------------------------------------
# ResultRejected reasons


def _extend(s: Sample, k: int, version: int = 1, finish: FinishReason = FinishReason.STOP) -> Sample:
    out = s.extend([20 + i for i in range(k)], [-0.25] * k, version, finish)
    return out.scored(1.0) if finish in (FinishReason.STOP, FinishReason.LENGTH) else out


def _flip_first(s: Sample) -> Sample:
    ids = s.response_ids.copy()
    ids[0] += 1
    return dataclasses.replace(s, response_ids=ids)


def _shorter(s: Sample) -> Sample:
    return dataclasses.replace(
        s,
        response_ids=s.response_ids[:2],
        response_logprobs=s.response_logprobs[:2],
        segments=(Segment(0, 0, 2),),
    )


# name -> (expected reason, the bad result built from (leased sample, a sibling sample))
BAD_RESULTS: dict[str, tuple[str, Callable[[Sample, Sample], Sample]]] = {
    "wrong_sample": ("wrong_sample", lambda s, other: _extend(other, 2)),
    "bad_status-still-running": ("bad_status", lambda s, _: _extend(s, 2, finish=FinishReason.NONE)),
    "bad_length-over-budget": ("bad_length", lambda s, _: _extend(s, MAX_NEW - 3 + 1)),
    "bad_length-shorter-than-leased": ("bad_length", lambda s, _: _shorter(_extend(s, 2))),
    "not_a_continuation-changed-token": ("not_a_continuation", lambda s, _: _flip_first(_extend(s, 2))),
    "future_version": ("future_version", lambda s, _: _extend(s, 2, version=2)),
    "bad_finish-finished-without-reward": (
        "bad_finish",
        lambda s, _: s.extend([5], [-0.1], 1, FinishReason.STOP),
    ),
    "bad_finish-finished-with-abort": (
        "bad_finish",
        lambda s, _: dataclasses.replace(_extend(s, 2), finish_reason=FinishReason.ABORT),
    ),
    "bad_finish-interrupted-without-abort": (
        "bad_finish",
        lambda s, _: dataclasses.replace(
            _extend(s, 2, finish=FinishReason.ABORT), finish_reason=FinishReason.STOP
        ),
    ),
    "prompt_changed": (
        "prompt_changed",
        lambda s, _: dataclasses.replace(_extend(s, 2), prompt_ids=s.prompt_ids + 1),
    ),
}


@pytest.mark.parametrize("name", list(BAD_RESULTS))
def test_result_rejected(name: str) -> None:
    d, lease_id, leased = april_with_partial()
    state = d.state
    assert state.version == 1
    reason, build = BAD_RESULTS[name]
    bad = build(leased, state.groups[2].samples[1])
    ledger, queue = state.ledger(), state.queue.ordered()
    with pytest.raises(ResultRejected) as exc:
        state.accept_result("w0", lease_id, bad)
    assert exc.value.reason == reason, str(exc.value)
    # nothing changed: the lease is still held (the server reclaims it), the books are as they were
    assert lease_id in state.leases and state.ledger() == ledger and state.queue.ordered() == queue
    assert_samples_equal(state.groups[2].samples[0], leased)
    d.check()
    d.finish(lease_id, tokens=2)  # the genuine result is still accepted


def test_result_with_empty_prompt_is_rejected_for_a_fresh_sample() -> None:
    state = make_state(Mode.SYNC, b=1, n=1)
    d = Driver(state)
    ((lease_id, _, s),) = d.take()
    bad = dataclasses.replace(_extend(s, 2, version=0), prompt_ids=np.zeros(0, dtype=np.int32))
    with pytest.raises(ResultRejected) as exc:
        state.accept_result("w0", lease_id, bad)
    assert exc.value.reason == "prompt_changed"


def test_resumed_lease_may_span_two_versions() -> None:
    """Weights loaded between decode steps: a resumed sample returns its old segment plus two new ones."""
    d, lease_id, leased = april_with_partial()
    state = d.state
    assert state.version == 1
    out = leased.extend([1], [-0.1], 1, FinishReason.NONE)
    assert state.set_weights(2, "v2", "sha")
    out = out.extend([2], [-0.1], 2, FinishReason.STOP).scored(1.0)
    state.accept_result("w0", lease_id, out)
    d.held.pop(lease_id)
    d.check()
    assert state.groups[2].samples[0].segments == (Segment(0, 0, 3), Segment(1, 3, 4), Segment(2, 4, 5))


def test_fresh_lease_may_span_two_versions() -> None:
    state = make_state(Mode.APRIL, b=1, over=1, n=1)
    d = Driver(state)
    ((lease_id, _, s),) = d.take()
    out = s.extend([1, 2], [-0.1, -0.1], 0, FinishReason.NONE)
    assert state.set_weights(1, "v1", "sha")
    out = out.extend([3], [-0.1], 1, FinishReason.STOP).scored(1.0)
    state.accept_result("w0", lease_id, out)  # a fresh lease has no old segment to keep
    d.held.pop(lease_id)
    d.check()
    assert state.groups[0].samples[0].segments == (Segment(0, 0, 2), Segment(1, 2, 3))


def test_result_that_retags_earlier_tokens_is_rejected() -> None:
    d, lease_id, leased = april_with_partial()
    state = d.state
    assert leased.segments == (Segment(0, 0, 3),) and state.version == 1
    out = _extend(leased, 2, version=1)
    forged = dataclasses.replace(out, segments=(Segment(1, 0, 5),))  # tokens 0..3 claimed by v1
    assert forged.staleness(1) == 0 and out.staleness(1) == 1
    with pytest.raises(ResultRejected) as exc:
        state.accept_result("w0", lease_id, forged)
    assert exc.value.reason == "not_a_continuation"


def test_result_that_rewrites_earlier_logprobs_is_rejected() -> None:
    d, lease_id, leased = april_with_partial()
    state = d.state
    out = _extend(leased, 2)
    forged = dataclasses.replace(out, response_logprobs=np.full(5, -0.01, dtype=np.float32))
    assert not np.array_equal(forged.response_logprobs[:3], leased.response_logprobs)
    with pytest.raises(ResultRejected) as exc:
        state.accept_result("w0", lease_id, forged)
    assert exc.value.reason == "not_a_continuation"


# ---------------------------------------------------------------------------------------------------
# batches and weights


def test_form_batch_is_stable_until_acked() -> None:
    state = make_state(Mode.SYNC, b=1, n=2)
    d = Driver(state)
    assert state.form_batch(0) is None
    d.take()
    d.finish_all()
    assert state.close_round_if_complete()
    batch = state.form_batch(0)
    assert batch is not None
    assert state.form_batch(5) is batch  # a repeated request gets the same batch
    d.check()
    assert state.ledger().complete_waiting == 1  # handed out, not trained yet
    assert not state.ack_batch(batch.batch_id + 1)
    assert state.batch is batch and state.trained == 0
    assert state.ack_batch(batch.batch_id)
    assert not state.ack_batch(batch.batch_id)  # a replayed ack
    assert state.trained == 1
    d.check()


def test_set_weights_ignores_older_or_equal_version() -> None:
    state = make_state(Mode.ASYNC)
    assert state.set_weights(2, "v2", "aa")
    assert not state.set_weights(2, "again", "bb")
    assert not state.set_weights(1, "old", "cc")
    assert (state.version, state.weights_uri, state.weights_sha256) == (2, "v2", "aa")


# ---------------------------------------------------------------------------------------------------
# snapshots


def mid_run_april() -> Driver:
    """An april state mid-abort: leases out on two workers, a partial and a fresh sample queued, a
    surplus complete group, an unacked batch and a dropped group."""
    state = BrokerState(Mode.APRIL, algo(b=1, over=5, n=2, dynamic=True), source())
    d = Driver(state)
    d.take()  # groups 0..4
    d.finish(d.lease_of((0, 0)), reward=1.0)
    d.finish(d.lease_of((0, 1)), reward=1.0)  # dropped: uniform rewards
    for g in (1, 4):
        d.finish(d.lease_of((g, 0)))
        d.finish(d.lease_of((g, 1)))
    assert d.end_round()  # groups 2, 3 interrupted
    assert d.train() is not None  # group 1; group 4 is surplus
    d.take(credit=3, worker="w1")  # (2, 0), (2, 1), (3, 0) resumed
    d.finish(d.lease_of((2, 0)))
    d.finish(d.lease_of((2, 1)))
    d.take(credit=2, worker="w2")  # (3, 1) resumed and fresh (5, 0); (5, 1) stays queued
    assert state.close_round_if_complete()
    d.interrupt(d.lease_of((3, 0)))  # the abort has started: one result is back
    assert state.form_batch(1) is not None  # unacked
    d.check()
    assert state.batch is not None and state.batch.group_ids == [2]
    assert list(state.complete) == [4] and state.dropped == {"dynamic_filter": 1}
    assert sorted(s.key for _, s, _ in d.held.values()) == [(3, 1), (5, 0)]
    assert state.queue.ordered() == [(3, 0), (5, 1)]
    return d


def assert_same_books(a: BrokerState, b: BrokerState) -> None:
    assert a.ledger() == b.ledger()
    assert (a.cursor, a.next_group_id, a.next_batch_id, a.version, a.round_open) == (
        b.cursor,
        b.next_group_id,
        b.next_batch_id,
        b.version,
        b.round_open,
    )
    assert (a.weights_uri, a.weights_sha256) == (b.weights_uri, b.weights_sha256)
    assert a.queue.ordered() == b.queue.ordered()
    assert a.pinned == b.pinned and a.restarts == b.restarts
    assert list(a.complete) == list(b.complete)
    assert sorted(a.groups) == sorted(b.groups)
    for gid, entry in a.groups.items():
        for x, y in zip(entry.samples, b.groups[gid].samples, strict=True):
            assert_samples_equal(x, y)
    assert sorted(a.leases) == sorted(b.leases)
    for lease_id, lease in a.leases.items():
        assert lease.worker_id == b.leases[lease_id].worker_id
        assert_samples_equal(lease.at_lease, b.leases[lease_id].at_lease)
    assert (a.batch is None) == (b.batch is None)
    if a.batch is not None and b.batch is not None:
        assert (a.batch.batch_id, a.batch.step, a.batch.version, a.batch.group_ids, a.batch.stats) == (
            b.batch.batch_id,
            b.batch.step,
            b.batch.version,
            b.batch.group_ids,
            b.batch.stats,
        )
        for x, y in zip(a.batch.samples, b.batch.samples, strict=True):
            assert_samples_equal(x, y)


def test_snapshot_round_trip_and_continue(tmp_path: Path) -> None:
    d = mid_run_april()
    old = d.state
    snapshot.write(snapshot.capture(old), tmp_path)
    new = snapshot.restore(snapshot.read(tmp_path), old.mode, old.algo, source())
    new.check_ledger()
    assert_same_books(old, new)
    assert new.epoch == old.epoch + 1
    assert [s.key for s in new.partial_samples()] == [s.key for s in old.partial_samples()] == [(3, 0)]

    # carry on with the restored books: the batch is acked, leases granted before the snapshot finish
    d.state = new
    batch = d.train(step=1)
    assert batch is not None and batch.group_ids == [2]
    d.finish_all()
    old_ids = set(old.leases)
    for _ in range(4):
        work = d.take()
        assert all(lid >> LEASE_EPOCH_SHIFT == new.epoch for lid, _, _ in work)
        assert not old_ids & {lid for lid, _, _ in work}
        d.finish_all()
        assert d.end_round()
        d.train()
    ledger = new.check_ledger()
    assert ledger.in_flight == ledger.partial == 0
    assert ledger.issued == ledger.trained + ledger.complete_waiting + sum(ledger.dropped.values())
    assert ledger.trained >= old.trained + 5


def test_snapshot_of_a_fresh_state(tmp_path: Path) -> None:
    state = make_state(Mode.SYNC)
    snapshot.write(snapshot.capture(state), tmp_path)
    new = snapshot.restore(snapshot.read(tmp_path), Mode.SYNC, state.algo, source())
    assert_same_books(state, new)


def complete_group(gid: int, rng: np.random.Generator) -> list[Sample]:
    """Two finished samples of group `gid`, with responses of random length."""
    prompt = rng.integers(1, 50, size=4).astype(np.int32)
    out = []
    for s in new_group_samples(gid, 2, prompt, f"prompt {gid}", {"answer": str(gid)}):
        n = int(rng.integers(1, 9))
        tokens, logprobs = rng.integers(1, 50, size=n).tolist(), (-rng.random(n)).tolist()
        out.append(s.extend(tokens, logprobs, 0, FinishReason.STOP).scored(float(gid % 2)))
    return out


def loaded_groups(directory: Path) -> dict[int, list[Sample]]:
    """What a restarted broker loads from `directory`: the samples of each complete group, by group id."""
    by_gid: dict[int, list[Sample]] = {}
    for sample in snapshot.SnapshotStore(directory).load().samples.to_samples():
        by_gid.setdefault(sample.group_id, []).append(sample)
    return by_gid


def log_bytes(directory: Path) -> int:
    return sum(p.stat().st_size for p in directory.glob("complete*.log"))


def record_bytes(gid: int, samples: list[Sample]) -> int:
    """The size of a record holding group `gid` alone (a record of several groups is smaller than theirs)."""
    [(_, record)] = complete_log.encode_groups([(gid, samples)])
    return complete_log.record_size(record)


def single_group_record(gid: int, samples: list[Sample]) -> bytes:
    """A format-1 record (one group, `LoggedGroup`), as earlier versions wrote them."""
    frames = codec.encode_frames(
        complete_log.SINGLE_GROUP_FORMAT,
        complete_log.LOG_KIND,
        complete_log.LoggedGroup(gid, SampleBatch.from_samples(samples)),
    )
    return complete_log.frames_bytes(frames)


@pytest.mark.parametrize("straggler", [False, True], ids=["fifo", "straggler"])
def test_the_complete_log_keeps_every_live_group_through_segments_and_restarts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, straggler: bool
) -> None:
    """The complete-group log over a long run: groups complete, are trained and leave; segments whose
    groups all left are deleted, and ones kept by stragglers (groups live for the whole run) have their
    live records copied out once the log holds more than 2 x live + one segment's worth of records.
    After every save, a fresh store (a restarted broker) loads exactly the live
    complete groups, also after a restart mid-run and after a torn record at a segment's tail; the log's
    size on disk stays bounded by the live records and one segment."""
    monkeypatch.setattr(complete_log, "SEGMENT_MIN_SAMPLES", 16)
    rng = np.random.default_rng(0)
    live_part, _ = snapshot.capture_refs(BrokerState(Mode.APRIL, algo(n=2), source())).split()
    groups = {gid: complete_group(gid, rng) for gid in range(400)}
    store = snapshot.SnapshotStore(tmp_path)
    deleted: set[str] = set()
    for first in range(1, 380, 3):  # 20 groups live at a time, 3 trained and 3 completed per save
        if first == 181:
            store = snapshot.SnapshotStore(tmp_path)  # a restart: the index is read from the log
        if first == 241:
            newest = max(tmp_path.glob("complete.*.log"))
            with open(newest, "ab") as f:
                f.write(b"\x05\x00\x00")  # a record torn by a crash, cut off when the log is opened
            store = snapshot.SnapshotStore(tmp_path)
        live = {gid: groups[gid] for gid in range(first, first + 20)}
        if straggler:  # every 25th group stays live to the end, each keeping its segment alive
            live |= {gid: groups[gid] for gid in range(0, first, 25)}
        before = {p.name for p in tmp_path.glob("complete.*.log")}
        store.save(dataclasses.replace(live_part, complete_order=list(live)), live)
        deleted |= before - {p.name for p in tmp_path.glob("complete.*.log")}
        by_gid = loaded_groups(tmp_path)
        assert sorted(by_gid) == sorted(live), first
        for gid, samples in by_gid.items():
            for x, y in zip(samples, live[gid], strict=True):
                assert_samples_equal(x, y)
        # at most 2 x live + max(8, live) records, and the newest segment's last append (3 records)
        biggest = max(record_bytes(g, groups[g]) for g in groups)
        assert log_bytes(tmp_path) <= (3 * len(live) + 3) * biggest, first
    assert len(deleted) >= 10  # segments were deleted, also after the restart and the torn tail
    if straggler:  # the first segment held straggler 0: it was copied out
        assert "complete.00000000.log" in deleted
    assert not (tmp_path / ".state.snap.tmp").exists()


def test_a_crash_between_the_log_and_the_state_keeps_the_previous_snapshot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The state file is written after the log: a crash in between leaves the previous state file, and
    every group it refers to is still in the log (no segment is deleted before a newer state is durable)."""
    monkeypatch.setattr(complete_log, "SEGMENT_MIN_SAMPLES", 4)
    rng = np.random.default_rng(1)
    live_part, _ = snapshot.capture_refs(BrokerState(Mode.APRIL, algo(n=2), source())).split()
    groups = {gid: complete_group(gid, rng) for gid in range(12)}
    old = {gid: groups[gid] for gid in range(0, 4)}
    snapshot.SnapshotStore(tmp_path).save(dataclasses.replace(live_part, complete_order=list(old)), old)

    def crash(src: object, dst: object) -> None:
        raise OSError("killed before the rename")

    monkeypatch.setattr(snapshot.os, "replace", crash)
    new = {gid: groups[gid] for gid in range(8, 12)}  # every old group trained
    with pytest.raises(OSError):
        snapshot.SnapshotStore(tmp_path).save(dataclasses.replace(live_part, complete_order=list(new)), new)
    by_gid = loaded_groups(tmp_path)
    assert sorted(by_gid) == sorted(old)
    for gid, samples in by_gid.items():
        for x, y in zip(samples, old[gid], strict=True):
            assert_samples_equal(x, y)


def test_a_legacy_single_complete_log_is_read_and_deleted_once_dead(tmp_path: Path) -> None:
    """A run directory written by an earlier version (one complete.log) resumes: its groups load, and the
    file is deleted once no durable state refers to them."""
    rng = np.random.default_rng(2)
    live_part, _ = snapshot.capture_refs(BrokerState(Mode.APRIL, algo(n=2), source())).split()
    groups = {gid: complete_group(gid, rng) for gid in range(6)}
    legacy = tmp_path / complete_log.LEGACY_NAME
    legacy.write_bytes(b"".join(single_group_record(g, groups[g]) for g in range(3)))
    old = {gid: groups[gid] for gid in range(3)}
    state = complete_log.frames_bytes(
        codec.encode_frames(
            snapshot.SNAPSHOT_FORMAT,
            snapshot.SNAPSHOT_KIND,
            dataclasses.replace(live_part, complete_order=list(old)),
        )
    )
    (tmp_path / snapshot.FILE_NAME).write_bytes(state)
    assert sorted(loaded_groups(tmp_path)) == [0, 1, 2]
    store = snapshot.SnapshotStore(tmp_path, trusted=[0, 1, 2])  # as a broker restored from it
    for keep_ids, legacy_kept in (((2, 3, 4), True), ((3, 4, 5), False)):  # group 2 is in the legacy log
        keep = {gid: groups[gid] for gid in keep_ids}
        store.save(dataclasses.replace(live_part, complete_order=list(keep)), keep)
        assert legacy.exists() == legacy_kept
        by_gid = loaded_groups(tmp_path)
        assert sorted(by_gid) == sorted(keep)
        for gid, samples in by_gid.items():
            for x, y in zip(samples, keep[gid], strict=True):
                assert_samples_equal(x, y)


def segment_records(path: Path) -> list[list[int]]:
    """The group ids of each record of a segment file, in file order."""
    data, pos, out = path.read_bytes(), 0, []
    while pos < len(data):
        frames, pos = complete_log.read_record(data, pos)
        out.append(complete_log.decode_record(frames, max_bytes=len(data) + 1)[0])
    return out


def save_live(store: snapshot.SnapshotStore, groups: dict[int, list[Sample]], ids: list[int]) -> None:
    """Save a state whose complete groups are `ids`, then check that a restarted broker loads exactly
    those, field by field."""
    live_part, _ = snapshot.capture_refs(BrokerState(Mode.APRIL, algo(n=2), source())).split()
    keep = {gid: groups[gid] for gid in ids}
    store.save(dataclasses.replace(live_part, complete_order=list(keep)), keep)
    by_gid = loaded_groups(store.directory)
    assert sorted(by_gid) == sorted(keep)
    for gid, samples in by_gid.items():
        for x, y in zip(samples, keep[gid], strict=True):
            assert_samples_equal(x, y)


def test_groups_handed_over_together_are_one_record_read_back_field_by_field(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Groups handed to the log in one call are one record (those logged ahead of a snapshot, and those
    the snapshot logs itself); a fresh store reads every group back from it; past RECORD_MAX_TOKENS
    response tokens a hand-over is split into several records."""
    rng = np.random.default_rng(5)
    groups = {gid: complete_group(gid, rng) for gid in range(12)}
    store = snapshot.SnapshotStore(tmp_path)
    store.log_groups([(gid, groups[gid]) for gid in (4, 1, 3)])  # as they complete
    save_live(store, groups, [1, 3, 4, 0, 5])  # 0 and 5 were never handed over: the save logs them
    [segment] = tmp_path.glob("complete.*.log")
    assert segment_records(segment) == [[4, 1, 3], [0, 5]]

    monkeypatch.setattr(complete_log, "RECORD_MAX_TOKENS", 1)  # every group is over the limit
    store.log_groups([(gid, groups[gid]) for gid in (6, 7, 8)])
    assert segment_records(segment)[2:] == [[6], [7], [8]]
    save_live(store, groups, [5, 6, 7, 8])


def test_a_record_lives_while_any_of_its_groups_does_and_a_copy_keeps_only_the_live_ones(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A group of a record trained while another of it stays live: the record and its segment stay and
    the live group loads; once stragglers make the log copy that segment out, the copy is a record of the
    live group alone (the dead ones no longer take disk) and the old segment is deleted."""
    monkeypatch.setattr(complete_log, "SEGMENT_MIN_SAMPLES", 8)
    rng = np.random.default_rng(6)
    groups = {gid: complete_group(gid, rng) for gid in range(40)}
    store = snapshot.SnapshotStore(tmp_path)
    first = tmp_path / "complete.00000000.log"
    save_live(store, groups, list(range(10)))
    save_live(store, groups, [1])  # groups 0 and 2..9 trained, group 1 is a straggler
    assert first.exists() and segment_records(first) == [list(range(10))]
    for gid in range(10, 37, 3):  # three more complete and are trained each round
        save_live(store, groups, [1, gid, gid + 1, gid + 2])
        if not first.exists():
            break
    assert not first.exists(), "the straggler's segment was never copied out"
    records = [ids for path in sorted(tmp_path.glob("complete.*.log")) for ids in segment_records(path)]
    assert [1] in records  # the copy holds the straggler alone
    assert not any({0, *range(2, 10)} & set(ids) for ids in records)
    save_live(store, groups, [1])
    restarted = snapshot.SnapshotStore(tmp_path, trusted=[1])
    assert restarted.log.holds((1, 0)) and restarted.log.holds((1, 1)) and not restarted.log.holds((0, 0))
    save_live(restarted, groups, [1, 39])


def test_a_segment_of_single_group_records_is_read_copied_and_deleted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run directory written by the previous format (one group per record, format 1) resumes: its
    groups load, and once the log holds too many dead groups a straggler among them is copied out
    (as it is) and the old segment deleted."""
    monkeypatch.setattr(complete_log, "SEGMENT_MIN_SAMPLES", 8)
    rng = np.random.default_rng(7)
    groups = {gid: complete_group(gid, rng) for gid in range(40)}
    old = tmp_path / "complete.00000000.log"
    old.write_bytes(b"".join(single_group_record(g, groups[g]) for g in range(10)))
    live_part, _ = snapshot.capture_refs(BrokerState(Mode.APRIL, algo(n=2), source())).split()
    state = codec.encode_frames(
        snapshot.SNAPSHOT_FORMAT,
        snapshot.SNAPSHOT_KIND,
        dataclasses.replace(live_part, complete_order=list(range(10))),
    )
    (tmp_path / snapshot.FILE_NAME).write_bytes(complete_log.frames_bytes(state))
    assert segment_records(old) == [[gid] for gid in range(10)]
    by_gid = loaded_groups(tmp_path)
    assert sorted(by_gid) == list(range(10))
    for gid, samples in by_gid.items():
        for x, y in zip(samples, groups[gid], strict=True):
            assert_samples_equal(x, y)
    store = snapshot.SnapshotStore(tmp_path, trusted=range(10))  # as a broker restored from it
    save_live(store, groups, [1, 2, 3, 10])  # 11 groups in the log, within 2 x 4 live + 4: kept
    assert old.exists() and segment_records(tmp_path / "complete.00000001.log") == [[10]]
    save_live(store, groups, [1, 10])  # past 2 x 2 live + 4: group 1 is copied out
    assert not old.exists()
    assert segment_records(tmp_path / "complete.00000001.log") == [[10], [1]]
    save_live(store, groups, [39])


def test_a_multi_group_record_torn_at_the_tail_is_cut_off_and_its_groups_logged_again(tmp_path: Path) -> None:
    """A crash while appending a record of several groups leaves part of it: the log is cut back to the
    record before, none of the torn record's groups counts as logged, and they are logged again."""
    rng = np.random.default_rng(8)
    groups = {gid: complete_group(gid, rng) for gid in range(6)}
    store = snapshot.SnapshotStore(tmp_path)
    save_live(store, groups, [0, 1, 2])
    [segment] = tmp_path.glob("complete.*.log")
    whole = segment.stat().st_size
    store.log_groups([(gid, groups[gid]) for gid in (3, 4, 5)])
    store.log.sync()
    torn = whole + (segment.stat().st_size - whole) // 2
    with open(segment, "r+b") as f:
        f.truncate(torn)  # the broker died halfway through the append
    restarted = snapshot.SnapshotStore(tmp_path, trusted=[0, 1, 2])
    assert [restarted.log.holds((gid, i)) for gid in range(6) for i in (0, 1)] == [True] * 6 + [False] * 6
    assert segment.stat().st_size == whole and segment_records(segment) == [[0, 1, 2]]
    save_live(restarted, groups, [2, 3, 4, 5])


def test_a_record_whose_group_ids_do_not_match_its_samples_is_not_a_record() -> None:
    rng = np.random.default_rng(9)
    two = complete_group(0, rng) + complete_group(1, rng)
    for ids in ([0], [0, 1, 1], [0, 2]):
        body = complete_log.LoggedGroups(np.array(ids, dtype=np.int64), SampleBatch.from_samples(two))
        frames = codec.encode_frames(complete_log.LOG_FORMAT, complete_log.LOG_KIND, body)
        with pytest.raises(codec.ProtocolError):
            complete_log.decode_record(frames, max_bytes=1 << 20)
    body = complete_log.LoggedGroups(np.array([1, 0], dtype=np.int64), SampleBatch.from_samples(two))
    frames = codec.encode_frames(complete_log.LOG_FORMAT, complete_log.LOG_KIND, body)
    assert complete_log.decode_record(frames, max_bytes=1 << 20)[0] == [1, 0]


@pytest.mark.parametrize("cut", [0, 5, 0.5, -1], ids=["empty", "5-bytes", "half", "last-byte"])
def test_truncated_snapshot_is_an_error(tmp_path: Path, cut: float) -> None:
    path = snapshot.write(snapshot.capture(mid_run_april().state), tmp_path)
    data = path.read_bytes()
    keep = int(len(data) * cut) if isinstance(cut, float) else (cut if cut >= 0 else len(data) + cut)
    path.write_bytes(data[:keep])
    with pytest.raises(SnapshotError):
        snapshot.read(tmp_path)


def test_missing_snapshot_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(SnapshotError):
        snapshot.read(tmp_path)


def test_snapshot_for_another_mode_is_an_error(tmp_path: Path) -> None:
    state = mid_run_april().state
    snapshot.write(snapshot.capture(state), tmp_path)
    snap = snapshot.read(tmp_path)
    with pytest.raises(SnapshotError):
        snapshot.restore(snap, Mode.SYNC, state.algo, source())
    with pytest.raises(SnapshotError):
        snapshot.restore(snap, Mode.APRIL, dataclasses.replace(state.algo, n_samples_per_prompt=3), source())


# ---------------------------------------------------------------------------------------------------
# randomized sequences of operations


def random_run(mode: Mode, seed: int, dynamic: bool) -> None:
    rng = random.Random(seed)
    eta = rng.randint(0, 2)
    b = rng.randint(1, 3)
    state = BrokerState(
        mode, algo(b=b, over=b + rng.randint(0, 3), n=rng.randint(1, 3), eta=eta, dynamic=dynamic), source()
    )
    d = Driver(state)
    workers = ["w0", "w1", "w2"]
    step = 0

    def leased() -> int | None:
        return rng.choice(sorted(d.held)) if d.held else None

    for _ in range(200):
        op = rng.randrange(9)
        lease_id = leased()
        if op == 0:
            d.take(credit=rng.randint(0, 5), worker=rng.choice(workers))
        elif op == 1 and lease_id is not None:
            d.finish(lease_id, tokens=rng.randint(0, MAX_NEW), reward=float(rng.randint(0, 1)))
        elif op == 2 and lease_id is not None:
            d.interrupt(lease_id, tokens=rng.randint(0, 3))
        elif op == 3 and lease_id is not None and rng.random() < 0.3:
            d.fail(lease_id)
        elif op == 4 and lease_id is not None:
            d.reclaim(lease_id)
        elif op == 5:
            assert not state.set_weights(rng.randint(0, state.version), "replay", "")
        elif op == 6 and policy_for(mode).round_based:
            d.end_round()
        elif op == 7:
            version = state.version
            batch = d.train(step)
            if batch is not None:
                step += 1
                if mode == Mode.ASYNC:
                    assert max(s.staleness(version) for s in batch.samples) <= eta
        elif op == 8 and rng.random() < 0.3:  # the broker restarts from a snapshot of this moment
            restored = snapshot.restore(snapshot.capture(state), mode, state.algo, source())
            assert_same_books(state, restored)
            assert restored.epoch == state.epoch + 1
            d.state = state = restored
            d.check()
        if mode == Mode.ASYNC:
            assert state.counts().accepted <= asynchronous.admission_limit(state.algo, state.version)

    # drain: finish whatever is out and train what can be trained
    for _ in range(6):
        d.take()
        for lease_id in sorted(d.held):
            d.finish(lease_id, tokens=1, reward=float(rng.randint(0, 1)))
        d.end_round()
        d.train(step)
    d.check()

    issued = set(range(state.next_group_id))
    live = set(state.groups)
    assert state.trained == len(d.trained_groups)
    assert not live & d.trained_groups
    dropped = issued - live - d.trained_groups
    assert len(dropped) == sum(state.dropped.values())
    assert state.issued == len(issued)
    assert len(d.trained_keys) == state.trained * state.algo.n_samples_per_prompt


@pytest.mark.parametrize("dynamic", [False, True], ids=["plain", "dynamic"])
@pytest.mark.parametrize("mode", list(Mode), ids=str)
def test_random_operations_keep_the_books(mode: Mode, dynamic: bool) -> None:
    for seed in range(40):
        random_run(mode, seed, dynamic)


def test_the_snapshot_writer_logs_complete_groups_ahead_and_a_snapshot_makes_them_durable(
    tmp_path: Path,
) -> None:
    """Groups handed to the writer as they complete are in the log before any snapshot refers to them; a
    snapshot that refers to them (and to one never handed over) loads them all, field by field; groups
    logged ahead of a snapshot do not disturb the previous one."""
    rng = np.random.default_rng(3)
    state = BrokerState(Mode.APRIL, algo(n=2), source())
    groups = {gid: complete_group(gid, rng) for gid in range(6)}
    writer = SnapshotWriter(tmp_path)
    try:
        first = writer.submit(snapshot.capture_refs(state))
        assert writer.wait(first, timeout=60)
        writer.log_groups([(gid, groups[gid]) for gid in range(5)])  # group 5 is never handed over
        deadline = time.monotonic() + 60
        while not all(writer.store.log.holds((gid, i)) for gid in range(5) for i in (0, 1)):
            assert time.monotonic() < deadline, "the writer did not log the groups"
            time.sleep(0.01)
        assert loaded_groups(tmp_path) == {}  # the durable state refers to none of them yet
        refs = snapshot.capture_refs(state)
        refs = dataclasses.replace(
            refs, groups=[*refs.groups, *((g, groups[g]) for g in (1, 3, 5))], complete_order=[1, 3, 5]
        )
        assert writer.wait(writer.submit(refs), timeout=60)
    finally:
        writer.close()
    assert writer.error is None
    by_gid = loaded_groups(tmp_path)
    assert sorted(by_gid) == [1, 3, 5]
    for gid, samples in by_gid.items():
        for x, y in zip(samples, groups[gid], strict=True):
            assert_samples_equal(x, y)


def test_records_a_dead_broker_logged_after_its_last_snapshot_are_not_trusted(tmp_path: Path) -> None:
    """A broker logs groups as they complete; killed before its next snapshot (here even after the log's
    fsync), it leaves records of groups the restored broker issues again under the same ids with other
    samples. The restored broker trusts only the records it restored from, logs its own completion of
    those groups, and a later restart loads its samples, not the dead broker's."""
    rng = np.random.default_rng(4)
    live_part, _ = snapshot.capture_refs(BrokerState(Mode.APRIL, algo(n=2), source())).split()
    dead = {gid: complete_group(gid, rng) for gid in range(5)}
    again = {gid: complete_group(gid, rng) for gid in (3, 4)}  # the same ids, generated again
    for gid in again:
        assert not np.array_equal(dead[gid][0].response_ids, again[gid][0].response_ids)
    first = {gid: dead[gid] for gid in range(3)}
    store = snapshot.SnapshotStore(tmp_path)
    store.save(dataclasses.replace(live_part, complete_order=list(first)), first)
    store.log_groups([(gid, dead[gid]) for gid in (3, 4)])
    store.log.sync()  # the broker dies here, before the state that would refer to groups 3 and 4
    restored = snapshot.SnapshotStore(tmp_path).load()
    assert sorted(restored.complete_order) == [0, 1, 2]
    store = snapshot.SnapshotStore(tmp_path, trusted=restored.complete_order)
    second = {**first, **again}
    store.save(dataclasses.replace(live_part, complete_order=list(second)), second)
    by_gid = loaded_groups(tmp_path)
    assert sorted(by_gid) == [0, 1, 2, 3, 4]
    for gid, samples in by_gid.items():
        for x, y in zip(samples, second[gid], strict=True):
            assert_samples_equal(x, y)


def state_file_keys(directory: Path) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """The keys of the samples the state file itself holds (not those it leaves to the log): in `samples`,
    and as leased (`leased_at`)."""
    data = (directory / snapshot.FILE_NAME).read_bytes()
    frames, _ = complete_log.read_record(data, 0)
    live = codec.decode_body(snapshot.BrokerSnapshot, frames, max_bytes=len(data) + 1)
    return sorted(s.key for s in live.samples.to_samples()), sorted(
        s.key for s in live.leased_at.to_samples()
    )


def logged_keys(directory: Path) -> list[tuple[int, int]]:
    """The keys of every sample in the log's records, superseded ones included."""
    out = []
    for path in sorted(directory.glob("complete.*.log")):
        data, pos = path.read_bytes(), 0
        while pos < len(data):
            frames, pos = complete_log.read_record(data, pos)
            out += [s.key for s in complete_log.decode_record(frames, len(data) + 1)[1].to_samples()]
    return out


def test_settled_samples_of_live_groups_go_to_the_log_once_and_not_into_every_state_file(
    tmp_path: Path,
) -> None:
    """A live group waiting for its last samples: its settled (finished, failed) samples are appended to
    the log once, and the state file holds only the samples that may still change, so a snapshot costs
    what changed since the last one, not every live token again; a leased sample only as it was leased
    (`leased_at`), since it is that sample resumed. A restart loads the whole books."""
    state = make_state(Mode.ASYNC, b=2, n=3)
    d = Driver(state)
    d.take(credit=6)  # groups 0 and 1, every sample leased
    d.finish(d.lease_of((0, 0)), tokens=5)
    d.fail(d.lease_of((1, 2)))
    d.interrupt(d.lease_of((1, 0)))  # a partial: it still changes, the state file holds it
    d.check()
    writer = SnapshotWriter(tmp_path)
    try:
        assert writer.wait(writer.submit(snapshot.capture_refs(state)), timeout=60)
        assert state_file_keys(tmp_path) == ([(1, 0)], [(0, 1), (0, 2), (1, 1)])
        assert sorted(logged_keys(tmp_path)) == [(0, 0), (1, 2)]
        assert_same_books(state, snapshot.restore(snapshot.read(tmp_path), state.mode, state.algo, source()))

        d.finish(d.lease_of((0, 1)))
        d.finish(d.lease_of((1, 1)))
        assert writer.wait(writer.submit(snapshot.capture_refs(state)), timeout=60)
        assert state_file_keys(tmp_path) == ([(1, 0)], [(0, 2)])
        assert sorted(logged_keys(tmp_path)) == [(0, 0), (0, 1), (1, 1), (1, 2)]  # each sample once
        restored = snapshot.restore(snapshot.read(tmp_path), state.mode, state.algo, source())
        assert_same_books(state, restored)
        restored.check_ledger()

        [(_, _, resumed)] = state.take_work("w0", 1)  # the partial leased again: resumed, one resume more
        assert resumed.key == (1, 0) and resumed.resumes == 1 and resumed.response_len
        assert writer.wait(writer.submit(snapshot.capture_refs(state)), timeout=60)
        assert state_file_keys(tmp_path) == ([], [(0, 2), (1, 0)])
        restored = snapshot.restore(snapshot.read(tmp_path), state.mode, state.algo, source())
        assert_same_books(state, restored)
        assert_samples_equal(restored.groups[1].samples[0], resumed)
    finally:
        writer.close()
    assert writer.error is None


def test_a_stale_record_of_a_live_groups_sample_is_not_read_in_place_of_the_state_files(
    tmp_path: Path,
) -> None:
    """A broker killed after logging a settled sample of a group its last durable state did not know
    leaves a record the restored broker must not take for the group it issues again under that id: while
    the sample is unsettled the state file's copy is loaded, and once it settles its new record wins."""
    rng = np.random.default_rng(11)
    live_part, _ = snapshot.capture_refs(BrokerState(Mode.APRIL, algo(n=2), source())).split()
    stale = complete_group(7, rng)
    store = snapshot.SnapshotStore(tmp_path)
    store.save(live_part, {})
    store.log_groups([(7, stale[:1])])
    store.log.sync()  # the broker dies here: (7, 0) is logged, no durable state knows group 7
    restored = snapshot.SnapshotStore(tmp_path).load()
    assert restored.group_ids.tolist() == [] and len(restored.samples) == 0

    again = complete_group(7, rng)  # group 7 issued again: (7, 0) running, (7, 1) finished
    running = dataclasses.replace(again[0], status=SampleStatus.RUNNING, finish_reason=FinishReason.NONE)
    store = snapshot.SnapshotStore(tmp_path, trusted=restored.complete_order)
    assert not store.log.holds((7, 0))
    groups = [(7, [running, again[1]])]
    unsettled, settled = snapshot.partition(groups, held=())
    assert [s.key for s in unsettled] == [(7, 0)] and list(settled) == [7]
    with_7 = dataclasses.replace(
        live_part,
        samples=SampleBatch.from_samples(unsettled),
        group_ids=np.array([7], np.int64),
        group_cursors=np.array([0], np.int64),
    )
    store.save(with_7, settled)
    loaded = {s.key: s for s in snapshot.SnapshotStore(tmp_path).load().samples.to_samples()}
    assert_samples_equal(loaded[(7, 0)], running)  # the state file's, not the dead broker's record
    assert_samples_equal(loaded[(7, 1)], again[1])

    settles = dataclasses.replace(with_7, samples=SampleBatch.from_samples([]))  # (7, 0) settled
    store.save(settles, {7: again})
    loaded = {s.key: s for s in snapshot.SnapshotStore(tmp_path).load().samples.to_samples()}
    for key, sample in zip([(7, 0), (7, 1)], again, strict=True):
        assert_samples_equal(loaded[key], sample)  # its new record, newer than the dead broker's


def test_a_format_2_state_file_holding_every_live_sample_still_loads(tmp_path: Path) -> None:
    """State files of the previous format hold the settled samples of live groups themselves: they load
    as they are, and the next snapshot moves those samples to the log."""
    state = make_state(Mode.ASYNC, b=2, n=3)
    d = Driver(state)
    d.take(credit=6)
    d.finish(d.lease_of((0, 0)))
    d.finish(d.lease_of((1, 1)))
    full = snapshot.capture(state)
    frames = codec.encode_frames(2, snapshot.SNAPSHOT_KIND, full)
    (tmp_path / snapshot.FILE_NAME).write_bytes(complete_log.frames_bytes(frames))
    assert state_file_keys(tmp_path)[0] == sorted(s.key for g in state.groups.values() for s in g.samples)
    restored = snapshot.restore(snapshot.read(tmp_path), state.mode, state.algo, source())
    assert_same_books(state, restored)
    snapshot.write(snapshot.capture(restored), tmp_path, snapshot.restored_groups(restored))
    assert sorted(logged_keys(tmp_path)) == [(0, 0), (1, 1)]
    assert_same_books(state, snapshot.restore(snapshot.read(tmp_path), state.mode, state.algo, source()))


def test_settled_samples_handed_over_one_at_a_time_are_each_logged_once(tmp_path: Path) -> None:
    """The server hands each sample to the log as it settles: every one is logged, none twice, also when
    a hand-over repeats one already logged, and a snapshot of the complete group then adds nothing."""
    rng = np.random.default_rng(12)
    group = complete_group(3, rng)
    store = snapshot.SnapshotStore(tmp_path)
    store.log_groups([(3, group[1:2])])
    store.log_groups([(3, group[0:1]), (3, group[1:2])])
    assert sorted(logged_keys(tmp_path)) == [(3, 0), (3, 1)]
    live_part, _ = snapshot.capture_refs(BrokerState(Mode.APRIL, algo(n=2), source())).split()
    store.save(dataclasses.replace(live_part, complete_order=[3]), {3: group})
    assert sorted(logged_keys(tmp_path)) == [(3, 0), (3, 1)]
    for x, y in zip(loaded_groups(tmp_path)[3], group, strict=True):
        assert_samples_equal(x, y)


def test_a_result_logged_as_received_is_one_record_and_a_snapshot_adds_nothing_to_it(tmp_path: Path) -> None:
    """A whole result, every sample settled, is logged with the arrays the worker sent (one record, no
    gathering sample by sample); the snapshot that then refers to its groups as complete writes no record
    again, and a restart loads every sample field by field."""
    rng = np.random.default_rng(13)
    groups = {gid: complete_group(gid, rng) for gid in range(8)}
    received = SampleBatch.from_samples([s for gid in (5, 2, 7) for s in groups[gid]])
    writer = SnapshotWriter(tmp_path)
    try:
        writer.log_received(received)
        deadline = time.monotonic() + 60
        while not all(writer.store.log.holds((gid, i)) for gid in (2, 5, 7) for i in (0, 1)):
            assert time.monotonic() < deadline, "the writer did not log the result"
            time.sleep(0.01)
        [segment] = tmp_path.glob("complete.*.log")
        assert segment_records(segment) == [[2, 5, 7]]
        assert logged_keys(tmp_path) == [s.key for s in received.to_samples()]
        refs = snapshot.capture_refs(BrokerState(Mode.APRIL, algo(n=2), source()))
        held = {gid: groups[gid] for gid in (2, 5, 7, 0)}  # group 0 never went through log_received
        refs = dataclasses.replace(refs, groups=list(held.items()), complete_order=list(held))
        assert writer.wait(writer.submit(refs), timeout=60)
    finally:
        writer.close()
    assert writer.error is None
    assert segment_records(segment) == [[2, 5, 7], [0]]
    by_gid = loaded_groups(tmp_path)
    assert sorted(by_gid) == [0, 2, 5, 7]
    for gid, samples in by_gid.items():
        for x, y in zip(samples, groups[gid], strict=True):
            assert_samples_equal(x, y)


def test_the_snapshot_writer_gathers_the_unacked_batch_for_its_message_once(tmp_path: Path) -> None:
    """A snapshot holding an unacked batch leaves its samples gathered into the message's columns (off the
    poll loop), equal field by field to gathering them in place; another batch id gets none, and a later
    snapshot of the same batch keeps the columns it has."""
    d = mid_run_april()
    batch = d.state.batch
    assert batch is not None
    writer = SnapshotWriter(tmp_path)
    try:
        assert writer.batch_columns(batch.batch_id) is None  # nothing durable yet
        assert writer.wait(writer.submit(snapshot.capture_refs(d.state)), timeout=60)
        columns = writer.batch_columns(batch.batch_id)
        assert columns is not None and writer.batch_columns(batch.batch_id + 1) is None
        for x, y in zip(columns.to_samples(), batch.samples, strict=True):
            assert_samples_equal(x, y)
        assert writer.wait(writer.submit(snapshot.capture_refs(d.state)), timeout=60)
        assert writer.batch_columns(batch.batch_id) is columns
    finally:
        writer.close()
    assert writer.error is None


def test_a_segment_outliving_the_newer_copy_of_one_of_its_samples_is_deleted_cleanly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sample logged twice (a restored broker logs it again): the newer record's segment dies first
    while the older one is kept by another live group; deleting the older one later must not trip on the
    sample whose newest record is already gone."""
    monkeypatch.setattr(complete_log, "SEGMENT_MIN_SAMPLES", 1)  # every append starts a segment
    rng = np.random.default_rng(14)
    one, two, three = (complete_group(gid, rng) for gid in (1, 2, 3))
    log = complete_log.CompleteLog(tmp_path)
    log.append(complete_log.encode_groups([(1, one), (2, two)]), live=0)  # segment 0
    log.append(complete_log.encode_groups([(1, one)]), live=0)  # segment 1: group 1 again, newer
    log.append(complete_log.encode_groups([(3, three)]), live=0)  # segment 2, the current one
    log.drop_dead({2, 3})  # group 1 is dead: segment 1 goes, segment 0 stays for group 2
    assert sorted(p.name for p in tmp_path.glob("complete.*.log")) == [
        "complete.00000000.log",
        "complete.00000002.log",
    ]
    log.drop_dead({3})
    assert [p.name for p in tmp_path.glob("complete.*.log")] == ["complete.00000002.log"]
    assert not log.holds((1, 0)) and not log.holds((2, 0)) and log.holds((3, 1))
    assert sorted(log.read({3})) == [(3, 0), (3, 1)]
