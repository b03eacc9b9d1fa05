"""Crash-consistent persistence of the broker's books in `RUN_DIR/broker/`.

Two files make a restart lose nothing. `state.snap` holds the live books: every in-flight and partial
group with every sample in its latest known state (partials with their tokens, log-probs and segments),
the lease table, the complete queue and the unacked batch (as group ids), the ledger counters, the data
cursor and the weights version. `complete.log` holds the samples of complete groups, appended once when a
group completes (complete groups can be most of the data, and never change), and rewritten without the
trained groups when it grows to more than twice what is live: the live groups' records are copied as
they are, not encoded again (the store knows where each record is).

Both are written with the protocol codec (the same strict decoding on load as for a peer's message) as
length-prefixed frames. The log is appended and fsynced before the state file that refers to it is
written to a temporary file, fsynced and renamed over the old one, so a crash at any point leaves a
previous consistent pair; a torn record at the log's tail is cut off on open.

Restoring starts a new lease epoch (see `broker.state`). Does not decide when to snapshot: the server does.
"""

from __future__ import annotations

import dataclasses
import os
import struct
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np

from april.codec import Int64Array, ProtocolError, decode_body, decode_header, encode_frames
from april.config import AlgoConfig, Mode
from april.data import PromptSource
from april.files import fsync_dir
from april.length_history import HistoryWire, LengthHistory
from april.records import Sample, SampleStatus
from april.wire_records import SampleBatch
from broker.state import BrokerState, GroupEntry, LeaseEntry, PendingBatch, WaitingPrompt

SNAPSHOT_FORMAT = 2  # 2: the length history
SNAPSHOT_KIND = 0
LOG_KIND = 1
FILE_NAME = "state.snap"
LOG_NAME = "complete.log"
_LEN = struct.Struct("<Q")


class SnapshotError(Exception):
    """The snapshot file is missing, truncated or does not match this run."""


@dataclass(frozen=True, slots=True)
class BrokerSnapshot:
    epoch: int
    mode: str
    n_samples_per_prompt: int
    version: int
    weights_uri: str
    weights_sha256: str
    cursor: int
    next_group_id: int
    next_batch_id: int
    issued: int
    trained: int
    dropped: dict[str, int]
    round_open: bool
    samples: SampleBatch  # every sample of every live group, latest known state
    lease_ids: Int64Array
    lease_workers: list[str]
    leased_at: SampleBatch  # state of each leased sample before its lease
    complete_order: list[int]
    batch_id: int  # -1: no unacked batch
    batch_step: int
    batch_version: int
    batch_groups: list[int]
    batch_stats: dict[str, float]
    length_history: HistoryWire
    group_ids: Int64Array  # every live group, with the data cursor it was issued from
    group_cursors: Int64Array
    waiting_cursors: Int64Array  # prompts drawn ahead, not issued (algo.prompt_order), in draw order
    waiting_drawn_at: Int64Array


@dataclass(frozen=True, slots=True)
class SnapshotRefs:
    """A consistent copy of the books made in the poll loop: scalars and references to immutable
    samples only (O(live samples) pointer copies), so the costly encoding can run on another thread."""

    scalars: dict[str, Any]
    samples: list[Sample]
    leases: list[LeaseEntry]
    complete_order: list[int]
    batch: PendingBatch | None

    def build(self) -> BrokerSnapshot:
        """The full snapshot, every sample included (for in-memory use and tests)."""
        return self._snapshot(self.samples)

    def split(self) -> tuple[BrokerSnapshot, dict[int, list[Sample]]]:
        """For SnapshotStore.save: the snapshot of live groups, and the complete groups' samples."""
        held = set(self.complete_order) | set(self.batch.group_ids if self.batch else ())
        live: list[Sample] = []
        complete: dict[int, list[Sample]] = {}
        for s in self.samples:
            if s.group_id in held:
                complete.setdefault(s.group_id, []).append(s)
            else:
                live.append(s)
        return self._snapshot(live), complete

    def _snapshot(self, samples: list[Sample]) -> BrokerSnapshot:
        batch = self.batch
        return BrokerSnapshot(
            **self.scalars,
            samples=SampleBatch.from_samples(samples),
            lease_ids=np.array([lease.lease_id for lease in self.leases], dtype=np.int64),
            lease_workers=[lease.worker_id for lease in self.leases],
            leased_at=SampleBatch.from_samples([lease.at_lease for lease in self.leases]),
            complete_order=self.complete_order,
            batch_id=batch.batch_id if batch else -1,
            batch_step=batch.step if batch else 0,
            batch_version=batch.version if batch else 0,
            batch_groups=list(batch.group_ids) if batch else [],
            batch_stats=dict(batch.stats) if batch else {},
        )


