"""A worker's end of the collective weight broadcast: `BroadcastMember`, a background thread.

    member = BroadcastMember(worker_id, timeout_s=config.weights.timeout_s)
    member.join(host, port)          # the learner's rendezvous: WeightsLocation.broadcast_rendezvous
    got = member.poll()              # between engine steps: the newest version received, or None
    if got is not None and got.version > engine.version:
        engine.load_tensors(got.tensors, got.version)     # an engine that is TensorLoading
    got = member.wait(version, timeout_s)   # on WeightsReady(version): None = fetch it over the network
    for line in member.errors(): ...                       # failures since the last look, one line each
    member.close()

The thread joins the learner's `learner.weight_broadcast.BroadcastHub` through its store (protocol:
`april.broadcast_group`), answers the hub's call to a group generation, connects its gloo group (its own
sockets on this machine's address on the route to the learner, unless `address` is given), then waits for
each version's manifest and receives its buckets straight into one flat tensor per dtype, each bucket
checked against the sha256 the hub set in the store. The named tensors it hands out are views into those
flat tensors (CPU for gloo), so a version costs the model's size in memory once, plus nothing per bucket.
`poll` returns only the newest version received since the last call; an older one not yet polled is
dropped (the worker wants the newest).

Every wait is bounded by `timeout_s` except the wait for the next manifest (versions may be minutes apart;
the thread looks at the store every POLL_S and sees the hub end the group). After any failure (the hub
ended the group, a bucket was late or its digest wrong, the learner went away) it leaves the group, records
the failure, and joins anew (backoff 0.5 s doubling to 8 s while the learner cannot be reached), so it
takes part again from a later version; the versions it missed come through the network transport.

`close` returns promptly (it does not wait out a receive in flight): a gloo call already posted ends by the
group's own timeout (`timeout_s`), in gloo's thread. The NCCL path (`backend="nccl"`, `device="cuda"`) is
the same code but untested here (no GPU in CI).
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from typing import Any

import torch

from april.broadcast_group import (
    END_REFORM,
    JOINS,
    LATEST,
    BroadcastError,
    Manifest,
    await_work,
    call_key,
    check_bucket,
    digest_key,
    end_key,
    here_key,
    join_key,
    manifest_key,
    open_group,
    open_store,
    roster_key,
    start_broadcast,
)
from april.ports import route_address

POLL_S = 0.05  # how often an idle member looks at the store (for a call, a manifest or the group's end)
BACKOFF_S = (0.5, 8.0)  # first and longest pause before joining anew after a failure


@dataclass(frozen=True, slots=True)
class ReceivedWeights:
    """One version received whole and verified."""

    version: int
    tensors: dict[str, torch.Tensor]  # name -> tensor (views into one flat tensor per dtype)
    seconds: float  # from the manifest seen to the last bucket verified
    bytes: int
    started_at: float  # time.monotonic() when its manifest was seen (the worker first heard of it)


class _Rejoin(Exception):
    """The hub no longer counts this member's ticket: take a new one."""


