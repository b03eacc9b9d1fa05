"""Who may connect to a broker running with CurveZMQ keys: the ZAP handler, inside the broker's loop.

The ZAP handler itself (`april.zap.ZapHandler`: 200 for a key in ``authorized/*.key``, 400 otherwise,
re-read when the directory changes) is shared with the learner's weight service; here it answers from the
broker's own poll loop (no thread), and every refusal is counted in the broker's `Rejections` as
``auth_refused`` under the client's address, so it shows in `april status` and Prometheus.

A client with no CURVE at all, or one that does not know the broker's public key, never reaches ZAP:
libzmq drops it during the handshake. `CurveGate` watches the broker's sockets' monitor events and counts
those as ``handshake_failed`` under the broker endpoint they hit (the peer's address is not reported).
Does not own: key files (`april.keys`) or socket options (`april.transport`).
"""

from __future__ import annotations

import logging

import zmq
from zmq.utils.monitor import recv_monitor_message

from april.keys import ServerKeys
from april.transport import curve_server
from april.zap import DRAIN_LIMIT, ZapHandler
from broker.peers import Rejections

log = logging.getLogger("april.broker")
REFUSED = "auth_refused"
HANDSHAKE_FAILED = "handshake_failed"
FAILED_EVENTS = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL  # not _AUTH: ZAP


class CurveGate:
    """The broker's CURVE set-up in one place: server keys on its sockets, the ZAP handler, and the
    monitors that count handshakes failing before ZAP. `drain` is called from the broker's loop."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], keys: ServerKeys, rejections: Rejections) -> None:
        self.keys = keys
        self.rejections = rejections
        self.zap = ZapHandler(ctx, keys.authorized, lambda peer: rejections.count(peer, REFUSED))
        self.monitors: list[zmq.Socket[bytes]] = []

    def secure(self, sock: zmq.Socket[bytes]) -> None:
        """Make `sock` a CURVE server watched by this gate (before it binds)."""
        curve_server(sock, self.keys)
        self.monitors.append(sock.get_monitor_socket(FAILED_EVENTS))

    @property
    def sockets(self) -> list[zmq.Socket[bytes]]:
        """What the broker's poller should wake on."""
        return [self.zap.sock, *self.monitors]

    def drain(self) -> None:
        self.zap.drain()
        for monitor in self.monitors:
            for _ in range(DRAIN_LIMIT):
                try:
                    event = recv_monitor_message(monitor, zmq.NOBLOCK)
                except zmq.Again:
                    break
                endpoint = bytes(event.get("endpoint", b"")).decode("utf-8", "replace")[:64] or "unknown"
                self.rejections.count(endpoint, HANDSHAKE_FAILED)

    def close(self) -> None:
        for monitor in self.monitors:
            monitor.close(linger=0)
        self.zap.close()
