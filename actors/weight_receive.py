"""A worker's end of the collective weight broadcast: `BroadcastMember`, a background thread.

    member = BroadcastMember(worker_id, timeout_s=config.weights.timeout_s)
    member.join(host, port)          # the learner's rendezvous: WeightsLocation.broadcast_rendezvous
    got = member.poll()              # between engine steps: the newest version received, or None
    got = member.wait(version, timeout_s)   # on WeightsReady(version): None = fetch it over the network
    member.close()

The thread joins the learner's `learner.weight_broadcast.BroadcastHub` through its store (protocol:
`april.broadcast_group`), answers each call to a group generation, and takes part in it one of two ways:
  - itself (an engine that takes tensors): it connects a group rank (gloo sockets on this machine's
    address on the route to the learner, unless `address` is given) and receives each bucket in place,
    checked against the sha256 the hub set; the tensors it hands out are views into the buckets, so a
    version costs the model's size once;
  - through its `servers` (SGLang, `GroupServers`): it asks for their ranks, has them join the group
    (`/init_weights_update_group`), and hands each version's manifest out as an `Offer` the worker loop
    takes with `offer()` and posts to the servers while the hub sends; they leave the group when it ends.
`poll` and `offer` return only the newest item since the last call.

Every wait is bounded by `timeout_s` except the wait for the next manifest (versions may be minutes apart;
the thread looks at the store every POLL_S and sees the hub end the group). After any failure, or when
asked to (`rejoin`: a server restarted), it leaves the group, records the failure, and joins anew
(backoff 0.5 s doubling to 8 s while the learner cannot be reached), taking part again from a later
version; the versions it missed come through the network transport. `close` returns promptly; a receive
in flight ends by the group's own timeout. The NCCL path is the same code, untested here (no GPU in CI).
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from april.broadcast_group import (
    END_REFORM,
    JOINS,
    LATEST,
    BroadcastError,
    Manifest,
    Roster,
    await_work,
    call_key,
    check_bucket,
    digest_key,
    end_key,
    entry_view,
    here_key,
    join_key,
    manifest_key,
    open_group,
    open_store,
    protocol_keys,
    roster_key,
    start_broadcast,
)
from april.ports import route_address

POLL_S = 0.05  # how often an idle member looks at the store (for a call, a manifest or the group's end)
BACKOFF_S = (0.5, 8.0)  # first and longest pause before joining anew after a failure
SERVERS_POLL_S = 1.0  # how often a member whose servers take no rank now asks again


@dataclass(frozen=True, slots=True)
class ReceivedWeights:
    """One version received whole and verified."""

    version: int
    tensors: dict[str, torch.Tensor]  # name -> tensor (views into the received buckets)
    seconds: float  # from the manifest seen to the last bucket verified
    bytes: int
    started_at: float  # time.monotonic() when its manifest was seen (the worker first heard of it)


@dataclass(frozen=True, slots=True)
class Invite:
    """Where a member's servers join a generation's group: SGLang's /init_weights_update_group fields,
    `rank_offset` the member's first rank (its servers take the ranks from there on)."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_name: str
    backend: str


@dataclass(frozen=True, slots=True)
class Offer:
    """A version the hub is sending now to the member's servers: they must receive `manifest`'s buckets
    in order in group `group_name` (the worker loop posts them) or the hub gives up after its timeout."""

    manifest: Manifest
    group_name: str
    started_at: float  # time.monotonic() when the member saw the manifest

    @property
    def version(self) -> int:
        return self.manifest.version


class GroupServers(Protocol):
    """Servers that receive the broadcast themselves (actors.engines.sglang_broadcast.ServerGroup). Called
    from the member's thread; each call is bounded by the servers' own timeouts."""

    def ranks(self) -> int:
        """The ranks they take in a group now (the sum of their TP sizes); 0 when they cannot join now."""
        ...

    def join(self, invite: Invite) -> None:
        """Every server joins the invited group; returns once it formed. BroadcastError otherwise."""
        ...

    def leave(self, group_name: str) -> None:
        """Every server drops the group (an ended generation); never raises."""
        ...


class _Rejoin(Exception):
    """The hub no longer counts this member's ticket, or the member was asked to rejoin: take a new one."""


