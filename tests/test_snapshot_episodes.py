"""Episodes in the broker's books survive snapshots, restarts and the log's compaction bit for bit.

A partial episode (its observation spans and episode state with it) lives in the state file, a settled
one in the log of settled samples, and a leased one in the lease table as leased; each must come back
exactly, so that any worker can continue it. Property tests (hypothesis): the books driven with
episodes a worker's episode driver could return (model turns, observations and new states in random
order, within the lease's budget), snapshotted, restored and driven on as a restarted broker would be;
and settled episodes through the log alone, its segments compacted.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from unittest import mock

from episode_samples import LOGPROBS, TOKENS, episodes
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from test_broker_state import Driver, algo, assert_same_books, source
from test_snapshot_formats import assert_identical

from april.config import Mode
from april.episode import EpisodeState, live_state
from april.records import SETTLED, FinishReason, Sample
from april.wire_records import SampleBatch
from broker import complete_log, snapshot
from broker.modes import policy_for
from broker.state import BrokerState, PendingBatch

MAX_NEW = 24
# what the test does next, as often as listed: mostly leases and results, so that saves find episodes
OPERATIONS = (
    ["take"] * 3
    + ["finish"] * 2
    + ["interrupt"] * 3
    + ["fail", "reclaim", "round", "train", "lose"]
    + ["save"] * 2
)


def event_of_episodes(where: str, samples: list[Sample]) -> None:
    """Tell hypothesis's statistics how many samples of a save held an episode's observations and state."""
    n = sum(1 for s in samples if s.observations and s.episode)
    event(f"{where}: {'none' if n == 0 else 'some' if n < 4 else '4 or more'} with observations and state")


@st.composite
def worker_turns(draw: st.DrawFn, leased: Sample, version: int, budget: int) -> Sample:
    """What an episode driver on weights `version` makes of `leased` with at most `budget` new response
    tokens: model turns, observations and new episode states in random order; still RUNNING."""
    sample, left = leased, budget
    for _ in range(draw(st.integers(0, 8), label="steps")):
        step = draw(st.sampled_from(["model", "observation", "state"]), label="step")
        if step == "state":
            # sometimes a state kept in the worker's memory: the partial is then pinned to that worker
            live = EpisodeState(live_state(f"h{sample.group_id}-{sample.index}")).to_bytes()
            state = draw(st.one_of(st.binary(max_size=24), st.just(live)), label="episode state")
            sample = sample.with_episode(state)
            continue
        n = min(left, draw(st.integers(0, 4), label="tokens"))
        ids = draw(st.lists(TOKENS, min_size=n, max_size=n), label="ids")
        if step == "model":
            lps = draw(st.lists(LOGPROBS, min_size=n, max_size=n), label="logprobs")
            sample = sample.extend(ids, lps, version, FinishReason.NONE)
        else:
            sample = sample.observed(ids)
        left -= n
    return sample


class EpisodeDriver(Driver):
    """The test's `Driver` whose workers return episodes drawn by hypothesis."""

    def __init__(self, state: BrokerState, data: st.DataObject) -> None:
        super().__init__(state)
        self.data = data

    def result(
        self,
        lease_id: int,
        tokens: int = 2,
        finish: FinishReason = FinishReason.STOP,
        reward: float | None = None,
    ) -> Sample:
        worker, leased, budget = self.held.pop(lease_id)
        version = self.state.version
        out = self.data.draw(worker_turns(leased, version, budget), label="turns")
        if finish == FinishReason.ABORT:
            out = out.extend([], [], version, finish)
        else:  # a last model turn, if the budget leaves room for it
            n = min(1, budget - (out.response_len - leased.response_len))
            out = out.extend([7] * n, [-0.25] * n, version, finish).scored(float(leased.index % 2))
        self.state.accept_result(worker, lease_id, out)
        self.check()
        return out


def every_sample(state: BrokerState) -> list[Sample]:
    return sorted((s for g in state.groups.values() for s in g.samples), key=lambda s: s.key)


def assert_identical_books(a: BrokerState, b: BrokerState) -> None:
    """The same books, and every sample in them (groups, leases, the unacked batch) equal bit for bit."""
    assert_same_books(a, b)
    assert_identical(every_sample(b), every_sample(a))
    assert_identical(*[[x.leases[lease_id].at_lease for lease_id in sorted(x.leases)] for x in (b, a)])
    batches: list[PendingBatch | None] = [a.batch, b.batch]
    assert_identical(*[[] if x is None else x.samples for x in batches])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mode=st.sampled_from(list(Mode)), data=st.data())
