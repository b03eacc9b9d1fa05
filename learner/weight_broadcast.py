"""The learner's end of the collective weight broadcast: `BroadcastHub`, run by the learner's rank 0.

    hub = BroadcastHub.from_config(config.weights, address)   # hosts the rendezvous store at port + 1
    report = hub.broadcast(state_dict, version)                # after the version's file is published
    hub.close()

`address` is the learner's address the workers reach (the weight service's advertised host); gloo binds
its sockets there, the rendezvous store listens on `bind_host`, port + 1. Workers join with
`actors.weight_receive.BroadcastMember` at any time; the protocol (store keys, manifest, buckets) is
`april.broadcast_group`'s.

`broadcast` is synchronous and never raises for a member's fault, and nothing in it waits longer than
`timeout_s` (a formation waits at most ~2 x timeout_s: the members' answers, then connecting):
  - with no member joined it returns at once (one store call);
  - when members joined since the last call (or the last group failed), it ends the current group
    ("reform": its members stay), calls the old members and the newcomers to a new generation, forms a
    group of those that answered within `timeout_s` with the ranks each asked for (a worker whose SGLang
    servers receive takes their ranks; the rest are reported dropped) and only then sends;
  - it publishes the version's manifest (SGLang's flattened buckets, each with the first values of one
    tensor, `april.broadcast_group.plan`) in the store and broadcasts each bucket's bytes, its sha256 set
    in the store before it is sent when a member checks them (SGLang servers are read back instead); it
    packs and hashes bucket i + 1 while bucket i is on the wire;
  - any failure (a member died, was late or slow: an error or no progress within `timeout_s`) ends the
    group: every member of it is reported dropped (gloo does not say which peer failed, and a dropped
    member may even have received the version) and must join anew, which they do by themselves; the
    report carries the error. A member that missed a version catches up through the network transport.

Memory: besides the caller's state dict, two buffers of the largest bucket (at most bucket_bytes, or one
tensor larger than that).

Security: the store and gloo are plain, unauthenticated TCP (CurveZMQ covers the broker and the weight
service, not these): anyone who reaches port + 1 can join and receive the weights. Use the broadcast on a
trusted cluster network, as NCCL is; the store listens on `bind_host` only.

Not thread-safe: one caller (the learner loop) at a time; after `close` it is not used again.

The NCCL path (`backend="nccl"`, `device="cuda"`: buffers on the GPU, a bucket hashed through a host
copy when a member checks sha256s, an ended group's communicator aborted) is the same code but untested
here: CI and this machine have no GPU, and NCCL needs a GPU per rank. Before using it: the learner and
the members must have picked their CUDA device (`torch.cuda.set_device`), and NCCL's watchdog tears the
whole process down on a timed-out collective unless TORCH_NCCL_ASYNC_ERROR_HANDLING says otherwise (set it
so a member's fault only ends the group). Only gloo on CPU is tested.
Owns the hub's side only; the learner loop decides when to call it, and the file/network transports
stay the source of truth for every version.
"""

from __future__ import annotations

import json
import secrets
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from april.broadcast_group import (
    END_FAILED,
    END_REFORM,
    JOINS,
    LATEST,
    POLL_S,
    SAMPLE_VALUES,
    BroadcastError,
    Bucket,
    Manifest,
    Roster,
    await_work,
    call_key,
    digest,
    digest_key,
    dtype_name,
    end_key,
    group_name,
    here_key,
    join_key,
    manifest_key,
    open_group,
    open_store,
    plan,
    protocol_keys,
    roster_key,
    start_broadcast,
)

if TYPE_CHECKING:
    from april.config import WeightsConfig

JOIN_RECORD_S = 2.0  # how long a ticket's holder may take to name itself


@dataclass(frozen=True, slots=True)
class BroadcastReport:
    """What one `broadcast` call did. Members are named by the worker ids they joined with."""

    version: int
    reached: tuple[str, ...]  # members the whole version was sent to
    dropped: tuple[str, ...]  # members this call dropped from the group (they join anew)
    seconds: float
    bytes: int  # the version's size (what each reached member received); 0 when none was reached
    buckets: int  # collective calls made
    error: str = ""  # why the group ended ("" when it did not)


@dataclass(frozen=True, slots=True)
class _Member:
    ticket: int
    worker: str


