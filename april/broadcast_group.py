"""The broadcast group's shared half: its rendezvous protocol, its manifest and its collective calls.

The learner's `learner.weight_broadcast.BroadcastHub` and a worker's `actors.weight_receive.BroadcastMember`
meet in a torch.distributed TCPStore that the hub hosts (at the weight service's port + 1,
`april.weights_uri.WeightsLocation.broadcast_rendezvous`). What they say outside the collective is a key
under `april/weights/`; the keys, the manifest, the group's store prefixes (SGLang's
`init_custom_process_group`, so that SGLang servers are ranks of the same group) and the verification
samples are docs/protocol.md section 16's contract.

A version travels as SGLang's flattened buckets: whole tensors laid back to back as bytes, at most
`bucket_bytes` a bucket (a larger tensor alone), ordered so each tensor's offset is a multiple of its
element size; one collective call per bucket.

Owns that protocol, the manifest, forming a group and waiting on one collective call with a deadline.
Holds no state and runs no thread: the hub and the member do. Imports torch only inside the functions that
need it (april/ never loads torch at import time).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import math
import socket
import threading
import time
from collections.abc import Callable, Sequence
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
SAMPLE_VALUES = 32  # first values of each bucket's sampled tensor, checked on SGLang servers
# SGLang's get_weights_by_name turns the whole tensor into a Python list before it truncates (models/
# llama.py: .tolist()[:truncate_size]): a tensor larger than this is never sampled (seconds and GBs a call)
SAMPLE_MAX_NUMEL = 1 << 22
SAMPLE_RTOL = 2.0**-8  # one bfloat16 rounding: a server may hold the weights narrower than they were sent


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


def group_name(hub: str, generation: int) -> str:
    """The torch process group name of a hub's generation: unique per hub, so a server that outlived a
    learner (SGLang keeps its groups by name) never meets a name twice."""
    return f"april-{hub}-g{generation}"


@dataclass(frozen=True, slots=True)
class Roster:
    """Who is in generation g: each ticket's first rank (a member may take several: its servers' ranks),
    the group's size with the hub's rank 0, its torch name and backend."""

    size: int
    ranks: dict[int, int]
    group: str
    backend: str

    def to_json(self) -> str:
        ranks = {str(t): r for t, r in self.ranks.items()}
        return json.dumps({"size": self.size, "ranks": ranks, "group": self.group, "backend": self.backend})

    @classmethod
    def from_json(cls, text: str | bytes) -> Roster:
        try:
            raw = json.loads(text)
            ranks = {int(t): int(r) for t, r in raw["ranks"].items()}
            return cls(int(raw["size"]), ranks, str(raw["group"]), str(raw["backend"]))
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise BroadcastError(f"broadcast roster: malformed ({exc})") from exc


@dataclass(frozen=True, slots=True)
class Entry:
    """One named tensor: `nbytes(dtype, shape)` bytes of its bucket from byte `offset` on."""

    name: str
    dtype: str  # torch dtype name without "torch.", e.g. "bfloat16"
    shape: tuple[int, ...]
    offset: int

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * itemsize(self.dtype)


@dataclass(frozen=True, slots=True)
class Sample:
    """The first values of one tensor of a bucket (as float, read row-major), to check what a server holds."""

    name: str
    values: tuple[float, ...]


@dataclass(frozen=True, slots=True)
class Bucket:
    """What one collective call carries: `entries` back to back, `nbytes` in all."""

    entries: tuple[Entry, ...]
    sample: Sample | None = None

    @property
    def nbytes(self) -> int:
        return sum(e.nbytes for e in self.entries)


@dataclass(frozen=True, slots=True)
class Manifest:
    """What the s-th broadcast of a generation carries: the version's buckets, in send order."""

    version: int
    buckets: tuple[Bucket, ...]

    @property
    def entries(self) -> tuple[Entry, ...]:
        return tuple(e for b in self.buckets for e in b.entries)

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    def to_json(self) -> str:
        return json.dumps(
            {
                "version": self.version,
                "buckets": [
                    {
                        "entries": [[e.name, e.dtype, list(e.shape), e.offset] for e in b.entries],
                        "sample": None if b.sample is None else [b.sample.name, list(b.sample.values)],
                    }
                    for b in self.buckets
                ],
            }
        )

    @classmethod
    def from_json(cls, text: str | bytes) -> Manifest:
        """The manifest in `text`; BroadcastError naming what is wrong if it is not a consistent one."""
        try:
            raw = json.loads(text)
            buckets = []
            for b in raw["buckets"]:
                entries = tuple(
                    Entry(str(n), str(d), tuple(int(x) for x in s), int(o)) for n, d, s, o in b["entries"]
                )
                sample = b["sample"]
                if sample is not None:
                    sample = Sample(str(sample[0]), tuple(float(v) for v in sample[1]))
                buckets.append(Bucket(entries, sample))
            manifest = cls(int(raw["version"]), tuple(buckets))
        except (ValueError, KeyError, TypeError, IndexError) as exc:
            raise BroadcastError(f"broadcast manifest: malformed ({exc})") from exc
        manifest.check()
        return manifest

    def check(self) -> None:
        """Each bucket's entries lie back to back from byte 0, each at a multiple of its element size (what
        SGLang's FlattenedTensorBucket.empty computes from names, dtypes and shapes alone)."""
        for i, bucket in enumerate(self.buckets):
            offset = 0
            for e in bucket.entries:
                if min(e.shape, default=0) < 0:
                    raise BroadcastError(f"broadcast manifest: entry {e.name!r} has a negative size")
                if e.offset != offset or offset % itemsize(e.dtype):
                    raise BroadcastError(
                        f"broadcast manifest: bucket {i} entry {e.name!r} at byte {e.offset}, expected "
                        f"{offset} aligned to {itemsize(e.dtype)}"
                    )
                offset += e.nbytes
            names = {e.name for e in bucket.entries}
            if bucket.sample is not None and bucket.sample.name not in names:
                raise BroadcastError(
                    f"broadcast manifest: bucket {i} samples {bucket.sample.name!r}, not its own"
                )


