"""The log of complete groups in `RUN_DIR/broker/`: segment files `complete.NNNNNNNN.log`.

Each complete group's final samples are appended once to the newest segment, as soon as the group
completes or at the latest with the state file that refers to it (fsynced before that state file is
written; `broker.snapshot` orders the two). The groups handed in together are appended as one record
(`encode_groups`; split past `RECORD_MAX_TOKENS` response tokens), so the encoding's fixed cost is paid
once per hand-over, not once per group. A group's samples never change once it is complete, so a record
is never rewritten: it is live while any group the durable state refers to has its newest record there,
and a segment is deleted whole once none of its records is live. Groups are mostly trained in the order
they complete, so old segments die whole; when stragglers keep old segments alive and the log holds more
than twice the live groups plus one segment's worth, the old segment with the most dead groups has its
live groups copied to the newest segment (a record whose groups are all live as raw bytes, any other
encoded again with its live groups only, so copying always frees disk) and is deleted, which bounds the
disk the log takes.

A record is a little-endian u64 frame count, then for each frame a u64 length and the bytes; the frames
are codec frames with header `[LOG_FORMAT, LOG_KIND]` and body `LoggedGroups`. Records of format 1 (one
group each, body `LoggedGroup`, written by earlier versions) are still read. A torn record at the end of
a segment (a crash while appending) is cut off when the log is opened; when a group has records in
several places (copied, or appended again after a crash) the newest wins. A `complete.log` written by
earlier versions (one file, compacted by rewriting) is read as the oldest segment.

Knows nothing of the broker's books: callers hand it encoded records and the set of live group ids.
"""

from __future__ import annotations

import os
import re
import struct
from collections.abc import Collection, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from april.codec import Int64Array, ProtocolError, decode_body, decode_header, encode_frames
from april.files import fsync_dir
from april.records import Sample
from april.wire_records import SampleBatch

LOG_FORMAT = 2  # the log record's codec version (the state file has its own: broker.snapshot); 2: a
# record holds several groups
SINGLE_GROUP_FORMAT = 1  # records of one group each, written by earlier versions: still read
LOG_KIND = 1
LEGACY_NAME = "complete.log"
SEGMENT_PATTERN = re.compile(r"complete\.(\d{8})\.log")
SEGMENT_MAX_BYTES = 64 << 20  # a new segment starts past this size ...
SEGMENT_MIN_GROUPS = 64  # ... or past max(this, live groups) group entries
RECORD_MAX_TOKENS = 1 << 18  # a record is closed past this many response tokens (2 MB of ids + log-probs;
# encoding cost per sample, measured with 2048-token samples: 10 us one group a record, ~4 us 8 to 128
# groups, ~7 us 256 groups)
_LEN = struct.Struct("<Q")


@dataclass(frozen=True, slots=True)
class LoggedGroups:
    """One record of the log: the final samples of the complete groups appended together."""

    group_ids: Int64Array  # [G], distinct
    samples: SampleBatch  # every sample of those groups, each group's in its own order

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
Logged = tuple[Sequence[int], Record]  # a record and the ids of the groups it holds
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


def encode_groups(groups: Sequence[tuple[int, Sequence[Sample]]]) -> list[tuple[list[int], Record]]:
    """The log records of complete groups (distinct ids), each with the ids of the groups it holds: one
    record, or more where the groups hold more than `RECORD_MAX_TOKENS` response tokens."""
    out: list[tuple[list[int], Record]] = []
    ids: list[int] = []
    samples: list[Sample] = []
    tokens = 0
    for gid, group in groups:
        ids.append(gid)
        samples += group
        tokens += sum(s.response_ids.shape[0] for s in group)
        if tokens >= RECORD_MAX_TOKENS:
            out.append((ids, _encode(ids, samples)))
            ids, samples, tokens = [], [], 0
    if ids:
        out.append((ids, _encode(ids, samples)))
    return out


def _encode(ids: list[int], samples: list[Sample]) -> Record:
    body = LoggedGroups(np.array(ids, dtype=np.int64), SampleBatch.from_samples(samples))
    return record_parts(encode_frames(LOG_FORMAT, LOG_KIND, body))


def decode_record(frames: Sequence[bytes | memoryview], max_bytes: int) -> tuple[list[int], SampleBatch]:
    """The group ids and samples of a record of either format; ProtocolError if it is not one."""
    try:
        decode_header(frames, LOG_FORMAT)
    except ProtocolError as exc:
        if exc.reason != "wrong_version":
            raise
        decode_header(frames, SINGLE_GROUP_FORMAT)
        old: LoggedGroup = decode_body(LoggedGroup, frames, max_bytes=max_bytes)
        return [old.group_id], old.samples
    record: LoggedGroups = decode_body(LoggedGroups, frames, max_bytes=max_bytes)
    return record.group_ids.tolist(), record.samples


def record_size(record: Record) -> int:
    return sum(len(part) for part in record)


@dataclass(slots=True)
class Segment:
    """One segment file and where each group's record is in it (the newest, if logged twice)."""

    number: int  # -1: the legacy complete.log
    path: Path
    size: int = 0
    entries: int = 0  # groups in the file's records, superseded ones included
    spans: dict[int, tuple[int, int]] = field(default_factory=dict)  # group id -> its record's (start, end)


