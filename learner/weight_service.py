"""The learner's weight service: published weights versions served in chunks over ZeroMQ (the network
transport, docs/design.md section 6).

Why ZeroMQ and not an HTTP server: the run already speaks ZeroMQ, so the CurveZMQ keys that authenticate
and encrypt the broker's traffic cover the weight bytes too (one key directory, one ZAP handler:
`april.zap`); credit-based chunk pipelining (the ZeroMQ guide's file-transfer pattern: the client keeps a
window of chunk requests in flight, the server answers each with one chunk) bounds memory on both sides by
window x chunk size whatever the model size, and makes resuming a dropped transfer a matter of asking
again from an offset; and there is no second server stack to run, secure and monitor. The broker stays the
control plane: it relays the version's URI and sha256 (`april.weights_uri`) and never carries a weight byte.

Public API (used by `learner.loop`, the benchmarks and the multi-host test):

    service = WeightService(weights_dir, cfg, keys=None, broker_host="127.0.0.1")
    service.start()             # binds tcp://{cfg.bind_host}:{cfg.port} (WeightServiceError: one line)
    service.endpoint            # "tcp://HOST:PORT" workers reach it at (what the URI names)
    service.stop()              # ends the thread, closes every socket and file
    announce_location(transport, path, endpoint) -> WeightsLocation   # what the learner announces

and for tests and fault injection: `pause()` / `resume()` (read requests, answer none), `stats()`
(requests seen, the most a peer had outstanding, chunks served per version).

Protocol (docs/protocol.md, "The weight service"): a worker's DEALER sends `WeightsChunkRequest(version,
offset, length)`; the service's ROUTER answers each with `WeightsChunk(version, offset, size, data)`, or
`WeightsGone(version, newest)` when it does not have that version, or `Error` for a malformed request.
A published file is immutable once renamed into place (`learner.weights`), so each version is opened
once and mapped read-only: a chunk goes to the socket straight from the page cache (`os.pread` where a
filesystem cannot map). A version the learner prunes while a worker fetches it is still served from the
open file; one pruned before anyone asked for it is gone. With CurveZMQ keys
(`broker.curve_keys_dir`), the service is a CURVE server with its own pair (weights.key_secret) accepting
the broker's authorised clients; binding a non-loopback address without keys is refused.

Does not publish weights (`learner.weights`), announce them (`learner.loop`) or fetch them
(`actors.weight_fetch`). Imports no torch.
"""

from __future__ import annotations

import errno
import logging
import mmap
import os
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

import numpy as np
import zmq

from april import protocol
from april.codec import ProtocolError
from april.config import ConfigError, WeightsConfig, WeightsTransport
from april.keys import ServerKeys
from april.ports import is_loopback, route_address
from april.transport import configure, curve_server
from april.weights_uri import WeightsLocation, file_version, published_versions, version_path
from april.zap import ZapHandler

log = logging.getLogger("april.weights")
REQUEST_MAX_BYTES = 4096  # a chunk request is three ints: anything bigger is not one
POLL_MS = 100
MAX_OPEN_VERSIONS = 8  # fds kept open at most (the newest versions a worker may still be fetching)
RECENT_REQUESTS = 100_000  # requests remembered for stats() (fault-injection tests read them)


class WeightServiceError(ConfigError):
    """The weight service cannot start as configured (busy port, non-loopback bind without keys)."""


def advertised_host(cfg: WeightsConfig, broker_host: str) -> str:
    """The address workers reach the service at: weights.advertise_host, else the bind address when it
    is one address, else this host's address on its route to the broker."""
    if cfg.advertise_host:
        return cfg.advertise_host
    if cfg.bind_host not in ("0.0.0.0", "::", "*", ""):
        return cfg.bind_host
    try:
        return route_address(broker_host)
    except OSError:  # no route (or no such name): only this host can reach the service
        return "127.0.0.1"


def announce_location(transport: WeightsTransport, path: Path, endpoint: str) -> WeightsLocation:
    """What the learner announces for the published file `path` (vNNNNNN.safetensors) per transport:
    file: the file; auto: the service and the file (a worker that sees it reads it); network: the
    service only; broadcast: the service, flagged broadcast (the collective comes on top)."""
    version = file_version(path.name)
    if version is None:
        raise ValueError(f"announce_location: {path.name} is not a published version's file")
    if transport == WeightsTransport.FILE or not endpoint:
        return WeightsLocation(version, path=str(path))
    size = path.stat().st_size
    offered = str(path) if transport == WeightsTransport.AUTO else ""
    broadcast = transport == WeightsTransport.BROADCAST
    return WeightsLocation(version, path=offered, service=endpoint, size=size, broadcast=broadcast)


@dataclass(frozen=True, slots=True)
class ServiceStats:
    """What the service saw, for tests and benchmarks: every request (peer, version, offset, length) in
    arrival order (the newest RECENT_REQUESTS), the most requests any peer had waiting at once, and the
    chunks served per version."""

    requests: list[tuple[bytes, int, int, int]]
    max_outstanding: dict[bytes, int]
    chunks_served: dict[int, int]
    gone: int


