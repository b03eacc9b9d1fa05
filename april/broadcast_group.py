"""The broadcast group's shared half: its rendezvous protocol, its manifest and its collective calls.

The learner's `learner.weight_broadcast.BroadcastHub` and a worker's `actors.weight_receive.BroadcastMember`
meet in a torch.distributed TCPStore that the hub hosts (at the weight service's port + 1,
`april.weights_uri.WeightsLocation.broadcast_rendezvous`). Everything they say to each other outside the
collective itself is a key in that store, all under `april/weights/`:

    joins                     counter; `add(joins, 1)` hands a joining member its ticket t (1, 2, ...)
    join/<t>                  {"worker": id}: who holds ticket t
    latest                    the newest generation g the hub called (a group "generation": one membership)
    g<g>/call                 {"tickets": [...], "upto": T}: the hub invites these tickets to generation g;
                              tickets <= T that it does not list are not wanted (they must join anew)
    g<g>/here/<t>             a member's answer to the call
    g<g>/roster               {"size": n, "ranks": {t: rank}}: who answered in time (the hub is rank 0)
    g<g>/pg/...               the gloo (or NCCL) group's own rendezvous, under its own PrefixStore
    g<g>/m<s>                 the manifest of the s-th broadcast in generation g (`Manifest.to_json`)
    g<g>/m<s>/d<i>            sha256 of bucket i's bytes, set before bucket i is sent
    g<g>/end                  why the hub ended generation g: "reform" (members stay, a new generation
                              with newcomers follows: answer its call) or "failed" (join anew)

A version travels as flat buckets: the tensors of one dtype are laid end to end as one stream, and each
stream is cut into buckets of at most `bucket_bytes` (a tensor may span buckets), so a broadcast is a few
collective calls rather than one per parameter and the sender's buffer stays bounded by the bucket size.

Owns that protocol, the manifest, forming a group and waiting on one collective call with a deadline.
Holds no state and runs no thread: the hub and the member do. Imports torch only inside the functions that
need it (april/ never loads torch at import time).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    from torch._C._distributed_c10d import Backend, Store, Work

ROOT = "april/weights/"
POLL_S = 0.02  # how often a store key is looked at while waiting for it (a store call is ~0.1 ms)
JOINS = "joins"
LATEST = "latest"
END_REFORM = "reform"
END_FAILED = "failed"


class BroadcastError(Exception):
    """The group cannot go on (a peer died, was late or slow, or sent what the protocol does not allow).

    One readable line; the group that raised it is finished and its members join anew."""


def join_key(ticket: int) -> str:
    return f"join/{ticket}"


def call_key(generation: int) -> str:
    return f"g{generation}/call"


def here_key(generation: int, ticket: int) -> str:
    return f"g{generation}/here/{ticket}"


def roster_key(generation: int) -> str:
    return f"g{generation}/roster"


def end_key(generation: int) -> str:
    return f"g{generation}/end"


def manifest_key(generation: int, seq: int) -> str:
    return f"g{generation}/m{seq}"


def digest_key(generation: int, seq: int, bucket: int) -> str:
    return f"g{generation}/m{seq}/d{bucket}"


@dataclass(frozen=True, slots=True)
class Entry:
    """One named tensor: `numel(shape)` elements of stream `dtype` from element `offset` on."""

    name: str
    dtype: str  # torch dtype name without "torch.", e.g. "bfloat16"
    shape: tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True, slots=True)
class Bucket:
    """Elements [start, start + numel) of stream `dtype`: what one collective call carries."""

    dtype: str
    start: int
    numel: int


@dataclass(frozen=True, slots=True)
class Manifest:
    """What the s-th broadcast of a generation carries: the tensors, the streams and their buckets."""

    version: int
    entries: tuple[Entry, ...]
    streams: tuple[tuple[str, int], ...]  # (dtype, elements), in send order
    buckets: tuple[Bucket, ...]

    def to_json(self) -> str:
        return json.dumps(
            {
                "version": self.version,
                "entries": [[e.name, e.dtype, list(e.shape), e.offset] for e in self.entries],
                "streams": [list(s) for s in self.streams],
                "buckets": [[b.dtype, b.start, b.numel] for b in self.buckets],
            }
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> Manifest:
        """The manifest in `text`; BroadcastError naming what is wrong if it is not a consistent one."""
        try:
            raw = json.loads(text)
            entries = tuple(
                Entry(str(n), str(d), tuple(int(x) for x in s), int(o)) for n, d, s, o in raw["entries"]
            )
            streams = tuple((str(d), int(n)) for d, n in raw["streams"])
            buckets = tuple(Bucket(str(d), int(s), int(n)) for d, s, n in raw["buckets"])
            manifest = cls(int(raw["version"]), entries, streams, buckets)
        except (ValueError, KeyError, TypeError) as exc:
            raise BroadcastError(f"broadcast manifest: malformed ({exc})") from exc
        manifest.check()
        return manifest

    def check(self) -> None:
        """Every entry lies inside its stream and the buckets tile every stream exactly, in order."""
        sizes = dict(self.streams)
        for dtype, total in self.streams:
            if itemsize(dtype) and total < 0:
                raise BroadcastError(f"broadcast manifest: stream {dtype} has {total} elements")
        for e in self.entries:
            if e.dtype not in sizes or e.offset < 0 or min(e.shape, default=0) < 0:
                raise BroadcastError(
                    f"broadcast manifest: entry {e.name!r}: no such stream, or a negative size"
                )
            if e.offset + e.numel > sizes[e.dtype]:
                raise BroadcastError(f"broadcast manifest: entry {e.name!r} runs past its {e.dtype} stream")
        covered = dict.fromkeys(sizes, 0)
        for b in self.buckets:
            if b.dtype not in covered or b.start != covered[b.dtype] or b.numel <= 0:
                raise BroadcastError(f"broadcast manifest: bucket {b} does not continue its stream")
            covered[b.dtype] += b.numel
        if covered != sizes:
            raise BroadcastError("broadcast manifest: the buckets do not cover every stream")

    @property
    def nbytes(self) -> int:
        return sum(b.numel * itemsize(b.dtype) for b in self.buckets)


def plan(version: int, specs: Sequence[tuple[str, str, tuple[int, ...]]], bucket_bytes: int) -> Manifest:
    """The manifest for tensors `specs` = (name, dtype, shape): streams by dtype in order of first
    appearance, each cut into buckets of at most `bucket_bytes` (at least one element each)."""
    offsets: dict[str, int] = {}
    entries = []
    for name, dtype, shape in specs:
        entry = Entry(name, dtype, tuple(shape), offsets.get(dtype, 0))
        entries.append(entry)
        offsets[dtype] = entry.offset + entry.numel
    buckets = []
    for dtype, total in offsets.items():
        per = max(1, bucket_bytes // itemsize(dtype))
        buckets += [Bucket(dtype, start, min(per, total - start)) for start in range(0, total, per)]
    return Manifest(version, tuple(entries), tuple(offsets.items()), tuple(buckets))


_ITEMSIZE = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4, "int16": 2,
    "int8": 1, "uint8": 1, "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
}  # fmt: skip


def itemsize(dtype: str) -> int:
    """Bytes per element of a manifest dtype; BroadcastError for one the broadcast does not carry."""
    if dtype not in _ITEMSIZE:
        raise BroadcastError(f"broadcast manifest: dtype {dtype!r} is not one the broadcast carries")
    return _ITEMSIZE[dtype]


def dtype_name(tensor: torch.Tensor) -> str:
    """ "float32" for torch.float32: the name a manifest carries."""
    name = str(tensor.dtype).removeprefix("torch.")
    itemsize(name)
    return name


def digest(buffer: torch.Tensor) -> str:
    """sha256 (hex) of a contiguous 1-D tensor's bytes; a device tensor is copied to the host first."""
    import torch

    host = buffer.detach().cpu().contiguous().view(-1).view(torch.uint8)
    # hashlib drops the GIL on big buffers, so hashing one bucket overlaps the transfer of another
    return hashlib.sha256(host.numpy().data).hexdigest()


