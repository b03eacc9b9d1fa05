"""The journal of the broker's books (broker/journal.py): a restart restores the books as they were at the
last durable write of the journal, whatever the snapshot interval.

Property tests (hypothesis): the books driven by workers returning episodes (tests/test_snapshot_episodes.py's
driver: partials with observations and states, finished and failed samples), with reclaims, rounds,
aborts, batches trained and weights published, in every mode and prompt order; the journal handed to the
log and made durable at random moments (the snapshot writer's turn), state files written at others, and
the broker "killed" at any moment, sometimes in the middle of appending a record. The restored books
(state file + journal) equal the books at the last durable write, sample for sample and counter for
counter; the restarted books then take the results of the leases the dead broker granted after that
write (its workers send them again) and go on.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from unittest import mock

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from test_broker_state import Driver, source
from test_snapshot_episodes import EpisodeDriver, assert_identical_books

from april.config import AlgoConfig, Mode, PromptOrder
from april.records import SETTLED, FinishReason, Sample, SampleStatus
from april.wire_records import SampleBatch
from broker import complete_log, journal, snapshot
from broker.journal import Journal
from broker.modes import policy_for
from broker.result_check import ResultRejected, check_continues
from broker.state import BrokerState

MAX_NEW = 24
OPERATIONS = (
    ["take"] * 3
    + ["finish"] * 2
    + ["interrupt"] * 3
    + ["fail", "reclaim", "round", "train", "abort", "resend", "lose"]
    + ["flush"] * 3
    + ["save", "crash"]
)


def make_algo(order: PromptOrder) -> AlgoConfig:
    return AlgoConfig(
        rollout_batch_size=1,
        over_sampling_batch_size=3,
        n_samples_per_prompt=2,
        max_new_tokens=MAX_NEW,
        max_staleness=2,
        prompt_order=order,
        prompt_window=3,
    )


class Workers(EpisodeDriver):
    """The driver's workers keep each result they return until a durable write acknowledges it."""

    def __init__(self, state: BrokerState, data: st.DataObject) -> None:
        super().__init__(state, data)
        self.unacked: list[tuple[str, int, Sample]] = []  # (worker, lease id, sample) in the order sent
        self.returned: list[tuple[str, int, Sample]] = []  # every result the books took

    def result(
        self,
        lease_id: int,
        tokens: int = 2,
        finish: FinishReason = FinishReason.STOP,
        reward: float | None = None,
    ) -> Sample:
        worker = self.held[lease_id][0]
        out = super().result(lease_id, tokens, finish, reward)
        self.unacked.append((worker, lease_id, out))
        self.returned.append((worker, lease_id, out))
        return out

    def fail(self, lease_id: int) -> Sample:
        worker = self.held[lease_id][0]
        out = super().fail(lease_id)
        self.unacked.append((worker, lease_id, out))
        self.returned.append((worker, lease_id, out))
        return out


