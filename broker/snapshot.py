"""Crash-consistent snapshots of the broker's books in `RUN_DIR/broker/state.snap`.

A snapshot holds everything that makes a restart lose nothing: every live group with every sample in its
latest known state (partials with their tokens, log-probs and segments), the lease table, the complete
queue, the unacked batch, the ledger counters, the data cursor and the weights version. It is written with
the protocol codec (the same strict decoding on load as for a peer's message) as length-prefixed frames,
to a temporary file that is fsynced and renamed over the old one, so a crash mid-write leaves the previous
snapshot intact.

Restoring starts a new lease epoch (see `broker.state`). Does not decide when to snapshot: the server does.
"""

from __future__ import annotations

import os
import struct
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from april.codec import Int64Array, ProtocolError, decode_body, decode_header, encode_frames
from april.config import AlgoConfig, Mode
from april.data import PromptSource
from april.records import SampleStatus
from april.wire_records import SampleBatch
from broker.state import BrokerState, GroupEntry, LeaseEntry, PendingBatch

SNAPSHOT_FORMAT = 1
SNAPSHOT_KIND = 0
FILE_NAME = "state.snap"
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


def capture(state: BrokerState) -> BrokerSnapshot:
    leases = list(state.leases.values())
    batch = state.batch
    return BrokerSnapshot(
        epoch=state.epoch,
        mode=state.mode.value,
        n_samples_per_prompt=state.algo.n_samples_per_prompt,
        version=state.version,
        weights_uri=state.weights_uri,
        weights_sha256=state.weights_sha256,
        cursor=state.cursor,
        next_group_id=state.next_group_id,
        next_batch_id=state.next_batch_id,
        issued=state.issued,
        trained=state.trained,
        dropped=dict(state.dropped),
        round_open=state.round_open,
        samples=SampleBatch.from_samples([s for g in state.groups.values() for s in g.samples]),
        lease_ids=np.array([lease.lease_id for lease in leases], dtype=np.int64),
        lease_workers=[lease.worker_id for lease in leases],
        leased_at=SampleBatch.from_samples([lease.at_lease for lease in leases]),
        complete_order=list(state.complete),
        batch_id=batch.batch_id if batch else -1,
        batch_step=batch.step if batch else 0,
        batch_version=batch.version if batch else 0,
        batch_groups=list(batch.group_ids) if batch else [],
        batch_stats=dict(batch.stats) if batch else {},
    )


def write(snapshot: BrokerSnapshot, directory: Path) -> Path:
    """Atomically replace `directory/state.snap`."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / FILE_NAME
    tmp = directory / f".{FILE_NAME}.tmp"
    frames = encode_frames(SNAPSHOT_FORMAT, SNAPSHOT_KIND, snapshot)
    with open(tmp, "wb") as f:
        f.write(_LEN.pack(len(frames)))
        for frame in frames:
            f.write(_LEN.pack(len(frame)))
            f.write(frame)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    return path


def read(directory: Path) -> BrokerSnapshot:
    path = directory / FILE_NAME
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        raise SnapshotError(f"no broker snapshot at {path} (nothing to resume)") from None
    frames: list[bytes] = []
    try:
        (count,), pos = _LEN.unpack_from(data, 0), _LEN.size
        for _ in range(count):
            (n,) = _LEN.unpack_from(data, pos)
            pos += _LEN.size
            if pos + n > len(data):
                raise struct.error("truncated frame")
            frames.append(data[pos : pos + n])
            pos += n
        decode_header(frames, SNAPSHOT_FORMAT)
        snap: BrokerSnapshot = decode_body(BrokerSnapshot, frames, max_bytes=len(data) + 1)
    except (struct.error, ProtocolError) as exc:
        raise SnapshotError(f"broker snapshot {path} is unreadable: {exc}") from exc
    return snap


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
    by_group: dict[int, list] = {}  # type: ignore[type-arg]
    for s in snap.samples.to_samples():
        by_group.setdefault(s.group_id, []).append(s)
    for gid, samples in by_group.items():
        samples.sort(key=lambda s: s.index)
        entry = GroupEntry(gid, samples)
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