class BroadcastMember:
    """Receives broadcast versions in a background thread (module docstring)."""

    def __init__(
        self, worker_id: str, timeout_s: float, backend: str = "gloo", device: str = "cpu", address: str = ""
    ) -> None:
        self.worker_id = worker_id
        self.timeout_s = timeout_s
        self.backend = backend
        self.device = torch.device(device)
        self.address = address
        self._target: tuple[str, int] | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)  # notified when a version is received
        self._received: ReceivedWeights | None = None
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
            self._received = None
        if self._thread is not None:
            self._thread.join(timeout=1.0)
        self._thread, self._target = None, None

    # ---- the thread -------------------------------------------------------------------------------

    def _run(self, host: str, port: int, stop: threading.Event) -> None:
        pause = BACKOFF_S[0] / 2
        while not stop.is_set():
            groups = self._groups
            try:
                store = open_store(host, port, self.timeout_s)
                address = self.address or route_address(host)
                self._serve(store, address, stop)
            except (BroadcastError, RuntimeError, OSError, ValueError, KeyError, TypeError) as exc:
                if stop.is_set():
                    break
                self._fail(exc)
            self.generation = 0
            # a member that got into a group since the last failure was reachable: start the backoff over
            pause = BACKOFF_S[0] if self._groups > groups else min(pause * 2, BACKOFF_S[1])
            stop.wait(pause)

    def _serve(self, store: Any, address: str, stop: threading.Event) -> None:
        """Join, then take part in generation after generation until a failure (raised) or `stop`."""
        ticket, after = self._join(store), 0
        while not stop.is_set():
            try:
                generation, rank, size = self._await_roster(store, ticket, after, stop)
            except _Rejoin:
                ticket = self._join(store)
                continue
            group = open_group(store, generation, rank, size, address, self.timeout_s, self.backend)
            self.generation = generation
            self._groups += 1
            reason = self._receive_all(store, group, generation, stop)
            del group  # before the next generation's sockets
            self.generation, after = 0, generation
            if reason != END_REFORM:  # the group failed: the hub wants a new ticket
                ticket = self._join(store)

    def _join(self, store: Any) -> int:
        ticket = int(store.add(JOINS, 1))
        store.set(join_key(ticket), json.dumps({"worker": self.worker_id}))
        return ticket

    def _await_roster(
        self, store: Any, ticket: int, after: int, stop: threading.Event
    ) -> tuple[int, int, int]:
        """(generation, rank, size) of the first generation after `after` whose call lists `ticket`."""
        while not stop.wait(POLL_S):
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
            store.set(here_key(latest, ticket), "1")
            self._wait_any(store, [roster_key(latest), end_key(latest)], 2 * self.timeout_s + 5, stop)
            if not store.check([roster_key(latest)]):
                raise _Rejoin
            roster = json.loads(store.get(roster_key(latest)))
            if str(ticket) not in roster["ranks"]:
                raise _Rejoin
            return latest, int(roster["ranks"][str(ticket)]), int(roster["size"])
        raise BroadcastError("closing")

    def _wait_any(self, store: Any, keys: list[str], timeout_s: float, stop: threading.Event) -> str:
        """The first of `keys` set in the store; BroadcastError after `timeout_s` or on `stop`."""
        deadline = time.monotonic() + timeout_s
        while not stop.wait(POLL_S):
            for key in keys:
                if store.check([key]):
                    return key
            if time.monotonic() > deadline:
                raise BroadcastError(f"broadcast: the hub set none of {keys} in {timeout_s:g} s")
        raise BroadcastError("closing")

    def _receive_all(self, store: Any, group: Any, generation: int, stop: threading.Event) -> str:
        """Receive every version of `generation`; returns why the hub ended it. Raises on a failure."""
        seq = 0
        while True:
            end = end_key(generation)
            key = self._wait_any(store, [end, manifest_key(generation, seq)], float("inf"), stop)
            if key == end or store.check([end]):
                return str(store.get(end), "utf-8")
            manifest = Manifest.from_json(store.get(key))
            got = self._receive(store, group, generation, seq, manifest, stop)
            with self._arrived:
                if stop.is_set():  # closed while it arrived: hand out nothing after close()
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
        flats = {d: torch.empty(n, dtype=getattr(torch, d), device=self.device) for d, n in manifest.streams}
        views = [flats[b.dtype][b.start : b.start + b.numel] for b in manifest.buckets]
        works = [start_broadcast(group, views[0])] if views else []
        for i, view in enumerate(views):
            if i + 1 < len(views):
                works.append(start_broadcast(group, views[i + 1]))
            await_work(works[i], self.timeout_s, stop, what=f"v{manifest.version} bucket {i}")
            check_bucket(view, str(store.get(digest_key(generation, seq, i)), "utf-8"), i)
        tensors = {
            e.name: flats[e.dtype][e.offset : e.offset + e.numel].view(e.shape) for e in manifest.entries
        }
        seconds = time.perf_counter() - start
        return ReceivedWeights(manifest.version, tensors, seconds, manifest.nbytes, started_at)

    def _fail(self, exc: BaseException) -> None:
        text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        with self._lock:
            self._errors.append(f"broadcast member {self.worker_id}: {text}")
