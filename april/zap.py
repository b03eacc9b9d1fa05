"""Who may complete a CURVE handshake on a server socket: the ZAP handler every CURVE server shares.

libzmq asks the ZAP endpoint (``inproc://zeromq.zap.01`` in the server socket's context) about every CURVE
handshake and waits for the answer before the peer can send a single message. `ZapHandler` answers from
its owner's poll loop (no thread of its own): 200 when the client's public key is one of
``authorized/*.key``, 400 otherwise. The authorised directory is re-read when it changes, so
`april keys add-client` needs no restart. Its users: the broker (`broker.auth`, which counts refusals in
its status) and the learner's weight service (`learner.weight_service`), each in its own context.

Does not own: key files (`april.keys`), socket options (`april.transport`) or what a refusal is counted as
(the owner's `on_refused`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import zmq

from april.keys import KeysError, authorized_keys

log = logging.getLogger("april.zap")
ZAP_ENDPOINT = "inproc://zeromq.zap.01"
ZAP_VERSION = b"1.0"
DRAIN_LIMIT = 256  # handshakes answered per call before the owner's loop ticks again


class ZapHandler:
    """Binds the ZAP endpoint of `ctx` (before any CURVE server socket of that context binds, so that no
    handshake goes unanswered); `on_refused(peer_address)` hears of every refused handshake."""

    def __init__(
        self,
        ctx: zmq.Context[zmq.Socket[bytes]],
        authorized: Path,
        on_refused: Callable[[str], None] | None = None,
    ) -> None:
        self.authorized = authorized
        self.on_refused = on_refused
        self.stamp = self._stamp()
        self.allowed = authorized_keys(authorized)  # a corrupt key at start-up stops the owner (KeysError)
        self.sock: zmq.Socket[bytes] = ctx.socket(zmq.REP)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(ZAP_ENDPOINT)
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
        if self.on_refused is not None:
            self.on_refused(peer)
        self.refused += 1
        if (
            self.refused & (self.refused - 1) == 0
        ):  # 1st, 2nd, 4th, ...: a retrying stranger cannot flood logs
            log.warning("refused a handshake from %s: key not authorised (%d refused)", peer, self.refused)
        return [ZAP_VERSION, request_id, b"400", b"key not authorised", b"", b""]

    def close(self) -> None:
        self.sock.close(linger=0)
