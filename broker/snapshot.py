"""Crash-consistent persistence of the broker's books in `RUN_DIR/broker/`.

Two files make a restart lose nothing. `state.snap` holds the live books: every sample that may still
change in its latest known state (pending, and partials with their tokens, log-probs, segments and, for
an episode, observation spans and episode state), the
lease table with each leased sample as it was leased (leased, it is that sample resumed), the live
groups, the complete queue and the unacked batch (as group ids), the ledger counters, the run's counters
(aborts, resumes, abort rounds), the data cursor, the weights version, and the position in the log from
which the journal of later changes (`broker.journal`) is replayed. The log of settled samples
(`broker.complete_log`) holds every FINISHED or FAILED sample, appended once when it settles: they never
change, and are most of the data (those of complete groups, and of live groups waiting for their last
samples), so a snapshot writes only what changed since the last one; its segments are deleted whole once
no durable state refers to their groups and the journal after the state file does not start in them.

Both are written with the protocol codec (the same strict decoding on load as for a peer's message) as
length-prefixed frames. The log is appended and fsynced before the state file that refers to it is
written to a temporary file, fsynced and renamed over the old one, and a log segment is deleted only
after a state file that no longer refers to it is durable, so a crash at any point leaves a previous
consistent pair; a torn record at a segment's tail is cut off on open. Files of earlier formats are read
(`READABLE_FORMATS`; the columns a later protocol added, episodes and lease spans, empty).

Restoring starts a new lease epoch (see `broker.state`). Does not decide when to snapshot: the server does.
"""

from __future__ import annotations

import dataclasses
import os
import struct
from collections import Counter
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from april.codec import Int64Array, ProtocolError, decode_body, decode_file_version, encode_frames
from april.config import AlgoConfig, Mode
from april.data import PromptSource
from april.files import fsync_dir
from april.records import SETTLED, Sample
from april.wire_records import SampleBatch
from broker import journal
from broker.complete_log import (
    CompleteLog,
    Key,
    decode_upgraded,
    encode_batch,
    encode_groups,
    read_record,
    record_parts,
    write_parts,
)
from broker.length_history import HistoryWire, LengthHistory
from broker.state import BrokerState, GroupEntry, LeaseEntry, PendingBatch, RoundCounters, WaitingPrompt

SNAPSHOT_FORMAT = 7  # the state file's codec version (log records have their own: complete_log); 2: the
# length history and prompt window; 3: settled samples of live groups are in the log, not the state file;
# 4: a leased sample is only in `leased_at` (as leased it is that sample resumed); 5: samples carry
# episodes (observation spans, episode state); 6: samples carry their lease spans; 7: the journal's position
# and the run's counters
READABLE_FORMATS = (7, 6, 5, 4, 3, 2)  # formats 2 and 3 also hold leased samples in `samples`: read as they
# are; formats before 5 lack the episode columns, before 6 the lease spans: read with them empty; before 7,
# no journal and no counters
NO_JOURNAL = -1  # journal_segment of a state file no journal follows (written before format 7)
BEFORE_7 = {"counters": {}, "journal_segment": NO_JOURNAL, "journal_offset": 0}  # what earlier formats lack
SNAPSHOT_KIND = 0
RESTARTS = "restarts:"  # counters: pinned partials restarted from their prompt, by cause ("restarts:CAUSE")
FILE_NAME = "state.snap"


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
    planned_target: int  # over_sampling auto: the open round's planned target; -1: none (the cap)
    samples: SampleBatch  # every unsettled sample of the live groups, latest known state (the settled
    # ones, and every sample of the complete and handed-out groups, are in the log, and a leased one is
    # its `leased_at` resumed; a loaded snapshot holds them all)
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
    counters: dict[str, int]  # the run's counters (`counters_of`): aborts, resumes, abort rounds, ...
    journal_segment: int  # the journal of later changes starts in this log segment (NO_JOURNAL: none) ...
    journal_offset: int  # ... at this byte


def counters_of(state: BrokerState) -> dict[str, int]:
    """The run's counters the books keep (they go on across restarts): this batch's and the run's."""
    out = {f"round_{k}": v for k, v in dataclasses.asdict(state.round).items()}
    out.update({f"total_{k}": v for k, v in dataclasses.asdict(state.totals).items()})
    out["abort_rounds"], out["aborts_done"] = state.abort_rounds, state.aborts_done
    out.update({f"{RESTARTS}{cause}": n for cause, n in state.restarts.items()})
    return out


