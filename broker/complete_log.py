"""The log of settled samples, and the journal of the books, in `RUN_DIR/broker/`: segment files
`complete.NNNNNNNN.log`.

A sample is settled once it is FINISHED or FAILED: it never changes again (its group completes, is
trained or dropped, and leaves). Each settled sample is appended once to the newest segment, as soon as
it settles or at the latest with the state file that refers to it (fsynced before that state file is
written; `broker.snapshot` orders the two), so the state file holds only the samples that still change
and a snapshot's cost does not grow with the tokens of the live groups. The samples handed in together
are appended as one record (`encode_groups`; split past `RECORD_MAX_TOKENS` response tokens), so the
encoding's fixed cost is paid once per hand-over, not once per sample; a record holds all or some of the
samples of each of its groups. A record is never rewritten: it is live while the durable state refers to
a group one of its samples (its newest record) belongs to, and a segment is deleted whole once none of
its records is live. Groups are mostly trained in the order they complete, so old segments die whole;
when stragglers keep old segments alive and the log holds more than twice the live samples plus one
segment's worth, the old segment with the most dead samples has its live ones copied to the newest
segment (a record whose samples are all live as raw bytes, any other encoded again with its live samples
only, so copying always frees disk) and is deleted, which bounds the disk the log takes.

A record is a little-endian u64 frame count, then for each frame a u64 length and the bytes; the frames
are codec frames with header `[LOG_FORMAT, LOG_KIND]` and body `LoggedGroups`. Records of earlier formats
(before protocol 3's episode columns or protocol 4's lease spans; format 1 holds one group each, body
`LoggedGroup`) are still read, their samples given the columns they lack, empty (`decode_upgraded`). A
torn record at the end of a segment (a crash while appending) is cut off when the log is opened; when a
sample has records in several places (copied, or appended again after a crash) the newest wins. A
`complete.log` written by earlier versions (one file, compacted by rewriting) is read as the oldest
segment.

The same segments carry the journal's records (`broker.journal`, header kind `JOURNAL_KIND`), appended in
order with the samples: a state file names the position (segment, byte) after which its journal starts
(`end`), `journal` reads the records from there, and no segment at or after the durable state's position
is deleted or copied out (`drop_dead`'s `keep_from`). Journal records are no sample's record: the index of
settled samples skips them, and they count no sample entries.

Knows nothing of the broker's books: callers hand it encoded records and the set of live group ids.
Samples are known by their key, (group id, index in the group).
"""

from __future__ import annotations

import os
import re
import struct
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from april.codec import Frame, Int64Array, ProtocolError, decode_body, decode_file_version, encode_frames
from april.files import fsync_dir
from april.records import Sample
from april.wire_records import SampleBatch, add_missing_columns

LOG_FORMAT = 4  # the log record's codec version (the state file has its own: broker.snapshot); 2: a
# record holds several groups; 3: samples carry episodes (observation spans, episode state); 4: lease spans
EPISODE_FORMAT = 3  # records without the lease spans: still read
MULTI_GROUP_FORMAT = 2  # records of several groups without the episode columns: still read
SINGLE_GROUP_FORMAT = 1  # records of one group each, written by earlier versions: still read
LOG_KIND = 1
JOURNAL_KIND = 2  # a journal record's kind (broker.journal owns its body and format)
LEGACY_NAME = "complete.log"
SEGMENT_PATTERN = re.compile(r"complete\.(\d{8})\.log")
SEGMENT_MAX_BYTES = 64 << 20  # a new segment starts past this size ...
SEGMENT_MIN_SAMPLES = 512  # ... or past max(this, live samples) sample entries
RECORD_MAX_TOKENS = 1 << 18  # a record is closed past this many response tokens (2 MB of ids + log-probs;
# encoding cost per sample, measured with 2048-token samples: 10 us one group a record, ~4 us 8 to 128
# groups, ~7 us 256 groups)
_LEN = struct.Struct("<Q")


@dataclass(frozen=True, slots=True)
class LoggedGroups:
    """One record of the log: settled samples of the groups appended together (all of each group's, in
    the records of earlier versions, which logged complete groups only)."""

    group_ids: Int64Array  # [G], distinct
    samples: SampleBatch  # samples of those groups (each at most once), each group's in its own order

    def validate(self) -> None:
        ids = np.unique(self.group_ids)
        if ids.shape[0] != self.group_ids.shape[0]:
            raise ValueError("a group id is listed twice")
        if not np.array_equal(ids, np.unique(self.samples.group_id)):
            raise ValueError("the samples' groups are not the record's groups")