def test_episodes_survive_snapshots_restarts_and_log_compaction(mode: Mode, data: st.DataObject) -> None:
    with tempfile.TemporaryDirectory() as tmp, mock.patch.object(complete_log, "SEGMENT_MIN_SAMPLES", 2):
        directory = Path(tmp)
        state = BrokerState(mode, algo(b=1, over=3, n=2, eta=2, max_new=MAX_NEW), source())
        d = EpisodeDriver(state, data)
        store = snapshot.SnapshotStore(directory)
        step = 0
        for _ in range(data.draw(st.integers(5, 30), label="operations")):
            lease_id = data.draw(st.sampled_from(sorted(d.held)), label="lease") if d.held else None
            op = data.draw(st.sampled_from(OPERATIONS), label="operation")
            if op == "take":
                d.take(credit=data.draw(st.integers(1, 4)), worker=data.draw(st.sampled_from(["w0", "w1"])))
            elif op in ("finish", "interrupt") and lease_id is not None:
                out = d.finish(lease_id) if op == "finish" else d.interrupt(lease_id)
                if out.status in SETTLED and out.group_id in state.groups and data.draw(st.booleans()):
                    kept = state.groups[out.group_id].samples[out.index]  # with the books' lease span
                    # as the server logs results: the arrays as they came, the books' lease spans
                    store.log_received([SampleBatch.from_samples([out]).with_leases([kept])])
            elif op == "fail" and lease_id is not None and data.draw(st.integers(0, 3)) == 0:
                d.fail(lease_id)  # it drops its group: rarely, or little would be trained
            elif op == "reclaim" and lease_id is not None:
                d.reclaim(lease_id)
            elif op == "lose":  # a worker lost: its pinned partials restart from their prompt
                lost = d.lose(data.draw(st.sampled_from(["w0", "w1"]), label="lost worker"))
                event(f"pinned partials restarted: {min(lost, 2)}")
            elif op == "round" and policy_for(mode).round_based:
                d.end_round()
            elif op == "train" and d.train(step) is not None:
                step += 1
            elif op == "save":  # a snapshot; then, maybe, a restart from it
                live, settled = snapshot.capture_refs(state).split()
                store.save(live, settled)
                event_of_episodes("state file", [*live.samples.to_samples(), *live.leased_at.to_samples()])
                event_of_episodes("log", [s for samples in settled.values() for s in samples])
                restored = snapshot.restore(snapshot.read(directory), mode, state.algo, source())
                assert_identical_books(state, restored)
                if data.draw(st.booleans(), label="restart"):
                    d.state = state = restored
                    store = snapshot.SnapshotStore(directory, snapshot.restored_groups(restored))
                    d.check()
        for _ in range(4):  # drain, on the books as they are now
            d.take()
            d.finish_all()
            d.end_round()
            d.train(step)
        live, settled = snapshot.capture_refs(state).split()
        store.save(live, settled)
        assert_identical_books(state, snapshot.restore(snapshot.read(directory), mode, state.algo, source()))
        state.check_ledger()


@settings(max_examples=80, deadline=None)
@given(data=st.data())
def test_settled_episodes_survive_the_log_and_its_compaction(data: st.DataObject) -> None:
    """Settled episodes appended in records of several groups (as handed over, and as workers returned
    them), one segment per append; then the log is compacted down to a random set of live groups, which
    copies their records as they are or encodes them again: every live sample reads back bit for bit
    (and any dead one the newest segment still holds)."""
    groups = {
        gid: [data.draw(episodes(gid, i, finished=True), label="episode") for i in range(n)]
        for gid, n in enumerate(
            data.draw(st.lists(st.integers(1, 3), min_size=3, max_size=10), label="groups")
        )
    }
    appends = data.draw(st.lists(st.integers(1, 4), min_size=len(groups), max_size=len(groups)), label="cuts")
    live = data.draw(st.sets(st.sampled_from(sorted(groups)), min_size=1, max_size=2), label="live groups")
    with tempfile.TemporaryDirectory() as tmp, mock.patch.object(complete_log, "SEGMENT_MIN_SAMPLES", 1):
        directory = Path(tmp)
        log = complete_log.CompleteLog(directory)
        pending = sorted(groups)
        for cut in appends:
            now, pending = pending[:cut], pending[cut:]
            if not now:
                break
            if data.draw(st.booleans(), label="as returned"):
                batch = SampleBatch.from_samples([s for gid in now for s in groups[gid]])
                log.append([complete_log.encode_batch(batch)], live=0)
            else:
                log.append(complete_log.encode_groups([(gid, groups[gid]) for gid in now]), live=0)
        for gid in pending:
            log.append(complete_log.encode_groups([(gid, groups[gid])]), live=0)
        every = [s for gid in sorted(groups) for s in groups[gid]]
        read = complete_log.CompleteLog(directory).read(set(groups))
        assert_identical([read[s.key] for s in every], every)
        with mock.patch.object(complete_log, "encode_groups", wraps=complete_log.encode_groups) as encode:
            log.drop_dead(live)
        event(f"compaction encoded records again: {encode.called}")
        read = complete_log.CompleteLog(directory).read(set(groups))
        assert {s.key for gid in live for s in groups[gid]} <= set(read)  # the newest segment keeps dead ones
        by_key = {s.key: s for s in every}
        assert_identical([read[key] for key in sorted(read)], [by_key[key] for key in sorted(read)])