class CompleteLog:
    """The segments in one directory, indexed on first use (a restarted broker scans them once)."""

    def __init__(self, directory: Path, trusted: Collection[int] = ()) -> None:
        """`trusted`: the groups whose newest record on disk is known to be right (the complete groups of
        the state this broker restored, which it read from those records). Any other record found on
        disk may be stale: written after the last durable state by a broker that then died, for a group
        id the restored broker issues again; such a group is logged again when it completes here."""
        self.directory = directory
        self._trusted = set(trusted)
        self._segments: list[Segment] | None = None  # oldest first
        self._where: dict[int, Segment] = {}  # group id -> the segment of its newest record
        self._logged: set[int] = set()  # groups whose newest record is right: trusted or appended here
        self._current: Segment | None = None  # appended to; None until the first append of this process
        self._unsynced: set[int] = set()  # numbers of segments appended to since the last sync
        self._new_name = False  # a segment was created since the last sync
        self._made = False  # the directory exists (made before the first segment, not checked again)

    def holds(self, gid: int) -> bool:
        """Whether the log holds the group's right record (then it need not be appended again)."""
        self._index()
        return gid in self._logged

    def append(self, records: Sequence[Logged], live: int, durable: bool = True) -> None:
        """Append records (the ids of the groups each holds, the encoded record), durably unless `durable` is
        False (then `sync` makes them durable); `live` is the number of live complete groups (a segment
        holds up to about max(SEGMENT_MIN_GROUPS, live) groups)."""
        if not records:
            return
        segments = self._index()
        cur = self._current
        if cur is None or cur.size >= SEGMENT_MAX_BYTES or cur.entries >= max(SEGMENT_MIN_GROUPS, live):
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
        for gids, record in records:
            span = (cur.size, cur.size + record_size(record))
            cur.size = span[1]
            cur.entries += len(gids)
            for gid in gids:
                cur.spans[gid] = span
                self._where[gid] = cur
            self._logged.update(gids)
        if durable:
            self.sync()

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

    def drop_dead(self, live: Collection[int]) -> None:
        """Called once a state that refers to no group outside `live` is durable: delete every segment
        (but the newest) that holds no live group's newest record; then, while the log holds more than
        2 x live + one segment's worth of groups, copy the live groups of the old segment with the most
        dead groups (of those, the fewest live) to the newest segment and delete it (FIFO training never
        needs to)."""
        segments = self._index()
        cap = max(SEGMENT_MIN_GROUPS, len(live))

        def live_in(seg: Segment) -> list[int]:
            return [gid for gid in seg.spans if gid in live and self._where.get(gid) is seg]

        for seg in [seg for seg in segments if seg is not self._current and not live_in(seg)]:
            self._delete(seg)
        while sum(seg.entries for seg in segments) > 2 * len(live) + cap:
            old = []  # (dead groups, -live groups, segment, its live groups)
            for seg in segments:
                if seg is not self._current:
                    mine = live_in(seg)
                    old.append((seg.entries - len(mine), -len(mine), seg, mine))
            if not old:
                return
            dead, _, seg, mine = max(old, key=lambda t: t[:2])
            if dead == 0:
                return  # every old group is live: copying would not shrink the log
            self.append(_live_records(seg, mine), len(live))  # durable (below) before the old copy goes
            self._delete(seg)

    def _delete(self, seg: Segment) -> None:
        for gid in seg.spans:
            if self._where.get(gid) is seg:
                del self._where[gid]
                self._logged.discard(gid)
        seg.path.unlink(missing_ok=True)
        assert self._segments is not None
        self._segments.remove(seg)

    def read(self, wanted: Collection[int]) -> dict[int, list[Sample]]:
        """The samples of each wanted group that the log holds (its newest record), in logged order."""
        out: dict[int, list[Sample]] = {}
        for seg in _segment_files(self.directory):
            for gids, samples, _ in _scan(seg.path):
                if any(gid in wanted for gid in gids):
                    found: dict[int, list[Sample]] = {}
                    for sample in samples.to_samples():
                        if sample.group_id in wanted:
                            found.setdefault(sample.group_id, []).append(sample)
                    out.update(found)  # newer than any record read before
        return out

    def _index(self) -> list[Segment]:
        if self._segments is None:
            self._segments = []
            for seg in _segment_files(self.directory):
                for gids, _, span in _scan(seg.path):
                    for gid in gids:
                        seg.spans[gid] = span
                        self._where[gid] = seg
                    seg.entries += len(gids)
                    seg.size = span[1]
                self._segments.append(seg)
            self._logged = self._trusted & self._where.keys()
        return self._segments


def _live_records(seg: Segment, mine: list[int]) -> list[tuple[list[int], Record]]:
    """The records of `seg` that hold its live groups `mine`: as they are where every group of the record
    is live, else encoded again with the live groups only (the dead ones would keep taking disk)."""
    by_span: dict[tuple[int, int], list[int]] = {}
    for gid in mine:
        by_span.setdefault(seg.spans[gid], []).append(gid)
    out: list[tuple[list[int], Record]] = []
    with open(seg.path, "rb") as f:
        for span, gids in by_span.items():
            data = _read_span(f, span)
            held, samples = decode_record(read_record(data, 0)[0], max_bytes=len(data) + 1)
            if len(held) == len(gids):  # gids is a subset of held (the index was read from this record)
                out.append((gids, [data]))
            else:
                keep = set(gids)
                group: dict[int, list[Sample]] = {gid: [] for gid in gids}
                for sample in samples.to_samples():
                    if sample.group_id in keep:
                        group[sample.group_id].append(sample)
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
    """Each record of a segment (its group ids and samples) with its (start, end); a torn tail is cut off."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        return
    pos = 0
    while pos < len(data):
        try:
            frames, end = read_record(data, pos)
            gids, samples = decode_record(frames, max_bytes=len(data) + 1)
        except (struct.error, ProtocolError):
            break  # a record torn by a crash: never referenced by a durable snapshot
        yield gids, samples, (pos, end)
        pos = end
    if pos < len(data):
        with open(path, "r+b") as f:
            f.truncate(pos)