@dataclass(frozen=True, slots=True)
class LoggedGroup:
    """A format-1 record: the final samples of one complete group."""

    group_id: int
    samples: SampleBatch


Record = list[bytes | memoryview]  # a record's bytes in parts (the frames are not copied into one)
Key = tuple[int, int]  # a sample's (group id, index)
Logged = tuple[Sequence[Key], Record]  # a record and the keys of the samples it holds
IOV_MAX = 1024  # parts per writev (the POSIX minimum of IOV_MAX)


def record_parts(frames: Sequence[bytes | memoryview]) -> Record:
    """One record: the frame count, then each frame's length and bytes."""
    out: Record = [_LEN.pack(len(frames))]
    for frame in frames:
        out += [_LEN.pack(len(frame)), frame]
    return out


def frames_bytes(frames: Sequence[bytes | memoryview]) -> bytes:
    return b"".join(record_parts(frames))


def read_record(data: bytes, pos: int) -> tuple[list[bytes], int]:
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


def write_parts(path: Path, parts: Sequence[bytes | memoryview], mode: str, fsync: bool) -> None:
    """Write the parts' concatenation with writev (no joined copy), fsynced if `fsync`."""
    with open(path, mode) as f:
        fd = f.fileno()
        for i in range(0, len(parts), IOV_MAX):
            chunk = parts[i : i + IOV_MAX]
            done = os.writev(fd, chunk)
            for part in chunk:  # a short write (a signal, a full disk): the rest one part at a time
                n = len(part)
                if done < n:
                    f.write(memoryview(part)[done:])
                done = max(0, done - n)
        f.flush()
        if fsync:
            os.fsync(fd)


def encode_groups(groups: Sequence[tuple[int, Sequence[Sample]]]) -> list[tuple[list[Key], Record]]:
    """The log records of settled samples, by group (distinct ids), each with the keys of the samples it
    holds: one record, or more where they hold more than `RECORD_MAX_TOKENS` response tokens."""
    out: list[tuple[list[Key], Record]] = []
    ids: list[int] = []
    samples: list[Sample] = []
    tokens = 0
    for gid, group in groups:
        ids.append(gid)
        samples += group
        tokens += sum(s.response_ids.shape[0] for s in group)
        if tokens >= RECORD_MAX_TOKENS:
            out.append(([s.key for s in samples], _record(ids, SampleBatch.from_samples(samples))))
            ids, samples, tokens = [], [], 0
    if ids:
        out.append(([s.key for s in samples], _record(ids, SampleBatch.from_samples(samples))))
    return out


def encode_batch(batch: SampleBatch) -> tuple[list[Key], Record]:
    """The log record of settled samples as a worker returned them (distinct keys), with their keys: the
    arrays are written as they came, not gathered sample by sample again. One record whatever its size
    (a message is bounded by the broker's `max_message_bytes`)."""
    return batch_keys(batch), _record(np.unique(batch.group_id).tolist(), batch)


def batch_keys(batch: SampleBatch) -> list[Key]:
    return list(zip(batch.group_id.tolist(), batch.index.tolist(), strict=True))


def _record(ids: list[int], samples: SampleBatch) -> Record:
    body = LoggedGroups(np.array(ids, dtype=np.int64), samples)
    return record_parts(encode_frames(LOG_FORMAT, LOG_KIND, body))


def decode_record(frames: Sequence[Frame], max_bytes: int) -> tuple[list[int], SampleBatch]:
    """The group ids and samples of a record of any readable format; ProtocolError if it is not one."""
    readable = (LOG_FORMAT, EPISODE_FORMAT, MULTI_GROUP_FORMAT, SINGLE_GROUP_FORMAT)
    version = decode_file_version(frames, readable)
    if version == SINGLE_GROUP_FORMAT:
        old: LoggedGroup = decode_upgraded(LoggedGroup, frames, ("samples",), max_bytes)
        return [old.group_id], old.samples
    if version != LOG_FORMAT:
        record: LoggedGroups = decode_upgraded(LoggedGroups, frames, ("samples",), max_bytes)
    else:
        record = decode_body(LoggedGroups, frames, max_bytes=max_bytes)
    return record.group_ids.tolist(), record.samples


