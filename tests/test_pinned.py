"""Pinned partials (docs/protocol.md, "Pinned partials"): an interrupted episode whose environment state is
kept in its worker's memory waits for that worker alone, and restarts from its prompt when that worker is
lost. The broker core driven event by event: leased back only to its worker (when it has credit, never to
another, taking no one's share), restarted when the worker is lost or comes back as a new process, kept
when the same process says hello again; the books balance throughout and the restarts are counted by
cause; a restarted broker (state file + journal) keeps the pins and the restarts.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
from test_broker_core import core_of, hello

from april import protocol
from april.config import Mode
from april.data import SyntheticPromptSource
from april.episode import EpisodeState, holds_live_state, live_state
from april.records import FinishReason, Sample, SampleStatus
from broker import snapshot
from broker.core import BrokerCore
from broker.decisions import LeaseOut, WorkerLost
from broker.journal import Journal

NO_LEASES = np.zeros(0, dtype=np.int64)


def live(sample: Sample, tokens: int = 3) -> Sample:
    """`sample` back from its worker interrupted after `tokens` tokens, its state kept in that worker."""
    out = sample.extend([5] * tokens, [-0.5] * tokens, 0, FinishReason.ABORT)
    return out.with_episode(EpisodeState(live_state(f"h{sample.key}"), turns=1).to_bytes())


def written(sample: Sample, tokens: int = 3) -> Sample:
    """The same with a state written down in full: it resumes anywhere."""
    out = sample.extend([5] * tokens, [-0.5] * tokens, 0, FinishReason.ABORT)
    return out.with_episode(EpisodeState('{"board": [1, 2]}', turns=1).to_bytes())


def work_of(decisions: list[object]) -> dict[str, list[tuple[int, int, Sample]]]:
    return {d.worker_id: list(d.work) for d in decisions if isinstance(d, LeaseOut)}


def two_workers() -> tuple[BrokerCore, dict[str, list[tuple[int, int, Sample]]]]:
    """An async core with w0 and w1 (2 slots each), both leased two fresh samples."""
    core = core_of(Mode.ASYNC, rollout_batch_size=2, over_sampling_batch_size=4, max_staleness=4)
    core.on_hello(hello("w0", 2), 0.0)
    core.on_hello(hello("w1", 2), 0.0)
    work = work_of(core.tick(0.1))
    assert sorted(work) == ["w0", "w1"] and all(len(w) == 2 for w in work.values())
    return core, work


def test_a_pinned_partial_is_leased_only_to_its_worker_and_takes_no_ones_share() -> None:
    core, work = two_workers()
    back = [live(s) for _, _, s in work["w0"]]
    core.on_samples("w0", [lid for lid, _, _ in work["w0"]], back, 0, 0.2)  # w0 grants no slot yet
    assert set(core.state.pinned) == {s.key for s in back} and set(core.state.pinned.values()) == {"w0"}
    assert core.state.partial_samples() and core.view(0.2).books.pinned == {"w0": 2}
    w1 = [lid for lid, _, _ in work["w1"]]
    out = core.on_samples("w1", w1, [written(s) for _, _, s in work["w1"]], 2, 0.3)  # w1 has 2 free slots
    given = work_of(out)["w1"]
    assert {s.key for _, _, s in given}.isdisjoint(core.state.pinned)  # never w0's pins
    assert {s.key for _, _, s in given} == {s.key for _, _, s in work["w1"]}  # its own partials, anywhere
    assert len(core.state.pinned) == 2
    core.state.check_ledger()
    got = work_of(core.on_credit("w0", 2) + core.tick(0.4))["w0"]
    assert sorted(s.key for _, _, s in got) == sorted(s.key for s in back)  # back where their state is
    assert all(s.response_len == 3 and holds_live_state(s.episode) for _, _, s in got)
    assert not core.state.pinned and core.state.totals.restarted == 0


def test_a_lost_worker_s_pinned_partials_restart_from_their_prompt() -> None:
    core, work = two_workers()
    back = [live(s, tokens=4) for _, _, s in work["w0"]]
    core.on_samples("w0", [lid for lid, _, _ in work["w0"]], back, 0, 0.2)
    out = core.on_worker_lost("w0")
    assert any(isinstance(d, WorkerLost) for d in out)
    assert not core.state.pinned
    for s in back:
        now = core.state.groups[s.group_id].samples[s.index]
        assert now.status == SampleStatus.PENDING and now.response_len == 0 and now.episode == b""
        assert s.key in core.state.queue.ordered()  # anyone's now
    assert (core.state.totals.restarted, core.state.totals.tokens_restarted) == (2, 8)
    assert core.state.restarts == {"worker_lost": 2}
    core.state.check_ledger("after the restarts")
    totals = core.run_totals()
    assert totals["restarted"] == 2 and totals["tokens_restarted"] == 8
    again = core.state.take_work("w1", 10)  # anyone may lease them now, as fresh samples
    assert {s.key for s in back} <= {s.key for _, _, s in again}


def test_a_leased_pinned_partial_of_a_lost_worker_restarts_too() -> None:
    """Leased back to its worker, which dies with it: reclaimed (pinned as it was leased), then
    restarted with the rest of that worker's pins."""
    core, work = two_workers()
    back = [live(s) for _, _, s in work["w0"]]
    core.on_samples("w0", [lid for lid, _, _ in work["w0"]], back, 2, 0.2)
    core.tick(0.3)
    assert len(core.state.leases_of("w0")) == 2 and not core.state.pinned
    for peer in core.workers.peers.values():
        peer.last_seen = 0.3
    core.tick(0.3 + core.workers.window + 1)  # w0 and w1 silent past the window: both lost
    assert core.state.restarts == {"worker_lost": 2} and not core.state.pinned
    core.state.check_ledger()


