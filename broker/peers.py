"""Who is connected to the broker: workers, the learner, and what each got rejected for.

Tracks liveness (any message counts as a heartbeat; a peer silent for liveness x interval is dead),
credit (free engine slots a worker granted; none while its engine is down), each worker's engine health
and engine-error counts and where its engine runs (its EngineHealth), the weights version each worker
acked, what the learner says it is doing (its latest phase) and which engine it initialised, and
bounded per-peer, per-reason rejection counters. Knows nothing about samples or leases.

The broker asks after every message which workers are dead, are due a heartbeat, or have credit. With a
cluster's thousand workers a scan of them all each time cost more than handling the message (157 us a
tick at 1,024 workers, against 4 at 16), so the registry keeps workers in the order they were last heard
from and last sent to, and the set of those with credit: each question costs what it answers. Times must
come from one monotonic clock, as the broker's do.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from april.protocol import LearnerPhase

MAX_WORKERS = 4096  # bound on the registry: strangers cannot grow it without limit
MAX_COUNTED_PEERS = 1024  # rejections past this many distinct peers are counted under "other"


@dataclass(slots=True)
class Peer:
    peer_id: str
    last_seen: float
    last_sent: float = 0.0


@dataclass(slots=True)
class WorkerPeer(Peer):
    engine: str = ""
    slots: int = 0
    credit: int = 0
    version: int = 0  # weights version the worker reports loaded
    weights_transport: str = ""  # how that version's bytes came (file, network, broadcast)
    weights_sync_s: float = 0.0  # seconds from the worker hearing of that version to serving it
    failed_version: int = -1  # the newest version it reported it could not load (it serves an older one)
    pid: int = 0
    host: str = ""
    tokens_generated: int = 0  # new model tokens accepted from this worker (for its tokens/s)
    messages: int = 0  # messages heard from it since its hello (heartbeats and usage reports included)
    samples_returned: int = 0  # samples in its SampleResults since its hello
    restored: bool = False  # known only from a snapshot's leases; has not said hello to this broker
    hello_asked: float = float("-inf")  # when a restored worker was last asked to say hello
    engine_ok: bool = True  # its latest EngineHealth: False while its engine cannot serve
    engine_detail: str = ""
    failed_by_engine: int = 0  # cumulative counts from its latest EngineHealth
    returned_by_engine: int = 0
    placement: str = ""  # where and how its engine runs (EngineHealth.placement; "" until it is built)

    @property
    def leasable(self) -> bool:
        """May be leased to: has said hello to this broker and its engine can serve."""
        return self.engine_ok and not self.restored


@dataclass(slots=True)
class LearnerPeer(Peer):
    phase: LearnerPhase | None = None  # its latest LearnerPhaseReport; None before the first
    phase_detail: str = ""  # which model, engine or step (LearnerPhaseReport.detail)
    phase_since: float = 0.0  # broker clock when that phase was reported
    engine: str = ""  # the detail of its INITIALISING_ENGINE report: backend, device, optimizer, ranks

    def enter(self, phase: LearnerPhase, detail: str, now: float) -> None:
        self.phase, self.phase_detail, self.phase_since = phase, detail, now
        if phase == LearnerPhase.INITIALISING_ENGINE:
            self.engine = detail


@dataclass(slots=True)
class Rejections:
    """Dropped messages, by peer and by reason."""

    by_reason: Counter[str] = field(default_factory=Counter)
    by_peer: dict[str, Counter[str]] = field(default_factory=dict)

    def count(self, peer: str, reason: str) -> None:
        self.by_reason[reason] += 1
        if peer not in self.by_peer and len(self.by_peer) >= MAX_COUNTED_PEERS:
            peer = "other"
        self.by_peer.setdefault(peer, Counter())[reason] += 1

    @property
    def total(self) -> int:
        return sum(self.by_reason.values())


class Workers:
    """The registry. `peers` is in registration order, read by anyone; a worker's `last_seen`,
    `last_sent` and `credit` change only through `heard`, `sent` and `set_credit`, which keep the
    orders below."""

    def __init__(self, heartbeat_interval_s: float, liveness: int) -> None:
        self.interval = heartbeat_interval_s
        self.liveness = liveness
        self.peers: dict[str, WorkerPeer] = {}
        self._by_seen: OrderedDict[str, None] = OrderedDict()  # least recently heard from first
        self._by_sent: OrderedDict[str, None] = OrderedDict()  # least recently sent to first
        self._credited: set[str] = set()  # those with credit > 0
        self._rank: dict[str, int] = {}  # registration order, kept when a worker registers again
        self._registrations = 0

    def __contains__(self, worker_id: str) -> bool:
        return worker_id in self.peers

    def __len__(self) -> int:
        return len(self.peers)

    def get(self, worker_id: str) -> WorkerPeer | None:
        return self.peers.get(worker_id)

    def register(self, worker_id: str, now: float, **info: object) -> WorkerPeer | None:
        """Add or reset a worker; None when the registry is full."""
        if worker_id not in self.peers and len(self.peers) >= MAX_WORKERS:
            return None
        peer = WorkerPeer(worker_id, last_seen=now, **info)  # type: ignore[arg-type]
        self.peers[worker_id] = peer
        if worker_id not in self._rank:
            self._rank[worker_id] = self._registrations
            self._registrations += 1
        self._by_seen[worker_id] = None
        self._by_seen.move_to_end(worker_id)
        self._by_sent[worker_id] = None
        self._by_sent.move_to_end(worker_id, last=peer.last_sent >= now)  # never sent to: due first
        self.set_credit(peer, peer.credit)
        return peer

    def remove(self, worker_id: str) -> None:
        self.peers.pop(worker_id, None)
        self._by_seen.pop(worker_id, None)
        self._by_sent.pop(worker_id, None)
        self._credited.discard(worker_id)
        self._rank.pop(worker_id, None)

    def heard(self, peer: WorkerPeer, now: float) -> None:
        """A message came from `peer`."""
        peer.last_seen = now
        self._by_seen.move_to_end(peer.peer_id)

    def sent(self, peer: WorkerPeer, now: float) -> None:
        """A message went to `peer`."""
        peer.last_sent = now
        self._by_sent.move_to_end(peer.peer_id)

    def set_credit(self, peer: WorkerPeer, credit: int) -> None:
        peer.credit = credit
        if credit > 0:
            self._credited.add(peer.peer_id)
        else:
            self._credited.discard(peer.peer_id)

    @property
    def window(self) -> float:
        """The liveness window in seconds: liveness x heartbeat interval."""
        return self.liveness * self.interval

    def alive(self, peer: WorkerPeer, now: float) -> bool:
        """Heard from within the liveness window."""
        return now - peer.last_seen <= self.window

    def dead(self, now: float) -> list[str]:
        """Workers silent for longer than the liveness window, the longest silent first."""
        window = self.window
        return [p.peer_id for p in self._oldest_while(self._by_seen, lambda p: now - p.last_seen > window)]

    def due_heartbeat(self, now: float) -> list[WorkerPeer]:
        """Workers sent nothing for a heartbeat interval."""
        return self._oldest_while(self._by_sent, lambda p: now - p.last_sent >= self.interval)

    def _oldest_while(
        self, order: OrderedDict[str, None], overdue: Callable[[WorkerPeer], bool]
    ) -> list[WorkerPeer]:
        """The workers of `order` from its front while `overdue`: every later one is more recent."""
        out = []
        for worker_id in order:
            peer = self.peers[worker_id]
            if not overdue(peer):
                break
            out.append(peer)
        return out

    def with_credit(self) -> list[WorkerPeer]:
        """Workers that may be leased to now, in registration order: credit left, said hello, engine up."""
        credited = [self.peers[w] for w in sorted(self._credited, key=self._rank.__getitem__)]
        return [p for p in credited if p.leasable]