def decode_upgraded(
    cls: type,
    frames: Sequence[Frame],
    batches: Sequence[str],
    max_bytes: int,
    added: Mapping[str, Any] | None = None,
) -> Any:
    """Decode a body of `cls` written by an earlier version: each `SampleBatch` field named in `batches` is
    given the columns it lacks, empty (`april.wire_records.add_missing_columns`), each field of `added` it
    lacks is given that value, and the body is then decoded as strictly as a current one. A body that is
    not such a map is decoded as it is, for the decoder to name what is wrong."""
    try:
        body = msgpack.unpackb(frames[1], raw=False)
    except (ValueError, TypeError, OverflowError, RecursionError, msgpack.UnpackException):
        return decode_body(cls, frames, max_bytes=max_bytes)
    if not isinstance(body, dict):
        return decode_body(cls, frames, max_bytes=max_bytes)
    for name in batches:
        if name in body:
            body[name] = add_missing_columns(body[name], frames)
    for name, value in (added or {}).items():
        body.setdefault(name, value)
    upgraded = [frames[0], msgpack.packb(body, use_bin_type=True), *frames[2:]]
    # the empty columns make the body longer than the bytes read: the limit grows by as much
    grown = len(upgraded[1]) - len(frames[1])
    return decode_body(cls, upgraded, max_bytes=max_bytes + max(0, grown))


def record_size(record: Record) -> int:
    return sum(len(part) for part in record)


@dataclass(slots=True)
class Segment:
    """One segment file and where each sample's record is in it (the newest, if logged twice)."""

    number: int  # -1: the legacy complete.log
    path: Path
    size: int = 0
    entries: int = 0  # samples in the file's records, superseded ones included
    # group id -> sample index -> its record's (start, end); by group, so that the live groups (most of
    # them complete, with every sample logged) are looked at once per snapshot, not once per sample
    spans: dict[int, dict[int, tuple[int, int]]] = field(default_factory=dict)


