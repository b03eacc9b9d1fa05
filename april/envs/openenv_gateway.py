"""The OpenEnv session gateway: one process that holds the WebSocket sessions of every live episode.

An OpenEnv server keeps an episode's environment only while its WebSocket (`/ws`) stays open (one
environment per connection, destroyed when it closes; HTTP `/reset` and `/step` are stateless), so the
connection cannot travel in a sample. The gateway holds it instead: `open` connects and resets, giving a
handle (`EPOCH-N`, the epoch drawn at the gateway's start); `step` and `close` name the handle, from any
worker. A step is answered once per `StepKey` (a replay gets the first answer). Sessions whose episode
ended are closed at once, idle ones after `idle_s`; a lost connection drops its session and says why.
Messages are msgpack maps on a ROUTER socket (docs/protocol.md, "OpenEnv session gateway"); each request
runs on a thread of its own session's order, so a slow server never delays another episode.

Speaks OpenEnv's WebSocket protocol with `websockets` (the package its own client uses); knows nothing of
episodes, text or rewards (`april.envs.openenv_adapter`).
"""

from __future__ import annotations

import contextlib
import importlib
import json
import secrets
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import msgpack
import zmq

from april.episode import one_line
from april.transport import configure

VERSION = 1
INSTALL = "pip install 'april-rl[openenv]' (or: pip install 'websockets>=15')"
CONNECT_TIMEOUT_S = 10.0
CLOSE_TIMEOUT_S = 1.0  # closing a session waits this long for the server's goodbye (its answers first)
MAX_MESSAGE_BYTES = 100 * 2**20  # an observation may carry a screenshot (OpenEnv's client allows 100 MB)
WORKERS = 256  # threads running server calls (each waits on its server): sessions stepping at once


class GatewayError(Exception):
    """A gateway request that could not be answered; the message is one line. `lost`: the session is gone
    (the server closed it, did not answer, or never connected; or the gateway does not hold it)."""

    def __init__(self, message: str, lost: bool = False) -> None:
        super().__init__(message)
        self.lost = lost


def package() -> Any:
    """`websockets.sync.client`, or a one-line error naming the extra to install."""
    try:
        return importlib.import_module("websockets.sync.client")
    except ImportError as exc:
        raise GatewayError(f"websockets is not installed ({one_line(exc)}); install it: {INSTALL}") from None


def ws_url(url: str) -> str:
    """The server's WebSocket endpoint: http(s)://host:port[/prefix] -> ws(s)://host:port[/prefix]/ws."""
    base = url.rstrip("/")
    if base.startswith("http"):
        base = "ws" + base.removeprefix("http")
    return base + "/ws"


@dataclass(slots=True)
class Session:
    handle: str
    url: str
    ws: Any  # websockets.sync.client.ClientConnection
    lock: threading.Lock = field(default_factory=threading.Lock)
    used_at: float = field(default_factory=time.monotonic)
    last_key: str | None = None  # the last step's StepKey and its answer: a replay gets the same answer
    last_answer: dict[str, Any] | None = None


