"""april.peer_link on its own, against a real ROUTER on a random loopback port, on a fake clock.

The clock only decides when to heartbeat and when the broker counts as silent; messages travel over real
sockets, and every wait for one has a generous "did not hang" deadline. What the link sent is read back in
order up to a Disconnect marker (one DEALER connection keeps its order), so counts are exact. A reconnect
drops what the old socket still queued, and the ROUTER hands the identity over to the new connection
(renaming the old one), so across reconnects the tests wait for the new socket's hello instead.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Iterator

import pytest
import zmq
from test_codec import EXAMPLES

from april import protocol
from april.peer_link import BACKOFF_MAX_S, BACKOFF_MIN_S, LIVENESS, PeerLink

DEADLINE_MS = 60_000  # "did not hang", never "was fast"
IDENTITY = "peer-test"


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


class Broker:
    """A bare ROUTER standing in for the broker, set up as the broker sets up its own."""

    def __init__(self) -> None:
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_HANDOVER, 1)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.address = f"tcp://127.0.0.1:{self.port}"

    def recv(self) -> protocol.Message:
        assert self.sock.poll(DEADLINE_MS), "the link sent nothing"
        identity, *frames = self.sock.recv_multipart()
        assert identity == IDENTITY.encode()
        return protocol.decode(frames)

    def hello(self, count: int) -> None:
        """Wait for the `count`-th introduction, from the connection that now holds the identity (what
        an old socket still had in flight arrives under a name the ROUTER made up, or not at all)."""
        while True:
            assert self.sock.poll(DEADLINE_MS), f"introduction {count} never came"
            identity, *frames = self.sock.recv_multipart()
            msg = protocol.decode(frames)
            if identity == IDENTITY.encode() and msg == protocol.LearnerHello(IDENTITY, count, 1):
                return

    def until_disconnect(self) -> list[protocol.Message]:
        """Everything the link sent, in order, up to its Disconnect."""
        got: list[protocol.Message] = []
        while not isinstance(msg := self.recv(), protocol.Disconnect):
            got.append(msg)
        return got

    def send(self, msg: protocol.Message) -> None:
        self.sock.send_multipart([IDENTITY.encode(), *protocol.encode(msg)])

    def send_frames(self, frames: list[bytes]) -> None:
        self.sock.send_multipart([IDENTITY.encode(), *frames])

    def close(self) -> None:
        self.sock.close(linger=0)
        self.ctx.term()


class Introduction:
    """The owner's introduction: a hello and what it must re-send; the hello's version field counts how
    many times the link asked for it (so each one is told apart)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self) -> list[protocol.Message]:
        self.calls += 1
        return [protocol.LearnerHello(IDENTITY, self.calls, 1), protocol.BatchRequest(self.calls, -1)]


@pytest.fixture
def broker() -> Iterator[Broker]:
    b = Broker()
    yield b
    b.close()


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def link(broker: Broker, clock: FakeClock) -> Iterator[PeerLink]:
    peer = PeerLink(broker.address, IDENTITY, Introduction(), clock=clock)
    peer.connect()
    broker.hello(1)  # connected: the ROUTER can route to it (what it gets before that, it drops)
    assert broker.recv() == protocol.BatchRequest(1, -1)
    yield peer
    peer.close(linger_ms=0)


def hellos(msgs: list[protocol.Message]) -> list[int]:
    """The introductions among what the link sent, by number."""
    return [m.version for m in msgs if isinstance(m, protocol.LearnerHello)]


def kinds(msgs: list[protocol.Message]) -> list[str]:
    return [type(m).__name__ for m in msgs]


def welcome(interval_s: float) -> protocol.Welcome:
    example = EXAMPLES[protocol.Welcome]
    assert isinstance(example, protocol.Welcome)
    return dataclasses.replace(example, heartbeat_interval_s=interval_s)


def test_a_silent_broker_is_reconnected_to_with_backoff_doubling_to_the_bound(
    link: PeerLink, broker: Broker, clock: FakeClock
) -> None:
    """Silent for LIVENESS intervals (or for the backoff, once it is the longer): a new socket, under the
    same identity, that introduces itself again; the wait doubles from 1 s up to 32 s."""
    reconnected_at: list[float] = []
    while len(reconnected_at) < 8:
        clock.now += 0.25
        before = link.reconnects
        link.keep_alive()
        if link.reconnects > before:
            reconnected_at.append(clock.now)
            broker.hello(len(reconnected_at) + 1)  # the new socket introduced itself
    gaps = [b - a for a, b in zip([0.0, *reconnected_at], reconnected_at, strict=False)]
    # the silence must *exceed* max(LIVENESS x 1 s, backoff): the next 0.25 s step past it
    waits = [max(LIVENESS * 1.0, min(BACKOFF_MIN_S * 2**i, BACKOFF_MAX_S)) for i in range(8)]
    assert gaps == [w + 0.25 for w in waits]
    assert waits == [3.0, 3.0, 4.0, 8.0, 16.0, 32.0, 32.0, 32.0]  # the bound holds


def test_any_message_heard_counts_as_a_heartbeat_and_resets_the_backoff(
    link: PeerLink, broker: Broker, clock: FakeClock
) -> None:
    """Heartbeats, owner messages and errors from the broker all keep the link alive; only owner messages
    reach the owner. A message heard after reconnects puts the backoff back to its minimum."""
    for n in range(3):  # three reconnects: the backoff has grown to 8 s
        clock.now += LIVENESS * 1.0 + 5.0
        link.keep_alive()
        broker.hello(n + 2)
    assert link.reconnects == 3 and link.backoff == 8.0
    weights = protocol.WeightsReady(9, "sim://w", "1" * 64)
    chatter: list[protocol.Message] = [protocol.Heartbeat(), weights, protocol.Error("stale_batch_ack", "x")]
    for i in range(30):  # 60 fake seconds, far past any liveness window, the broker speaking every 2 s
        clock.now += 2.0
        broker.send(chatter[i % 3])
        got = link.recv(DEADLINE_MS)
        assert got == (weights if i % 3 == 1 else None)
        assert link.last_heard == clock.now and link.backoff == BACKOFF_MIN_S
        link.keep_alive()
    assert link.reconnects == 3
    # backoff back at 1 s: the next silence reconnects after the liveness window, not after 8 s
    clock.now += LIVENESS * 1.0 + 0.25
    link.keep_alive()
    assert link.reconnects == 4