class BroadcastHub:
    """Hosts the broadcast group's rendezvous and sends versions to its members (module docstring)."""

    def __init__(
        self,
        bind_host: str,
        port: int,
        address: str,
        bucket_bytes: int,
        timeout_s: float,
        backend: str = "gloo",
        device: str = "cpu",
    ) -> None:
        """`port` is the store's own port (the weight service's + 1, as `broadcast_rendezvous` says)."""
        self.address = address
        self.bucket_bytes = bucket_bytes
        self.timeout_s = timeout_s
        self.backend = backend
        self.device = torch.device(device)
        self._raw = open_store(bind_host, port, timeout_s, bind=True)  # the groups' keys
        self._store = protocol_keys(self._raw)
        self._id = secrets.token_hex(4)  # names this hub's groups
        self._seen = 0  # the highest join ticket taken into account
        self._generation = 0
        self._group: Any = None  # the current generation's ProcessGroup, or None
        self._members: tuple[_Member, ...] = ()
        self._digests = True  # a member of the current generation checks each bucket's sha256
        self._seq = 0  # broadcasts made in the current generation

    @classmethod
    def from_config(cls, config: WeightsConfig, address: str, backend: str = "gloo") -> BroadcastHub:
        device = "cuda" if backend == "nccl" else "cpu"
        return cls(
            config.bind_host, config.port + 1, address, config.bucket_bytes, config.timeout_s, backend, device
        )

    @property
    def members(self) -> tuple[str, ...]:
        """Worker ids in the current group (empty between a failure and the next broadcast)."""
        return tuple(m.worker for m in self._members)

    def waiting(self) -> int:
        """Members that joined and are not yet in a group: the next broadcast forms one with them."""
        return int(self._store.add(JOINS, 0)) - self._seen

    def broadcast(self, state: Mapping[str, torch.Tensor], version: int) -> BroadcastReport:
        """Send `state` as `version` to every member; never raises for a member's fault (module docstring)."""
        start = time.perf_counter()
        dropped: list[_Member] = []
        try:
            joiners = self._new_joiners()
            if joiners:
                dropped += self._form(joiners)
            if self._group is None:
                return self._report(version, start, (), dropped, 0, 0)
            manifest = self._send(state, version)
            return self._report(
                version, start, self._members, dropped, manifest.nbytes, len(manifest.buckets)
            )
        except (BroadcastError, RuntimeError) as exc:  # RuntimeError: torch's store or group, one line below
            failed = self._members
            self._end(END_FAILED)
            error = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            return self._report(version, start, (), dropped + list(failed), 0, 0, error)

    def close(self) -> None:
        """End the group (members join anew, e.g. a restarted learner's hub) and stop the store."""
        if self._group is not None:
            self._end(END_FAILED)
        self._store = self._raw = None  # type: ignore[assignment]  # the TCPStore server stops with its last reference

    # ---- forming a generation ---------------------------------------------------------------------

    def _new_joiners(self) -> list[_Member]:
        """Members that took a ticket since the last look.

        A member names itself just after taking its ticket; one whose name is not there within
        JOIN_RECORD_S is skipped (if alive, the call's `upto` tells it to join anew)."""
        last = int(self._store.add(JOINS, 0))
        joiners = []
        for ticket in range(self._seen + 1, last + 1):
            self._seen = ticket
            deadline = time.monotonic() + min(JOIN_RECORD_S, self.timeout_s)
            while not (named := self._store.check([join_key(ticket)])) and time.monotonic() < deadline:
                time.sleep(POLL_S)
            if named:
                joiners.append(_Member(ticket, _worker_name(self._store.get(join_key(ticket)), ticket)))
        return joiners

    def _form(self, joiners: list[_Member]) -> list[_Member]:
        """A new generation with the current members and `joiners`; returns those that did not answer (or
        answered that they take no rank now).

        Raises BroadcastError (the group could not connect) with `_members` set to those called in."""
        rejoined = {m.worker for m in joiners}  # a member that left its group and joined anew: one ticket
        candidates = [*(m for m in self._members if m.worker not in rejoined), *joiners]
        if self._group is not None:
            self._end(END_REFORM)
        self._generation += 1
        g = self._generation
        tickets = [m.ticket for m in candidates]
        self._store.set(call_key(g), json.dumps({"tickets": tickets, "upto": self._seen}))
        self._store.set(LATEST, str(g))
        answered = self._answers(g, tickets)
        roster = tuple(m for m in candidates if answered.get(m.ticket, (0, False))[0] > 0)
        late = [m for m in candidates if m not in roster]
        if not roster:
            self._store.set(end_key(g), END_FAILED)  # anyone answering after the deadline joins anew
            return late
        ranks, size = {}, 1
        for m in roster:
            ranks[m.ticket], size = size, size + answered[m.ticket][0]
        self._digests = any(answered[m.ticket][1] for m in roster)
        name = group_name(self._id, g)
        self._store.set(roster_key(g), Roster(size, ranks, name, self.backend).to_json())
        self._members, self._seq = roster, 0
        self._group = open_group(self._raw, name, 0, size, self.address, self.timeout_s, self.backend)
        return late

    def _answers(self, generation: int, tickets: list[int]) -> dict[int, tuple[int, bool]]:
        """Ticket -> (the ranks it asked for, whether it checks sha256s), of those that answered the call
        within timeout_s (returns as soon as all did)."""
        deadline = time.monotonic() + self.timeout_s
        answered: dict[int, tuple[int, bool]] = {}
        while True:
            for t in tickets:
                if t not in answered and self._store.check([here_key(generation, t)]):
                    answered[t] = _answer(self._store.get(here_key(generation, t)))
            if len(answered) == len(tickets) or time.monotonic() >= deadline:
                return answered
            time.sleep(POLL_S)

    def _end(self, reason: str) -> None:
        """End the current generation: members see `reason` in the store and act on it."""
        group, self._group, self._members = self._group, None, ()
        try:
            if self._generation:
                self._store.set(end_key(self._generation), reason)
            if group is not None and self.backend == "nccl":  # untested: frees the communicator now
                group.abort()
        except RuntimeError:
            pass  # members see the group fail on their side instead, within their timeout

    # ---- sending a version ------------------------------------------------------------------------

    def _send(self, state: Mapping[str, torch.Tensor], version: int) -> Manifest:
        """Publish the manifest, then broadcast its buckets, packing bucket i + 1 while i is on the wire."""
        specs = [(n, dtype_name(t), tuple(t.shape)) for n, t in state.items()]
        manifest = plan(version, specs, self.bucket_bytes, lambda name: _first_values(state[name]))
        g, seq = self._generation, self._seq
        self._seq += 1
        if seq >= 2:  # every member finished broadcast seq - 2 before broadcast seq - 1 could complete
            self._forget(g, seq - 2)
        self._store.set(manifest_key(g, seq), manifest.to_json())
        size = max((b.nbytes for b in manifest.buckets), default=0)
        raw = [torch.empty(size, dtype=torch.uint8, device=self.device) for _ in range(2)]
        pending = None
        for i, bucket in enumerate(manifest.buckets):
            buffer = raw[i % 2][: bucket.nbytes]
            _pack(buffer, bucket, state)
            if self._digests:  # SGLang servers are read back instead: no hashing for them
                self._store.set(digest_key(g, seq, i), digest(buffer))
            if pending is not None:
                await_work(pending, self.timeout_s, what=f"broadcast v{version} bucket {i - 1}")
            pending = start_broadcast(self._group, buffer)
        if pending is not None:
            await_work(
                pending, self.timeout_s, what=f"broadcast v{version} bucket {len(manifest.buckets) - 1}"
            )
        return manifest

    def _forget(self, generation: int, seq: int) -> None:
        """Delete broadcast `seq`'s keys: the store holds only the last two manifests of a generation."""
        text = self._store.get(manifest_key(generation, seq))
        for i in range(len(Manifest.from_json(text).buckets)):
            self._store.delete_key(digest_key(generation, seq, i))  # False when it was never set
        self._store.delete_key(manifest_key(generation, seq))

    def _report(
        self,
        version: int,
        start: float,
        reached: tuple[_Member, ...],
        dropped: list[_Member],
        nbytes: int,
        buckets: int,
        error: str = "",
    ) -> BroadcastReport:
        return BroadcastReport(
            version,
            tuple(m.worker for m in reached),
            tuple(m.worker for m in dropped),
            time.perf_counter() - start,
            nbytes if reached else 0,
            buckets,
            error,
        )