def set_counters(state: BrokerState, counters: Mapping[str, int]) -> None:
    """`counters_of`'s figures back into the books (a counter the file lacks stays 0)."""
    for name in (f.name for f in dataclasses.fields(RoundCounters)):
        setattr(state.round, name, counters.get(f"round_{name}", 0))
        setattr(state.totals, name, counters.get(f"total_{name}", 0))
    state.abort_rounds = counters.get("abort_rounds", 0)
    state.aborts_done = counters.get("aborts_done", 0)
    state.restarts = Counter(
        {k.removeprefix(RESTARTS): n for k, n in counters.items() if k.startswith(RESTARTS)}
    )


@dataclass(frozen=True, slots=True)
class SnapshotRefs:
    """A consistent copy of the books made in the poll loop: scalars and references to immutable
    samples only (O(live samples) pointer copies), so the costly encoding can run on another thread."""

    scalars: dict[str, Any]
    groups: list[tuple[int, list[Sample]]]  # (group id, its samples) of every live group
    leases: list[LeaseEntry]
    complete_order: list[int]
    batch: PendingBatch | None

    def build(self) -> BrokerSnapshot:
        """The full snapshot, every sample included (for in-memory use and tests)."""
        return self._snapshot([s for _, samples in self.groups for s in samples])

    def split(self) -> tuple[BrokerSnapshot, dict[int, Sequence[Sample]]]:
        """For SnapshotStore.save: the snapshot of the unsettled samples but the leased ones (each is its
        lease's `at_lease` resumed, which the snapshot holds already), and the settled ones by group."""
        held = set(self.complete_order) | set(self.batch.group_ids if self.batch else ())
        unsettled, settled = partition(self.groups, held, {lease.at_lease.key for lease in self.leases})
        return self._snapshot(unsettled), settled

    def _snapshot(self, samples: list[Sample]) -> BrokerSnapshot:
        batch = self.batch
        return BrokerSnapshot(
            **self.scalars,
            journal_segment=NO_JOURNAL,  # where the journal goes on is known once written (SnapshotStore)
            journal_offset=0,
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
        "mode": str(state.mode),
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
        "planned_target": -1 if state.planned_target is None else state.planned_target,
        "length_history": state.history.to_wire(),
        "group_ids": np.array(list(state.groups), dtype=np.int64),
        "group_cursors": np.array([g.cursor for g in state.groups.values()], dtype=np.int64),
        "waiting_cursors": np.array([w.cursor for w in state.waiting], dtype=np.int64),
        "waiting_drawn_at": np.array([w.drawn_at for w in state.waiting], dtype=np.int64),
        "counters": counters_of(state),
    }
    return SnapshotRefs(
        scalars=scalars,
        # a copy of each group's list (the books replace samples in it); complete groups' never change
        groups=[
            (gid, g.samples if gid in state.complete else list(g.samples)) for gid, g in state.groups.items()
        ],
        leases=list(state.leases.values()),
        complete_order=list(state.complete),
        batch=state.batch,
    )


def partition(
    groups: Iterable[tuple[int, Sequence[Sample]]],
    held: Collection[int],
    leased: Collection[tuple[int, int]] = (),
) -> tuple[list[Sample], dict[int, Sequence[Sample]]]:
    """The samples a state file holds in `samples` (those that may still change, but the `leased` keys:
    the lease table holds those, as leased), and the settled samples by group, which go to the log: every
    sample of a `held` group (complete or handed out), the settled ones of any other."""
    unsettled: list[Sample] = []
    settled: dict[int, Sequence[Sample]] = {}
    for gid, samples in groups:
        if gid in held:
            settled[gid] = samples
            continue
        done = [s for s in samples if s.status in SETTLED]
        if done:
            settled[gid] = done
        unsettled += samples if not done else [s for s in samples if s.status not in SETTLED]
    if leased:
        unsettled = [s for s in unsettled if s.key not in leased]
    return unsettled, settled


def restored_groups(state: BrokerState) -> set[int]:
    """The complete and handed-out groups of a restored state: read from the log, so trusted by it."""
    return set(state.complete) | set(state.batch.group_ids if state.batch else ())


def capture(state: BrokerState) -> BrokerSnapshot:
    return capture_refs(state).build()