class BroadcastMember:
    """Receives broadcast versions in a background thread (module docstring)."""

    def __init__(
        self,
        worker_id: str,
        timeout_s: float,
        backend: str = "gloo",
        device: str = "cpu",
        address: str = "",
        servers: GroupServers | None = None,
    ) -> None:
        self.worker_id = worker_id
        self.timeout_s = timeout_s
        self.backend = backend  # what this member can receive with (the hub's roster names the group's)
        self.device = torch.device(device)
        self.address = address
        self.servers = servers
        self._target: tuple[str, int] | None = None
        self._stop = threading.Event()
        self._rejoin = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)  # notified when a version is received
        self._received: ReceivedWeights | None = None
        self._offer: Offer | None = None
        self._errors: list[str] = []
        self.generation = 0  # the group generation it is in now (0: none)
        self._groups = 0  # groups it has been in

    def join(self, host: str, port: int) -> None:
        """Join the hub whose store is at (host, port) from now on; a no-op if already joined there."""
        if self._target == (host, port) and self._thread is not None:
            return
        self.close()
        self._target, self._stop = (host, port), threading.Event()
        self._thread = threading.Thread(target=self._run, args=(host, port, self._stop), daemon=True)
        self._thread.name = f"broadcast-member-{self.worker_id}"
        self._thread.start()

    def poll(self) -> ReceivedWeights | None:
        """The newest version received since the last call, or None."""
        with self._lock:
            got, self._received = self._received, None
        return got

    def offer(self) -> Offer | None:
        """The version being sent to this member's servers now, if not taken yet (servers mode)."""
        with self._lock:
            got, self._offer = self._offer, None
        return got

    def wait(self, version: int, timeout_s: float) -> ReceivedWeights | None:
        """Like `poll`, for a version announced to be `version`: the newest received if it is `version` or
        newer, waiting up to `timeout_s` for it while this member is in a group; None (at once when it is
        in none) means fetch it through the network transport instead."""
        deadline = time.monotonic() + timeout_s
        with self._arrived:
            while True:
                got = self._received
                if got is not None and got.version >= version:
                    self._received = None
                    return got
                left = deadline - time.monotonic()
                if not self.generation or left <= 0:
                    return None
                self._arrived.wait(min(left, POLL_S))  # also looks at `generation` again

    def rejoin(self) -> None:
        """Leave the current group and join anew (the servers changed: one restarted, or went down); the
        hub forms a new generation at its next broadcast."""
        self._rejoin.set()

    def errors(self) -> list[str]:
        """Failures since the last call, one line each (the member has already joined anew)."""
        with self._lock:
            out, self._errors = self._errors, []
        return out

    def close(self) -> None:
        """Stop the thread: returns within about a second even when a receive is in flight (module docstring);
        nothing is handed out after it."""
        with self._lock:
            self._stop.set()
            self._received = self._offer = None
        if self._thread is not None:
            self._thread.join(timeout=1.0)
        self._thread, self._target = None, None

    # ---- the thread -------------------------------------------------------------------------------

    def _run(self, host: str, port: int, stop: threading.Event) -> None:
        pause = BACKOFF_S[0] / 2
        while not stop.is_set():
            groups = self._groups
            try:
                raw = open_store(host, port, self.timeout_s)
                address = self.address or route_address(host)
                self._serve(raw, (host, port), address, stop)
            except (BroadcastError, RuntimeError, OSError, ValueError, KeyError, TypeError) as exc:
                if stop.is_set():
                    break
                self._fail(exc)
            self.generation = 0
            # a member that got into a group since the last failure was reachable: start the backoff over
            pause = BACKOFF_S[0] if self._groups > groups else min(pause * 2, BACKOFF_S[1])
            stop.wait(pause)

    def _serve(self, raw: Any, target: tuple[str, int], address: str, stop: threading.Event) -> None:
        """Join, then take part in generation after generation until a failure (raised) or `stop`."""
        store = protocol_keys(raw)
        ticket, after = self._join(store, stop), 0
        while not stop.is_set():
            try:
                generation, rank, roster = self._await_roster(store, ticket, after, stop)
            except _Rejoin:
                ticket = self._join(store, stop)
                continue
            if self.servers is not None:
                invite = Invite(*target, rank, roster.size, roster.group, roster.backend)
                self.servers.join(invite)
                group = None
            else:
                group = open_group(
                    raw, roster.group, rank, roster.size, address, self.timeout_s, roster.backend
                )
            self.generation, after = generation, generation
            self._groups += 1
            try:
                reason = self._receive_all(store, group, generation, roster.group, stop)
            except _Rejoin:
                reason = ""
            finally:
                del group  # before the next generation's sockets
                self.generation = 0
                if self.servers is not None:
                    self.servers.leave(roster.group)
            if reason != END_REFORM:  # the group failed, or this member left it: the hub wants a new ticket
                # one that left takes it at once, so that the hub forms its next group without it
                ticket = self._join(store, stop, wait=bool(reason))

    def _join(self, store: Any, stop: threading.Event, wait: bool = True) -> int:
        """A new ticket: once this member's servers (if any) can take a rank, unless not `wait`."""
        while wait and self.servers is not None and self.servers.ranks() <= 0:
            if stop.wait(SERVERS_POLL_S):
                raise BroadcastError("closing")
        self._rejoin.clear()
        ticket = int(store.add(JOINS, 1))
        store.set(join_key(ticket), json.dumps({"worker": self.worker_id}))
        return ticket

    def _await_roster(
        self, store: Any, ticket: int, after: int, stop: threading.Event
    ) -> tuple[int, int, Roster]:
        """(generation, first rank, roster) of the first generation after `after` calling `ticket`."""
        while not stop.wait(POLL_S):
            if self._rejoin.is_set():
                raise _Rejoin
            if not store.check([LATEST]):
                continue
            latest = int(store.get(LATEST))
            if latest <= after:
                continue
            call = json.loads(store.get(call_key(latest)))
            if ticket not in call["tickets"]:
                if ticket <= int(call["upto"]):
                    raise _Rejoin
                after = latest  # called before this ticket was taken: the next call will list it
                continue
            ranks = 1 if self.servers is None else self.servers.ranks()
            answer = {"ranks": ranks, "sha256": self.servers is None}  # servers are read back instead
            store.set(here_key(latest, ticket), json.dumps(answer))
            self._wait_any(store, [roster_key(latest), end_key(latest)], 2 * self.timeout_s + 5, stop)
            if not store.check([roster_key(latest)]):
                raise _Rejoin
            roster = Roster.from_json(store.get(roster_key(latest)))
            if ticket not in roster.ranks:
                raise _Rejoin
            return latest, roster.ranks[ticket], roster
        raise BroadcastError("closing")

    def _wait_any(self, store: Any, keys: list[str], timeout_s: float, stop: threading.Event) -> str:
        """The first of `keys` set in the store; BroadcastError after `timeout_s` or on `stop`, _Rejoin
        when asked to rejoin."""
        deadline = time.monotonic() + timeout_s
        while not stop.wait(POLL_S):
            for key in keys:
                if store.check([key]):
                    return key
            if self._rejoin.is_set():
                raise _Rejoin
            if time.monotonic() > deadline:
                raise BroadcastError(f"broadcast: the hub set none of {keys} in {timeout_s:g} s")
        raise BroadcastError("closing")

    def _receive_all(self, store: Any, group: Any, generation: int, name: str, stop: threading.Event) -> str:
        """Receive (or offer) every version of `generation`; returns why the hub ended it. Raises on a
        failure."""
        seq = 0
        while True:
            end = end_key(generation)
            key = self._wait_any(store, [end, manifest_key(generation, seq)], float("inf"), stop)
            if key == end or store.check([end]):
                return str(store.get(end), "utf-8")
            manifest = Manifest.from_json(store.get(key))
            with self._arrived:
                if stop.is_set():  # closed meanwhile: hand out nothing after close()
                    raise BroadcastError("closing")
            if group is None:  # the servers receive it: the worker loop posts the buckets
                with self._arrived:
                    self._offer = Offer(manifest, name, time.monotonic())
            else:
                got = self._receive(store, group, generation, seq, manifest, stop)
                with self._arrived:
                    if stop.is_set():
                        raise BroadcastError("closing")
                    self._received = got
                    self._arrived.notify_all()
            seq += 1

    def _receive(
        self, store: Any, group: Any, generation: int, seq: int, manifest: Manifest, stop: threading.Event
    ) -> ReceivedWeights:
        """One version: every bucket received in place and verified; bucket i + 1 is posted before i is
        hashed, so hashing overlaps the transfer."""
        start, started_at = time.perf_counter(), time.monotonic()
        buckets = [torch.empty(b.nbytes, dtype=torch.uint8, device=self.device) for b in manifest.buckets]
        works = [start_broadcast(group, buckets[0])] if buckets else []
        for i, bucket in enumerate(buckets):
            if i + 1 < len(buckets):
                works.append(start_broadcast(group, buckets[i + 1]))
            await_work(works[i], self.timeout_s, stop, what=f"v{manifest.version} bucket {i}")
            check_bucket(bucket, str(store.get(digest_key(generation, seq, i)), "utf-8"), i)
        tensors = {
            e.name: entry_view(buckets[i], e) for i, b in enumerate(manifest.buckets) for e in b.entries
        }
        seconds = time.perf_counter() - start
        return ReceivedWeights(manifest.version, tensors, seconds, manifest.nbytes, started_at)

    def _fail(self, exc: BaseException) -> None:
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        with self._lock:
            self._errors.append(f"broadcast member {self.worker_id}: {text}")
