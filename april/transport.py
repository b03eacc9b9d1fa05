"""ZeroMQ plumbing shared by every role: socket set-up, sending a message, receiving with a timeout.

Sockets get linger 0 (closing never blocks), a MAXMSGSIZE bound (a peer cannot make us buffer more),
and DEALER sockets a routing identity equal to the peer id, so the broker's ROUTER knows who spoke.
With CurveZMQ keys (`april.keys`), clients are CURVE clients of the broker's public key and the broker's
sockets CURVE servers that ask ZAP (`broker.auth`) about every handshake. Knows the codec, not the roles.
"""

from __future__ import annotations

from collections.abc import Sequence

import zmq

from april.codec import DEFAULT_MAX_BYTES, Frame
from april.keys import ClientKeys, ServerKeys
from april.protocol import Message, decode, encode

HIGH_WATER_MARK = 100_000  # messages; a ROUTER drops silently past it, so keep it far from reach
ZAP_DOMAIN = b"april"


def configure(sock: zmq.Socket[bytes], max_bytes: int = DEFAULT_MAX_BYTES) -> zmq.Socket[bytes]:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)
    sock.setsockopt(zmq.SNDHWM, HIGH_WATER_MARK)
    sock.setsockopt(zmq.RCVHWM, HIGH_WATER_MARK)
    return sock


def curve_client(sock: zmq.Socket[bytes], keys: ClientKeys | None) -> zmq.Socket[bytes]:
    """Make `sock` a CURVE client of the broker (before `connect`); no-op without keys."""
    if keys is not None:
        sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
        sock.setsockopt(zmq.CURVE_SERVERKEY, keys.server_public)
    return sock


def curve_server(sock: zmq.Socket[bytes], keys: ServerKeys) -> zmq.Socket[bytes]:
    """Make `sock` a CURVE server (before `bind`). ZAP is enforced: with no ZAP handler bound in the
    socket's context every handshake fails, so a missing handler can never mean "let everyone in"."""
    sock.setsockopt(zmq.CURVE_SERVER, 1)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
    sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN)
    sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)
    return sock


def dealer(
    ctx: zmq.Context[zmq.Socket[bytes]],
    address: str,
    identity: str,
    max_bytes: int = DEFAULT_MAX_BYTES,
    curve: ClientKeys | None = None,
) -> zmq.Socket[bytes]:
    """A DEALER connected to `address`, speaking as `identity` (a CURVE client when given keys)."""
    sock = curve_client(configure(ctx.socket(zmq.DEALER), max_bytes), curve)
    sock.setsockopt(zmq.IDENTITY, identity.encode())
    sock.setsockopt(zmq.RECONNECT_IVL, 100)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
    sock.connect(address)
    return sock


def send(sock: zmq.Socket[bytes], msg: Message, identity: bytes | None = None) -> None:
    frames: list[Frame] = encode(msg)
    if identity is not None:
        frames = [identity, *frames]
    sock.send_multipart(frames, copy=len(frames) < 4)


def recv(sock: zmq.Socket[bytes], timeout_ms: int, max_bytes: int = DEFAULT_MAX_BYTES) -> Message | None:
    """The next message on a DEALER/SUB-less socket, or None after `timeout_ms`. Raises ProtocolError."""
    if not sock.poll(timeout_ms, zmq.POLLIN):
        return None
    frames: Sequence[Frame] = [f.buffer for f in sock.recv_multipart(copy=False)]
    return decode(frames, max_bytes)