@dataclass(slots=True)
class _OpenVersion:
    fd: int
    size: int
    inode: int
    used_at: float
    # the file mapped read-only: a chunk goes to the socket straight from the page cache (no copy in this
    # process); never closed explicitly, as frames still being sent hold views of it (freed with the last)
    mapped: mmap.mmap | None = None


@dataclass(slots=True)
class _Counters:
    requests: deque[tuple[bytes, int, int, int]] = field(
        default_factory=lambda: deque(maxlen=RECENT_REQUESTS)
    )
    max_outstanding: Counter[bytes] = field(default_factory=Counter)
    chunks_served: Counter[int] = field(default_factory=Counter)
    gone: int = 0


class WeightService:
    """A thread serving chunks of the versions in `weights_dir` on one ROUTER socket (see module doc)."""

    def __init__(
        self,
        weights_dir: Path,
        cfg: WeightsConfig,
        keys: ServerKeys | None = None,
        broker_host: str = "127.0.0.1",
    ) -> None:
        self.weights_dir = Path(weights_dir)
        self.cfg = cfg
        self.keys = keys
        self.broker_host = broker_host
        self.endpoint = ""
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._router: zmq.Socket[bytes] | None = None
        self._zap: ZapHandler | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._answering = threading.Event()
        self._answering.set()
        self._lock = threading.Lock()  # guards _counters (read by stats() from other threads)
        self._counters = _Counters()
        self._open: dict[int, _OpenVersion] = {}
        self._pending: deque[tuple[bytes, protocol.WeightsChunkRequest]] = deque()

    # ------------------------------------------------------------------ life cycle

    def start(self) -> None:
        """Bind and start serving; WeightServiceError (one line) when it cannot."""
        host, port = self.cfg.bind_host, self.cfg.port
        if not is_loopback(host) and self.keys is None:
            raise WeightServiceError(
                f"weights.bind_host = {host!r}: binding a non-loopback address needs CurveZMQ keys: run "
                "`april keys generate DIR` and set broker.curve_keys_dir = DIR (or bind 127.0.0.1)"
            )
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        zap = ZapHandler(ctx, self.keys.authorized) if self.keys is not None else None
        router = configure(ctx.socket(zmq.ROUTER), REQUEST_MAX_BYTES)
        router.setsockopt(zmq.ROUTER_MANDATORY, 0)  # a peer gone mid-answer: drop its chunks quietly
        # answers a peer has not read are bounded per connection (past it the ROUTER drops them and the
        # fetcher asks again after timeout_s): a client asking without reading cannot fill our memory
        router.setsockopt(zmq.SNDHWM, protocol.MAX_WEIGHTS_WINDOW)
        if self.keys is not None:
            curve_server(router, self.keys)
        address = f"[{host}]" if ":" in host else host
        try:
            router.bind(f"tcp://{address}:{port}")
        except zmq.ZMQError as exc:
            router.close(linger=0)
            if zap is not None:
                zap.close()
            ctx.term()
            if exc.errno == errno.EADDRINUSE:
                raise WeightServiceError(
                    f"weights.port = {port}: busy on {host} (is another learner running?)"
                ) from None
            raise WeightServiceError(
                f"weights.bind_host = {host!r}: cannot bind port {port}: {exc}"
            ) from None
        self._ctx, self._router, self._zap = ctx, router, zap
        self.endpoint = f"tcp://{advertised_host(self.cfg, self.broker_host)}:{port}"
        # the sockets move to the service thread here and are touched by no other thread from now on
        self._thread = threading.Thread(target=self._serve, name="weight-service", daemon=True)
        self._thread.start()
        log.info("weight service on %s (%s)", self.endpoint, "CURVE" if self.keys else "no CURVE")

    def stop(self) -> None:
        """Stop serving; requests waiting (while paused) are dropped unanswered, as by a crash."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def pause(self) -> None:
        """Fault injection: keep reading requests, answer none, until `resume()`."""
        self._answering.clear()

    def resume(self) -> None:
        self._answering.set()

    def stats(self) -> ServiceStats:
        with self._lock:
            c = self._counters
            return ServiceStats(list(c.requests), dict(c.max_outstanding), dict(c.chunks_served), c.gone)

    # ------------------------------------------------------------------ the thread

    def _serve(self) -> None:
        assert self._router is not None and self._ctx is not None
        router = self._router
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        if self._zap is not None:
            poller.register(self._zap.sock, zmq.POLLIN)
        try:
            while not self._stopping.is_set():
                poller.poll(POLL_MS if not self._pending or not self._answering.is_set() else 0)
                if self._zap is not None:
                    self._zap.drain()
                self._read(router)
                while self._pending and self._answering.is_set() and not self._stopping.is_set():
                    identity, request = self._pending.popleft()
                    self._answer(router, identity, request)
                self._close_pruned(time.monotonic())
        finally:
            router.close(linger=0)
            if self._zap is not None:
                self._zap.close()
            for opened in self._open.values():
                os.close(opened.fd)
            self._open.clear()
            self._ctx.term()

    def _read(self, router: zmq.Socket[bytes]) -> None:
        """Queue every waiting request, counting how many each peer has waiting (its window in flight)."""
        while True:
            try:
                frames = router.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            identity, body = frames[0], frames[1:]
            try:
                msg = protocol.decode(body, REQUEST_MAX_BYTES)
            except ProtocolError as exc:
                self._send(router, identity, protocol.Error(exc.reason, str(exc)[:200]))
                continue
            if not isinstance(msg, protocol.WeightsChunkRequest):
                self._send(router, identity, protocol.Error("unexpected_message", type(msg).__name__))
                continue
            self._pending.append((identity, msg))
            waiting = sum(1 for peer, _ in self._pending if peer == identity)
            with self._lock:
                c = self._counters
                c.requests.append((identity, msg.version, msg.offset, msg.length))
                c.max_outstanding[identity] = max(c.max_outstanding[identity], waiting)

    def _answer(
        self, router: zmq.Socket[bytes], identity: bytes, request: protocol.WeightsChunkRequest
    ) -> None:
        opened = self._version(request.version)
        if opened is None:
            with self._lock:
                self._counters.gone += 1
            self._send(router, identity, protocol.WeightsGone(request.version, self._newest()))
            return
        if request.offset >= opened.size and opened.size > 0:
            detail = f"v{request.version}: offset {request.offset} is past the end ({opened.size} bytes)"
            self._send(router, identity, protocol.Error("bad_range", detail))
            return
        length = min(request.length, opened.size - request.offset)
        if opened.mapped is not None:  # a view of the mapped file: zmq sends it without a copy here
            chunk = np.frombuffer(opened.mapped, dtype=np.uint8, count=length, offset=request.offset)
        else:
            try:
                chunk = np.frombuffer(os.pread(opened.fd, length, request.offset), dtype=np.uint8)
            except OSError as exc:  # a failing disk: this worker hears it, the service goes on
                detail = f"v{request.version}: {exc}"[:200]
                self._send(router, identity, protocol.Error("read_failed", detail))
                return
        self._send(
            router, identity, protocol.WeightsChunk(request.version, request.offset, opened.size, chunk)
        )
        with self._lock:
            self._counters.chunks_served[request.version] += 1

    def _send(self, router: zmq.Socket[bytes], identity: bytes, msg: protocol.Message) -> None:
        router.send_multipart([identity, *protocol.encode(msg)], copy=False)

    # ------------------------------------------------------------------ files

    def _path(self, version: int) -> Path:
        return version_path(self.weights_dir, version)

    def _version(self, version: int) -> _OpenVersion | None:
        """The open file of `version`; None when it is not (or no longer) published."""
        now = time.monotonic()
        opened = self._open.get(version)
        try:
            inode = os.stat(self._path(version)).st_ino
        except OSError:  # pruned: still served from the fd a fetch opened, gone otherwise
            if opened is not None:
                opened.used_at = now
            return opened
        if opened is not None and opened.inode == inode:
            opened.used_at = now
            return opened
        if opened is not None:  # republished under the same name (a resumed run): serve the new file
            os.close(self._open.pop(version).fd)
        try:
            fd = os.open(self._path(version), os.O_RDONLY)
        except OSError:
            return None
        stat = os.fstat(fd)
        try:  # published files are immutable (written aside, renamed into place): safe to map
            mapped = mmap.mmap(fd, stat.st_size, access=mmap.ACCESS_READ) if stat.st_size else None
        except (OSError, ValueError):  # a filesystem that cannot map: served by pread
            mapped = None
        self._open[version] = _OpenVersion(fd, stat.st_size, stat.st_ino, now, mapped)
        while len(self._open) > MAX_OPEN_VERSIONS:  # the least recently used goes
            oldest = min(self._open, key=lambda v: self._open[v].used_at)
            os.close(self._open.pop(oldest).fd)
        return self._open[version]

    def _close_pruned(self, now: float) -> None:
        """Close the fds of pruned versions nobody asked for in 2 x timeout_s (their fetches are over)."""
        idle = 2 * self.cfg.timeout_s
        for version in [v for v, o in self._open.items() if now - o.used_at > idle]:
            if not self._path(version).exists():
                os.close(self._open.pop(version).fd)

    def _newest(self) -> int:
        """The newest version published (0: none)."""
        return max([*published_versions(self.weights_dir), *self._open], default=0)


def broker_host_of(address: str) -> str:
    """The host of a broker address such as tcp://10.0.0.5:5556."""
    return urlparse(address).hostname or "127.0.0.1"
