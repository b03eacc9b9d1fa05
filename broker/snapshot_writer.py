"""Writes broker snapshots and the log (settled samples, the journal of the books) on a background
thread, and says what is durable.

The poll loop only copies references (`snapshot.capture_refs`) and hands them over with a sequence
number; it also hands over settled samples as they settle (`log_groups`, or `log_received` for a whole
result as the worker sent it) and the journal's events (`log_journal`), each counted in `log_seq`. The
thread takes everything queued at once, appends the samples, then the events as one journal record, and
fsyncs, which makes it all durable at once (`durable_log`: the `log_seq` reached); where a snapshot was
queued among them it writes the state file at that point of the queue (after what came before it, before
what came after: the state file names where its journal starts). Requests that pile up are coalesced: a
later snapshot holds everything an earlier one did, so only the newest is written. `durable_seq` is the
newest snapshot on disk; the server waits for it before handing a batch to the learner, so a crash can
never forget a batch the learner may have trained, and for `durable_log` before acknowledging a result.
The thread writes what waits `LOG_GROUP_S` after the first of it was queued (at once for a snapshot,
for `LOG_AHEAD_SAMPLES` samples, or for someone waiting on the log): every write is one record and one
fsync for all that waits (group commit), so results are durable, and acknowledged, within a few
milliseconds, while the thread wakes at most once a group (each wake-up costs the poll loop a thread
switch on a busy machine). While the server waits for a batch's snapshot, the thread also
gathers the unacked batch's samples into the columns its message carries (`batch_columns`), off the poll
loop: gathering hundreds of samples' tokens stalled every worker's reply for milliseconds at each batch.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Collection
from pathlib import Path
from typing import Any

from april.records import Sample
from april.wire_records import SampleBatch
from broker import snapshot
from broker.journal import Event
from broker.state import PendingBatch

log = logging.getLogger("april.broker")

LOG_AHEAD_SAMPLES = 128  # settled samples waiting that are written at once ...
LOG_GROUP_S = 0.005  # ... else what waits is written this long after the first of it was queued


class SnapshotWriter:
    def __init__(self, directory: Path, trusted: Collection[int] = ()) -> None:
        self.store = snapshot.SnapshotStore(directory, trusted)  # trusted: see CompleteLog
        self.durable_seq = 0
        self.durable_log = 0  # everything queued up to this log_seq is on disk
        self.error: Exception | None = None
        self._seq = 0
        self._log_seq = 0
        self._items: list[tuple[str, Any]] = []  # what to write, in the order it was queued
        self._waiting = 0  # samples waiting to be logged
        self._snapshots = 0  # snapshots waiting to be written
        self._urgent = False  # someone waits for the log: write what is queued now
        self._first_at = 0.0  # when the oldest item waiting was queued
        self._columns: tuple[int, SampleBatch] | None = None  # (batch id, its samples' columns)
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="snapshot-writer", daemon=True)
        self._thread.start()

    @property
    def log_seq(self) -> int:
        """The count of log writes queued so far (`durable_log` reaches it once they are on disk)."""
        return self._log_seq

    def submit(self, refs: snapshot.SnapshotRefs) -> int:
        """Queue a snapshot; returns its sequence number."""
        with self._cond:
            self._seq += 1
            if not self._items:
                self._first_at = time.monotonic()
            self._items.append(("snapshot", (self._seq, refs)))
            self._snapshots += 1
            self._cond.notify()
            return self._seq

    def log_groups(self, groups: list[tuple[int, list[Sample]]]) -> None:
        """Queue newly settled samples (group id, samples of it that no longer change) for the log. They
        are logged in the background, so the snapshot that hands out a batch rarely has any left to encode
        and fsync."""
        self._queue("groups", groups, sum(len(samples) for _, samples in groups))

    def log_received(self, batch: SampleBatch) -> None:
        """Queue a result's samples, every one accepted and settled, to be logged as they came."""
        self._queue("received", batch, len(batch))

    def log_journal(self, events: list[Event]) -> None:
        """Queue the journal's events (after the samples queued before them, which they may name)."""
        self._queue("journal", events, 0)

    def _queue(self, kind: str, item: Any, samples: int) -> None:
        """Queue one log write of `samples` samples; wake the thread as the samples waiting pass
        LOG_AHEAD_SAMPLES, once."""
        with self._cond:
            first = not self._items
            if first:
                self._first_at = time.monotonic()
            self._items.append((kind, item))
            self._log_seq += 1
            waiting = self._waiting
            self._waiting += samples
            if first or waiting < LOG_AHEAD_SAMPLES <= self._waiting:
                self._cond.notify()  # the thread starts the group's clock, or writes at once

    def batch_columns(self, batch_id: int) -> SampleBatch | None:
        """The samples of batch `batch_id` as its message carries them, if gathered by a snapshot that
        held it (then it is durable too)."""
        with self._cond:
            columns = self._columns
        return columns[1] if columns is not None and columns[0] == batch_id else None

    def wait(self, seq: int, timeout: float | None = None) -> bool:
        """Block until snapshot `seq` (or a newer one) is durable."""
        with self._cond:
            return self._cond.wait_for(
                lambda: self.durable_seq >= seq or self._closed or self.error is not None, timeout
            )

    def wait_log(self, log_seq: int, timeout: float | None = None) -> bool:
        """Block until the log writes up to `log_seq` are durable (the thread writes them at once)."""
        with self._cond:
            self._urgent = True
            self._cond.notify()
            return self._cond.wait_for(
                lambda: self.durable_log >= log_seq or self._closed or self.error is not None, timeout
            )

    def close(self) -> None:
        """Write what is pending, then stop the thread."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join()

    def _due_in(self) -> float | None:
        """Seconds until what waits is to be written (0: now; None: nothing waits). The caller holds the
        lock."""
        if self._closed or self._urgent or self._snapshots or self._waiting >= LOG_AHEAD_SAMPLES:
            return 0.0
        if not self._items:
            return None
        return max(0.0, self._first_at + LOG_GROUP_S - time.monotonic())

    def _run(self) -> None:
        while True:
            with self._cond:
                while (due := self._due_in()) != 0.0:
                    self._cond.wait(due)
                if not self._items:
                    if self._closed:
                        return  # everything written
                    self._urgent = False  # someone waited on a log that had nothing left to write
                    continue
                items, self._items, self._waiting, self._snapshots = self._items, [], 0, 0
                self._urgent = False
                log_seq = self._log_seq
            try:
                self._write(items)
                with self._cond:
                    self.durable_log = max(self.durable_log, log_seq)
                    self._cond.notify_all()
            except Exception as exc:
                log.exception("the broker's log or snapshot could not be written")
                with self._cond:
                    self.error = exc
                    self._cond.notify_all()
                return

    def _write(self, items: list[tuple[str, Any]]) -> None:
        """Append the items in order, the newest snapshot's state file where it was queued; then fsync."""
        last = max((i for i, (kind, _) in enumerate(items) if kind == "snapshot"), default=-1)
        self._append([item for item in items[: max(last, 0)] if item[0] != "snapshot"])
        compact: Collection[int] | None = None
        if last >= 0:
            seq, refs = items[last][1]
            live, settled = refs.split()  # the snapshot logs every settled sample it refers to itself
            self.store.make_durable(live, settled)
            columns = self._gathered(refs.batch)
            with self._cond:
                self.durable_seq = max(self.durable_seq, seq)
                self._columns = columns
                self._cond.notify_all()
            compact = settled.keys()
        self._append(items[last + 1 :])
        self.store.log.sync()
        if compact is not None:
            self.store.compact(compact)  # once the batch may leave: it waits for nothing here

    def _append(self, items: list[tuple[str, Any]]) -> None:
        """The samples first (a journal event may name one), then every event as one journal record."""
        received = [item for kind, item in items if kind == "received"]
        groups = [group for kind, item in items if kind == "groups" for group in item]
        events = [event for kind, item in items if kind == "journal" for event in item]
        self.store.log_received(received)
        if groups:
            self.store.log_groups(groups)
        self.store.log_journal(events)

    def _gathered(self, batch: PendingBatch | None) -> tuple[int, SampleBatch] | None:
        """The unacked batch's columns: gathered once per batch (later snapshots find them)."""
        if batch is None:
            return None
        if self._columns is not None and self._columns[0] == batch.batch_id:
            return self._columns
        return batch.batch_id, SampleBatch.from_samples(batch.samples)