def check_bucket(buffer: torch.Tensor, expected: str, index: int) -> None:
    """BroadcastError unless bucket `index`'s bytes hash to `expected` (the sender's sha256)."""
    got = digest(buffer)
    if got != expected:
        raise BroadcastError(f"broadcast bucket {index}: sha256 {got[:12]}... expected {expected[:12]}...")


def open_store(host: str, port: int, timeout_s: float, bind: bool = False) -> Store:
    """The rendezvous store at (host, port) under ROOT: hosted here (`bind`: listening on exactly that
    address, not on every interface) or reached as a client; waits at most `timeout_s` to connect."""
    from torch._C._distributed_c10d import PrefixStore, TCPStore

    timeout = datetime.timedelta(seconds=timeout_s)
    if not bind:
        return PrefixStore(ROOT, TCPStore(host, port, timeout=timeout))
    info = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    listener = socket.socket(info[0], socket.SOCK_STREAM)
    try:
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(info[4])
        listener.listen(128)
        fd = listener.fileno()
        master = TCPStore(
            host, port, is_master=True, wait_for_workers=False, timeout=timeout, master_listen_fd=fd
        )
    except BaseException:
        listener.close()
        raise
    listener.detach()  # the store owns the socket now
    return PrefixStore(ROOT, master)


