"""Fetching a weights version from the learner's weight service into a local cache (the network transport,
docs/design.md section 6; the service is `learner.weight_service`, whose docstring says why ZeroMQ).

Public API (used by `actors.weight_sync`, the benchmarks and the multi-host test):

    fetcher = WeightFetcher(cfg, cache_dir, keys=None, identity="worker-0")
    fetcher.fetch(location, sha256)   # start, or supersede an older fetch; never blocks
    fetcher.poll() -> list[Fetched | FetchFailed]   # finished results since the last poll
    fetcher.close()

One background thread per worker. `fetch` of a version newer than the one in progress abandons the older
(a worker that missed versions fetches only the latest); an older or equal one is ignored. The thread keeps
`cfg.window` WeightsChunkRequests of `cfg.chunk_bytes` in flight on one DEALER socket (memory: at most
window x chunk_bytes in flight whatever the model size), writes each chunk at its offset into
`vNNNNNN.safetensors.part` in the cache directory, and a second thread hashes the chunks' bytes as they
join the contiguous prefix (hashing overlaps the transfer; at most 2 x window chunks wait for it).
A dropped connection (the socket's monitor reports it) or a chunk unanswered for `cfg.timeout_s` closes
the socket and resumes from the contiguous prefix on a new one. When every byte is in, the sha256 is
checked, the file renamed to `vNNNNNN.safetensors`, and older versions deleted from the cache (the newest
`cfg.keep` stay). A failure (no answer, refused keys, sha256 mismatch) is reported once per version and
the fetch retried with backoff (1 s doubling to 32 s) for as long as its version is the newest asked for;
a version the service says is gone is not retried (a newer one is announced by then).

Does not load weights (the worker does, between engine steps) nor choose the transport (`actors.weight_sync`).
"""

from __future__ import annotations

import enum
import hashlib
import logging
import os
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import zmq
from zmq.utils.monitor import recv_monitor_message

from april import protocol
from april.codec import ProtocolError
from april.config import WeightsConfig
from april.files import sha256_file
from april.keys import ClientKeys
from april.transport import configure, curve_client
from april.weights_uri import WeightsLocation, published_versions, version_path

log = logging.getLogger("april.weights")
POLL_MS = 50
BACKOFF_FIRST_S, BACKOFF_MAX_S = 1.0, 32.0
PART_SUFFIX = ".part"
DROPPED_EVENTS = zmq.EVENT_DISCONNECTED
REFUSED_EVENTS = (
    zmq.EVENT_HANDSHAKE_FAILED_AUTH
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
)


@dataclass(frozen=True, slots=True)
class Fetched:
    """Version `version` is verified and in the cache at `path`: `bytes` fetched in `seconds`."""

    version: int
    path: Path
    seconds: float
    bytes: int


@dataclass(frozen=True, slots=True)
class FetchFailed:
    """Fetching `version` failed (reported once per version; it is retried while it is the newest)."""

    version: int
    reason: str


FetchResult = Fetched | FetchFailed


class _End(enum.Enum):
    DONE = "done"  # every byte is in
    SUPERSEDED = "superseded"
    CLOSED = "closed"


class _Retry(Exception):
    """This connection is done for; resume on a new one (`progressed`: bytes came on this one)."""

    def __init__(self, reason: str, progressed: bool) -> None:
        super().__init__(reason)
        self.progressed = progressed


class _Failed(Exception):
    """The fetch failed; `final`: do not retry (the service no longer has the version)."""

    def __init__(self, reason: str, final: bool = False) -> None:
        super().__init__(reason)
        self.final = final


@dataclass(slots=True)
class _Job:
    location: WeightsLocation
    sha256: str
    started: float = field(default_factory=time.monotonic)

    @property
    def version(self) -> int:
        return self.location.version