class Gateway:
    """The sessions and the requests on them; `serve` drives it from a ROUTER socket."""

    def __init__(self, urls: tuple[str, ...], idle_s: float = 600.0) -> None:
        self.client = package()
        self.epoch = secrets.token_hex(4)
        self.urls = tuple(u.rstrip("/") for u in urls)  # the servers it opens sessions on, no others
        self.idle_s = idle_s
        self.sessions: dict[str, Session] = {}
        self._lock = threading.Lock()
        self._count = 0
        self.closed_idle = 0  # sessions closed for idleness

    # -- requests (each runs on a pool thread; answers are maps with ok, and error when not ok) --------

    def handle(self, req: dict[str, Any]) -> dict[str, Any]:
        try:
            kind = req.get("t")
            if kind == "open":
                return self._open(str(req["url"]), dict(req.get("reset") or {}), _timeout(req))
            if kind == "step":
                return self._step(str(req["handle"]), req.get("key"), dict(req["action"]), _timeout(req))
            if kind == "close":
                self.close(str(req["handle"]))
                return {"ok": True}
            if kind == "ping":
                return {"ok": True, "epoch": self.epoch, "sessions": len(self.sessions)}
            raise GatewayError(f"request type {kind!r}, expected open, step, close or ping")
        except GatewayError as exc:
            return {"ok": False, "error": str(exc), "lost": exc.lost}
        except (KeyError, TypeError, ValueError) as exc:
            return {"ok": False, "error": f"bad request: {one_line(exc)}"}

    def _open(self, url: str, reset: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        if url.rstrip("/") not in self.urls:
            raise GatewayError(f"server {url!r}: this gateway serves {', '.join(self.urls)} only")
        try:
            ws = self.client.connect(
                ws_url(url),
                open_timeout=min(CONNECT_TIMEOUT_S, timeout_s),
                close_timeout=CLOSE_TIMEOUT_S,
                max_size=MAX_MESSAGE_BYTES,
            )
        except Exception as exc:
            raise GatewayError(
                f"cannot connect to the OpenEnv server at {ws_url(url)}: {one_line(exc)}", True
            ) from None
        with self._lock:
            self._count += 1
            handle = f"{self.epoch}-{self._count}"
            session = self.sessions[handle] = Session(handle, url, ws)
        try:
            with session.lock:
                result = self._call(session, {"type": "reset", "data": reset}, timeout_s)
        except GatewayError:
            self.close(handle)  # a refused reset: no one will hold this session
            raise
        return {"ok": True, "handle": handle, "result": result}

    def _step(self, handle: str, key: object, action: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        session = self._session(handle)
        with session.lock:
            if key is not None and key == session.last_key and session.last_answer is not None:
                return session.last_answer  # a replay of a step that ran: its first answer, not a new step
            result = self._call(session, {"type": "step", "data": action}, timeout_s)
            answer = {"ok": True, "result": result}
            session.last_key, session.last_answer = (None if key is None else str(key)), answer
        if result.get("done") is True:
            self.close(handle)  # the episode ended: its environment is freed now, not at the idle limit
        return answer

    def _call(self, session: Session, message: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        """Send one OpenEnv message and read its answer (`WSObservationResponse`'s data), within `timeout_s`.
        A lost or late connection drops the session (OpenEnv's server has destroyed it, or may have)."""
        session.used_at = time.monotonic()
        what = message["type"]
        try:
            session.ws.send(json.dumps(message))
            raw = session.ws.recv(timeout=timeout_s)
        except TimeoutError:
            self._drop(session)
            raise GatewayError(
                f"session {session.handle}: the OpenEnv server did not answer a {what} within {timeout_s:g}s",
                True,
            ) from None
        except Exception as exc:
            self._drop(session)
            raise GatewayError(
                f"session {session.handle} lost: the OpenEnv server at {session.url} closed it during a "
                f"{what} (restarted?): {one_line(exc)}",
                True,
            ) from None
        session.used_at = time.monotonic()
        try:
            reply = json.loads(raw)
        except ValueError:
            raise GatewayError(
                f"session {session.handle}: the server answered a {what} with non-JSON"
            ) from None
        if reply.get("type") == "error":
            error = reply.get("data") or {}
            detail = str(error.get("message", "?"))
            if error.get("errors"):
                detail += f" {json.dumps(error['errors'], default=str)[:200]}"
            raise GatewayError(f"session {session.handle}: the OpenEnv server refused the {what}: {detail}")
        if reply.get("type") != "observation" or not isinstance(reply.get("data"), dict):
            raise GatewayError(
                f"session {session.handle}: the server answered a {what} with {str(raw)[:80]!r}"
            )
        data: dict[str, Any] = reply["data"]
        return data

    def _session(self, handle: str) -> Session:
        with self._lock:
            session = self.sessions.get(handle)
        if session is not None:
            return session
        epoch = handle.partition("-")[0]
        if epoch != self.epoch:
            raise GatewayError(
                f"session {handle} lost: the gateway restarted (its sessions were of epoch {epoch}, this "
                f"gateway's is {self.epoch})",
                True,
            )
        raise GatewayError(
            f"session {handle} lost: closed (its episode ended, or it was idle over {self.idle_s:g}s, or its "
            "connection broke)",
            True,
        )

    def close(self, handle: str) -> None:
        """Close a session (OpenEnv's `close` message, then the socket); an unknown handle is no error."""
        with self._lock:
            session = self.sessions.pop(handle, None)
        if session is not None:
            with contextlib.suppress(Exception):  # a connection gone already: closing it is all that is left
                session.ws.send(json.dumps({"type": "close"}))
            session.ws.close()

    def _drop(self, session: Session) -> None:
        with self._lock:
            self.sessions.pop(session.handle, None)
        session.ws.close()

    def close_idle(self) -> list[str]:
        """Close the sessions unused for `idle_s` (an episode cut off by the worker, or abandoned)."""
        now = time.monotonic()
        with self._lock:
            idle = [
                h for h, s in self.sessions.items() if now - s.used_at > self.idle_s and not s.lock.locked()
            ]
            self.closed_idle += len(idle)  # counted before they go: whoever sees them gone sees the count
        for handle in idle:
            self.close(handle)
        return idle

    def close_all(self) -> None:
        for handle in list(self.sessions):
            self.close(handle)


def _timeout(req: dict[str, Any]) -> float:
    value = float(req.get("timeout_s", 30.0))
    if not value > 0:
        raise GatewayError(f"timeout_s: got {value!r}, expected > 0")
    return value


def serve(gateway: Gateway, address: str, should_stop: Callable[[], bool]) -> None:
    """Serve `gateway` on a ROUTER bound at `address` until `should_stop()`; its sessions are closed on
    the way out. Requests are one msgpack frame each; answers carry the request's `id` back."""
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    router = configure(ctx.socket(zmq.ROUTER))
    try:
        router.bind(address)
    except zmq.ZMQError as exc:
        ctx.destroy(linger=0)
        raise GatewayError(f"cannot bind the OpenEnv gateway at {address}: {exc}") from None
    done = configure(ctx.socket(zmq.PULL))
    done.bind(f"inproc://openenv-gateway-{gateway.epoch}")
    local = threading.local()

    def run(identity: bytes, req: dict[str, Any]) -> None:
        answer = gateway.handle(req)
        answer["id"] = req.get("id")
        if not hasattr(local, "push"):
            local.push = configure(ctx.socket(zmq.PUSH))
            local.push.connect(f"inproc://openenv-gateway-{gateway.epoch}")
        local.push.send_multipart([identity, msgpack.packb(answer, default=str)])

    poller = zmq.Poller()
    poller.register(router, zmq.POLLIN)
    poller.register(done, zmq.POLLIN)
    next_sweep = time.monotonic() + 1.0
    with ThreadPoolExecutor(WORKERS, thread_name_prefix="openenv-session") as pool:
        try:
            while not should_stop():
                events = dict(poller.poll(200))
                if router in events:
                    while router.poll(0):
                        identity, payload = _receive(router)
                        if isinstance(payload, dict):
                            pool.submit(run, identity, payload)
                        else:
                            router.send_multipart([identity, msgpack.packb({"ok": False, "error": payload})])
                if done in events:
                    while done.poll(0):
                        router.send_multipart(done.recv_multipart())
                if time.monotonic() > next_sweep:
                    pool.submit(gateway.close_idle)
                    next_sweep = time.monotonic() + 1.0
        finally:
            gateway.close_all()
    ctx.destroy(linger=0)  # the pool's threads are done: their PUSH sockets close with the rest


def _receive(router: zmq.Socket[bytes]) -> tuple[bytes, dict[str, Any] | str]:
    frames = router.recv_multipart()
    identity = frames[0]
    try:
        req = msgpack.unpackb(frames[-1])
    except Exception:
        return identity, "bad request: not msgpack"
    if not isinstance(req, dict) or req.get("v") != VERSION:
        got = req.get("v") if isinstance(req, dict) else type(req).__name__
        return identity, f"bad request: version {got!r}, expected {VERSION}"
    return identity, req
