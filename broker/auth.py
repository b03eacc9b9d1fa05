"""Who may connect to a broker running with CurveZMQ keys: the ZAP handler, inside the broker's loop.

libzmq asks the ZAP endpoint (``inproc://zeromq.zap.01`` in the broker's context) about every CURVE
handshake on the broker's sockets and waits for the answer before the peer can send a single message.
`ZapHandler` answers from the broker's own poll loop (no thread): 200 when the client's public key is one
of ``authorized/*.key``, 400 otherwise. Every refusal is counted in the broker's `Rejections` as
``auth_refused`` under the client's address, so it shows in `april status` and Prometheus. The authorised
directory is re-read when it changes, so `april keys add-client` needs no restart.

A client with no CURVE at all, or one that does not know the broker's public key, never reaches ZAP:
libzmq drops it during the handshake. `CurveGate` watches the broker's sockets' monitor events and counts
those as ``handshake_failed`` under the broker endpoint they hit (the peer's address is not reported).
Does not own: key files (`april.keys`) or socket options (`april.transport`).
"""

from __future__ import annotations

import logging
from pathlib import Path

import zmq
from zmq.utils.monitor import recv_monitor_message

from april.keys import KeysError, ServerKeys, authorized_keys
from april.transport import curve_server
from broker.peers import Rejections

log = logging.getLogger("april.broker")
ZAP_ENDPOINT = "inproc://zeromq.zap.01"
ZAP_VERSION = b"1.0"
DRAIN_LIMIT = 256  # handshakes answered per call before the loop ticks again
REFUSED = "auth_refused"
HANDSHAKE_FAILED = "handshake_failed"
FAILED_EVENTS = zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL  # not _AUTH: ZAP


class ZapHandler:
    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], authorized: Path, rejections: Rejections) -> None:
        self.authorized = authorized
        self.rejections = rejections
        self.stamp = self._stamp()
        self.allowed = authorized_keys(authorized)  # a corrupt key at start-up stops the broker (KeysError)
        self.sock: zmq.Socket[bytes] = ctx.socket(zmq.REP)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(ZAP_ENDPOINT)  # before any CURVE socket binds: no handshake goes unanswered
        self.accepted = 0
        self.refused = 0

    def _stamp(self) -> int:
        return hash(tuple(sorted((p.name, p.stat().st_mtime_ns) for p in self.authorized.glob("*.key"))))

    def _reload(self) -> None:
        """Re-read authorized/*.key when a file there was added, removed or rewritten."""
        try:
            stamp = self._stamp()
        except OSError as exc:
            log.error(
                "cannot read %s (%s): keeping %d authorised keys", self.authorized, exc, len(self.allowed)
            )
            return
        if stamp == self.stamp:
            return
        try:
            self.allowed = authorized_keys(self.authorized)
        except KeysError as exc:  # a corrupt file added while running: keep the last good set
            log.error("%s: keeping %d authorised keys", exc, len(self.allowed))
            return
        self.stamp = stamp
        log.info("%d authorised client keys in %s", len(self.allowed), self.authorized)

    def drain(self) -> None:
        """Answer every pending ZAP request (at most DRAIN_LIMIT)."""
        for _ in range(DRAIN_LIMIT):
            try:
                request = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            self.sock.send_multipart(self.answer(request))

    def answer(self, request: list[bytes]) -> list[bytes]:
        """The ZAP reply (RFC 27) to one request: [version, request_id, status, text, user_id, metadata]."""
        if len(request) < 6 or request[0] != ZAP_VERSION:
            request_id = request[1] if len(request) > 1 else b""
            return [ZAP_VERSION, request_id, b"500", b"malformed ZAP request", b"", b""]
        _, request_id, _domain, address, _identity, mechanism, *credentials = request
        self._reload()
        if mechanism == b"CURVE" and len(credentials) == 1 and credentials[0] in self.allowed:
            self.accepted += 1
            return [ZAP_VERSION, request_id, b"200", b"OK", b"", b""]
        peer = address.decode("utf-8", "replace")[:64] or "unknown"
        self.rejections.count(peer, REFUSED)
        self.refused += 1
        if (
            self.refused & (self.refused - 1) == 0
        ):  # 1st, 2nd, 4th, ...: a retrying stranger cannot flood logs
            log.warning("refused a handshake from %s: key not authorised (%d refused)", peer, self.refused)
        return [ZAP_VERSION, request_id, b"400", b"key not authorised", b"", b""]

    def close(self) -> None:
        self.sock.close(linger=0)


class CurveGate:
    """The broker's CURVE set-up in one place: server keys on its sockets, the ZAP handler, and the
    monitors that count handshakes failing before ZAP. `drain` is called from the broker's loop."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], keys: ServerKeys, rejections: Rejections) -> None:
        self.keys = keys
        self.rejections = rejections
        self.zap = ZapHandler(ctx, keys.authorized, rejections)
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