class _PrefixHasher:
    """The sha256 of a file's contiguous prefix, computed on a thread of its own from the chunks' bytes as
    they join the prefix (hashing overlaps receiving and writing instead of adding to them, and nothing is
    read back). At most `limit` chunks wait to be hashed: `feed` waits for room beyond that, so memory
    stays bounded whatever the model size."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.digest = hashlib.sha256()
        self.hashed = 0  # bytes hashed so far
        self.queue: deque[memoryview] = deque()  # chunks of the prefix, in order, not yet hashed
        self.closed = False
        self.cond = threading.Condition()
        self.thread = threading.Thread(target=self._run, name="weight-hash", daemon=True)
        self.thread.start()

    def feed(self, chunk: memoryview) -> None:
        """The next chunk of the prefix (the caller keeps the order)."""
        with self.cond:
            self.cond.wait_for(lambda: len(self.queue) < self.limit or self.closed)
            self.queue.append(chunk)
            self.cond.notify_all()

    def hexdigest(self, size: int) -> str:
        """The sha256 of the first `size` bytes, once they are hashed."""
        with self.cond:
            self.cond.wait_for(lambda: self.hashed >= size or self.closed)
            return self.digest.hexdigest()

    def close(self) -> None:
        with self.cond:
            self.closed = True
            self.queue.clear()
            self.cond.notify_all()
        self.thread.join()

    def _run(self) -> None:
        while True:
            with self.cond:
                self.cond.wait_for(lambda: self.closed or bool(self.queue))
                if self.closed:
                    return
                chunk = self.queue[0]
            self.digest.update(chunk)  # outside the lock: sha256 releases the GIL on large buffers
            with self.cond:
                if self.queue:
                    self.queue.popleft()
                self.hashed += len(chunk)
                self.cond.notify_all()


@dataclass(slots=True)
class _Part:
    """A download in progress: the .part file, its contiguous prefix and the hash of that prefix. Chunks
    that came ahead of the prefix are kept (at most a window of them) until the prefix reaches them."""

    path: Path
    fd: int
    size: int
    window: int
    prefix: int = 0
    ahead: dict[int, memoryview] = field(default_factory=dict)  # offset -> chunk past the prefix
    hasher: _PrefixHasher | None = None

    def __post_init__(self) -> None:
        self.hasher = _PrefixHasher(2 * self.window)

    def write(self, offset: int, data: memoryview) -> None:
        os.pwrite(self.fd, data, offset)
        if offset != self.prefix:
            self.ahead[offset] = data
            return
        assert self.hasher is not None
        self.hasher.feed(data)
        self.prefix += len(data)
        while self.prefix in self.ahead:  # chunks that came early join the prefix
            chunk = self.ahead.pop(self.prefix)
            self.hasher.feed(chunk)
            self.prefix += len(chunk)

    def hexdigest(self) -> str:
        assert self.hasher is not None
        return self.hasher.hexdigest(self.size)

    def restart(self) -> None:
        """Start over (the bytes did not hash to the announced sha256)."""
        assert self.hasher is not None
        self.hasher.close()
        os.ftruncate(self.fd, 0)
        self.prefix, self.hasher = 0, _PrefixHasher(2 * self.window)
        self.ahead.clear()

    def close(self) -> None:
        if self.hasher is not None:
            self.hasher.close()
        os.close(self.fd)


class WeightFetcher:
    """Fetches the newest version asked for into `cache_dir`, on a thread of its own (see module doc)."""

    def __init__(
        self, cfg: WeightsConfig, cache_dir: Path, keys: ClientKeys | None = None, identity: str = ""
    ) -> None:
        self.cfg = cfg
        self.cache_dir = Path(cache_dir)
        self.keys = keys
        self.identity = identity
        self.chunk_bytes = min(cfg.chunk_bytes, protocol.MAX_WEIGHTS_CHUNK)
        self.window = min(cfg.window, protocol.MAX_WEIGHTS_WINDOW)  # the service queues no more per peer
        self._lock = threading.Condition()
        self._wanted: _Job | None = None  # the newest version asked for, until it is done or gone
        self._results: list[FetchResult] = []
        self._closing = False
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._thread = threading.Thread(target=self._run, name="weight-fetch", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ the caller's side

    def fetch(self, location: WeightsLocation, sha256: str) -> None:
        """Fetch `location` (an april+tcp location) unless a newer version is wanted already."""
        if not location.service:
            raise ValueError(f"v{location.version}: no weight service to fetch from ({location.uri()})")
        with self._lock:
            if self._wanted is not None and self._wanted.version >= location.version:
                return
            self._wanted = _Job(location, sha256)
            self._lock.notify_all()

    def poll(self) -> list[FetchResult]:
        with self._lock:
            results, self._results = self._results, []
        return results

    def close(self) -> None:
        with self._lock:
            self._closing = True
            self._lock.notify_all()
        self._thread.join()
        self._ctx.term()

    # ------------------------------------------------------------------ the thread

    def _current(self, job: _Job) -> bool:
        with self._lock:
            return not self._closing and self._wanted is job

    def _report(self, result: FetchResult) -> None:
        with self._lock:
            self._results.append(result)

    def _run(self) -> None:
        while True:
            with self._lock:
                while not self._closing and self._wanted is None:
                    self._lock.wait()
                if self._closing:
                    return
                job = self._wanted
            assert job is not None
            try:
                self._fetch(job)
            except Exception as exc:  # a bug must not kill the thread: every later version would hang
                log.exception("weights v%d: the fetch failed unexpectedly", job.version)
                self._report(FetchFailed(job.version, f"fetch failed: {exc!r}"[:500]))
            with self._lock:
                if self._wanted is job:
                    self._wanted = None

    def _fetch(self, job: _Job) -> None:
        """Fetch `job` until it is done, gone, superseded, or the fetcher closes; retry with backoff,
        keeping the bytes already in (a retry resumes from the contiguous prefix). A cache that cannot be
        written (OSError: full, not writable) fails the fetch like a peer would, and is retried too."""
        part: _Part | None = None
        backoff = BACKOFF_FIRST_S
        reported = False
        try:
            while self._current(job):
                try:
                    if part is None:
                        part = self._start(job)
                    if part is None or self._attempt(job, part) is not _End.DONE:
                        return  # found in the cache, or superseded or closing: the newer job runs next
                    self._finish(job, part)
                    return
                except (_Failed, OSError) as exc:
                    reason = str(exc) if isinstance(exc, _Failed) else f"cache {self.cache_dir}: {exc}"
                    if not reported:
                        log.warning("weights v%d not fetched: %s", job.version, reason)
                        self._report(FetchFailed(job.version, reason[:500]))
                        reported = True
                    if (isinstance(exc, _Failed) and exc.final) or not self._sleep(job, backoff):
                        return
                    backoff = min(2 * backoff, BACKOFF_MAX_S)
        finally:
            if part is not None:
                part.close()
                part.path.unlink(missing_ok=True)

    def _start(self, job: _Job) -> _Part | None:
        """The .part file to fetch into; None when the cache holds the version already (a restarted
        worker), which is then reported fetched."""
        final = self.cache_dir / job.location.file_name
        if final.is_file() and sha256_file(final) == job.sha256:
            self._report(Fetched(job.version, final, time.monotonic() - job.started, 0))
            self._prune(job.version)
            return None
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        path = self.cache_dir / (job.location.file_name + PART_SUFFIX)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        return _Part(path, fd, job.location.size, self.window)

    def _finish(self, job: _Job, part: _Part) -> None:
        """Every byte is in and verified: into the cache under its name, older versions out."""
        final = self.cache_dir / job.location.file_name
        os.replace(part.path, final)
        seconds = time.monotonic() - job.started
        self._report(Fetched(job.version, final, seconds, part.size))
        log.info("weights v%d fetched: %d bytes in %.3fs", job.version, part.size, seconds)
        self._prune(job.version)

    def _sleep(self, job: _Job, seconds: float) -> bool:
        """Wait `seconds` unless superseded or closing first; True if the job is still current."""
        deadline = time.monotonic() + seconds
        with self._lock:
            while not self._closing and self._wanted is job and time.monotonic() < deadline:
                self._lock.wait(deadline - time.monotonic())
            return not self._closing and self._wanted is job

    def _attempt(self, job: _Job, part: _Part) -> _End:
        """Fetch the rest of `part` over as many connections as it takes while bytes keep coming, then
        check the sha256. Raises _Failed (a connection that brought nothing, a sha256 mismatch)."""
        while True:
            try:
                end = self._transfer(job, part)
            except _Retry as exc:
                if not exc.progressed:
                    raise _Failed(str(exc)) from None
                log.info("weights v%d: %s; resuming at byte %d", job.version, exc, part.prefix)
                continue
            if end is not _End.DONE:
                return end
            got = part.hexdigest()
            if got != job.sha256:
                part.restart()
                raise _Failed(f"sha256 of the fetched v{job.version} is {got}, announced {job.sha256}")
            return _End.DONE

    def _transfer(self, job: _Job, part: _Part) -> _End:
        """Fetch the rest of `part` over one new connection; _Retry when it drops or stalls."""
        sock = configure(self._ctx.socket(zmq.DEALER), self.chunk_bytes + 4096)
        curve_client(sock, self.keys)
        if self.identity:
            sock.setsockopt(zmq.IDENTITY, f"{self.identity}-{os.urandom(4).hex()}".encode())
        monitor = sock.get_monitor_socket(DROPPED_EVENTS | REFUSED_EVENTS)
        sock.connect(job.location.service)
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        in_flight: dict[int, float] = {}  # offset -> when it was asked for
        next_offset = part.prefix
        started_at = part.prefix
        try:
            while part.prefix < part.size:
                if not self._current(job):
                    return _End.CLOSED if self._closing else _End.SUPERSEDED
                while len(in_flight) < self.window and next_offset < part.size:
                    length = min(self.chunk_bytes, part.size - next_offset)
                    request = protocol.WeightsChunkRequest(job.version, next_offset, length)
                    sock.send_multipart(protocol.encode(request))
                    in_flight[next_offset] = time.monotonic()
                    next_offset += length
                events = dict(poller.poll(POLL_MS))
                if monitor in events:
                    self._check_monitor(monitor, part.prefix > started_at)
                if sock in events:
                    self._receive(sock, job, part, in_flight)
                oldest = min(in_flight.values(), default=time.monotonic())
                if time.monotonic() - oldest > self.cfg.timeout_s:
                    raise _Retry(
                        f"no answer from {job.location.service} for {self.cfg.timeout_s:g}s",
                        part.prefix > started_at,
                    )
            return _End.DONE
        finally:
            sock.disable_monitor()
            monitor.close(linger=0)
            sock.close(linger=0)

    def _check_monitor(self, monitor: zmq.Socket[bytes], progressed: bool) -> None:
        while True:
            try:
                event = recv_monitor_message(monitor, zmq.NOBLOCK)
            except zmq.Again:
                return
            kind = int(event["event"])
            if kind & zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                raise _Failed(
                    "the weight service refused this worker's CurveZMQ keys (handshake failed): "
                    "check broker.curve_keys_dir here holds weights.key and an authorised client pair"
                )
            if kind & REFUSED_EVENTS:  # no detail: wrong keys, or the service went away mid-handshake
                raise _Failed(
                    "the CurveZMQ handshake with the weight service failed (keys that do not match its "
                    "weights.key, or the service stopped during it)"
                )
            if kind & DROPPED_EVENTS:
                raise _Retry("connection to the weight service dropped", progressed)

    def _receive(self, sock: zmq.Socket[bytes], job: _Job, part: _Part, in_flight: dict[int, float]) -> None:
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                msg = protocol.decode([f.buffer for f in frames], self.chunk_bytes + 4096)
            except ProtocolError as exc:
                raise _Failed(f"the weight service sent a malformed message: {exc}") from None
            match msg:
                case protocol.WeightsChunk(version=version, offset=offset, size=size, data=data):
                    if version != job.version or offset not in in_flight:
                        continue  # a late answer to a request of an earlier connection or version
                    if size != part.size:
                        raise _Failed(f"v{version} is {size} bytes on the learner, announced {part.size}")
                    expected = min(self.chunk_bytes, part.size - offset)
                    if len(data) != expected:
                        raise _Failed(
                            f"v{version}: chunk at {offset} has {len(data)} bytes, expected {expected}"
                        )
                    del in_flight[offset]
                    part.write(offset, data.data)
                case protocol.WeightsGone(version=version, newest=newest):
                    if version == job.version:
                        raise _Failed(
                            f"v{version} is gone from the learner (it serves v{newest})", final=True
                        )
                case protocol.Error(code=code, detail=detail):
                    raise _Failed(f"the weight service refused a request: {code}: {detail}")
                case _:
                    raise _Failed(f"unexpected {type(msg).__name__} from the weight service")

    def _prune(self, version: int) -> None:
        """Keep the newest `cfg.keep` versions in the cache (always `version`); drop stale .part files."""
        cached = published_versions(self.cache_dir)
        keep = {version, *cached[-self.cfg.keep :]}
        for v in cached:
            if v not in keep:
                version_path(self.cache_dir, v).unlink(missing_ok=True)
        for p in self.cache_dir.glob(f"v*.safetensors{PART_SUFFIX}"):
            with self._lock:
                busy = self._wanted is not None and p.name.startswith(self._wanted.location.file_name)
            if not busy:
                p.unlink(missing_ok=True)
