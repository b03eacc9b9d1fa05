"""The worker's side of every weights transport: from a WeightsReady to a local file ready to load.

Given each announced version (`announce`), `WeightSync` picks how its bytes come (docs/design.md
section 6), per the URI the learner announced (`april.weights_uri`) and the worker's `weights.transport`:

    file       the learner's file, when the URI offers a path this worker sees with the announced size
               (transport auto or file; a plain file:// URI is always read so)
    network    the learner's weight service, through `actors.weight_fetch.WeightFetcher` (background)
    broadcast  the learner's collective (`actors.weight_receive.BroadcastMember`), joined once the engine
               says it takes tensors (`accept_broadcast`) or has servers that receive them
               (`accept_server_broadcast`, SGLang); a version the member does not get within
               `weights.timeout_s`, or that comes while it is in no group (it joined late, or its group
               ended), or that its servers did not take, is fetched through the network transport
               instead

and hands the worker loop, through `poll`, each version that is ready to load (`Ready`: its local path,
the transport, and when the worker first heard of it, from which the worker reports `sync_s` once the
engine serves it), that could not be had (`Unavailable`, once per version), or that the hub is sending to
the engine's servers now (`Offered`: the loop loads it at once, before it is announced). Never blocks: the
worker loop only ever waits on its broker socket. Verification: a fetched file was hashed as it came
(`verified`); a file read in place is hashed by the worker before it loads it; a broadcast is checked per
bucket (sha256) or on the servers (sampled values).

Does not load weights (the worker does, between engine steps) nor talk to the broker.
"""

from __future__ import annotations

import logging
import re
import tempfile
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from actors.weight_fetch import Fetched, FetchFailed, WeightFetcher
from april import protocol
from april.config import WeightsConfig, WeightsTransport
from april.keys import ClientKeys
from april.weights_uri import WEIGHT_TRANSPORTS, WeightsLocation, WeightsURIError, parse

if TYPE_CHECKING:
    from actors.weight_receive import BroadcastMember, GroupServers, Offer, ReceivedWeights

log = logging.getLogger("april.weights")
FILE, NETWORK, BROADCAST = WEIGHT_TRANSPORTS  # WeightsLoaded.transport


@dataclass(frozen=True, slots=True)
class Ready:
    """Version `version` can be loaded from `path` (None: nothing to load, e.g. sim://; the engine gets
    `source`). `verified`: its sha256 was checked as it came; otherwise the loader checks `sha256`."""

    version: int
    path: Path | None
    source: str
    sha256: str
    transport: str
    heard_at: float  # time.monotonic() when the worker first heard of the version
    verified: bool
    tensors: Mapping[str, Any] | None = None  # broadcast: the version itself (the engine takes tensors)


@dataclass(frozen=True, slots=True)
class Unavailable:
    """Version `version` could not be had (reported once; a network fetch is retried meanwhile)."""

    version: int
    error: str
    transport: str
    heard_at: float


@dataclass(frozen=True, slots=True)
class Offered:
    """Version `offer.version` is being broadcast to the engine's servers now: load it at once (the hub
    waits for them at most weights.timeout_s)."""

    offer: Offer


SyncResult = Ready | Unavailable | Offered


def default_cache_dir(worker_id: str) -> Path:
    """A per-worker directory under the system temp (weights.cache_dir empty)."""
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", worker_id) or "worker"
    return Path(tempfile.gettempdir()) / f"april-weights-{safe}"


