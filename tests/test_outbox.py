"""The worker's outbox (`actors/outbox.py`, `worker.result_hold_ms`): results and freed slots held up to
the hold and sent as one message, never overtaken by a later message of the worker, never forgotten by a
hello; with the hold 0 (the default) every result and credit leaves at once, as before.

The outbox alone and the worker's send path are driven on a clock the test sets (nothing here depends on
how fast the machine is); the last test runs the real worker loop against a bare ZeroMQ broker."""

from __future__ import annotations

import dataclasses
import types

import numpy as np
import pytest
from harness import wait_for
from scripted_engine import EngineScript, response_length
from test_engine_failures import PROMPT, SLOTS, HeldRewards, groups_where, lease, results, running_worker
from test_peer_link import FakeClock

from actors.outbox import Outbox
from actors.slot_meter import SlotMeter
from actors.worker import Worker
from april import protocol
from april.config import ConfigError, WorkerConfig
from april.records import FinishReason, Sample, SampleStatus
from april.sim.byte_tokenizer import ByteTokenizer
from april.sim.sample_draw import sample_key
from april.wire_records import SampleBatch


def finished(group_id: int) -> Sample:
    s = Sample(group_id=group_id, index=0, prompt_ids=PROMPT, status=SampleStatus.RUNNING)
    return s.extend([7, 8], [-0.1, -0.2], 0, FinishReason.STOP).scored(1.0)


def test_results_and_credit_held_within_the_hold_leave_as_one_result() -> None:
    box = Outbox(hold_s=0.1, max_samples=8)
    assert not box.due(0.0) and box.wait_s(0.0) is None and box.take() is None
    box.add([], 1, now=0.0)  # a sample finished: its slot is owed from now
    box.add([(11, finished(1))], 0, now=0.03)  # ...and later its scored result
    box.add([(12, finished(2))], 1, now=0.06)
    assert not box.due(0.09) and box.wait_s(0.09) == pytest.approx(0.01)  # the oldest sets the deadline
    assert box.lease_ids() == [11, 12] and box.credit == 2
    assert box.due(0.1) and box.wait_s(0.1) == 0.0
    msg = box.take()
    assert isinstance(msg, protocol.SampleResult)
    assert msg.lease_ids.tolist() == [11, 12] and msg.credit == 2
    assert [(s.group_id, s.reward) for s in msg.samples.to_samples()] == [(1, 1.0), (2, 1.0)]
    assert len(box) == 0 and box.credit == 0 and not box.due(1.0) and box.take() is None


def test_credit_alone_leaves_as_a_lease_request_and_a_full_engine_does_not_wait() -> None:
    box = Outbox(hold_s=0.5, max_samples=2)
    box.add([], 3, now=0.0)
    assert box.take() == protocol.LeaseRequest(3)
    box.add([(1, finished(1))], 0, now=0.0)
    assert not box.due(0.0)
    box.add([(2, finished(2))], 0, now=0.0)  # as many samples as the engine has slots: no reason to wait
    assert box.due(0.0)
    box.add([], 0, now=0.0)  # owing nothing changes nothing
    msg = box.take()
    assert isinstance(msg, protocol.SampleResult) and msg.lease_ids.tolist() == [1, 2] and msg.credit == 0


def test_an_outbox_refuses_what_it_cannot_keep() -> None:
    with pytest.raises(ValueError, match="hold_s"):
        Outbox(hold_s=-1.0, max_samples=1)
    with pytest.raises(ValueError, match="max_samples"):
        Outbox(hold_s=0.0, max_samples=0)
    with pytest.raises(ValueError, match="credit"):
        Outbox(hold_s=0.0, max_samples=1).add([], -1, now=0.0)
    for bad in (-1.0, 1000.5):
        with pytest.raises(ConfigError, match=r"worker.result_hold_ms"):
            WorkerConfig(result_hold_ms=bad)


class SentLink:
    """Stands in for the worker's PeerLink: keeps what the worker sends, in order."""

    def __init__(self) -> None:
        self.sent: list[protocol.Message] = []

    def send(self, msg: protocol.Message) -> None:
        self.sent.append(msg)

    def close(self, linger_ms: int = 0) -> None:
        pass


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    c = FakeClock()
    monkeypatch.setattr("actors.worker.time.monotonic", c)
    return c