class CompleteLog:
    """The segments in one directory, indexed on first use (a restarted broker scans them once)."""

    def __init__(self, directory: Path, trusted: Collection[int] = ()) -> None:
        """`trusted`: the groups whose samples' newest records on disk are known to be right (the complete
        groups of the state this broker restored, which it read from those records). Any other record
        found on disk may be stale: written after the last durable state by a broker that then died, for
        a group id the restored broker issues again; such a sample is logged again when it settles here."""
        self.directory = directory
        self._trusted = set(trusted)
        self._segments: list[Segment] | None = None  # oldest first
        self._where: dict[int, dict[int, Segment]] = {}  # group id -> index -> its newest record's segment
        self._logged: dict[int, set[int]] = {}  # group id -> indices whose newest record is right (trusted
        # or appended here)
        self._current: Segment | None = None  # appended to; None until the first append of this process
        self._unsynced: set[int] = set()  # numbers of segments appended to since the last sync
        self._new_name = False  # a segment was created since the last sync
        self._made = False  # the directory exists (made before the first segment, not checked again)

    def holds(self, key: Key) -> bool:
        """Whether the log holds the sample's right record (then it need not be appended again)."""
        return key[1] in self.logged(key[0])

    def logged(self, gid: int) -> Collection[int]:
        """The indices of the group's samples whose right record the log holds."""
        self._index()
        return self._logged.get(gid, ())

    def append(self, records: Sequence[Logged], live: int, durable: bool = True) -> None:
        """Append records (the keys of the samples each holds, the encoded record), durably unless
        `durable` is False (then `sync` makes them durable); `live` is the number of live samples in the
        log (a segment holds up to about max(SEGMENT_MIN_SAMPLES, live) samples)."""
        if not records:
            return
        segments = self._index()
        cur = self._current
        if cur is None or cur.size >= SEGMENT_MAX_BYTES or cur.entries >= max(SEGMENT_MIN_SAMPLES, live):
            number = max((seg.number for seg in segments), default=-1) + 1
            cur = Segment(number, self.directory / f"complete.{number:08d}.log")  # created by the append
            if not self._made:
                self.directory.mkdir(parents=True, exist_ok=True)
                self._made = True
            self._new_name = True
            segments.append(cur)
            self._current = cur
        write_parts(cur.path, [part for _, record in records for part in record], "ab", fsync=False)
        self._unsynced.add(cur.number)
        for keys, record in records:
            span = (cur.size, cur.size + record_size(record))
            cur.size = span[1]
            cur.entries += len(keys)
            for gid, i in keys:
                cur.spans.setdefault(gid, {})[i] = span
                self._where.setdefault(gid, {})[i] = cur
                self._logged.setdefault(gid, set()).add(i)
        if durable:
            self.sync()

    def end(self) -> tuple[int, int]:
        """Where the next record goes: (segment number, byte offset). A new segment started after this
        counts as later."""
        segments = self._index()
        if not segments:
            return (0, 0)
        last = segments[-1]
        return (last.number, last.size)

    def journal(self, start: tuple[int, int]) -> Iterator[tuple[list[bytes], int]]:
        """The journal records at or after `start` (segment, byte), in order: each one's frames and a size
        limit for decoding them."""
        for seg in _segment_files(self.directory):
            if seg.number < start[0]:
                continue
            for kind, content, span in _records(seg.path):
                if kind == JOURNAL_KIND and (seg.number > start[0] or span[0] >= start[1]):
                    assert isinstance(content, list)
                    yield content, span[1] - span[0] + 1

    def sync(self) -> None:
        """Make every record appended so far durable (and the names of new segments)."""
        for seg in self._index():
            if seg.number in self._unsynced:
                fd = os.open(seg.path, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)
        self._unsynced.clear()
        if self._new_name:
            fsync_dir(self.directory)  # a new segment's name is durable before any state refers to it
            self._new_name = False

    def drop_dead(self, live: Collection[int], keep_from: int | None = None) -> None:
        """Called once a state that refers to no group outside `live` is durable: delete every segment
        (but the newest) that holds no newest record of a live group's sample; then, while the log holds
        more than 2 x live + one segment's worth of samples, copy the live samples of the old segment with
        the most dead samples (of those, the fewest live) to the newest segment and delete it (FIFO
        training never needs to). Segments numbered `keep_from` or later (the durable state's journal
        starts there) are neither deleted nor copied out."""
        everything = self._index()
        segments = [seg for seg in everything if keep_from is None or seg.number < keep_from]
        live_samples = sum(len(self._where[gid]) for gid in live if gid in self._where)
        cap = max(SEGMENT_MIN_SAMPLES, live_samples)

        def live_in(seg: Segment) -> list[Key]:
            return [
                (gid, i)
                for gid in seg.spans
                if gid in live
                for i, where in self._where[gid].items()
                if where is seg
            ]

        def any_live(seg: Segment) -> bool:  # live_in(seg) != [], without listing them all
            return any(
                gid in live and any(where is seg for where in self._where[gid].values()) for gid in seg.spans
            )

        for seg in [seg for seg in segments if seg is not self._current and not any_live(seg)]:
            self._delete(seg)
            segments.remove(seg)
        while sum(seg.entries for seg in everything) > 2 * live_samples + cap:
            old = []  # (dead samples, -live samples, segment, its live samples)
            for seg in segments:
                if seg is not self._current:
                    mine = live_in(seg)
                    old.append((seg.entries - len(mine), -len(mine), seg, mine))
            if not old:
                return
            dead, _, seg, mine = max(old, key=lambda t: t[:2])
            if dead == 0:
                return  # every old group is live: copying would not shrink the log
            self.append(_live_records(seg, mine), live_samples)  # durable (below) before the old copy goes
            self._delete(seg)
            segments.remove(seg)

    def _delete(self, seg: Segment) -> None:
        for gid, indices in seg.spans.items():
            where = self._where.get(gid)
            if where is None:  # its newest records were in a segment deleted before this one
                continue
            for i in indices:
                if where.get(i) is seg:
                    del where[i]
                    self._logged.get(gid, set()).discard(i)
            if not where:
                del self._where[gid]
                self._logged.pop(gid, None)
        seg.path.unlink(missing_ok=True)
        assert self._segments is not None
        self._segments.remove(seg)

    def read(self, wanted: Collection[int]) -> dict[Key, Sample]:
        """Every sample of the wanted groups that the log holds (its newest record), by key."""
        out: dict[Key, Sample] = {}
        for seg in _segment_files(self.directory):
            for gids, samples, _ in _scan(seg.path):
                if any(gid in wanted for gid in gids):
                    for sample in samples.to_samples():
                        if sample.group_id in wanted:
                            out[sample.key] = sample  # newer than any record read before
        return out

    def _index(self) -> list[Segment]:
        if self._segments is None:
            self._segments = []
            for seg in _segment_files(self.directory):
                for kind, content, span in _records(seg.path):
                    seg.size = span[1]
                    if kind == JOURNAL_KIND:
                        continue
                    assert not isinstance(content, list)
                    keys = batch_keys(content[1])
                    for gid, i in keys:
                        seg.spans.setdefault(gid, {})[i] = span
                        self._where.setdefault(gid, {})[i] = seg
                    seg.entries += len(keys)
                self._segments.append(seg)
            self._logged = {gid: set(self._where[gid]) for gid in self._trusted if gid in self._where}
        return self._segments