class WeightSync:
    def __init__(
        self,
        cfg: WeightsConfig,
        worker_id: str,
        keys: ClientKeys | None = None,
        cache_dir: Path | None = None,
    ) -> None:
        self.cfg = cfg
        self.worker_id = worker_id
        self.keys = keys
        self.cache_dir = cache_dir or (Path(cfg.cache_dir) if cfg.cache_dir else default_cache_dir(worker_id))
        self.fetcher: WeightFetcher | None = None  # started at the first network fetch
        self.heard: dict[int, float] = {}  # version -> when first heard (the versions being synced)
        self.fetching: dict[int, protocol.WeightsReady] = {}
        self.failed: set[int] = set()  # versions being fetched whose fetch failed once (retrying)
        self.results: list[SyncResult] = []
        self.newest = -1  # the newest version announced
        self.to_fetch: tuple[WeightsLocation, protocol.WeightsReady] | None = None
        self.broadcast_device: str | None = None  # the engine takes tensors here (None: it takes none)
        self.servers: GroupServers | None = None  # the engine's servers receive the broadcast themselves
        self.served = -1  # the newest version the engine loaded (any transport)
        self.last: protocol.WeightsReady | None = None  # the newest announcement (for `refetch`)
        self.member: BroadcastMember | None = None  # joined at the first broadcast announcement
        self.received: ReceivedWeights | None = None  # the newest version the member got, not yet used
        # the announced version awaited from the broadcast, and when it falls back to the network instead
        self.awaiting: tuple[WeightsLocation, protocol.WeightsReady, float] | None = None

    def accept_broadcast(self, device: str) -> None:
        """The engine takes tensors (`actors.engine.TensorLoading`) on `device`: join the learner's broadcast
        group when a version is announced with one."""
        self.broadcast_device = device

    def accept_server_broadcast(self, servers: GroupServers) -> None:
        """The engine's servers receive broadcast versions themselves: join the learner's group with them
        when a version is announced with one."""
        self.servers = servers

    def remember(self, msg: protocol.WeightsReady) -> None:
        """An announcement of a version the engine has (it came by broadcast, before its announcement):
        kept for `refetch`."""
        if self.last is None or msg.version > self.last.version:
            self.last = msg

    def loaded(self, version: int) -> None:
        """The engine serves `version` now."""
        self.served = max(self.served, version)

    def rejoin_broadcast(self) -> None:
        """The servers changed (one went down or came back): the member leaves its group and joins anew."""
        if self.member is not None and self.servers is not None:
            self.member.rejoin()

    def refetch(self, at_least: int) -> None:
        """The engine lost its weights (they came by broadcast: no copy on disk): get the newest version
        announced again, by file or network, if it is `at_least` or newer (a newer one is on its way
        otherwise); `poll` hands it out as Ready."""
        msg = self.last
        if msg is None or msg.version < at_least or msg.version in self.fetching or self.to_fetch is not None:
            return
        self.newest = min(self.newest, msg.version - 1)
        self.announce(msg)

    def announce(self, msg: protocol.WeightsReady) -> None:
        """A version the broker announced (any number of times): start getting it if it is the newest."""
        self.remember(msg)
        if msg.version <= self.newest:
            return
        self.newest = msg.version
        heard_at = self.heard.setdefault(msg.version, time.monotonic())
        self.to_fetch = self.awaiting = None  # superseded before its fetch started or its broadcast came
        for older in [v for v in self.heard if v < msg.version]:  # superseded: never loaded now
            del self.heard[older]
        try:
            location = parse(msg.uri, msg.version)
        except WeightsURIError as exc:
            self.results.append(Unavailable(msg.version, str(exc), "", heard_at))
            return
        if location is None:  # sim://: nothing to load
            self.results.append(Ready(msg.version, None, msg.uri, msg.sha256, "", heard_at, True))
            return
        readable = self._readable_path(location)
        if readable is not None:
            self.results.append(Ready(msg.version, readable, msg.uri, msg.sha256, FILE, heard_at, False))
            return
        if location.broadcast and self._receive_broadcast(location, msg):
            return
        if not location.service:  # a file URI this worker cannot see: the loader reports the missing file
            path = Path(location.path)
            self.results.append(Ready(msg.version, path, msg.uri, msg.sha256, FILE, heard_at, False))
            return
        self.to_fetch = (location, msg)  # started by poll: of a burst of versions, only the newest

    def _readable_path(self, location: WeightsLocation) -> Path | None:
        """The learner's file when this worker may and can read it in place."""
        if not location.path:
            return None
        if not location.service:
            return Path(location.path)  # the file transport: the only place the bytes are
        if self.cfg.transport not in (WeightsTransport.AUTO, WeightsTransport.FILE):
            return None
        path = Path(location.path)
        try:
            return path if path.is_file() and path.stat().st_size == location.size else None
        except OSError:
            return None

    def _receive_broadcast(self, location: WeightsLocation, msg: protocol.WeightsReady) -> bool:
        """Await `msg`'s version from the learner's broadcast (`poll` takes it, or falls back to the
        network); False when this worker's engine takes no tensors (the network transport it is). With
        servers that receive it, only join: a version they take is loaded before its announcement, so
        one announced and not served did not come by broadcast (the network it is)."""
        if self.servers is not None:
            if self.member is None:
                from actors.weight_receive import BroadcastMember  # imports torch

                self.member = BroadcastMember(self.worker_id, self.cfg.timeout_s, servers=self.servers)
            self.member.join(*location.broadcast_rendezvous)
            return False
        if self.broadcast_device is None:
            return False
        if self.member is None:
            from actors.weight_receive import BroadcastMember  # imports torch: only where tensors are taken

            backend = "gloo" if self.broadcast_device == "cpu" else "nccl"
            self.member = BroadcastMember(self.worker_id, self.cfg.timeout_s, backend, self.broadcast_device)
        self.member.join(*location.broadcast_rendezvous)  # a no-op once joined there
        self.awaiting = (location, msg, time.monotonic() + self.cfg.timeout_s)
        return True

    def _poll_broadcast(self) -> None:
        """Take what the member received; hand out the awaited version, or fetch it when it will not come;
        hand out what its servers are being sent."""
        if self.member is None:
            return
        offer = self.member.offer()
        if offer is not None and offer.version > self.served:
            self.results.append(Offered(offer))
        got = self.member.poll()
        if got is not None:
            self.received = got
        for line in self.member.errors():
            log.warning("weights broadcast: %s", line)
        if self.awaiting is None:
            if self.received is not None and self.received.version <= self.newest:
                self.received = None  # came by the network first: free its memory
            return
        location, msg, deadline = self.awaiting
        got = self.received
        if got is not None and got.version >= msg.version:
            if got.version == msg.version:  # a newer one waits for its own announcement (control plane)
                self.awaiting = self.received = None
                heard_at = min(self.heard.get(msg.version, got.started_at), got.started_at)
                self.results.append(
                    Ready(msg.version, None, msg.uri, msg.sha256, BROADCAST, heard_at, True, got.tensors)
                )
            return
        if not self.member.generation or time.monotonic() > deadline:  # in no group, or it did not come
            self.awaiting = None
            self.to_fetch = (location, msg)

    @property
    def busy(self) -> bool:
        """A version is on its way (the worker polls more often meanwhile: nothing wakes it up)."""
        return (
            self.to_fetch is not None
            or self.awaiting is not None
            or any(v not in self.failed for v in self.fetching)
        )

    def poll(self) -> list[SyncResult]:
        """Versions ready to load or given up on since the last poll, oldest first. Starts the fetch of
        the newest version announced since the last poll (the others are superseded unfetched)."""
        self._poll_broadcast()
        if self.to_fetch is not None:
            location, announced = self.to_fetch
            self.to_fetch = None
            if self.fetcher is None:
                self.fetcher = WeightFetcher(self.cfg, self.cache_dir, self.keys, self.worker_id)
            self.fetching[announced.version] = announced
            self.fetcher.fetch(location, announced.sha256)
        if self.fetcher is not None:
            for result in self.fetcher.poll():
                msg = self.fetching.get(result.version)
                heard_at = self.heard.get(result.version)
                if msg is None or heard_at is None:
                    continue
                if isinstance(result, Fetched):
                    del self.fetching[result.version]
                    self.results.append(
                        Ready(result.version, result.path, msg.uri, msg.sha256, NETWORK, heard_at, True)
                    )
                elif isinstance(result, FetchFailed):  # retried in the background, at its own pace
                    self.failed.add(result.version)
                    self.results.append(Unavailable(result.version, result.reason, NETWORK, heard_at))
            for version in [v for v in self.fetching if v < self.newest]:
                del self.fetching[version]
            self.failed &= set(self.fetching)
        results, self.results = self.results, []
        return results

    def close(self) -> None:
        if self.member is not None:
            self.member.close()
            self.member = None
        if self.fetcher is not None:
            self.fetcher.close()
            self.fetcher = None