def worker_on(hold_ms: float) -> tuple[Worker, SentLink]:
    """A worker with no engine and no connection, whose sends the test reads (SentLink)."""
    worker = Worker(
        WorkerConfig(worker_id="w0", slots=SLOTS, result_hold_ms=hold_ms),
        ByteTokenizer(),
        HeldRewards(),
        None,  # type: ignore[arg-type]
        seed=0,
    )
    worker.link.close(linger_ms=0)  # never connected: the test reads what the worker sends instead
    sent = SentLink()
    worker.link = sent  # type: ignore[assignment]
    return worker, sent


def owe(worker: Worker, items: list[tuple[int, Sample]], credit: int) -> None:
    """The worker owes `items` with `credit` freed slots: the broker's credit is `credit` short of the
    worker's free slots, so its core grants that many."""
    worker.health.down = False  # an engine that serves grants credit
    worker.core.set_credit(worker.core.free() - credit)
    worker._owe(items)


def test_a_holding_worker_sends_what_it_owes_once_due_and_before_anything_else(clock: FakeClock) -> None:
    worker, link = worker_on(hold_ms=100)
    owe(worker, [], 1)  # a finish frees a slot
    clock.now += 0.04
    owe(worker, [(11, finished(1))], 0)  # its scored result
    owe(worker, [(12, finished(2))], 1)  # a failure: result and slot at once
    worker._send_outbox_if_due()
    assert link.sent == []  # nothing is due within the hold
    clock.now += 0.07
    worker._send_outbox_if_due()
    (msg,) = link.sent
    assert isinstance(msg, protocol.SampleResult)
    assert msg.lease_ids.tolist() == [11, 12] and msg.credit == 2
    # held again, then any other message of the worker goes out after it: nothing overtakes a result
    owe(worker, [(13, finished(3))], 1)
    worker._send(protocol.AbortDone(5, SLOTS, np.zeros(0, np.int64)))
    again, done = link.sent[1:]
    assert isinstance(again, protocol.SampleResult) and again.lease_ids.tolist() == [13]
    assert isinstance(done, protocol.AbortDone) and len(worker.outbox) == 0


def test_results_are_kept_until_acknowledged_and_a_hello_sends_them_again(clock: FakeClock) -> None:
    """Every result is numbered and kept until the broker acknowledges it (Lease.acked or ResultAck). A
    hello (a reconnect, or a broker that lost the worker) names the leases of the results held in the
    outbox and of those unacknowledged, says the free slots (so the credit the outbox held is dropped:
    it would count twice), and is followed by every unacknowledged result, in order, without credit."""
    worker, link = worker_on(hold_ms=0)
    worker.engine = types.SimpleNamespace(version=2)  # type: ignore[assignment]
    worker.health.down = False
    owe(worker, [(11, finished(1))], 1)
    owe(worker, [(12, finished(2))], 1)
    first, second = link.sent
    assert isinstance(first, protocol.SampleResult) and isinstance(second, protocol.SampleResult)
    assert (first.seq, second.seq) == (1, 2) and list(worker.unacked) == [1, 2]
    worker._handle(protocol.ResultAck(1))
    assert list(worker.unacked) == [2]
    worker.outbox.hold_s = 1.0  # the next ones are held
    owe(worker, [(13, finished(3))], 1)
    owe(worker, [], 2)
    hello, again = worker._hello()
    assert isinstance(hello, protocol.WorkerHello) and hello.held_leases.tolist() == [12, 13]
    assert hello.credit == SLOTS and worker.outbox.credit == 0  # no lease in the engine: every slot
    assert again == dataclasses.replace(second, credit=0)
    clock.now += 1.0
    worker._send_outbox_if_due()
    third = link.sent[-1]
    assert isinstance(third, protocol.SampleResult) and third.seq == 3 and third.credit == 0
    lease = protocol.Lease(
        np.zeros(0, np.int64), np.zeros(0, np.int32), np.zeros(0, np.uint8), SampleBatch.from_samples([]), 3
    )
    worker._handle(lease)
    assert worker.unacked == {}