class Run:
    """The books of a broker with its journal and its log directory; `flush` is the snapshot writer's
    turn (settled samples, then the journal as one record, then fsync), `durable` the books as of it."""

    def __init__(self, directory: Path, mode: Mode, order: PromptOrder, data: st.DataObject) -> None:
        self.directory, self.mode, self.order, self.data = directory, mode, order, data
        self.state = BrokerState(mode, make_algo(order), source())
        self.state.journal = Journal()
        self.driver = Workers(self.state, data)
        self.store = snapshot.SnapshotStore(directory)
        self.settled: list[Sample] = []  # settled since the last flush, for the log's data records
        self.durable: snapshot.BrokerSnapshot | None = None  # the books at the last durable write
        self.saved = False  # a state file exists

    def expected(self) -> BrokerState:
        assert self.durable is not None
        return snapshot.restore(self.durable, self.mode, self.state.algo, source())

    def flush(self) -> None:
        settled = [s for s in self.settled if s.group_id in self.state.groups]
        kept = [self.state.groups[s.group_id].samples[s.index] for s in settled]  # with their lease spans
        if settled and self.data.draw(st.booleans(), label="settled logged as data"):
            if self.data.draw(st.booleans(), label="as received"):  # as broker.server logs a whole result
                self.store.log_received([SampleBatch.from_samples(settled).with_leases(kept)])
            else:
                self.store.log_groups([(s.group_id, [s]) for s in kept])
        self.settled = []
        assert self.state.journal is not None
        self.store.log_journal(self.state.journal.take())
        self.store.log.sync()
        self.durable = snapshot.capture(self.state)
        self.driver.unacked = []  # acknowledged

    def save(self) -> None:
        assert self.state.journal is not None
        self.flush()
        live, settled = snapshot.capture_refs(self.state).split()
        self.store.make_durable(live, settled)
        self.store.compact(settled.keys())
        self.saved = True

    def crash(self) -> None:
        """The broker dies (its journal's tail not yet flushed is lost, maybe half a record on disk) and
        restarts from its files; the restarted books must equal those of the last durable write."""
        assert self.state.journal is not None
        tail = self.state.journal.take()
        segments = sorted(self.directory.glob("complete.*.log"))
        if tail and segments and self.data.draw(st.booleans(), label="torn record"):
            record = complete_log.frames_bytes(journal.encode(tail, self.store.log.holds))
            with open(segments[-1], "ab") as f:  # where the writer was appending when it died
                f.write(record[: self.data.draw(st.integers(1, len(record) - 1), label="torn at")])
        restored = snapshot.resume(self.directory, self.mode, self.state.algo, source())
        expected = self.expected()
        assert_identical_books(expected, restored)
        assert snapshot.counters_of(expected) == snapshot.counters_of(restored)
        trusted = snapshot.restored_groups(restored)
        snapshot.write(snapshot.capture(restored), self.directory, trusted)  # the new epoch, at once
        self.store = snapshot.SnapshotStore(self.directory, trusted)
        restored.journal = Journal()
        lost = {lid: held for lid, held in self.driver.held.items() if lid not in restored.leases}
        for lease_id in lost:
            del self.driver.held[lease_id]
        self.state = self.driver.state = restored
        self.durable = snapshot.capture(restored)
        self.settled = []
        listed = set(self.driver.held) | {lease_id for _, lease_id, _ in self.driver.unacked}
        for lease_id in [lid for lid in restored.leases if lid not in listed]:
            restored.reclaim(lease_id)  # the hellos name what the workers hold: the others go back
        for worker, lease_id, sample in self.driver.unacked:  # sent again, in order, after the hello
            self.resend(worker, lease_id, sample)
        self.driver.unacked = []
        self.driver.returned = []  # those the restarted books took are sent again as duplicates only
        for lease_id, held in lost.items():  # their workers send back what they made of them
            self.driver.held[lease_id] = held
            self.return_lost(lease_id)
        self.driver.check()

    def resend(self, worker: str, lease_id: int, sample: Sample) -> None:
        """An unacknowledged result sent again to the restarted books: taken (its lease is known, or made
        again), or refused without a change."""
        before = snapshot.counters_of(self.state)
        try:
            self.state.accept_result(worker, lease_id, sample)
            event("an unacknowledged result taken again")
        except ResultRejected as exc:
            event(f"an unacknowledged result refused: {exc.reason}")
            assert exc.reason in ("not_leased", "duplicate")
            assert snapshot.counters_of(self.state) == before
        self.state.check_ledger()

    def return_lost(self, lease_id: int) -> None:
        """A worker's result for a lease the restarted books do not know: taken if the sample waits as
        it was leased (and nobody holds it), else refused, the books unchanged."""
        _, leased, _ = self.driver.held[lease_id]
        group = self.state.groups.get(leased.group_id)
        now = group.samples[leased.index] if group is not None else None
        waits = now is not None and now.status in (SampleStatus.PENDING, SampleStatus.INTERRUPTED)
        before = snapshot.capture(self.state)
        try:
            out = self.driver.interrupt(lease_id)
            event("a lost lease's result taken")
            assert waits and now is not None  # and it continues what waits (the books' own check)
            check_continues(now, out, MAX_NEW, self.state.version)
        except ResultRejected as exc:
            event(f"a lost lease's result refused: {exc.reason}")
            self.driver.held.pop(lease_id, None)
            assert exc.reason in ("not_leased", "duplicate")
            assert snapshot.counters_of(self.state) == before.counters and self.state.issued == before.issued