def open_group(
    store: Store, generation: int, rank: int, size: int, address: str, timeout_s: float, backend: str = "gloo"
) -> Backend:
    """This process's rank in generation `generation`'s group, connected to every other rank.

    Its own group, never the default one (the learner's DeepSpeed group, if any, is untouched). Blocks
    until all `size` ranks connected, at most about `timeout_s`; every call on it times out after
    `timeout_s` too. gloo binds its sockets to `address`. Raises BroadcastError."""
    from torch._C import _distributed_c10d as c10d

    timeout = datetime.timedelta(seconds=timeout_s)
    prefix = c10d.PrefixStore(f"g{generation}/pg/", store)
    try:
        if backend == "gloo":
            options = c10d.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # (no stub)
            options._devices = [c10d.ProcessGroupGloo.create_device(hostname=address)]
            options._timeout = timeout
            group: Backend = c10d.ProcessGroupGloo(prefix, rank, size, options)
            return group
        if backend == "nccl":  # untested here (no GPU in CI); the same store, a device tensor per call
            nccl = c10d.ProcessGroupNCCL  # absent from CPU builds of torch
            nccl_options = nccl.Options()
            nccl_options._timeout = timeout
            nccl_group: Backend = nccl(prefix, rank, size, nccl_options)
            return nccl_group
    except (RuntimeError, ValueError) as exc:
        raise BroadcastError(f"broadcast group g{generation}: could not form ({_line(exc)})") from exc
    raise BroadcastError(f"broadcast backend {backend!r}: expected 'gloo' or 'nccl'")


def start_broadcast(group: Any, tensor: torch.Tensor) -> Work:
    """Start broadcasting `tensor` from rank 0 (the hub) on `group` (an `open_group` result; Any because
    torch's stubs give Backend no collective methods); returns the call's Work."""
    from torch._C._distributed_c10d import BroadcastOptions

    options = BroadcastOptions()
    options.rootRank = 0
    try:
        work: Work = group.broadcast([tensor], options)
        return work
    except RuntimeError as exc:
        raise BroadcastError(f"broadcast: {_line(exc)}") from exc


def await_work(
    work: Work, timeout_s: float, stop: threading.Event | None = None, what: str = "broadcast"
) -> None:
    """Wait for one collective call: at most `timeout_s`, and no longer than `stop` stays clear.

    BroadcastError if it failed, timed out or was given up for `stop` (the call then ends by the group's
    own timeout, in the group's thread)."""
    done = threading.Event()
    work.get_future().add_done_callback(lambda _: done.set())
    deadline = time.monotonic() + timeout_s
    while not done.wait(min(0.1, max(0.0, deadline - time.monotonic()))):
        if stop is not None and stop.is_set():
            raise BroadcastError(f"{what}: given up (closing)")
        if time.monotonic() >= deadline:
            raise BroadcastError(f"{what}: no progress in {timeout_s:g} s")
    try:
        work.wait()
    except RuntimeError as exc:
        raise BroadcastError(f"{what}: {_line(exc)}") from exc


def _line(exc: BaseException) -> str:
    """The first line of an exception's message, without torch's source location prefix."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text.split("] ", 1)[1] if text.startswith("[") and "] " in text else text