class SnapshotStore:
    """The state file and the log of complete groups (`broker.complete_log`) in one directory."""

    def __init__(self, directory: Path, trusted: Collection[int] = ()) -> None:
        """`trusted`: complete groups read from this directory's log (see CompleteLog)."""
        self.directory = directory
        self.state_path = directory / FILE_NAME
        self.log = CompleteLog(directory, trusted)
        self._made = False  # the directory exists (made on the first write, not checked again)
        self._live = 0  # settled samples the last saved state referred to (sizes the log's segments)
        self.journal_from = (0, 0)  # where the journal of the last state written starts in the log

    def save(self, live: BrokerSnapshot, settled: Mapping[int, Sequence[Sample]]) -> Path:
        """Persist `live` (the unsettled samples) and make sure the log holds every sample in `settled` (by
        group: every sample of the complete and handed-out groups, the settled ones of the others), then
        compact the log; returns the state file's path."""
        path = self.make_durable(live, settled)
        self.compact(settled.keys())
        return path

    def make_durable(self, live: BrokerSnapshot, settled: Mapping[int, Sequence[Sample]]) -> Path:
        """`save` up to the point where the snapshot is on disk: what a batch waits for. The log keeps
        what no durable state refers to any more until `compact`."""
        self._live = sum(map(len, settled.values()))
        self.log_groups(settled.items(), live.n_samples_per_prompt)
        self.log.sync()  # every group the state refers to is durable before the state
        segment, offset = self.journal_from = self.log.end()  # the journal after this state starts here
        live = dataclasses.replace(live, journal_segment=segment, journal_offset=offset)
        tmp = self.directory / f".{FILE_NAME}.tmp"
        # writev from the encoded frames: joining them first copied the whole state with the GIL held,
        # which stalled the poll loop for as long (tens of ms for 40 MB of live samples)
        write_parts(tmp, record_parts(encode_frames(SNAPSHOT_FORMAT, SNAPSHOT_KIND, live)), "wb", fsync=True)
        os.replace(tmp, self.state_path)
        fsync_dir(self.directory)  # the rename itself survives a power loss
        return self.state_path

    def compact(self, groups: Collection[int]) -> None:
        """Once a state referring to no group outside `groups` is durable: drop the log's dead segments
        (never one the durable state's journal starts in, nor a later one)."""
        self.log.drop_dead(groups, keep_from=self.journal_from[0])

    def log_groups(self, groups: Iterable[tuple[int, Sequence[Sample]]], group_size: int = 0) -> None:
        """Append the settled samples (by group, a group possibly more than once) that the log does not
        hold yet (a settled sample never changes, so it is logged once); `save` makes them durable before
        any state refers to them. `group_size`: the samples of a group (0: unknown); a group with as many
        logged (indices 0 to group_size - 1) is skipped at once, as every complete group is at every
        snapshot."""
        if not self._made:
            self.directory.mkdir(parents=True, exist_ok=True)
            self._made = True
        new: dict[int, dict[int, Sample]] = {}  # group id -> index -> sample: each sample once
        for gid, samples in groups:
            logged = self.log.logged(gid)
            if 0 < group_size == len(logged):
                continue
            for sample in samples:
                if sample.index not in logged:
                    new.setdefault(gid, {})[sample.index] = sample
        if new:  # one record for all of them: the encoding's fixed cost once, not once per sample
            records = encode_groups([(gid, list(by_index.values())) for gid, by_index in new.items()])
            self.log.append(records, self._live, durable=False)

    def log_journal(self, events: Sequence[journal.Event]) -> None:
        """Append the journal's events as one record, after everything appended before them (a settled
        sample they name is in the log already: appended before, never dropped while a state file's
        journal may need it); `sync` makes them durable."""
        if events:
            frames = journal.encode(events, self.log.holds)
            self.log.append([([], record_parts(frames))], self._live, durable=False)

    def log_received(self, batches: Sequence[SampleBatch]) -> None:
        """Append settled samples as workers returned them (each a result's batch, every sample accepted),
        a record each, without gathering them sample by sample (`log_groups`), in one write; `save` makes
        them durable."""
        self.log.append([encode_batch(batch) for batch in batches], self._live, durable=False)

    def load(self) -> BrokerSnapshot:
        """The full snapshot: live samples plus the logged samples of its complete and handed-out groups."""
        try:
            data = self.state_path.read_bytes()
        except FileNotFoundError:
            raise SnapshotError(f"no broker snapshot at {self.state_path} (nothing to resume)") from None
        try:
            frames, _ = read_record(data, 0)
            if decode_file_version(frames, READABLE_FORMATS) == SNAPSHOT_FORMAT:
                live: BrokerSnapshot = decode_body(BrokerSnapshot, frames, max_bytes=len(data) + 1)
            else:
                batches = ("samples", "leased_at")
                live = decode_upgraded(BrokerSnapshot, frames, batches, len(data) + 1, BEFORE_7)
        except (struct.error, ProtocolError) as exc:
            raise SnapshotError(f"broker snapshot {self.state_path} is unreadable: {exc}") from exc
        unsettled = live.samples.to_samples()
        held = {s.key for s in unsettled}
        # a leased sample is its lease's at_lease resumed (Sample.resumed is how the books lease it);
        # state files before format 4 hold it in `samples` as well
        unsettled += [at.resumed() for at in live.leased_at.to_samples() if at.key not in held]
        # every other sample of a live group (complete and handed-out ones included) is in the log
        held = {s.key for s in unsettled}
        groups = dict.fromkeys([*live.group_ids.tolist(), *live.complete_order, *live.batch_groups])
        n = live.n_samples_per_prompt
        wanted = [(gid, i) for gid in groups for i in range(n) if (gid, i) not in held]
        logged = self.log.read({gid for gid, _ in wanted})
        missing = [key for key in wanted if key not in logged]
        if missing:
            raise SnapshotError(
                f"the log of settled samples in {self.directory} lacks samples {missing[:5]} "
                "(group, index) of the snapshot"
            )
        samples = unsettled + [logged[key] for key in sorted(wanted)]
        return dataclasses.replace(live, samples=SampleBatch.from_samples(samples))

    def read_journal(self, snap: BrokerSnapshot) -> tuple[list[journal.JournalRecord], dict[Key, Sample]]:
        """The journal records after `snap` (a state file of this directory), in order, and the settled
        samples they name from the log."""
        if snap.journal_segment == NO_JOURNAL:
            return [], {}
        records = [
            journal.decode(frames, max_bytes)
            for frames, max_bytes in self.log.journal((snap.journal_segment, snap.journal_offset))
        ]
        return records, self.log.read(journal.wanted(records)) if records else {}