def train(run: Run, step: int) -> bool:
    """The learner's step as the server runs it: a batch formed is durable (a state file) before it is
    sent; acked, the next weights published (async aborts what is leased)."""
    d, state = run.driver, run.state
    batch = state.form_batch(step)
    d.check()
    if batch is None:
        return False
    run.save()
    assert state.ack_batch(batch.batch_id, slots=8)
    assert state.set_weights(state.version + 1, f"v{state.version + 1}", "sha")
    run.flush()  # a version is durable before the workers hear of it (the server waits for it)
    if policy_for(state.mode).abort_on_new_version:
        d.interrupt_all()
    d.check()
    return True


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    mode=st.sampled_from(list(Mode)),
    order=st.sampled_from([PromptOrder.ISSUE, PromptOrder.SHORTEST_FIRST]),
    data=st.data(),
)
def test_a_restart_restores_the_books_of_the_last_durable_write(
    mode: Mode, order: PromptOrder, data: st.DataObject
) -> None:
    with tempfile.TemporaryDirectory() as tmp, mock.patch.object(complete_log, "SEGMENT_MIN_SAMPLES", 2):
        run = Run(Path(tmp), mode, order, data)
        d = run.driver
        step = 0
        crashes = 0
        for _ in range(data.draw(st.integers(5, 40), label="operations")):
            d = run.driver
            state = run.state
            lease_id = data.draw(st.sampled_from(sorted(d.held)), label="lease") if d.held else None
            op = data.draw(st.sampled_from(OPERATIONS), label="operation")
            if op == "take":
                d.take(credit=data.draw(st.integers(1, 4)), worker=data.draw(st.sampled_from(["w0", "w1"])))
            elif op in ("finish", "interrupt") and lease_id is not None:
                out = d.finish(lease_id) if op == "finish" else d.interrupt(lease_id)
                if out.status in SETTLED:
                    run.settled.append(out)
            elif op == "fail" and lease_id is not None and data.draw(st.integers(0, 3)) == 0:
                d.fail(lease_id)
            elif op == "reclaim" and lease_id is not None:
                d.reclaim(lease_id)
            elif op == "lose":  # a worker lost: its pinned partials restart from their prompt (journaled)
                lost = d.lose(data.draw(st.sampled_from(["w0", "w1"]), label="lost worker"))
                event(f"pinned partials restarted: {min(lost, 2)}")
            elif op == "round" and policy_for(mode).round_based:
                d.end_round()
            elif op == "train" and train(run, step):
                step += 1
            elif op == "abort":
                state.begin_abort()
                if data.draw(st.booleans()):
                    state.end_abort()
            elif op == "resend" and d.returned:  # a result sent again: a duplicate, nothing changes
                worker, sent_lease, sample = data.draw(st.sampled_from(d.returned), label="resent")
                before = snapshot.capture(state)
                with pytest.raises(ResultRejected) as exc:
                    state.accept_result(worker, sent_lease, sample)
                assert exc.value.reason in ("duplicate", "not_leased")
                event(f"resent: {exc.value.reason}")
                assert snapshot.counters_of(state) == before.counters
                d.check()
            elif op == "flush":
                run.flush()
            elif op == "save":
                run.save()
            elif op == "crash" and run.saved:
                run.crash()
                crashes += 1
        event(f"crashes: {min(crashes, 3)}")
        if run.saved:
            run.crash()


def test_a_result_of_a_lost_lease_is_taken_once_and_a_resend_of_it_is_a_duplicate(tmp_path: Path) -> None:
    """The broker grants a lease and dies before its journal reaches the disk: restarted, it does not
    know the lease, but the worker's result continues the sample as the books have it waiting, so it is
    taken (the lease made again under its id, and journaled); the same result sent again (the worker did
    not get its acknowledgement) is a duplicate; a result that does not continue it is not_leased."""
    state = BrokerState(Mode.ASYNC, make_algo(PromptOrder.ISSUE), source())
    state.journal = Journal()
    d = Driver(state)
    store = snapshot.SnapshotStore(tmp_path)
    first = d.take(credit=2)
    d.interrupt(first[0][0], tokens=3)
    live, settled = snapshot.capture_refs(state).split()
    store.log_journal(state.journal.take())
    store.make_durable(live, settled)
    (lost_id, _, lost_sample), *_ = d.take(credit=1)  # leased; the broker dies before the journal is flushed
    restored = snapshot.resume(tmp_path, Mode.ASYNC, state.algo, source())
    assert lost_id not in restored.leases and restored.epoch == 1
    restored.journal = Journal()
    worker, leased, _ = d.held.pop(lost_id)
    assert leased.key == lost_sample.key
    out = leased.extend([5, 6], [-0.5, -0.5], 0, FinishReason.ABORT)
    restored.accept_result(worker, lost_id, out)
    assert restored.groups[out.group_id].samples[out.index].response_len == out.response_len
    events = restored.journal.take()
    assert [e[0] for e in events] == [journal.Op.LEASE, journal.Op.RESULT]
    with pytest.raises(ResultRejected) as exc:
        restored.accept_result(worker, lost_id, out)
    assert exc.value.reason == "duplicate"
    stale = leased.extend([7], [-0.5], 0, FinishReason.ABORT)  # made from the same lease: not a later state
    with pytest.raises(ResultRejected) as exc:
        restored.accept_result(worker, lost_id, stale)
    assert exc.value.reason == "not_leased"
    restored.check_ledger()
