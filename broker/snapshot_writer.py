"""Writes broker snapshots on a background thread, newest first, and says which one is durable.

The poll loop only copies references (`snapshot.capture_refs`) and hands them over with a sequence
number; the thread appends newly settled samples to the log and writes the state file (fsync, rename).
Settled samples may also be handed over as they settle (`log_groups`, or `log_received` for a whole
result as the worker sent it): the thread logs them while it has nothing else to do, so the snapshot
that must be durable before a batch leaves has little to write. It is woken for them only once
`LOG_AHEAD_SAMPLES` are waiting (else it looks every `LOG_AHEAD_S`): each wake-up costs the poll loop a
thread switch on a busy machine, and one record for many samples is cheaper to write than many small
ones.
Requests that pile up while a write is running are coalesced: a later snapshot holds everything an
earlier one did, so only the newest is written. `durable_seq` is the sequence number of the newest
snapshot on disk; the server waits for it before handing a batch to the learner, so a crash can never
forget a batch the learner may have trained. While it waits, the thread also gathers the unacked batch's
samples into the columns its message carries (`batch_columns`), off the poll loop: gathering hundreds of
samples' tokens stalled every worker's reply for milliseconds at each batch.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Collection
from pathlib import Path

from april.records import Sample
from april.wire_records import SampleBatch
from broker import snapshot
from broker.state import PendingBatch

log = logging.getLogger("april.broker")

LOG_AHEAD_SAMPLES = 128  # settled samples waiting that wake the thread to log them ahead of a snapshot ...
LOG_AHEAD_S = 0.05  # ... or the longest they wait for it while it is idle


class SnapshotWriter:
    def __init__(self, directory: Path, trusted: Collection[int] = ()) -> None:
        self.store = snapshot.SnapshotStore(directory, trusted)  # trusted: see CompleteLog
        self.durable_seq = 0
        self.error: Exception | None = None
        self._seq = 0
        self._pending: tuple[int, snapshot.SnapshotRefs] | None = None
        self._to_log: list[tuple[int, list[Sample]]] = []  # settled samples (by group) to log ahead
        self._received: list[SampleBatch] = []  # whole results to log as they came
        self._waiting = 0  # samples in _to_log and _received
        self._columns: tuple[int, SampleBatch] | None = None  # (batch id, its samples' columns)
        self._cond = threading.Condition()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="snapshot-writer", daemon=True)
        self._thread.start()

    def submit(self, refs: snapshot.SnapshotRefs) -> int:
        """Queue a snapshot; returns its sequence number."""
        with self._cond:
            self._seq += 1
            self._pending = (self._seq, refs)
            self._cond.notify()
            return self._seq

    def log_groups(self, groups: list[tuple[int, list[Sample]]]) -> None:
        """Queue newly settled samples (group id, samples of it that no longer change) for the log. They
        are logged in the background, so the snapshot that hands out a batch rarely has any left to encode
        and fsync (it waits for the log only for samples queued after the thread last looked)."""
        with self._cond:
            self._to_log += groups
            self._queued(sum(len(samples) for _, samples in groups))

    def log_received(self, batch: SampleBatch) -> None:
        """Queue a result's samples, every one accepted and settled, to be logged as they came."""
        with self._cond:
            self._received.append(batch)
            self._queued(len(batch))

    def _queued(self, samples: int) -> None:
        """`samples` more wait to be logged (the caller holds the lock): wake the thread as they pass
        LOG_AHEAD_SAMPLES, once."""
        waiting = self._waiting
        self._waiting += samples
        if waiting < LOG_AHEAD_SAMPLES <= self._waiting:
            self._cond.notify()

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

    def close(self) -> None:
        """Write what is pending, then stop the thread."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join()

    def _work(self) -> bool:
        return self._pending is not None or self._waiting >= LOG_AHEAD_SAMPLES or self._closed

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(self._work, LOG_AHEAD_S)  # fewer groups are logged after the timeout
                if self._pending is None and not self._waiting:
                    if self._closed:
                        return
                    continue
                pending, to_log, received = self._pending, self._to_log, self._received
                self._pending, self._to_log, self._received, self._waiting = None, [], [], 0
            try:
                self.store.log_received(received)  # before a snapshot's save, which would gather them
                if pending is None:
                    self.store.log_groups(to_log)
                    continue
                # the snapshot logs every settled sample it refers to itself
                refs = pending[1]
                live, settled = refs.split()
                self.store.make_durable(live, settled)
                columns = self._gathered(refs.batch)
                with self._cond:
                    self.durable_seq = max(self.durable_seq, pending[0])
                    self._columns = columns
                    self._cond.notify_all()
                self.store.compact(settled.keys())  # once the batch may leave: it waits for nothing here
            except Exception as exc:
                log.exception("snapshot %d could not be written", pending[0] if pending else self.durable_seq)
                with self._cond:
                    self.error = exc
                    self._cond.notify_all()
                return

    def _gathered(self, batch: PendingBatch | None) -> tuple[int, SampleBatch] | None:
        """The unacked batch's columns: gathered once per batch (later snapshots find them)."""
        if batch is None:
            return None
        if self._columns is not None and self._columns[0] == batch.batch_id:
            return self._columns
        return batch.batch_id, SampleBatch.from_samples(batch.samples)