def _live_records(seg: Segment, mine: list[Key]) -> list[tuple[list[Key], Record]]:
    """The records of `seg` that hold its live samples `mine`: as they are where every sample of the
    record is live, else encoded again with the live samples only (the dead ones would keep taking disk)."""
    by_span: dict[tuple[int, int], list[Key]] = {}
    for key in mine:
        by_span.setdefault(seg.spans[key[0]][key[1]], []).append(key)
    out: list[tuple[list[Key], Record]] = []
    with open(seg.path, "rb") as f:
        for span, keys in by_span.items():
            data = _read_span(f, span)
            _, samples = decode_record(read_record(data, 0)[0], max_bytes=len(data) + 1)
            if len(samples) == len(keys):  # keys are a subset of the record's (the index was read from it)
                out.append((keys, [data]))
            else:
                keep = set(keys)
                group: dict[int, list[Sample]] = {}
                for sample in samples.to_samples():
                    if sample.key in keep:
                        group.setdefault(sample.group_id, []).append(sample)
                out += encode_groups(list(group.items()))
    return out


def _read_span(f: Any, span: tuple[int, int]) -> bytes:
    f.seek(span[0])
    data: bytes = f.read(span[1] - span[0])
    return data


def _segment_files(directory: Path) -> list[Segment]:
    """The segments on disk, oldest first (the legacy single log before every numbered one)."""
    found = [Segment(-1, directory / LEGACY_NAME)] if (directory / LEGACY_NAME).is_file() else []
    if directory.is_dir():
        for path in directory.iterdir():
            match = SEGMENT_PATTERN.fullmatch(path.name)
            if match:
                found.append(Segment(int(match.group(1)), path))
    return sorted(found, key=lambda seg: seg.number)


def _scan(path: Path) -> Iterator[tuple[list[int], SampleBatch, tuple[int, int]]]:
    """Each record of settled samples of a segment (its group ids and samples) with its (start, end)."""
    for kind, content, span in _records(path):
        if kind != JOURNAL_KIND:
            assert not isinstance(content, list)
            yield content[0], content[1], span


def _records(
    path: Path,
) -> Iterator[tuple[int, tuple[list[int], SampleBatch] | list[bytes], tuple[int, int]]]:
    """Each record of a segment with its (start, end): its kind and content, the group ids and samples of
    a record of settled samples, the frames of a journal record. A torn tail is cut off (a record that
    does not read whole, or a record of samples that does not decode, was torn by a crash and is never
    referred to by a durable state)."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return
    pos = 0
    while pos < len(data):
        try:
            frames, end = read_record(data, pos)
            kind = _kind(frames)
            content: tuple[list[int], SampleBatch] | list[bytes] = frames
            if kind != JOURNAL_KIND:
                content = decode_record(frames, max_bytes=len(data) + 1)
        except (struct.error, ProtocolError):
            break
        yield kind, content, (pos, end)
        pos = end
    if pos < len(data):
        with open(path, "r+b") as f:
            f.truncate(pos)


def _kind(frames: Sequence[Frame]) -> int:
    """The kind of a record's header `[format, kind]` (ProtocolError when it has none)."""
    if not frames:
        raise ProtocolError("bad_frames", "a record without frames")
    try:
        header = msgpack.unpackb(frames[0], raw=False)
    except (ValueError, TypeError, msgpack.UnpackException):
        raise ProtocolError("bad_header", "a record's header is not msgpack") from None
    if not (isinstance(header, list) and len(header) == 2 and type(header[1]) is int):
        raise ProtocolError("bad_header", f"a record's header is {header!r}")
    return int(header[1])