def plan(
    version: int,
    specs: Sequence[tuple[str, str, tuple[int, ...]]],
    bucket_bytes: int,
    sample: Callable[[str], tuple[float, ...]] | None = None,
) -> Manifest:
    """The manifest for tensors `specs` = (name, dtype, shape): whole tensors in buckets of at most
    `bucket_bytes` in their order (a larger tensor alone), each bucket's entries ordered by element size,
    largest first (so every offset is aligned), and, given `sample` (name -> first values), each bucket's
    sampled tensor (`sample_entry`)."""
    groups: list[list[tuple[str, str, tuple[int, ...]]]] = [[]]
    used = 0
    for spec in specs:
        size = math.prod(spec[2]) * itemsize(spec[1])
        if groups[-1] and used + size > bucket_bytes:
            groups.append([])
            used = 0
        groups[-1].append(spec)
        used += size
    buckets = []
    for group in groups if groups[0] else []:
        entries, offset = [], 0
        for name, dtype, shape in sorted(group, key=lambda s: -itemsize(s[1])):  # stable: ties keep order
            entries.append(Entry(name, dtype, tuple(shape), offset))
            offset += entries[-1].nbytes
        chosen = sample_entry(entries) if sample is not None else None
        sampled = None if chosen is None or sample is None else Sample(chosen.name, sample(chosen.name))
        buckets.append(Bucket(tuple(entries), sampled))
    return Manifest(version, tuple(buckets))


_FLOATS = ("float64", "float32", "float16", "bfloat16")
# sglang/srt/models/llama.py: get_weights_by_name maps k_proj / v_proj into qkv_proj at offsets computed
# with head_dim = hidden_size // num_attention_heads, which is wrong for models whose head_dim differs
_UNSAMPLED = (".k_proj.", ".v_proj.")


def sample_entry(entries: Sequence[Entry]) -> Entry | None:
    """The tensor of a bucket whose first values are checked on SGLang servers: the smallest (the first of
    equals) non-empty floating-point one of at most SAMPLE_MAX_NUMEL values that SGLang's
    `get_weights_by_name` reads right whatever the tensor-parallel size (docs/protocol.md section 16);
    None when there is none."""
    fit = [
        e
        for e in entries
        if 0 < e.numel <= SAMPLE_MAX_NUMEL and e.dtype in _FLOATS and not any(p in e.name for p in _UNSAMPLED)
    ]
    return min(fit, key=lambda e: e.numel, default=None)