def capture_refs(state: BrokerState) -> SnapshotRefs:
    scalars = {
        "epoch": state.epoch,
        "mode": state.mode.value,
        "n_samples_per_prompt": state.algo.n_samples_per_prompt,
        "version": state.version,
        "weights_uri": state.weights_uri,
        "weights_sha256": state.weights_sha256,
        "cursor": state.cursor,
        "next_group_id": state.next_group_id,
        "next_batch_id": state.next_batch_id,
        "issued": state.issued,
        "trained": state.trained,
        "dropped": dict(state.dropped),
        "round_open": state.round_open,
        "length_history": state.history.to_wire(),
        "group_ids": np.array(list(state.groups), dtype=np.int64),
        "group_cursors": np.array([g.cursor for g in state.groups.values()], dtype=np.int64),
        "waiting_cursors": np.array([w.cursor for w in state.waiting], dtype=np.int64),
        "waiting_drawn_at": np.array([w.drawn_at for w in state.waiting], dtype=np.int64),
    }
    return SnapshotRefs(
        scalars=scalars,
        samples=[s for g in state.groups.values() for s in g.samples],
        leases=list(state.leases.values()),
        complete_order=list(state.complete),
        batch=state.batch,
    )


def capture(state: BrokerState) -> BrokerSnapshot:
    return capture_refs(state).build()


def _frames_bytes(frames: list[Any]) -> bytes:
    out = [_LEN.pack(len(frames))]
    for frame in frames:
        out += [_LEN.pack(len(frame)), bytes(frame)]
    return b"".join(out)


def _read_record(data: bytes, pos: int) -> tuple[list[bytes], int]:
    """The frames of the record at `pos` and the position after it; struct.error if torn."""
    (count,) = _LEN.unpack_from(data, pos)
    pos += _LEN.size
    frames: list[bytes] = []
    for _ in range(count):
        (n,) = _LEN.unpack_from(data, pos)
        pos += _LEN.size
        if pos + n > len(data):
            raise struct.error("truncated frame")
        frames.append(data[pos : pos + n])
        pos += n
    return frames, pos


def _fsync_write(path: Path, payload: bytes, mode: str) -> None:
    with open(path, mode) as f:
        f.write(payload)
        f.flush()
        os.fsync(f.fileno())


@dataclass(frozen=True, slots=True)
class LoggedGroup:
    """One record of complete.log: the final samples of one complete group."""

    group_id: int
    samples: SampleBatch