def write(snapshot: BrokerSnapshot, directory: Path, trusted: Collection[int] = ()) -> Path:
    """Persist a full snapshot (see SnapshotStore.save): settled samples go to the log. `trusted`: its
    complete groups that were read from this directory's log (a restored broker's), not logged again."""
    by_group: dict[int, list[Sample]] = {}
    for s in snapshot.samples.to_samples():
        by_group.setdefault(s.group_id, []).append(s)
    held = set(snapshot.complete_order) | set(snapshot.batch_groups)
    leased = set(zip(snapshot.leased_at.group_id.tolist(), snapshot.leased_at.index.tolist(), strict=True))
    unsettled, settled = partition(by_group.items(), held, leased)
    live_snapshot = dataclasses.replace(snapshot, samples=SampleBatch.from_samples(unsettled))
    return SnapshotStore(directory, trusted).save(live_snapshot, settled)


def exists(directory: Path) -> bool:
    """Whether a snapshot was ever written to `directory` (a broker killed before its first has none)."""
    return (directory / FILE_NAME).is_file()


def read(directory: Path) -> BrokerSnapshot:
    return SnapshotStore(directory).load()


def resume(directory: Path, mode: Mode, algo: AlgoConfig, source: PromptSource) -> BrokerState:
    """The books of the last durable state file in `directory`, with the journal after it applied."""
    store = SnapshotStore(directory)
    snap = store.load()
    state = restore(snap, mode, algo, source)
    records, settled = store.read_journal(snap)
    try:
        journal.replay(state, records, settled)
    except ValueError as exc:
        raise SnapshotError(f"the journal in {directory} does not fit its state file: {exc}") from None
    state.check_ledger("after replaying the journal")
    return state


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
    set_counters(state, snap.counters)
    state.planned_target = None if snap.planned_target < 0 else snap.planned_target
    state.history = LengthHistory.from_wire(snap.length_history)
    cursors = dict(zip(snap.group_ids.tolist(), snap.group_cursors.tolist(), strict=True))
    state.waiting = [
        WaitingPrompt(c, d, source.get(c).prompt_index)
        for c, d in zip(snap.waiting_cursors.tolist(), snap.waiting_drawn_at.tolist(), strict=True)
    ]
    by_group: dict[int, list] = {}  # type: ignore[type-arg]
    for s in snap.samples.to_samples():
        by_group.setdefault(s.group_id, []).append(s)
    finished = {*snap.complete_order, *snap.batch_groups}
    for gid, samples in by_group.items():
        samples.sort(key=lambda s: s.index)
        cursor = cursors[gid]
        entry = GroupEntry(gid, samples, cursor=cursor, prompt_index=source.get(cursor).prompt_index)
        state.groups[gid] = entry
        if gid in finished:
            continue
        state.restore_unfinished(entry)
    for lease_id, worker, at_lease in zip(
        snap.lease_ids.tolist(), snap.lease_workers, snap.leased_at.to_samples(), strict=True
    ):
        state.leases[lease_id] = LeaseEntry(lease_id, worker, at_lease)
    state.restore_complete(snap.complete_order)
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