def sample_rows(entry_shape: Sequence[int]) -> int:
    """`truncate_size` for SGLang's get_weights_by_name: it answers the first `truncate_size` rows of a
    tensor (`tolist()[:truncate_size]`), so enough rows to hold SAMPLE_VALUES values."""
    if len(entry_shape) <= 1:
        return SAMPLE_VALUES
    row = math.prod(entry_shape[1:])
    return max(1, math.ceil(SAMPLE_VALUES / max(1, row)))


def sample_mismatch(expected: Sequence[float], got: Sequence[float]) -> str:
    """Why `got` (a server's first values of a tensor) is not `expected` within SAMPLE_RTOL; "" when it is."""
    if len(got) < len(expected):
        return f"{len(got)} values, expected {len(expected)}"
    for i, (want, have) in enumerate(zip(expected, got, strict=False)):
        if math.isnan(want) and math.isnan(have):
            continue
        if not abs(have - want) <= SAMPLE_RTOL * abs(want):
            return f"value {i} is {have!r}, expected {want!r}"
    return ""


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


def entry_view(bucket: torch.Tensor, entry: Entry) -> torch.Tensor:
    """Entry `entry` of a received bucket (uint8): a view of its bytes as its dtype and shape."""
    import torch

    raw = bucket[entry.offset : entry.offset + entry.nbytes]
    return raw.view(getattr(torch, entry.dtype)).view(entry.shape)


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
    """The rendezvous TCPStore at (host, port): hosted here (`bind`: listening on exactly that address,
    not on every interface) or reached as a client; waits at most `timeout_s` to connect. Its raw keys are
    the groups' (`open_group`); the protocol's are under ROOT (`protocol_keys`)."""
    from torch._C._distributed_c10d import TCPStore

    timeout = datetime.timedelta(seconds=timeout_s)
    if not bind:
        return TCPStore(host, port, timeout=timeout)
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
    return master


def protocol_keys(store: Store) -> Store:
    """The store's keys under ROOT: what the hub and its members say to each other."""
    from torch._C._distributed_c10d import PrefixStore

    return PrefixStore(ROOT, store)


def open_group(
    store: Store, group: str, rank: int, size: int, address: str, timeout_s: float, backend: str = "gloo"
) -> Backend:
    """This process's rank in the process group `group`, connected to every other rank.

    Its keys are those SGLang's ranks use (sglang/srt/utils/common.py: init_custom_process_group: the
    tcp:// rendezvous store, PrefixStore(group_name), then torch's _new_process_group_helper:
    PrefixStore(f"{group_name}/"), PrefixStore(f"{device}/") before the backend), so SGLang servers that
    joined with /init_weights_update_group are ranks of the same group. Its own group, never the default
    one (the learner's DeepSpeed group, if any, is untouched). Blocks until all `size` ranks connected, at
    most about `timeout_s`; every call on it times out after `timeout_s` too. gloo binds its sockets to
    `address`. Raises BroadcastError."""
    from torch._C import _distributed_c10d as c10d

    timeout = datetime.timedelta(seconds=timeout_s)
    device = {"gloo": "cpu", "nccl": "cuda"}.get(backend)
    if device is None:
        raise BroadcastError(f"broadcast backend {backend!r}: expected 'gloo' or 'nccl'")
    prefix = c10d.PrefixStore(f"{device}/", c10d.PrefixStore(f"{group}/", c10d.PrefixStore(group, store)))
    try:
        if backend == "gloo":
            options = c10d.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # (no stub)
            options._devices = [c10d.ProcessGroupGloo.create_device(hostname=address)]
            options._timeout = timeout
            gloo: Backend = c10d.ProcessGroupGloo(prefix, rank, size, options)
            return gloo
        nccl = c10d.ProcessGroupNCCL  # absent from CPU builds of torch; untested here (no GPU in CI)
        nccl_options = nccl.Options()
        nccl_options._timeout = timeout
        nccl_group: Backend = nccl(prefix, rank, size, nccl_options)
        return nccl_group
    except (RuntimeError, ValueError, AttributeError) as exc:
        raise BroadcastError(f"broadcast group {group}: could not form ({_line(exc)})") from exc


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