class SnapshotStore:
    """The pair of files in one directory; remembers where in the log each complete group's record is."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.state_path = directory / FILE_NAME
        self.log_path = directory / LOG_NAME
        self._logged: dict[int, tuple[int, int]] | None = None  # group id -> its record's (start, end)
        self._records = 0  # records in the log, trained groups' included

    def save(self, live: BrokerSnapshot, complete: Mapping[int, Sequence[Sample]]) -> Path:
        """Persist `live` (samples of in-flight/partial groups) and make sure the log holds every group in
        `complete` (complete or handed-out groups); returns the state file's path."""
        self.directory.mkdir(parents=True, exist_ok=True)
        logged = self._index()
        if self._records > 2 * len(complete) + 64:  # mostly trained groups: rewrite with the live ones
            # A logged group's record is copied as it is (its samples never change once complete), so a
            # rewrite encodes only the groups it logs for the first time.
            with open(self.log_path, "rb") as old:
                records = [
                    (gid, self._logged_record(old, logged, gid, samples)) for gid, samples in complete.items()
                ]
            tmp = self.directory / f".{LOG_NAME}.tmp"
            _fsync_write(tmp, b"".join(record for _, record in records), "wb")
            os.replace(tmp, self.log_path)
            fsync_dir(self.directory)
            logged.clear()
            self._note(records, 0)
            self._records = len(records)
        else:
            new = [
                (gid, self._encode_group(gid, samples))
                for gid, samples in complete.items()
                if gid not in logged
            ]
            if new:
                end = self.log_path.stat().st_size if self.log_path.exists() else 0
                _fsync_write(self.log_path, b"".join(record for _, record in new), "ab")
                self._note(new, end)
                self._records += len(new)
        tmp = self.directory / f".{FILE_NAME}.tmp"
        _fsync_write(tmp, _frames_bytes(encode_frames(SNAPSHOT_FORMAT, SNAPSHOT_KIND, live)), "wb")
        os.replace(tmp, self.state_path)
        fsync_dir(self.directory)  # the rename itself survives a power loss
        return self.state_path

    def load(self) -> BrokerSnapshot:
        """The full snapshot: live samples plus the logged samples of its complete and handed-out groups."""
        try:
            data = self.state_path.read_bytes()
        except FileNotFoundError:
            raise SnapshotError(f"no broker snapshot at {self.state_path} (nothing to resume)") from None
        try:
            frames, _ = _read_record(data, 0)
            decode_header(frames, SNAPSHOT_FORMAT)
            live: BrokerSnapshot = decode_body(BrokerSnapshot, frames, max_bytes=len(data) + 1)
        except (struct.error, ProtocolError) as exc:
            raise SnapshotError(f"broker snapshot {self.state_path} is unreadable: {exc}") from exc
        wanted = set(live.complete_order) | set(live.batch_groups)
        groups = {gid: batch for gid, batch in self._read_log().items() if gid in wanted}
        missing = wanted - set(groups)
        if missing:
            raise SnapshotError(
                f"{self.log_path} lacks complete groups {sorted(missing)[:5]} of the snapshot"
            )
        samples = live.samples.to_samples() + [s for gid in sorted(groups) for s in groups[gid].to_samples()]
        return dataclasses.replace(live, samples=SampleBatch.from_samples(samples))

    @staticmethod
    def _encode_group(gid: int, samples: Sequence[Sample]) -> bytes:
        group = LoggedGroup(gid, SampleBatch.from_samples(list(samples)))
        return _frames_bytes(encode_frames(SNAPSHOT_FORMAT, LOG_KIND, group))

    def _logged_record(
        self, log: BinaryIO, logged: Mapping[int, tuple[int, int]], gid: int, samples: Sequence[Sample]
    ) -> bytes:
        """Group `gid`'s record: read from the log where it is there, encoded otherwise."""
        if gid not in logged:
            return self._encode_group(gid, samples)
        start, end = logged[gid]
        log.seek(start)
        return log.read(end - start)

    def _note(self, records: Sequence[tuple[int, bytes]], start: int) -> None:
        """Index `records`, written one after another from byte `start` of the log."""
        assert self._logged is not None
        for gid, record in records:
            self._logged[gid] = (start, start + len(record))
            start += len(record)

    def _index(self) -> dict[int, tuple[int, int]]:
        if self._logged is None:
            spans: dict[int, tuple[int, int]] = {}
            self._records = 0
            for gid, _, span in self._scan_log():
                spans[gid] = span
                self._records += 1
            self._logged = spans
        return self._logged

    def _read_log(self) -> dict[int, SampleBatch]:
        """Every group in the log (the last record of a group wins)."""
        return {gid: samples for gid, samples, _ in self._scan_log()}

    def _scan_log(self) -> Iterator[tuple[int, SampleBatch, tuple[int, int]]]:
        """Each record of the log: group id, samples, (start, end); a torn tail is cut off."""
        try:
            data = self.log_path.read_bytes()
        except FileNotFoundError:
            return
        pos = 0
        while pos < len(data):
            try:
                frames, end = _read_record(data, pos)
                decode_header(frames, SNAPSHOT_FORMAT)
                record: LoggedGroup = decode_body(LoggedGroup, frames, max_bytes=len(data) + 1)
            except (struct.error, ProtocolError):
                break  # a record torn by a crash: never referenced by a durable snapshot
            yield record.group_id, record.samples, (pos, end)
            pos = end
        if pos < len(data):
            with open(self.log_path, "r+b") as f:
                f.truncate(pos)