def test_usage_reports_while_generating_leave_held_results_held(clock: FakeClock) -> None:
    """A busy engine's usage report goes out every ~0.1 s; cumulative, it commutes with results, so it must
    not send the outbox, or no hold could outlast it."""
    worker, link = worker_on(hold_ms=500)
    link.interval = 1.0  # type: ignore[attr-defined]
    worker.engine = types.SimpleNamespace(active=2)  # type: ignore[assignment]
    worker.meter = SlotMeter(SLOTS, clock.now, worker.cfg.usage_report_s)
    worker.health.come_up()
    owe(worker, [(11, finished(1))], 1)
    for _ in range(3):
        clock.now += 0.15
        worker._meter_usage()
    assert [type(m) for m in link.sent] == [protocol.EngineUsage] * 3
    assert worker.outbox.lease_ids() == [11]  # still held: 0.45 s of a 0.5 s hold


def test_a_worker_without_the_hold_sends_every_result_and_credit_at_once(clock: FakeClock) -> None:
    worker, link = worker_on(hold_ms=0)
    owe(worker, [], 2)
    owe(worker, [(11, finished(1))], 0)
    assert link.sent[0] == protocol.LeaseRequest(2)
    assert isinstance(link.sent[1], protocol.SampleResult) and link.sent[1].lease_ids.tolist() == [11]
    assert len(link.sent) == 2 and worker._idle_wait_ms() == 50  # nothing held: it may block


def test_an_idle_worker_blocks_no_longer_than_its_outbox_may_wait(clock: FakeClock) -> None:
    worker, _ = worker_on(hold_ms=100)
    owe(worker, [(11, finished(1))], 0)
    clock.now += 0.0625
    assert worker._idle_wait_ms() == 38  # 37.5 ms left, rounded up: never woken before it is due
    # a step on its way: it looks every 5 ms, or when a simulated step is due to answer
    worker.episodes = types.SimpleNamespace(busy=True, next_answer_s=lambda: None)  # type: ignore[assignment]
    assert worker._idle_wait_ms() == 5
    worker.episodes = types.SimpleNamespace(busy=True, next_answer_s=lambda: 0.0021)  # type: ignore[assignment]
    assert worker._idle_wait_ms() == 3


def test_an_abort_finds_every_held_result_sent_before_its_abort_done() -> None:
    """The real worker loop with a long hold: two samples finish and are scored, held in the outbox; the
    Abort's partial and its AbortDone must come after them, and every lease is either returned before the
    AbortDone or named in its `scoring`, as the protocol asks whether or not results are held."""
    script = EngineScript(step_s=0.1, length_max=40)  # the long one runs >= 3 s: the Abort finds it running
    short = groups_where(lambda key: response_length(key, script) <= 4, 2, script)
    long = groups_where(lambda key: response_length(key, script) >= 30, 1, script)[0]
    with running_worker(script, result_hold_ms=1000) as w:
        w.rewards.released = True
        # three of the four slots: the outbox never fills an engine, so only the rule can send it in time
        w.broker.send(lease([(1, short[0]), (2, short[1]), (3, long)]))
        # both short ones finished and scored: held in the outbox (unless a stalled machine let the hold run
        # out; the rules below hold either way)
        held = w.worker.core.held
        wait_for(lambda: list(held) == [3] and not w.worker.scoring, 10, "both short ones scored")
        w.broker.send(protocol.Abort(7))
        back: dict[int, Sample] = {}
        credit = 0
        while not isinstance(msg := w.broker.next(), protocol.AbortDone):
            if isinstance(msg, protocol.SampleResult):
                back.update(results(msg))
            credit += msg.credit if isinstance(msg, protocol.SampleResult | protocol.LeaseRequest) else 0
        assert msg.round_id == 7 and msg.scoring.tolist() == []
        assert sorted(back) == [1, 2, 3]  # every lease returned before the AbortDone
        assert [back[i].status for i in (1, 2)] == [SampleStatus.FINISHED] * 2
        assert [back[i].response_len for i in (1, 2)] == [
            response_length(sample_key(g, 0), script) for g in short
        ]
        assert back[3].status == SampleStatus.INTERRUPTED
        assert credit == 2  # the finished samples' slots; the partials' come with AbortDone's credit
