"""A client's link to the broker: the client side of zguide's Paranoid Pirate, as april uses it.

Owns the DEALER socket (CurveZMQ client keys when given), the introduction sent on every (re)connect and
in answer to `Error("not_registered")`, heartbeats when nothing was sent for an interval, liveness (a
broker silent for LIVENESS x interval is reconnected to, with a new socket of the same identity),
backoff between reconnects (1 s doubling to 32 s, reset by any message heard), the heartbeat interval
the broker's `Welcome` announces, and dropping malformed messages. Any message heard counts as a
heartbeat. The rules of both sides are docs/protocol.md sections 7 and 8 (the broker's side:
`broker.peers`).

Knows nothing of what a role says: the owner (the worker, the learner client) gives the messages that
introduce it (a hello, plus what a broker that lost it must hear again) and handles every other message.
Sends and liveness checks happen only when the owner calls in; nothing runs in the background.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import zmq

from april import failures, protocol
from april.codec import DEFAULT_MAX_BYTES, ProtocolError
from april.config import BrokerConfig
from april.keys import ClientKeys
from april.transport import dealer, recv, send

log = logging.getLogger("april.peer_link")

_BROKER_DEFAULTS = BrokerConfig()
# Until a Welcome says otherwise, the broker's defaults; liveness is not in the Welcome, so a client
# counts the broker's default number of missed heartbeats (the broker sends one every interval).
HEARTBEAT_INTERVAL_S = _BROKER_DEFAULTS.heartbeat_interval_s
LIVENESS = _BROKER_DEFAULTS.liveness
BACKOFF_MIN_S, BACKOFF_MAX_S = 1.0, 32.0

Introduction = Callable[[], Sequence[protocol.Message]]  # the hello first, then what must be re-sent
Clock = Callable[[], float]  # monotonic seconds


class PeerLink:
    def __init__(
        self,
        address: str,
        identity: str,
        introduce: Introduction,
        curve: ClientKeys | None = None,
        max_bytes: int = DEFAULT_MAX_BYTES,
        clock: Clock = time.monotonic,
    ) -> None:
        self.address = address
        self.identity = identity
        self.introduce = introduce
        self.curve = curve  # CurveZMQ client keys when the broker requires them
        self.max_bytes = max_bytes
        self.clock = clock
        self.interval = HEARTBEAT_INTERVAL_S
        self.backoff = BACKOFF_MIN_S
        self.last_heard = self.last_sent = self.last_hello = float("-inf")
        self.reconnects = 0  # sockets replaced because the broker was silent
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.sock: zmq.Socket[bytes] | None = None

    def connect(self) -> None:
        """Open a new socket (closing any old one, and what it still queued) and introduce ourselves.
        The broker counts as just heard: it gets a whole liveness window to answer."""
        if self.sock is not None:
            self.sock.close(linger=0)
        self.sock = dealer(self.ctx, self.address, self.identity, self.max_bytes, self.curve)
        self._introduce()
        self.last_heard = self.clock()

    def send(self, msg: protocol.Message) -> None:
        assert self.sock is not None, "PeerLink.send before connect"
        send(self.sock, msg)
        self.last_sent = self.clock()

    def recv(self, timeout_ms: int) -> protocol.Message | None:
        """The next message for the owner, waiting at most `timeout_ms` for the first message; None when
        none came. Heartbeats and errors are handled here (and so is a Welcome's interval, though the
        Welcome itself is returned); once one arrived, only what is already queued is read."""
        assert self.sock is not None, "PeerLink.recv before connect"
        while True:
            try:
                msg = recv(self.sock, timeout_ms, self.max_bytes)
            except ProtocolError as exc:
                log.warning("malformed message from the broker dropped: %s", exc)
                timeout_ms = 0
                continue
            if msg is None:
                return None
            self.last_heard = self.clock()
            self.backoff = BACKOFF_MIN_S
            timeout_ms = 0
            match msg:
                case protocol.Heartbeat():
                    continue
                case protocol.Error(code="not_registered"):
                    self._on_not_registered()
                    continue
                case protocol.Error(code=failures.RUN_FAILED):
                    pass  # the owner's: the broker stopped the run
                case protocol.Error(code=code, detail=detail):
                    log.warning("broker error %s: %s", code, detail)
                    continue
                case protocol.Welcome(heartbeat_interval_s=interval):
                    self.interval = interval
            return msg

    def keep_alive(self) -> None:
        """Heartbeat when nothing was sent for an interval; reconnect when the broker was silent for
        LIVENESS intervals, or for the backoff once that has grown past them."""
        now = self.clock()
        if now - self.last_sent >= self.interval:
            self.send(protocol.Heartbeat())
        silent = now - self.last_heard
        if silent > max(LIVENESS * self.interval, self.backoff):
            log.warning("broker silent for %.1fs: reconnecting (next try in %.0fs)", silent, self.backoff)
            self.connect()
            self.reconnects += 1
            self.backoff = min(self.backoff * 2, BACKOFF_MAX_S)

    def close(self, linger_ms: int = 1000) -> None:
        """Close the socket, waiting up to `linger_ms` for what is queued (a Disconnect) to leave.
        Closing twice is harmless."""
        if self.sock is not None:
            self.sock.close(linger=linger_ms)
            self.sock = None
        if not self.ctx.closed:
            self.ctx.term()

    def _on_not_registered(self) -> None:
        # A broker that restarted (or declared us dead) answers every message with this, and is never
        # silent, so only a new hello gets us back. It may answer a burst of messages sent before our
        # last hello reached it: at most one hello per interval, as the broker asks at most once per interval.
        if self.clock() - self.last_hello < self.interval:
            return
        log.warning("the broker does not know us (restarted, or declared us dead): saying hello again")
        self._introduce()

    def _introduce(self) -> None:
        for msg in self.introduce():
            self.send(msg)
        self.last_hello = self.clock()