def _worker_name(raw: bytes, ticket: int) -> str:
    """The worker id a member joined with; a malformed one is named by its ticket (never an exception)."""
    try:
        worker = json.loads(raw)["worker"]
    except (ValueError, KeyError, TypeError):
        return f"ticket-{ticket}"
    return str(worker)


def _answer(raw: bytes) -> tuple[int, bool]:
    """The ranks a member's answer asks for (0: none now, or a malformed answer), and whether it checks
    each bucket's sha256."""
    try:
        answer = json.loads(raw)
        ranks, sha256 = answer["ranks"], answer.get("sha256", True)
    except (ValueError, KeyError, TypeError, AttributeError):
        return 0, False
    return (ranks if isinstance(ranks, int) and 0 <= ranks <= 4096 else 0), sha256 is not False


def _first_values(tensor: torch.Tensor) -> tuple[float, ...]:
    """A tensor's first SAMPLE_VALUES values (row-major) as floats: what a server must hold afterwards."""
    flat = tensor.detach().reshape(-1)[:SAMPLE_VALUES]
    return tuple(float(v) for v in flat.to(device="cpu", dtype=torch.float64).tolist())


def _pack(buffer: torch.Tensor, bucket: Bucket, state: Mapping[str, torch.Tensor]) -> None:
    """Copy the bucket's tensors into `buffer` (uint8) at their offsets, as their own dtypes' bytes."""
    for entry in bucket.entries:
        if entry.numel:
            target = buffer[entry.offset : entry.offset + entry.nbytes].view(getattr(torch, entry.dtype))
            target.copy_(state[entry.name].detach().reshape(-1))