def test_heartbeats_go_out_only_when_nothing_else_was_sent_for_an_interval(
    link: PeerLink, broker: Broker, clock: FakeClock
) -> None:
    for _ in range(8):  # the owner talks every 0.5 s: no heartbeat needed
        clock.now += 0.5
        link.send(protocol.LeaseRequest(1))
        broker.send(protocol.Heartbeat())  # keep the broker heard
        assert link.recv(DEADLINE_MS) is None
        link.keep_alive()
    for _ in range(8):  # the owner is quiet: one heartbeat each 1 s interval
        clock.now += 0.5
        broker.send(protocol.Heartbeat())
        assert link.recv(DEADLINE_MS) is None
        link.keep_alive()
    link.send(protocol.Disconnect("end"))
    assert kinds(broker.until_disconnect()) == ["LeaseRequest"] * 8 + ["Heartbeat"] * 4
    assert link.reconnects == 0


def test_not_registered_makes_the_link_introduce_itself_again_at_most_once_per_interval(
    link: PeerLink, broker: Broker, clock: FakeClock
) -> None:
    """A broker that does not know us answers every message with Error(not_registered) and is never
    silent: only a new introduction (with what the owner must re-send) brings us back. A burst of such
    answers (to messages sent before the hello reached it) gets one hello, not one each."""
    not_registered = protocol.Error("not_registered", "send LearnerHello first")
    marker = protocol.WeightsReady(1, "sim://marker", "3" * 64)

    def deliver(*msgs: protocol.Message) -> None:
        """Send `msgs` and return once the link has handled them all (the marker behind them arrived)."""
        for msg in (*msgs, marker):
            broker.send(msg)
        while link.recv(DEADLINE_MS) != marker:
            pass

    clock.now = 0.5  # half an interval after the connect's hello: answers to what came before it
    deliver(not_registered)
    clock.now = 2.0
    deliver(not_registered, not_registered, not_registered)  # a burst: one hello
    clock.now = 2.5
    deliver(not_registered)
    clock.now = 3.0  # an interval after the last hello: the broker still does not know us
    deliver(not_registered)
    link.send(protocol.Disconnect("end"))
    sent = broker.until_disconnect()
    assert hellos(sent) == [2, 3]  # the answers at 2.0 and 3.0, each introduction asked for anew
    assert kinds(sent) == ["LearnerHello", "BatchRequest"] * 2  # with what the owner must re-send
    assert link.reconnects == 0  # the same socket: the broker was never silent


def test_the_welcome_interval_is_adopted_for_heartbeats_and_liveness(
    link: PeerLink, broker: Broker, clock: FakeClock
) -> None:
    broker.send(welcome(5.0))
    got = link.recv(DEADLINE_MS)
    assert isinstance(got, protocol.Welcome)  # the owner gets the Welcome too (sampling settings, weights)
    assert link.interval == 5.0
    for clock.now in (1.0, 4.75, 5.0, 9.75, 10.0):
        link.keep_alive()
    link.send(protocol.Disconnect("end"))  # at 10.0, a message like any other
    # heartbeats at 5 and 10, none at the old 1 s interval
    assert kinds(broker.until_disconnect()) == ["Heartbeat", "Heartbeat"]
    clock.now = LIVENESS * 5.0  # silent exactly LIVENESS x 5 s since the Welcome at 0: still alive
    link.keep_alive()
    assert link.reconnects == 0
    clock.now += 0.25
    link.keep_alive()
    assert link.reconnects == 1
    broker.hello(2)


def test_a_malformed_message_is_dropped_and_does_not_count_as_heard(
    link: PeerLink, broker: Broker, clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    clock.now = 2.0
    weights = protocol.WeightsReady(4, "sim://w", "2" * 64)
    broker.send_frames([b"\x92\x09\x01", b"\x80"])  # protocol version 9
    broker.send(weights)
    with caplog.at_level(logging.WARNING, logger="april.peer_link"):
        # the bad one dropped, the good one behind it returned (by the same call, if it was there by then)
        got = link.recv(DEADLINE_MS) or link.recv(DEADLINE_MS)
    assert got == weights
    assert "malformed message from the broker dropped" in caplog.text and "protocol version 9" in caplog.text
    clock.now = 3.0
    caplog.clear()
    broker.send_frames([b"not msgpack", b""])
    with caplog.at_level(logging.WARNING, logger="april.peer_link"):
        assert link.recv(DEADLINE_MS) is None
    assert "malformed message from the broker dropped" in caplog.text
    assert link.last_heard == 2.0  # garbage is not a heartbeat


def test_close_sends_what_was_queued(broker: Broker, clock: FakeClock) -> None:
    intro = Introduction()
    for n in (1, 2):  # a second link under the same identity (a restarted process) is heard as well
        peer = PeerLink(broker.address, IDENTITY, intro, clock=clock)
        peer.connect()
        peer.send(protocol.Disconnect("done"))
        peer.close()
        sent = broker.until_disconnect()
        assert hellos(sent) == [n] and kinds(sent) == ["LearnerHello", "BatchRequest"]