def write(snapshot: BrokerSnapshot, directory: Path) -> Path:
    """Persist a full snapshot (see SnapshotStore.save): complete groups go to the log."""
    complete_ids = set(snapshot.complete_order) | set(snapshot.batch_groups)
    live: list[Sample] = []
    complete: dict[int, list[Sample]] = {}
    for s in snapshot.samples.to_samples():
        if s.group_id in complete_ids:
            complete.setdefault(s.group_id, []).append(s)
        else:
            live.append(s)
    live_snapshot = dataclasses.replace(snapshot, samples=SampleBatch.from_samples(live))
    return SnapshotStore(directory).save(live_snapshot, complete)


def exists(directory: Path) -> bool:
    """Whether a snapshot was ever written to `directory` (a broker killed before its first has none)."""
    return (directory / FILE_NAME).is_file()


def read(directory: Path) -> BrokerSnapshot:
    return SnapshotStore(directory).load()


def restore(snap: BrokerSnapshot, mode: Mode, algo: AlgoConfig, source: PromptSource) -> BrokerState:
    """Rebuild the books; leases keep their ids and workers so a reconnecting worker can finish them."""
    if snap.mode != mode.value or snap.n_samples_per_prompt != algo.n_samples_per_prompt:
        raise SnapshotError(
            f"snapshot is for mode={snap.mode} n_samples_per_prompt={snap.n_samples_per_prompt}, "
            f"this run has mode={mode.value} n_samples_per_prompt={algo.n_samples_per_prompt}"
        )
    state = BrokerState(mode, algo, source, epoch=snap.epoch + 1)
    state.version, state.weights_uri, state.weights_sha256 = (
        snap.version,
        snap.weights_uri,
        snap.weights_sha256,
    )
    state.cursor, state.next_group_id, state.next_batch_id = (
        snap.cursor,
        snap.next_group_id,
        snap.next_batch_id,
    )
    state.issued, state.trained, state.dropped = snap.issued, snap.trained, Counter(snap.dropped)
    state.round_open = snap.round_open
    state.history = LengthHistory.from_wire(snap.length_history)
    cursors = dict(zip(snap.group_ids.tolist(), snap.group_cursors.tolist(), strict=True))
    state.waiting = [
        WaitingPrompt(c, d, source.get(c).prompt_index)
        for c, d in zip(snap.waiting_cursors.tolist(), snap.waiting_drawn_at.tolist(), strict=True)
    ]
    by_group: dict[int, list] = {}  # type: ignore[type-arg]
    for s in snap.samples.to_samples():
        by_group.setdefault(s.group_id, []).append(s)
    for gid, samples in by_group.items():
        samples.sort(key=lambda s: s.index)
        cursor = cursors[gid]
        entry = GroupEntry(gid, samples, cursor=cursor, prompt_index=source.get(cursor).prompt_index)
        state.groups[gid] = entry
        if gid in snap.complete_order or gid in snap.batch_groups:
            continue
        state._moved("done", entry.state)
        for s in samples:
            if s.status in (SampleStatus.PENDING, SampleStatus.INTERRUPTED):
                state.queue.push(s.key, s.min_version)
    for lease_id, worker, at_lease in zip(
        snap.lease_ids.tolist(), snap.lease_workers, snap.leased_at.to_samples(), strict=True
    ):
        state.leases[lease_id] = LeaseEntry(lease_id, worker, at_lease)
    state.complete = dict.fromkeys(snap.complete_order)
    if snap.batch_id >= 0:
        samples = [s for gid in snap.batch_groups for s in state.groups[gid].samples]
        state.batch = PendingBatch(
            snap.batch_id,
            snap.batch_step,
            snap.batch_version,
            list(snap.batch_groups),
            samples,
            dict(snap.batch_stats),
        )
    state.check_ledger("after restoring the snapshot")
    return state
