"""The broker's poll loop (`Broker.serve`): the order it does its work in.

The broker here is a real one in this process, stepped by hand: its own drain and tick on its real
sockets, a worker and a learner as DEALER sockets over loopback. Only the backlog of worker messages
is a queue of real zmq frames handed to `_drain`, so that its length is certain (over TCP, how many
messages have arrived at a given moment is not).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import zmq
from harness import local_broker, wait_for

from april import protocol
from april.records import FinishReason
from april.transport import dealer, recv, send
from april.wire_records import SampleBatch
from broker.prometheus import status_metrics
from broker.server import DRAIN_LIMIT_BATCH_DUE

DEADLINE_S = 60.0


class QueuedMessages:
    """Stands in for the ROUTER socket in `Broker._drain`: `recv_multipart(NOBLOCK, copy=False)` as pyzmq
    answers it (real `zmq.Frame`s: the peer's identity, then the message's frames), then `zmq.Again`."""

    def __init__(self, identity: bytes, messages: list[protocol.Message]) -> None:
        self.waiting = deque([identity, *protocol.encode(m)] for m in messages)

    def recv_multipart(self, flags: int, copy: bool) -> list[zmq.Frame]:
        assert flags == zmq.NOBLOCK and copy is False
        if not self.waiting:
            raise zmq.Again()
        return [zmq.Frame(bytes(f)) for f in self.waiting.popleft()]


class SteppedBroker:
    """An async broker (B = 1 group of 2 samples), one worker with 2 slots and a learner."""

    def __init__(self, tmp_path: Path) -> None:
        self.broker, ports = local_broker(tmp_path / "run", {"algo.n_samples_per_prompt": 2})
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.worker = dealer(self.ctx, f"tcp://127.0.0.1:{ports[0]}", "w0")
        self.learner = dealer(self.ctx, f"tcp://127.0.0.1:{ports[1]}", "learner")

    def step(self) -> None:
        """One turn of the loop, on whatever has arrived."""
        b = self.broker
        b._drain(b.learner_sock, b._on_learner)
        b._drain(b.worker_sock, b._on_worker, batch_first=True)
        b.tick(time.monotonic())

    def until(self, sock: zmq.Socket[bytes], kind: type[protocol.Message]) -> protocol.Message:
        """Step the broker until `sock` gets a message of `kind`."""
        deadline = time.monotonic() + DEADLINE_S
        while time.monotonic() < deadline:
            self.step()
            msg = recv(sock, 5)
            if isinstance(msg, kind):
                return msg
        raise AssertionError(f"no {kind.__name__} within {DEADLINE_S} s")

    def close(self) -> None:
        self.ctx.destroy(linger=0)
        self.broker.close()


@pytest.fixture
def stepped(tmp_path: Path) -> Iterator[SteppedBroker]:
    s = SteppedBroker(tmp_path)
    try:
        yield s
    finally:
        s.close()


Handler = Callable[[bytes, protocol.Message, float], None]


def counting(handle: Handler, seen: list[str]) -> Handler:
    """`handle`, noting the type of each message it is given in `seen`."""

    def counted(identity: bytes, msg: protocol.Message, now: float) -> None:
        seen.append(type(msg).__name__)
        handle(identity, msg, now)

    return counted


def test_a_due_batch_waits_behind_no_more_than_a_few_worker_messages(stepped: SteppedBroker) -> None:
    """A backlog of worker messages is read DRAIN_LIMIT_BATCH_DUE at a time (never fewer: the results that
    let a batch form must get in) while the learner waits for a batch that can be formed, and while the
    formed batch waits for its snapshot; once it is sent, the rest is read in one go. Before, the loop read
    up to 256 messages first: with results arriving one sample a message, that held each batch back
    100-200 ms."""
    b = stepped.broker
    send(stepped.worker, protocol.WorkerHello("w0", "sim", 2, 0, 1, "node", np.zeros(0, np.int64)))
    lease = stepped.until(stepped.worker, protocol.Lease)
    assert isinstance(lease, protocol.Lease)
    leased = lease.samples.to_samples()
    done = [s.extend([5, 6], [-0.5, -0.5], 0, FinishReason.STOP).scored(1.0) for s in leased]
    send(stepped.worker, protocol.SampleResult(lease.lease_ids, SampleBatch.from_samples(done), 0))
    while not b.core.state.complete:
        stepped.step()
    send(stepped.learner, protocol.LearnerHello("learner", 0, 1))
    stepped.until(stepped.learner, protocol.Welcome)
    assert not b.core.batch_due()  # a batch worth of groups is complete, and nobody asks for it
    send(stepped.learner, protocol.BatchRequest(0, -1))
    while b.core.learner_waiting is None:
        b._drain(b.learner_sock, b._on_learner)

    backlog = QueuedMessages(b"w0", [protocol.Heartbeat() for _ in range(100)])
    seen: list[str] = []
    handle = counting(b._on_worker, seen)
    assert b.core.batch_due() and b.core.state.batch is None
    b._drain(backlog, handle, batch_first=True)  # type: ignore[arg-type]
    assert len(seen) == DRAIN_LIMIT_BATCH_DUE  # the tick comes next: it forms the batch
    b.tick(time.monotonic())
    assert b.core.state.batch is not None and b.batch_due()  # formed, waiting for its snapshot
    assert b.snapshots.wait(b.batch_snapshot_seq, DEADLINE_S)
    b._drain(backlog, handle, batch_first=True)  # type: ignore[arg-type]
    assert len(seen) == 2 * DRAIN_LIMIT_BATCH_DUE
    b.tick(time.monotonic())  # durable: sent
    batch = recv(stepped.learner, int(DEADLINE_S * 1000))
    while isinstance(batch, protocol.Heartbeat):
        batch = recv(stepped.learner, int(DEADLINE_S * 1000))
    assert isinstance(batch, protocol.Batch) and len(batch.samples) == 2
    assert not b.batch_due()
    b._drain(backlog, handle, batch_first=True)  # type: ignore[arg-type]
    assert len(seen) == 100 and seen == ["Heartbeat"] * 100  # nothing due: the backlog in one go


def test_the_status_counts_what_each_sample_cost_in_messages(stepped: SteppedBroker) -> None:
    """Per worker, since its hello: every message heard (heartbeats, usage reports and credit included) and
    every sample its results carried; `april status` and Prometheus show their ratio, what a sample costs
    the broker in messages (worker.result_hold_ms and worker.usage_report_s lower it)."""
    b = stepped.broker
    send(stepped.worker, protocol.WorkerHello("w0", "sim", 2, 0, 1, "node", np.zeros(0, np.int64)))
    lease = stepped.until(stepped.worker, protocol.Lease)
    assert isinstance(lease, protocol.Lease)
    (before,) = b.status(time.monotonic()).workers
    assert (before.messages, before.samples_returned) == (0, 0)
    assert b.status(time.monotonic()).messages_per_sample is None
    done = [
        s.extend([5, 6], [-0.5, -0.5], 0, FinishReason.STOP).scored(1.0) for s in lease.samples.to_samples()
    ]
    for msg in (
        protocol.Heartbeat(),
        protocol.EngineUsage(0.1, 0.2, 0.0, 0.1),
        protocol.LeaseRequest(1),
        protocol.SampleResult(lease.lease_ids[:1], SampleBatch.from_samples(done[:1]), 0),
        protocol.SampleResult(lease.lease_ids[1:], SampleBatch.from_samples(done[1:]), 1),
    ):
        send(stepped.worker, msg)
    wait_for(
        lambda: stepped.step() or b.status(time.monotonic()).workers[0].messages == 5,
        DEADLINE_S,
        "5 messages heard",
    )
    (after,) = b.status(time.monotonic()).workers
    assert (after.messages, after.samples_returned) == (5, 2)
    assert b.status(time.monotonic()).messages_per_sample == 2.5  # over the live workers
    (family,) = [
        m
        for m in status_metrics(b.status(time.monotonic()))
        if m.name == "april_broker_worker_messages_per_sample"
    ]
    assert [s.value for s in family.samples] == [2.5]
