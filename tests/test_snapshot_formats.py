"""Run directories written by earlier versions of april restore exactly (broker/snapshot.py, complete_log.py).

`tests/fixtures/books/v2` to `v6` are the `broker/` files that the versions writing state file formats 2,
3, 4, 5 and 6 (log record formats 1, 2, 2, 3 and 4; commits 3e645d2, d14677c, c3753dc, 3ab086a and
c532de4) wrote for one april run mid-abort (partials, leases on two workers, a surplus complete group, an
unacked batch, a dropped group, a settled sample of a group still running), with `books.json`: those books
as that version held them in memory. `fixtures/books/make_books.py` made them. Before v6 their samples
have no lease spans (protocol 4 added them), before v5 no episode columns (protocol 3), and no state file
before format 7 has the journal's position or the run's counters: each sample must come back exactly as
it was, with no observations, no episode state and the lease spans it had, and the books must go on
from there. `fixtures/books/journal1` is a state file with a journal of format 1 after it (commit
4c3c58a, `fixtures/books/make_journal.py`): replayed, it must give the books the current code holds.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest
from test_broker_state import Driver, algo, assert_same_books, mid_run_april, source

from april import codec
from april.config import Mode
from april.records import FinishReason, LeaseSpan, Sample, SampleStatus, Segment
from april.wire_records import SampleBatch
from broker import complete_log, snapshot
from broker.state import BrokerState

FIXTURES = Path(__file__).parent / "fixtures" / "books"
WRITTEN = ["v2", "v3", "v4", "v5", "v6"]


def encoded(samples: list[Sample]) -> bytes:
    """The samples as the log stores them: equal bytes are samples equal in every bit of every field."""
    return complete_log.frames_bytes(codec.encode_frames(0, 0, SampleBatch.from_samples(samples)))


def assert_identical(got: list[Sample], expected: list[Sample]) -> None:
    assert [s.key for s in got] == [s.key for s in expected]
    for a, b in zip(got, expected, strict=True):
        assert encoded([a]) == encoded([b]), f"{a} != {b}"


def sample_of(j: dict[str, Any]) -> Sample:
    """A sample of books.json (an earlier version's, so without episode columns)."""
    return Sample(
        j["group_id"],
        j["index"],
        np.array(j["prompt_ids"], dtype=np.int32),
        np.array(j["response_ids"], dtype=np.int32),
        np.array(j["response_logprobs"], dtype=np.float32),
        tuple(Segment(*seg) for seg in j["segments"]),
        SampleStatus(j["status"]),
        FinishReason(j["finish_reason"]),
        j["resumes"],
        math.nan if j["reward"] is None else j["reward"],
        j["prompt_text"],
        j["metadata"],
        j["error"],
        leases=tuple(LeaseSpan(worker, end) for worker, end in j.get("leases", [])),
    )


def headers(directory: Path) -> tuple[int, set[int]]:
    """The state file's format and the formats of the log's records."""
    [state_format] = headers_of(directory / snapshot.FILE_NAME)
    return state_format, {f for path in directory.glob("complete.*.log") for f in headers_of(path)}


def headers_of(path: Path) -> list[int]:
    """The format of each record of a file."""
    data, pos, out = path.read_bytes(), 0, []
    while pos < len(data):
        frames, pos = complete_log.read_record(data, pos)
        out.append(msgpack.unpackb(frames[0])[0])
    return out


def restored(written: str, directory: Path) -> tuple[BrokerState, dict[str, Any]]:
    shutil.copytree(FIXTURES / written / "broker", directory)
    books = json.loads((FIXTURES / written / "books.json").read_text(encoding="utf-8"))
    state_format, log_formats = headers(directory)
    assert state_format == books["format"] < snapshot.SNAPSHOT_FORMAT
    assert max(log_formats) <= complete_log.LOG_FORMAT  # v6 wrote log records of the current format
    state = snapshot.restore(
        snapshot.read(directory), Mode.APRIL, algo(b=1, over=5, n=2, dynamic=True), source()
    )
    return state, books


@pytest.mark.parametrize("written", WRITTEN)
def test_books_an_earlier_version_wrote_restore_exactly(tmp_path: Path, written: str) -> None:
    state, books = restored(written, tmp_path / "broker")
    assert state.epoch == books["epoch"] + 1
    assert (state.version, [state.weights_uri, state.weights_sha256]) == (books["version"], books["weights"])
    assert (state.cursor, state.next_group_id, state.next_batch_id, state.round_open) == (
        books["cursor"],
        books["next_group_id"],
        books["next_batch_id"],
        books["round_open"],
    )
    assert state.ledger().to_json() == books["ledger"]
    assert [list(key) for key in state.queue.ordered()] == books["queue"]
    assert list(state.complete) == books["complete"]
    assert sorted(state.groups) == sorted(map(int, books["groups"]))
    for gid, samples in books["groups"].items():
        assert_identical(state.groups[int(gid)].samples, [sample_of(s) for s in samples])
    assert all(s.observations == () and s.episode == b"" for g in state.groups.values() for s in g.samples)
    assert any(s.leases for g in state.groups.values() for s in g.samples) == (written >= "v6")
    assert sorted(state.leases) == [lease["lease_id"] for lease in books["leases"]]
    for lease in books["leases"]:
        entry = state.leases[lease["lease_id"]]
        assert entry.worker_id == lease["worker"]
        assert_identical([entry.at_lease], [sample_of(lease["at_lease"])])
    batch = state.batch
    assert batch is not None
    assert (batch.batch_id, batch.step, batch.version, batch.group_ids, batch.stats) == (
        books["batch"]["batch_id"],
        books["batch"]["step"],
        books["batch"]["version"],
        books["batch"]["group_ids"],
        books["batch"]["stats"],
    )
    assert_identical(batch.samples, [sample_of(s) for g in batch.group_ids for s in books["groups"][str(g)]])
    wire, old = state.history.to_wire(), books["history"]
    seen = {p: (m, n) for p, m, n in zip(old["prompts"], old["log_mean"], old["seen"], strict=True) if n}
    now = zip(wire.prompts.tolist(), wire.log_mean.tolist(), wire.seen.tolist(), strict=True)
    assert {p: (m, n) for p, m, n in now if n} == seen
    assert wire.recent.tolist() == old["recent"]


@pytest.mark.parametrize("written", WRITTEN)
def test_books_an_earlier_version_wrote_are_written_anew_and_the_run_goes_on(
    tmp_path: Path, written: str
) -> None:
    """The restored broker's first snapshot is of the current format (its log keeps the earlier
    records it trusts) and restores the same books; then the run trains the unacked batch and goes on
    with every lease of the earlier broker finished."""
    directory = tmp_path / "broker"
    state, _ = restored(written, directory)
    snapshot.write(snapshot.capture(state), directory, snapshot.restored_groups(state))
    state_format, log_formats = headers(directory)
    assert state_format == snapshot.SNAPSHOT_FORMAT
    # the earlier records are read, not copied (v6's log records are of the current format already)
    assert min(log_formats) < complete_log.LOG_FORMAT or written == "v6"
    again = snapshot.restore(snapshot.read(directory), state.mode, state.algo, source())
    assert_same_books(state, again)
    assert_identical(
        [s for g in again.groups.values() for s in g.samples],
        [s for g in state.groups.values() for s in g.samples],
    )
    d = Driver(again)
    for lease_id, lease in again.leases.items():
        leased = lease.at_lease.resumed()
        d.held[lease_id] = (lease.worker_id, leased, leased.budget(again.algo.max_new_tokens))
    d.check()
    assert d.train(step=1) is not None
    d.finish_all()
    for step in range(2, 6):
        d.take()
        d.finish_all()
        d.end_round()
        d.train(step)
    ledger = again.check_ledger()
    assert ledger.trained >= state.trained + 4 and ledger.in_flight == ledger.partial == 0


@pytest.mark.parametrize("written", ["v3", "v4", "v5"])
def test_an_earlier_log_record_partly_dead_is_copied_out_in_the_current_format(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, written: str
) -> None:
    """The earlier version logged groups 2, 4 and 5 in one record; once only group 5 is live and the
    log holds too many dead samples, its sample is encoded again, now with the columns its format lacked,
    and the earlier segment is deleted."""
    monkeypatch.setattr(complete_log, "SEGMENT_MIN_SAMPLES", 1)
    shutil.copy(FIXTURES / written / "broker" / "complete.00000000.log", tmp_path)
    books = json.loads((FIXTURES / written / "books.json").read_text(encoding="utf-8"))
    log = complete_log.CompleteLog(tmp_path, trusted=[2, 4, 5])
    assert sorted(log.read({2, 4, 5})) == [(2, 0), (2, 1), (4, 0), (4, 1), (5, 0)]
    log.drop_dead({5})
    assert not (tmp_path / "complete.00000000.log").exists()
    assert headers_of(tmp_path / "complete.00000001.log") == [complete_log.LOG_FORMAT]
    read = complete_log.CompleteLog(tmp_path).read({2, 4, 5})
    assert_identical(list(read.values()), [sample_of(books["groups"]["5"][0])])


@pytest.mark.parametrize("written", WRITTEN)
def test_the_size_limit_of_an_earlier_state_file_is_on_the_bytes_read(written: str) -> None:
    """Its samples gain the columns of later protocols in decoding, which makes the body longer than the
    bytes read: a file exactly at the limit still decodes, one byte over it does not."""
    frames, _ = complete_log.read_record((FIXTURES / written / "broker" / snapshot.FILE_NAME).read_bytes(), 0)
    size = sum(len(frame) for frame in frames)
    fields = ("samples", "leased_at")
    live = complete_log.decode_upgraded(snapshot.BrokerSnapshot, frames, fields, size, snapshot.BEFORE_7)
    samples = live.samples.to_samples()
    assert all(s.observations == () and s.episode == b"" for s in samples)
    assert any(s.leases for s in samples) == (written >= "v6")
    assert (live.counters, live.journal_segment) == ({}, snapshot.NO_JOURNAL)
    with pytest.raises(codec.ProtocolError) as exc:
        complete_log.decode_upgraded(snapshot.BrokerSnapshot, frames, fields, size - 1, snapshot.BEFORE_7)
    assert exc.value.reason == "oversize"


def test_a_journal_an_earlier_version_wrote_is_replayed_exactly(tmp_path: Path) -> None:
    """`fixtures/books/journal1`: a state file and a journal of format 1 after it (before the RESTART op),
    written by commit 4c3c58a (`fixtures/books/make_journal.py`). Restored and replayed, the books equal
    those the current code holds after the same changes, counters too."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("make_journal", FIXTURES / "make_journal.py")
    assert spec is not None and spec.loader is not None
    make_journal = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(make_journal)
    directory = tmp_path / "broker"
    shutil.copytree(FIXTURES / "journal1" / "broker", directory)
    store = snapshot.SnapshotStore(directory)
    records, _ = store.read_journal(store.load())
    assert records, "the fixture's journal is empty"
    (segment,) = sorted(directory.glob("complete.*.log"))
    kinds = {int(msgpack.unpackb(frames[0])[1]): int(msgpack.unpackb(frames[0])[0])
             for frames, _ in iter_records(segment)}  # fmt: skip
    assert kinds[complete_log.JOURNAL_KIND] == 1  # written in format 1
    algo_ = algo(b=1, over=5, n=2, dynamic=True)
    restored = snapshot.resume(directory, Mode.APRIL, algo_, source())
    d = mid_run_april()
    make_journal.after(d)
    assert_same_books(d.state, restored)
    assert snapshot.counters_of(d.state) == snapshot.counters_of(restored)


def iter_records(path: Path) -> list[tuple[list[bytes], int]]:
    """Each record's frames in a log segment, with its end."""
    data, pos, out = path.read_bytes(), 0, []
    while pos < len(data):
        frames, pos = complete_log.read_record(data, pos)
        out.append((frames, pos))
    return out
