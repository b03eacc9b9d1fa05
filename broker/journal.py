"""The journal of the broker's books: each change made since the last state file, in order, kept in the
log of settled samples (`broker.complete_log`) as it happens, so a restart restores it whatever the
snapshot interval.

`Journal` records in the poll loop what the books (`broker.state`) do: a group issued, a sample leased,
a result taken, a lease reclaimed, queued samples parked, a round closed, a batch acked, weights set, an
abort round begun or ended, a pinned partial restarted from its prompt. `encode` packs a run of them
into one journal record (a settled sample the log holds already is named by its key, any other sample
travels inline); the snapshot writer's thread appends and fsyncs them. `replay` applies the records
after a state file's journal position to the books restored from it, through the books' own methods,
then queues what waits for a lease.

Knows nothing of files, sockets or time: when a change is durable is `broker.snapshot_writer`'s, what a
result's acknowledgement promises is docs/protocol.md's (section 11).
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from april.codec import Frame, Int64Array, UInt8Array, decode_body, decode_file_version, encode_frames
from april.records import SETTLED, Sample
from april.wire_records import SampleBatch

if TYPE_CHECKING:
    from broker.state import BrokerState

JOURNAL_FORMAT = 2  # a journal record's codec version (its kind: JOURNAL_KIND in the log's records); 2:
# the RESTART op
READABLE_FORMATS = (2, 1)  # a format 1 record is a format 2 record without RESTART
JOURNAL_KIND = 2
Key = tuple[int, int]
Event = tuple[Any, ...]  # (Op, arguments...) as `Journal` records them


class Op(enum.IntEnum):
    """What changed, and the columns of its arguments in a `JournalRecord`."""

    ISSUE = 1  # a: group id, b: its data cursor, c: the source's cursor after (prompts drawn ahead)
    LEASE = 2  # a: lease id, b: worker (names), c: group id, d: index
    RESULT = 3  # a: lease id, b: worker (names), c: group id, d: index; sample inline or in the log
    RECLAIM = 4  # a: lease id
    PARK = 5  # (queued samples that never started wait as partials)
    CLOSE_ROUND = 6
    ACK = 7  # a: batch id, b: the workers' slots (the next round's plan reads them)
    WEIGHTS = 8  # a: version, b: uri (names), c: sha256 (names)
    ABORT_BEGUN = 9  # a: round id
    ABORT_ENDED = 10
    RESTART = 11  # a: group id, b: index, c: cause (names): a pinned partial restarted from its prompt


_OPS = frozenset(map(int, Op))


@dataclass(frozen=True, slots=True)
class JournalRecord:
    """Events in order: the op and up to four integer arguments each, `sample[e]` the index of event e's
    sample in `samples` (-1: none inline; a RESULT's settled sample is then the log's), and the strings
    they name (`names`: worker ids, weights URIs and hashes)."""

    ops: UInt8Array  # [E]
    a: Int64Array  # [E]
    b: Int64Array  # [E]
    c: Int64Array  # [E]
    d: Int64Array  # [E]
    sample: Int64Array  # [E]
    names: list[str]
    samples: SampleBatch

    def validate(self) -> None:
        n = self.ops.shape[0]
        if any(x.shape[0] != n for x in (self.a, self.b, self.c, self.d, self.sample)):
            raise ValueError("journal columns differ in length")
        if n and not set(np.unique(self.ops).tolist()) <= _OPS:
            raise ValueError("unknown journal op")
        if n and (int(self.sample.max()) >= len(self.samples) or int(self.sample.min()) < -1):
            raise ValueError("a journal event names a sample the record does not hold")


class Journal:
    """The books' changes since the last `take`, in the order they were made (poll loop only)."""

    def __init__(self) -> None:
        self._events: list[Event] = []

    def __len__(self) -> int:
        return len(self._events)

    def take(self) -> list[Event]:
        events, self._events = self._events, []
        return events

    def issue(self, group_id: int, cursor: int, drawn: int) -> None:
        self._events.append((Op.ISSUE, group_id, cursor, drawn))

    def lease(self, lease_id: int, worker_id: str, key: Key) -> None:
        self._events.append((Op.LEASE, lease_id, worker_id, key))

    def result(self, lease_id: int, worker_id: str, sample: Sample) -> None:
        self._events.append((Op.RESULT, lease_id, worker_id, sample))

    def reclaim(self, lease_id: int) -> None:
        self._events.append((Op.RECLAIM, lease_id))

    def park(self) -> None:
        self._events.append((Op.PARK,))

    def close_round(self) -> None:
        self._events.append((Op.CLOSE_ROUND,))

    def ack(self, batch_id: int, slots: int) -> None:
        self._events.append((Op.ACK, batch_id, slots))

    def weights(self, version: int, uri: str, sha256: str) -> None:
        self._events.append((Op.WEIGHTS, version, uri, sha256))

    def abort_begun(self, round_id: int) -> None:
        self._events.append((Op.ABORT_BEGUN, round_id))

    def abort_ended(self) -> None:
        self._events.append((Op.ABORT_ENDED,))

    def restart(self, key: Key, cause: str) -> None:
        self._events.append((Op.RESTART, key, cause))