def test_a_new_process_under_the_same_id_restarts_the_pins_and_the_same_one_keeps_them() -> None:
    core, work = two_workers()
    core.on_samples("w0", [lid for lid, _, _ in work["w0"]], [live(s) for _, _, s in work["w0"]], 0, 0.2)
    core.on_hello(hello("w0", 2), 0.3)  # the same process (pid 1) says hello again
    assert len(core.state.pinned) == 2
    renewed = protocol.WorkerHello("w0", "sim", 2, 0, 2, "node", NO_LEASES)  # pid 2: a new process
    core.on_hello(renewed, 0.4)
    assert not core.state.pinned and core.state.restarts == {"worker_restarted": 2}
    core.state.check_ledger()


def test_a_restarted_broker_keeps_the_pins_and_the_restarts(tmp_path: Path) -> None:
    """State file + journal: pins come back with their worker, a journaled restart is replayed, and the
    pin holder is registered as a restored worker (lost if it never comes back)."""
    core, work = two_workers()
    state = core.state
    state.journal = Journal()
    store = snapshot.SnapshotStore(tmp_path)
    live_w0 = [live(s) for _, _, s in work["w0"]]
    core.on_samples("w0", [lid for lid, _, _ in work["w0"]], live_w0, 0, 0.2)
    store.log_journal(state.journal.take())
    live_parts, settled = snapshot.capture_refs(state).split()
    store.make_durable(live_parts, settled)  # a state file with w0's pins
    core.on_samples("w1", [lid for lid, _, _ in work["w1"]], [live(s) for _, _, s in work["w1"]], 0, 0.3)
    core.on_worker_lost("w1")  # its pins restart: journaled after the state file
    store.log_journal(state.journal.take())
    store.log.sync()
    restored = snapshot.resume(tmp_path, Mode.ASYNC, state.algo, SyntheticPromptSource(50))
    assert restored.pinned == {s.key: "w0" for s in live_w0} == state.pinned
    assert restored.restarts == state.restarts == {"worker_lost": 2}
    assert restored.totals.restarted == 2
    again = BrokerCore(core.config, restored, (), 1.0, restored=True)
    assert again.workers.get("w0") is not None and again.workers.peers["w0"].restored
    again.on_hello(hello("w0", 2), 1.1)  # it comes back (after a broker restart, the pid is unknown)
    got = work_of(again.tick(1.2))["w0"]
    assert {s.key for s in live_w0} <= {s.key for _, _, s in got}