def encode(events: Iterable[Event], logged: Callable[[Key], bool]) -> list[Frame]:
    """The codec frames of one journal record of `events`; `logged(key)`: the log holds that settled
    sample already (appended before this record), so a RESULT names it instead of carrying it."""
    ops: list[int] = []
    cols: list[list[int]] = [[], [], [], []]
    at: list[int] = []
    names: dict[str, int] = {}
    inline: list[Sample] = []

    def name(text: str) -> int:
        return names.setdefault(text, len(names))

    for event in events:
        op = event[0]
        args: tuple[int, ...] = ()
        index = -1
        if op == Op.LEASE:
            _, lease_id, worker, key = event
            args = (lease_id, name(worker), key[0], key[1])
        elif op == Op.RESULT:
            _, lease_id, worker, sample = event
            args = (lease_id, name(worker), sample.group_id, sample.index)
            if sample.status not in SETTLED or not logged(sample.key):
                index = len(inline)
                inline.append(sample)
        elif op == Op.WEIGHTS:
            _, version, uri, sha256 = event
            args = (version, name(uri), name(sha256))
        elif op == Op.RESTART:
            _, key, cause = event
            args = (key[0], key[1], name(cause))
        else:
            args = tuple(event[1:])
        ops.append(int(op))
        for col, value in zip(cols, (*args, 0, 0, 0, 0), strict=False):
            col.append(value)
        at.append(index)
    a, b, c, d = (np.array(col, dtype=np.int64) for col in cols)
    record = JournalRecord(
        np.array(ops, dtype=np.uint8),
        a,
        b,
        c,
        d,
        np.array(at, dtype=np.int64),
        list(names),
        SampleBatch.from_samples(inline),
    )
    return encode_frames(JOURNAL_FORMAT, JOURNAL_KIND, record)


def decode(frames: Sequence[Frame], max_bytes: int) -> JournalRecord:
    decode_file_version(frames, READABLE_FORMATS)
    record: JournalRecord = decode_body(JournalRecord, frames, max_bytes=max_bytes)
    return record


def wanted(records: Iterable[JournalRecord]) -> set[int]:
    """The groups of the settled samples the records name without carrying them (the log has them)."""
    out: set[int] = set()
    for rec in records:
        named = (rec.ops == Op.RESULT) & (rec.sample < 0)
        out.update(rec.c[named].tolist())
    return out


def replay(state: BrokerState, records: Iterable[JournalRecord], settled: Mapping[Key, Sample]) -> int:
    """Apply the records to `state` (the books a state file restored, its journal off) in order; `settled`:
    the log's settled samples the records name. Returns the events applied. A record that does not fit
    the books (a lease of a sample that is not waiting, a result of a lease that is not held) is a
    broken log: ValueError."""
    applied = 0
    for rec in records:
        samples = rec.samples.to_samples()
        names = rec.names
        for op, a, b, c, d, at in zip(
            rec.ops.tolist(),
            rec.a.tolist(),
            rec.b.tolist(),
            rec.c.tolist(),
            rec.d.tolist(),
            rec.sample.tolist(),
            strict=True,
        ):
            _apply(state, Op(op), a, b, c, d, samples[at] if at >= 0 else None, names, settled)
            applied += 1
    state.requeue_waiting()
    return applied


def _apply(
    state: BrokerState,
    op: Op,
    a: int,
    b: int,
    c: int,
    d: int,
    sample: Sample | None,
    names: list[str],
    settled: Mapping[Key, Sample],
) -> None:
    if op == Op.ISSUE:
        state.replay_issue(a, b, c)
    elif op == Op.LEASE:
        state.replay_lease(a, names[b], (c, d))
    elif op == Op.RESULT:
        got = sample if sample is not None else settled.get((c, d))
        if got is None:
            raise ValueError(f"journal: the settled sample {(c, d)} of lease {a} is not in the log")
        state.accept_result(names[b], a, got, vouched=True)
    elif op == Op.RECLAIM:
        state.reclaim(a)
    elif op == Op.PARK:
        state.park_queued_samples()
    elif op == Op.CLOSE_ROUND:
        state.round_open = False
    elif op == Op.ACK:
        if not state.ack_batch(a, slots=b):
            raise ValueError(f"journal: batch {a} acked, but the books hold no such batch")
    elif op == Op.WEIGHTS:
        state.set_weights(a, names[b], names[c])
    elif op == Op.ABORT_BEGUN:
        state.abort_rounds = max(state.abort_rounds, a)
    elif op == Op.ABORT_ENDED:
        state.aborts_done += 1
    elif op == Op.RESTART:
        state.restart((a, b), names[c])
