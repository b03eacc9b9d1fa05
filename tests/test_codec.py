"""Tests for the wire codec (april.codec) and the message registry (april.protocol).

Three layers: a round trip of every registered message kind; one crafted input per rejection reason,
checking `ProtocolError.reason` and that the message names the problem; and hypothesis property tests
(random frames, mutated valid frames) asserting that `decode` raises only `ProtocolError` and that
whatever it accepts is a well-typed, valid message that round-trips again.

Inputs that once broke the codec are kept below as regression tests.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import msgpack
import numpy as np
import pytest
from episode_samples import episodes
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from april import protocol as P
from april.codec import (
    INLINE_ARRAY_MAX_BYTES,
    INT64_MAX,
    INT64_MIN,
    MAX_FRAMES,
    ProtocolError,
    _Array,
    _Dict,
    _Enum,
    _List,
    _Optional,
    _Scalar,
    _Spec,
    _Struct,
    decode_body,
    encode_frames,
    struct_schema,
)
from april.ledger import Ledger
from april.records import FinishReason, Sample, Span, new_group_samples
from april.status import (
    BrokerStatus,
    EvalProgress,
    EvalStatus,
    LearnerStatus,
    Rejected,
    RoundStatus,
    Totals,
    UnackedBatch,
    WorkerStatus,
)
from april.wire_records import SampleBatch

REASONS = {
    "bad_frames",
    "bad_header",
    "wrong_version",
    "unknown_kind",
    "bad_msgpack",
    "missing_field",
    "extra_field",
    "wrong_type",
    "invalid_value",
    "bad_buffer",
    "oversize",
}
SHA = "0123456789abcdef" * 4

# ---------------------------------------------------------------------------------------------------
# Representative instances of every message kind


def _samples() -> list[Sample]:
    fresh = Sample(group_id=4, index=0, prompt_ids=np.array([101, 7, 8], np.int32), metadata={"answer": "42"})
    text_only = Sample(group_id=4, index=1, prompt_ids=np.zeros(0, np.int32), prompt_text="What is 6 x 7?")
    # an episode: turn, tool result, abort, resume, turn, tool result, last turn
    resumed = Sample(group_id=5, index=0, prompt_ids=np.array([101, 9], np.int32))
    resumed = resumed.extend([3, 4], [-0.5, -1.25], 1, FinishReason.NONE).observed([70, 71])
    resumed = resumed.with_episode(b'{"env": {"x": 1}, "turns": 1}')
    resumed = resumed.extend([], [], 1, FinishReason.ABORT).returned_by("worker-1", ()).resumed()
    resumed = resumed.extend([5, 6], [-0.1, 0.0], 2, FinishReason.NONE).observed([72])
    resumed = resumed.extend([2], [-3.0], 2, FinishReason.STOP).scored(1.0)
    failed = Sample(group_id=6, index=3, prompt_ids=np.array([1], np.int32)).failed("reward timeout")
    return [fresh, text_only, resumed, failed]


def _finished_groups() -> SampleBatch:
    out = []
    for g in (10, 11):
        for i in range(2):
            s = Sample(group_id=g, index=i, prompt_ids=np.array([1, 2, g], np.int32))
            s = s.extend([g, i, 0], [-0.5, -0.25, -0.125], 3, FinishReason.STOP).scored(float(i))
            out.append(s)
    return SampleBatch.from_samples(out)


def _broker_status() -> BrokerStatus:
    """A status with every optional part present (learner, unacked batch, a running evaluation)."""
    return BrokerStatus(
        run="gsm8k", steps=100, mode="april", version=3, epoch=1, uptime_s=12.5,
        round=RoundStatus(id=2, open=True, aborting=True, aborts_done=1),
        workers=[
            WorkerStatus(
                id="worker-0", engine="sglang", slots=8, credit=2, leases=6, tokens_generated=900, version=3,
                pid=4242, host="node-1", last_seen_s=0.25, restored=False, alive=True,
                placement="http://node-1:30000",
            ),
            WorkerStatus(
                id="worker-1", engine="sglang", slots=8, credit=0, leases=0, tokens_generated=40, version=3,
                pid=4243, host="node-2", last_seen_s=0.5, restored=False, alive=True, engine_ok=False,
                engine_detail="sglang http://node-2:30000 does not answer", failed_by_engine=1,
                returned_by_engine=6,
            ),
        ],
        learner=LearnerStatus(
            id="learner-0", last_seen_s=0.5, waiting_for_batch=True, phase="training",
            engine="DeepSpeed ZeRO-2 on cuda, torch fused AdamW, 8 ranks",
        ),
        learner_metrics={"step": 2.0, "loss": 0.5, "learner/clip_frac": 0.125, "eval_accuracy": math.nan},
        in_flight_groups=4, leased_samples=6, queued_samples=2, partial_groups=1, partial_buffer=2,
        partial_staleness={"0": 1, "1": 1}, complete_groups=1,
        unacked_batch=UnackedBatch(batch_id=2, step=2, groups=2), cursor=12,
        ledger=Ledger(issued=12, trained=6, complete_waiting=3, in_flight=2, partial=1),
        totals=Totals(aborted=5, resumed=3, tokens_generated=4000, samples_finished=30, batches_acked=2),
        eval=EvalStatus(
            version=2, accuracy=0.5, reward_mean=None, n=4, failed=1, oldest_version=2, newest_version=3,
            every=2, completed=2, tokens_generated=64,
            running=EvalProgress(version=3, done=1, leased=3, of=4),
        ),
        rejected=Rejected(by_reason={"not_leased": 2}, by_peer={"worker-0": {"not_leased": 2}}),
    )  # fmt: skip


EXAMPLES: dict[type, Any] = {
    P.Heartbeat: P.Heartbeat(),
    P.EngineUsage: P.EngineUsage(busy_slot_s=12.5, slot_s=16.0, free_slot_s=1.25, elapsed_s=2.0),
    P.EngineHealth: P.EngineHealth(
        ok=False,
        detail="sglang http://gpu-1:30000 does not answer: connection refused",
        failed_by_engine=2,
        returned_by_engine=7,
        placement="http://gpu-1:30000",
    ),
    P.Error: P.Error(code="not_leased", detail="lease 12 is not held by worker-0"),
    P.WorkerHello: P.WorkerHello(
        worker_id="worker-0",
        engine="torch",
        slots=8,
        version=3,
        pid=4242,
        host="node-1",
        held_leases=np.array([100, 102], np.int64),
        credit=6,
    ),
    P.Welcome: P.Welcome(
        peer_id="worker-0",
        mode="april",
        version=3,
        weights_uri="file:///runs/r/weights/v3.safetensors",
        weights_sha256=SHA,
        heartbeat_interval_s=1.0,
        max_new_tokens=256,
        temperature=1.0,
        top_p=0.95,
        top_k=0,
    ),
    P.LeaseRequest: P.LeaseRequest(credit=4),
    P.Lease: P.Lease(
        lease_ids=np.array([100, 101, 102, 103], np.int64),
        budgets=np.array([256, 256, 251, 256], np.int32),
        greedy=np.array([0, 0, 0, 1], np.uint8),
        samples=SampleBatch.from_samples(_samples()),
        acked=41,
    ),
    P.SampleResult: P.SampleResult(
        lease_ids=np.array([100, 101, 102, 103], np.int64),
        samples=SampleBatch.from_samples(_samples()),
        credit=2,
        seq=42,
    ),
    P.ResultAck: P.ResultAck(acked=42),
    P.Abort: P.Abort(round_id=7),
    P.AbortDone: P.AbortDone(round_id=7, credit=8, scoring=np.array([3, 4], np.int64)),
    P.WeightsReady: P.WeightsReady(version=4, uri="file:///runs/r/weights/v4.safetensors", sha256=SHA),
    P.WeightsLoaded: P.WeightsLoaded(
        version=4, ok=False, error="sha256 mismatch", transport="network", sync_s=1.25
    ),
    P.Disconnect: P.Disconnect(reason="shutdown"),
    P.LearnerHello: P.LearnerHello(learner_id="learner-0", version=3, pid=77),
    P.BatchRequest: P.BatchRequest(step=3, last_batch_id=2),
    P.Batch: P.Batch(
        batch_id=9,
        step=3,
        version=3,
        samples=_finished_groups(),
        stats={"aborted": 5.0, "resumed": 2.0, "staleness_mean": 0.25, "rollout_s": 1.5},
        ledger=Ledger(
            issued=12, trained=6, complete_waiting=2, in_flight=2, partial=1, dropped={"dynamic_filter": 1}
        ),
    ),
    P.BatchAck: P.BatchAck(batch_id=9, metrics={"loss": 0.5, "reward_mean": 0.25}),
    P.LearnerPhaseReport: P.LearnerPhaseReport(P.LearnerPhase.INITIALISING_ENGINE, "DeepSpeed ZeRO-2 on cpu"),
    P.StatusRequest: P.StatusRequest(),
    P.StatusReply: P.StatusReply(status=_broker_status()),
    P.WeightsChunkRequest: P.WeightsChunkRequest(version=4, offset=8 << 20, length=4 << 20),
    P.WeightsChunk: P.WeightsChunk(
        version=4, offset=8, size=32, data=np.frombuffer(b"safetensors-bytes", np.uint8).copy()
    ),
    P.WeightsGone: P.WeightsGone(version=2, newest=4),
}


def frames_of(msg: Any) -> list[bytes]:
    """Encoded frames as independent bytes copies (what a receiver with copy=True sees)."""
    return [bytes(f) for f in P.encode(msg)]


def framed_of(msg: Any) -> list[bytes]:
    """The same message with every array in its own frame (as a large array always is): the frame-ref
    form, for the tests of frame references and buffers."""
    return [bytes(f) for f in encode_frames(P.PROTOCOL_VERSION, P.KIND_OF[type(msg)], msg)]


def body_of(frames: list[bytes]) -> dict[str, Any]:
    body: dict[str, Any] = msgpack.unpackb(frames[1], raw=False)
    return body


def with_body(frames: list[bytes], body: Any) -> list[bytes]:
    return [frames[0], msgpack.packb(body, use_bin_type=True), *frames[2:]]


def header(version: int, kind: int) -> bytes:
    return bytes(msgpack.packb([version, kind]))


# ---------------------------------------------------------------------------------------------------
# Deep comparison and schema check


def assert_same(a: Any, b: Any, where: str = "msg") -> None:
    """Equal field by field; arrays by dtype and np.array_equal; NaN equals NaN; SampleBatch via samples."""
    assert type(a) is type(b), f"{where}: {type(a).__name__} vs {type(b).__name__}"
    if isinstance(a, SampleBatch):
        sa, sb = a.to_samples(), b.to_samples()
        assert len(sa) == len(sb), f"{where}: {len(sa)} vs {len(sb)} samples"
        for i, (x, y) in enumerate(zip(sa, sb, strict=True)):
            assert_same(x, y, f"{where}.samples[{i}]")
    if dataclasses.is_dataclass(a):
        for f in dataclasses.fields(a):
            assert_same(getattr(a, f.name), getattr(b, f.name), f"{where}.{f.name}")
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype, f"{where}: {a.dtype} vs {b.dtype}"
        assert np.array_equal(a, b, equal_nan=a.dtype.kind == "f"), f"{where}: {a} vs {b}"
    elif isinstance(a, float):
        assert a == b or (math.isnan(a) and math.isnan(b)), f"{where}: {a} vs {b}"
    elif isinstance(a, dict):
        assert list(a) == list(b), f"{where}: keys {list(a)} vs {list(b)}"
        for k in a:
            assert_same(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, list | tuple):
        assert len(a) == len(b), f"{where}: length {len(a)} vs {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} vs {b!r}"


def check_schema(value: Any, spec: _Spec, where: str) -> None:
    """What decode returns must have exactly the declared types (bool is not an int, keys are str)."""
    match spec:
        case _Scalar(py):
            assert type(value) is py, f"{where}: {type(value).__name__}, expected {py.__name__}"
            if py is int:
                assert isinstance(value, int) and INT64_MIN <= value <= INT64_MAX, where
        case _Enum(cls):
            assert type(value) is cls, where
        case _Optional(inner):
            if value is not None:
                check_schema(value, inner, where)
        case _List(inner):
            assert type(value) is list, where
            for i, v in enumerate(value):
                check_schema(v, inner, f"{where}[{i}]")
        case _Dict(inner):
            assert type(value) is dict, where
            for k, v in value.items():
                assert type(k) is str, f"{where}: key {k!r} is not str"
                check_schema(v, inner, f"{where}[{k!r}]")
        case _Array(dtype):
            assert isinstance(value, np.ndarray) and value.ndim == 1, where
            assert value.dtype == dtype, f"{where}: {value.dtype} vs {dtype}"
        case _Struct(cls, fields):
            assert type(value) is cls, f"{where}: {type(value).__name__}, expected {cls.__name__}"
            for name, field_spec in fields:
                check_schema(getattr(value, name), field_spec, f"{where}.{name}")
            validate = getattr(value, "validate", None)
            if validate is not None:
                validate()


def assert_valid_message(msg: Any) -> None:
    """Registered type, schema-exact, valid, and re-encodes to frames that decode to the same message."""
    assert type(msg) in P.KIND_OF
    check_schema(msg, struct_schema(type(msg)), type(msg).__name__)
    again = P.decode(frames_of(msg))
    assert_same(msg, again)


# ---------------------------------------------------------------------------------------------------
# Round trip of every message kind


def test_examples_cover_every_message_type() -> None:
    assert set(EXAMPLES) == set(P.MESSAGE_TYPES), (
        f"add an example for {sorted(t.__name__ for t in set(P.MESSAGE_TYPES) - set(EXAMPLES))}"
    )
    for cls, msg in EXAMPLES.items():
        assert type(msg) is cls


def test_registry_is_consistent() -> None:
    assert len(set(P.KIND_OF.values())) == len(P.KIND_OF), "kind codes must be unique"
    assert all(type(k) is int and 0 < k < 2**31 for k in P.KIND_OF.values())
    assert {cls: kind for kind, cls in P.TYPE_OF.items()} == P.KIND_OF
    assert tuple(P.KIND_OF) == P.MESSAGE_TYPES
    # the wire codes are part of the protocol: docs/protocol.md lists exactly these
    assert {cls.__name__: kind for cls, kind in P.KIND_OF.items()} == {
        "Heartbeat": 1,
        "Error": 2,
        "WorkerHello": 10,
        "Welcome": 11,
        "LeaseRequest": 12,
        "Lease": 13,
        "SampleResult": 14,
        "Abort": 15,
        "AbortDone": 16,
        "WeightsReady": 17,
        "WeightsLoaded": 18,
        "Disconnect": 19,
        "EngineUsage": 20,
        "EngineHealth": 21,
        "ResultAck": 22,
        "LearnerHello": 30,
        "BatchRequest": 31,
        "Batch": 32,
        "BatchAck": 33,
        "LearnerPhaseReport": 34,
        "StatusRequest": 40,
        "StatusReply": 41,
        "WeightsChunkRequest": 50,
        "WeightsChunk": 51,
        "WeightsGone": 52,
    }


@pytest.mark.parametrize("cls", P.MESSAGE_TYPES, ids=lambda c: c.__name__)
def test_round_trip(cls: type) -> None:
    msg = EXAMPLES[cls]
    frames = frames_of(msg)
    assert msgpack.unpackb(frames[0]) == [P.PROTOCOL_VERSION, P.KIND_OF[cls]]
    decoded: Any = P.decode(frames)
    assert_same(msg, decoded)
    assert_valid_message(decoded)


@pytest.mark.parametrize("cls", [P.Lease, P.SampleResult, P.Batch], ids=lambda c: c.__name__)
def test_round_trip_sample_batches_field_by_field(cls: type) -> None:
    msg = EXAMPLES[cls]
    decoded: Any = P.decode(frames_of(msg))
    for original, back in zip(msg.samples.to_samples(), decoded.samples.to_samples(), strict=True):
        for f in dataclasses.fields(Sample):
            x, y = getattr(original, f.name), getattr(back, f.name)
            if isinstance(x, np.ndarray):
                assert x.dtype == y.dtype and np.array_equal(x, y), f.name
            elif isinstance(x, float) and math.isnan(x):
                assert math.isnan(y), f.name
            else:
                assert x == y, f.name
        back.check()


def test_array_frames_layout() -> None:
    """Arrays follow the body as frames 2.. in field order, referenced as [index, dtype, length]."""
    msg = EXAMPLES[P.Lease]
    frames = framed_of(msg)
    body = body_of(frames)
    assert body["lease_ids"] == [2, "<i8", 4]
    assert body["budgets"] == [3, "<i4", 4]
    assert body["greedy"] == [4, "|u1", 4]
    assert body["samples"]["group_id"] == [5, "<i8", 4]
    assert body["samples"]["segments"][1:] == ["<i8", 9]
    assert body["samples"]["observations"][1:] == ["<i8", 4]
    assert body["samples"]["episode"] == [b"", b"", b'{"env": {"x": 1}, "turns": 1}', b""]
    assert body["samples"]["lease_workers"] == ["worker-1"]  # the one sample that came back aborted
    assert body["samples"]["lease_ends"][1:] == ["<i8", 1]
    assert frames[2] == np.array([100, 101, 102, 103], "<i8").tobytes()
    assert len(frames) == 2 + 3 + 17  # header, body, lease_ids, budgets, greedy, 17 SampleBatch arrays


def test_small_arrays_travel_inline_and_large_ones_in_frames() -> None:
    """protocol.encode puts an array of at most INLINE_ARRAY_MAX_BYTES inside the body as
    [bytes, dtype, length] while the message's inline total stays within INLINE_BYTES; the rest get
    frames. Both forms decode to the same message."""
    small = EXAMPLES[P.Lease]
    frames = frames_of(small)
    assert len(frames) == 2  # header and body: a lease's arrays are small
    body = body_of(frames)
    assert body["lease_ids"] == [np.array([100, 101, 102, 103], "<i8").tobytes(), "<i8", 4]
    assert_same(small, P.decode(frames))
    assert_same(small, P.decode(framed_of(small)))
    big_ids = np.arange(INLINE_ARRAY_MAX_BYTES // 4 + 1, dtype=np.int32)  # one int32 past the limit
    sample = new_group_samples(1, 1, big_ids, "", {})[0]
    lease = P.Lease(
        np.array([7], np.int64),
        np.array([1], np.int32),
        np.zeros(1, np.uint8),
        SampleBatch.from_samples([sample]),
    )
    frames = frames_of(lease)
    body = body_of(frames)
    assert body["samples"]["prompt_ids"] == [2, "<i4", big_ids.shape[0]]  # the one frame
    assert type(body["samples"]["group_id"][0]) is bytes and len(frames) == 3
    assert_same(lease, P.decode(frames))


def test_inline_arrays_stop_at_the_message_budget() -> None:
    """Arrays each under the per-array limit go to frames once the message's inline total is spent."""
    n = INLINE_ARRAY_MAX_BYTES // 4  # int32s per maximal inline array
    samples = [new_group_samples(g, 1, np.arange(n, dtype=np.int32), "", {})[0] for g in range(8)]
    lease = P.Lease(
        np.arange(8, dtype=np.int64),
        np.ones(8, np.int32),
        np.zeros(8, np.uint8),
        SampleBatch.from_samples(samples[:1]),
    )
    assert len(frames_of(lease)) == 2
    batch = SampleBatch.from_samples(samples)  # 8 x 16 KiB of prompt ids: one array over the limit
    lease = dataclasses.replace(lease, samples=batch)
    frames = frames_of(lease)
    inline = sum(len(ref[0]) for ref in _inline_refs(body_of(frames)))
    assert inline <= P.INLINE_BYTES and len(frames) > 2
    assert_same(lease, P.decode(frames))


def _inline_refs(body: Any) -> list[list[Any]]:
    """Every inline array ref in a body map (nested records included)."""
    out: list[list[Any]] = []
    for value in body.values():
        if isinstance(value, dict):
            out += _inline_refs(value)
        elif isinstance(value, list) and len(value) == 3 and type(value[0]) is bytes:
            out.append(value)
    return out


@pytest.mark.parametrize(
    ("ref", "reason", "fragment"),
    [
        ([b"\x00" * 31, "<i8", 4], "bad_buffer", "31 inline bytes, expected 4 x 8"),
        ([b"\x00" * 40, "<i8", 4], "bad_buffer", "40 inline bytes, expected 4 x 8"),
        ([b"", "<i8", -1], "bad_buffer", "expected -1 x 8"),
        ([b"\x00" * 32, "<i4", 8], "wrong_type", "array ref"),
        (["\x00" * 32, "<i8", 4], "wrong_type", "array ref"),
        ([b"\x00" * 32, "<i8", 4, 0], "wrong_type", "array ref"),
    ],
)
def test_rejects_bad_inline_arrays(ref: list[Any], reason: str, fragment: str) -> None:
    frames = frames_of(EXAMPLES[P.Lease])
    body = body_of(frames)
    body["lease_ids"] = ref
    reject(with_body(frames, body), reason, "Lease.lease_ids", fragment)


def test_decode_accepts_memoryviews_and_empty_arrays() -> None:
    msg = P.Lease(
        lease_ids=np.zeros(0, np.int64),
        budgets=np.zeros(0, np.int32),
        greedy=np.zeros(0, np.uint8),
        samples=SampleBatch.from_samples([]),
    )
    decoded: Any = P.decode(P.encode(msg))  # memoryview frames straight from the encoder
    assert_same(msg, decoded)
    assert len(decoded.samples) == 0


def test_float_field_accepts_msgpack_int() -> None:
    frames = frames_of(EXAMPLES[P.Welcome])
    body = body_of(frames)
    body["temperature"] = 1
    msg = P.decode(with_body(frames, body))
    assert isinstance(msg, P.Welcome)
    assert type(msg.temperature) is float and msg.temperature == 1.0


def test_int64_bounds_are_accepted() -> None:
    for value in (INT64_MIN, INT64_MAX):
        frames = frames_of(EXAMPLES[P.Batch])
        body = body_of(frames)
        body["step"] = value  # Batch.step has no range check beyond int64
        msg = P.decode(with_body(frames, body))
        assert isinstance(msg, P.Batch) and msg.step == value


def test_encode_rejects_unregistered_type() -> None:
    with pytest.raises(TypeError, match="not a registered message"):
        P.encode(Sample(group_id=0, index=0, prompt_ids=np.zeros(0, np.int32)))  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------------
# One crafted input per rejection reason


def reject(frames: list[bytes], reason: str, *fragments: str, max_bytes: int | None = None) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        if max_bytes is None:
            P.decode(frames)
        else:
            P.decode(frames, max_bytes=max_bytes)
    err = info.value
    assert err.reason == reason, f"reason {err.reason!r}, expected {reason!r}: {err}"
    for fragment in fragments:
        assert fragment in str(err), f"{fragment!r} not in {str(err)!r}"
    return err


def _edit(cls: type, edit: Callable[[dict[str, Any]], None]) -> list[bytes]:
    frames = framed_of(EXAMPLES[cls])
    body = body_of(frames)
    edit(body)
    return with_body(frames, body)


def _set(cls: type, path: tuple[str, ...], value: Any) -> list[bytes]:
    def edit(body: dict[str, Any]) -> None:
        node = body
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value

    return _edit(cls, edit)


def _swap_ref(body: dict[str, Any], field: str, position: int, value: Any) -> None:
    body[field][position] = value


HB = frames_of(P.Heartbeat())[1]
V = P.PROTOCOL_VERSION

FRAME_CASES = [
    pytest.param([], "bad_frames", ["at least 2 frames", "got 0"], id="no_frames"),
    pytest.param([header(V, 1)], "bad_frames", ["at least 2 frames", "got 1"], id="one_frame"),
    pytest.param([b"\xc1", HB], "bad_msgpack", ["header"], id="header_not_msgpack"),
    pytest.param([header(V, 1) + b"\x00", HB], "bad_msgpack", ["header"], id="header_trailing_bytes"),
    pytest.param([msgpack.packb([1]), HB], "bad_header", ["[protocol_version, kind]"], id="header_len1"),
    pytest.param([msgpack.packb([1, 1, 1]), HB], "bad_header", ["got [1, 1, 1]"], id="header_len3"),
    pytest.param([msgpack.packb({"v": 1}), HB], "bad_header", ["header must be"], id="header_map"),
    pytest.param([msgpack.packb([1, "1"]), HB], "bad_header", ["integers"], id="header_str_kind"),
    pytest.param([msgpack.packb([True, 1]), HB], "bad_header", ["integers"], id="header_bool"),
    pytest.param([msgpack.packb([1.0, 1]), HB], "bad_header", ["integers"], id="header_float"),
    pytest.param([msgpack.packb([1, "x" * 70]), HB], "oversize", ["header", "limit 64"], id="header_big"),
    pytest.param(
        [header(V + 1, 1), HB],
        "wrong_version",
        [f"protocol version {V + 1}, expected {V}"],
        id="version_next",
    ),
    pytest.param([header(0, 1), HB], "wrong_version", ["version 0"], id="version0"),
    pytest.param([header(V, 999), HB], "unknown_kind", ["unknown message kind 999"], id="kind999"),
    pytest.param([header(V, 0), HB], "unknown_kind", ["kind 0"], id="kind0"),
    pytest.param([header(V, -1), HB], "unknown_kind", ["kind -1"], id="kind_negative"),
    pytest.param(
        [header(V, 1), b"\xc1"], "bad_msgpack", ["Heartbeat body", "not valid msgpack"], id="body_c1"
    ),
    pytest.param([header(V, 1), b""], "bad_msgpack", ["Heartbeat body"], id="body_empty"),
    pytest.param([header(V, 1), HB + b"\x80"], "bad_msgpack", ["Heartbeat body"], id="body_trailing"),
    pytest.param([header(V, 1), b"\x81\x01\x02"], "bad_msgpack", ["Heartbeat body"], id="body_int_key"),
    pytest.param([header(V, 1), b"\xc7\x01\x05\x00"], "bad_msgpack", ["Heartbeat body"], id="body_ext_type"),
    pytest.param([header(V, 1), b"\xa3ab"], "bad_msgpack", ["Heartbeat body"], id="body_truncated"),
    pytest.param([header(V, 1), b"\xa1\xff"], "bad_msgpack", ["Heartbeat body"], id="body_bad_utf8"),
    pytest.param([header(V, 1), msgpack.packb([])], "wrong_type", ["Heartbeat", "expected a map"], id="list"),
    pytest.param([header(V, 1), HB, b""], "bad_buffer", ["1 buffer frames, 0 referenced"], id="extra_frame"),
    pytest.param(
        [header(V, 1), HB, *([b""] * (MAX_FRAMES - 1))], "oversize", ["1025 frames", "1024"], id="frames"
    ),
]


@pytest.mark.parametrize(("frames", "reason", "fragments"), FRAME_CASES)
def test_rejects_bad_frames(frames: list[bytes], reason: str, fragments: list[str]) -> None:
    reject(frames, reason, *fragments)


def _drop(field: str) -> Callable[[dict[str, Any]], None]:
    return lambda body: body.pop(field)


BODY_CASES = [
    # missing / extra
    pytest.param(P.WorkerHello, _drop("slots"), "missing_field", ["WorkerHello", "slots"], id="missing"),
    pytest.param(
        P.Lease,
        lambda b: b["samples"].pop("prompt_text"),
        "missing_field",
        ["Lease.samples", "prompt_text"],
        id="missing_nested",
    ),
    pytest.param(
        P.Batch,
        lambda b: b["ledger"].pop("dropped"),
        "missing_field",
        ["Batch.ledger", "dropped"],
        id="ledger",
    ),
    pytest.param(
        P.StatusReply,
        lambda b: b["status"]["workers"][0].pop("alive"),
        "missing_field",
        ["StatusReply.status.workers[0]", "alive"],
        id="missing_status",
    ),
    pytest.param(P.Abort, lambda b: b.update(bogus=1), "extra_field", ["Abort", "bogus"], id="extra"),
    pytest.param(
        P.Heartbeat, lambda b: b.update(x=None), "extra_field", ["Heartbeat", "x"], id="extra_empty"
    ),
    pytest.param(
        P.Batch,
        lambda b: b["samples"].update(priority=[]),
        "extra_field",
        ["Batch.samples", "priority"],
        id="extra_nested",
    ),
    # scalar types
    pytest.param(
        P.StatusReply,
        lambda b: b["status"]["workers"][0].update(slots="8"),
        "wrong_type",
        ["StatusReply.status.workers[0].slots", "expected int"],
        id="status_str_int",
    ),
    pytest.param(
        P.StatusReply,
        lambda b: b["status"].update(learner={"id": "l", "last_seen_s": 0.1, "waiting_for_batch": 1}),
        "wrong_type",
        ["StatusReply.status.learner.waiting_for_batch", "expected bool"],
        id="status_int_bool",
    ),
    pytest.param(
        P.StatusReply,
        lambda b: b["status"]["eval"].update(accuracy="0.5"),
        "wrong_type",
        ["StatusReply.status.eval.accuracy", "expected float"],
        id="status_optional",
    ),
    pytest.param(
        P.Abort, lambda b: b.update(round_id="7"), "wrong_type", ["Abort.round_id", "expected int"], id="s"
    ),
    pytest.param(
        P.Abort, lambda b: b.update(round_id=True), "wrong_type", ["round_id", "got bool"], id="bool_int"
    ),
    pytest.param(
        P.Abort, lambda b: b.update(round_id=7.0), "wrong_type", ["round_id", "got float"], id="float_int"
    ),
    pytest.param(
        P.Abort, lambda b: b.update(round_id=None), "wrong_type", ["round_id", "NoneType"], id="none"
    ),
    pytest.param(
        P.Abort, lambda b: b.update(round_id=[7]), "wrong_type", ["round_id", "got list"], id="list_int"
    ),
    pytest.param(
        P.Abort, lambda b: b.update(round_id=2**63), "wrong_type", ["round_id", "expected int"], id="i64"
    ),
    pytest.param(P.Abort, lambda b: b.update(round_id=2**64 - 1), "wrong_type", ["round_id"], id="u64"),
    pytest.param(
        P.Error, lambda b: b.update(code=2), "wrong_type", ["Error.code", "expected str"], id="int_str"
    ),
    pytest.param(
        P.Error, lambda b: b.update(code=b"x"), "wrong_type", ["Error.code", "got bytes"], id="bin_str"
    ),
    pytest.param(
        P.WeightsLoaded,
        lambda b: b.update(ok=1),
        "wrong_type",
        ["WeightsLoaded.ok", "expected bool"],
        id="int_bool",
    ),
    pytest.param(
        P.Welcome,
        lambda b: b.update(top_p="0.9"),
        "wrong_type",
        ["Welcome.top_p", "expected float"],
        id="str_float",
    ),
    pytest.param(
        P.Welcome, lambda b: b.update(top_p=True), "wrong_type", ["top_p", "got bool"], id="bool_float"
    ),
    # containers
    pytest.param(
        P.Batch, lambda b: b.update(stats=[]), "wrong_type", ["Batch.stats", "expected a map"], id="map"
    ),
    pytest.param(
        P.Batch,
        lambda b: b.update(stats={"aborted": "5"}),
        "wrong_type",
        ["Batch.stats['aborted']", "expected float"],
        id="map_value",
    ),
    pytest.param(
        P.Batch, lambda b: b.update(ledger=5), "wrong_type", ["Batch.ledger", "expected a map"], id="struct"
    ),
    pytest.param(
        P.Lease,
        lambda b: b["samples"].update(prompt_text="x"),
        "wrong_type",
        ["Lease.samples.prompt_text", "expected a list"],
        id="list",
    ),
    pytest.param(
        P.Lease,
        lambda b: b["samples"].update(error=["", "", 3, ""]),
        "wrong_type",
        ["Lease.samples.error[2]", "expected str"],
        id="list_item",
    ),
    pytest.param(
        P.Lease,
        lambda b: b["samples"]["metadata"].__setitem__(0, {"answer": 42}),
        "wrong_type",
        ["Lease.samples.metadata[0]['answer']", "expected str"],
        id="metadata_value",
    ),
    # array refs
    pytest.param(
        P.Lease,
        lambda b: _swap_ref(b, "lease_ids", 1, "<i4"),
        "wrong_type",
        ["Lease.lease_ids", "expected array ref", "'<i8'"],
        id="ref_dtype",
    ),
    pytest.param(
        P.Lease,
        lambda b: _swap_ref(b, "lease_ids", 1, ">i8"),
        "wrong_type",
        ["lease_ids"],
        id="ref_big_endian",
    ),
    pytest.param(
        P.Lease,
        lambda b: _swap_ref(b, "lease_ids", 1, "int64"),
        "wrong_type",
        ["lease_ids"],
        id="ref_dtype_name",
    ),
    pytest.param(
        P.Lease, lambda b: b.update(lease_ids=[2, "<i8"]), "wrong_type", ["array ref"], id="ref_short"
    ),
    pytest.param(
        P.Lease, lambda b: b.update(lease_ids=[100, 101]), "wrong_type", ["lease_ids"], id="ref_inline"
    ),
    pytest.param(
        P.Lease, lambda b: _swap_ref(b, "lease_ids", 0, 2.0), "wrong_type", ["lease_ids"], id="ref_float"
    ),
    pytest.param(
        P.Lease, lambda b: _swap_ref(b, "lease_ids", 2, True), "wrong_type", ["lease_ids"], id="ref_bool"
    ),
    pytest.param(
        P.Lease,
        lambda b: _swap_ref(b, "budgets", 0, 2),
        "bad_buffer",
        ["Lease.budgets", "frame index 2", "reused"],
        id="ref_reused",
    ),
    pytest.param(
        P.Lease,
        lambda b: _swap_ref(b, "lease_ids", 0, 99),
        "bad_buffer",
        ["Lease.lease_ids", "frame index 99 missing"],
        id="ref_out_of_range",
    ),
    pytest.param(
        P.Lease, lambda b: _swap_ref(b, "lease_ids", 0, 1), "bad_buffer", ["frame index 1"], id="ref_body"
    ),
    pytest.param(
        P.Lease, lambda b: _swap_ref(b, "lease_ids", 0, 0), "bad_buffer", ["frame index 0"], id="ref_header"
    ),
    pytest.param(
        P.Lease, lambda b: _swap_ref(b, "lease_ids", 0, -1), "bad_buffer", ["frame index -1"], id="ref_neg"
    ),
    pytest.param(
        P.Lease,
        lambda b: _swap_ref(b, "lease_ids", 2, 5),
        "bad_buffer",
        ["Lease.lease_ids", "32 bytes, expected 5 x 8"],
        id="ref_length",
    ),
    pytest.param(
        P.Lease,
        lambda b: _swap_ref(b, "lease_ids", 2, -4),
        "bad_buffer",
        ["expected -4 x 8"],
        id="ref_neg_length",
    ),
    # validate()
    pytest.param(
        P.WorkerHello, lambda b: b.update(slots=0), "invalid_value", ["WorkerHello", "slots = 0"], id="v1"
    ),
    pytest.param(P.WorkerHello, lambda b: b.update(worker_id=""), "invalid_value", ["worker_id"], id="v2"),
    pytest.param(P.WorkerHello, lambda b: b.update(pid=-1), "invalid_value", ["pid = -1"], id="v3"),
    pytest.param(
        P.WeightsReady,
        lambda b: b.update(sha256="abc"),
        "invalid_value",
        ["WeightsReady", "sha256"],
        id="sha_short",
    ),
    pytest.param(
        P.WeightsReady, lambda b: b.update(sha256=SHA.upper()), "invalid_value", ["sha256"], id="sha_case"
    ),
    pytest.param(
        P.WeightsReady, lambda b: b.update(version=-1), "invalid_value", ["version = -1"], id="v_neg"
    ),
    pytest.param(
        P.WeightsChunkRequest,
        lambda b: b.update(length=0),
        "invalid_value",
        ["WeightsChunkRequest", "length = 0"],
        id="chunk_empty",
    ),
    pytest.param(
        P.WeightsChunkRequest,
        lambda b: b.update(length=P.MAX_WEIGHTS_CHUNK + 1),
        "invalid_value",
        ["length = 67108865"],
        id="chunk_huge",
    ),
    pytest.param(
        P.WeightsChunkRequest, lambda b: b.update(offset=-1), "invalid_value", ["offset = -1"], id="chunk_neg"
    ),
    pytest.param(
        P.WeightsChunk,
        lambda b: b.update(size=10),
        "invalid_value",
        ["WeightsChunk", "runs past size 10"],
        id="chunk_past_end",
    ),
    pytest.param(
        P.WeightsGone, lambda b: b.update(newest=-1), "invalid_value", ["newest = -1"], id="gone_neg"
    ),
    pytest.param(
        P.LeaseRequest, lambda b: b.update(credit=65537), "invalid_value", ["credit = 65537"], id="credit"
    ),
    pytest.param(
        P.SampleResult, lambda b: b.update(credit=-1), "invalid_value", ["credit = -1"], id="credit_neg"
    ),
    pytest.param(
        P.AbortDone, lambda b: b.update(round_id=-1), "invalid_value", ["round_id = -1"], id="abort_neg"
    ),
    pytest.param(P.BatchRequest, lambda b: b.update(step=-2), "invalid_value", ["step = -2"], id="step_neg"),
    pytest.param(
        P.EngineUsage,
        lambda b: b.update(slot_s=float("nan")),
        "invalid_value",
        ["slot_s = nan"],
        id="usage_nan",
    ),
    pytest.param(
        P.EngineUsage,
        lambda b: b.update(busy_slot_s=20.0),
        "invalid_value",
        ["busy_slot_s 20.0"],
        id="usage_busy",
    ),
    pytest.param(
        P.EngineHealth,
        lambda b: b.update(returned_by_engine=-1),
        "invalid_value",
        ["returned_by_engine = -1"],
        id="health_negative",
    ),
    pytest.param(
        P.EngineHealth,
        lambda b: b.update(detail="x" * 501),
        "invalid_value",
        ["detail has 501 characters"],
        id="health_detail",
    ),
    pytest.param(
        P.EngineHealth,
        lambda b: b.update(placement="x" * 201),
        "invalid_value",
        ["placement has 201 characters"],
        id="health_placement",
    ),
    pytest.param(
        P.LearnerPhaseReport, lambda b: b.update(phase=99), "invalid_value", ["phase", "99"], id="phase_code"
    ),
    pytest.param(
        P.LearnerPhaseReport,
        lambda b: b.update(detail="x" * 201),
        "invalid_value",
        ["detail has 201 characters"],
        id="phase_detail",
    ),
    pytest.param(
        P.Batch,
        lambda b: b["ledger"].update(partial=-1),
        "invalid_value",
        ["Batch.ledger", "negative ledger count"],
        id="ledger_negative",
    ),
    pytest.param(
        P.Lease,
        lambda b: b["samples"].update(prompt_text=["", ""]),
        "invalid_value",
        ["Lease.samples", "prompt_text has 2 entries for 4 samples"],
        id="batch_lengths",
    ),
]


@pytest.mark.parametrize(("cls", "edit", "reason", "fragments"), BODY_CASES)
def test_rejects_bad_body(
    cls: type, edit: Callable[[dict[str, Any]], None], reason: str, fragments: list[str]
) -> None:
    reject(_edit(cls, edit), reason, *fragments)


def test_rejects_sample_result_with_lease_ids_length_mismatch() -> None:
    msg = dataclasses.replace(EXAMPLES[P.SampleResult], lease_ids=np.array([1, 2, 3], np.int64))
    reject(frames_of(msg), "invalid_value", "SampleResult", "3 lease_ids for 4 samples")


def test_rejects_lease_with_budgets_length_mismatch() -> None:
    msg = dataclasses.replace(EXAMPLES[P.Lease], budgets=np.array([1], np.int32))
    reject(frames_of(msg), "invalid_value", "Lease", "differ in length")


def test_rejects_lease_with_bad_greedy_flags() -> None:
    short = dataclasses.replace(EXAMPLES[P.Lease], greedy=np.array([1], np.uint8))
    reject(frames_of(short), "invalid_value", "Lease", "differ in length")
    two = dataclasses.replace(EXAMPLES[P.Lease], greedy=np.array([0, 2, 0, 1], np.uint8))
    reject(frames_of(two), "invalid_value", "Lease", "greedy must be 0 or 1")


def test_rejects_nan_and_positive_log_probs() -> None:
    result = EXAMPLES[P.SampleResult]
    for bad in (np.nan, 0.5, np.inf):
        lp = result.samples.response_logprobs.copy()
        lp[1] = bad
        msg = dataclasses.replace(result, samples=dataclasses.replace(result.samples, response_logprobs=lp))
        reject(frames_of(msg), "invalid_value", "SampleResult.samples", "log-probs must be finite and <= 0")


def test_rejects_bad_status_code_and_segments() -> None:
    result = EXAMPLES[P.SampleResult]
    batch = dataclasses.replace(result.samples, status=np.array([0, 0, 3, 9], np.uint8))
    reject(frames_of(dataclasses.replace(result, samples=batch)), "invalid_value", "code out of range")
    segs = result.samples.segments.copy()
    segs[0] = 5  # version 5 then version 2: decreasing
    batch = dataclasses.replace(result.samples, segments=segs)
    reject(frames_of(dataclasses.replace(result, samples=batch)), "invalid_value", "non-decreasing versions")


def test_rejects_bad_episode_columns() -> None:
    result = EXAMPLES[P.SampleResult]
    spans = result.samples.observations.copy()
    spans[1] = 5  # observation [2, 5) overlaps the segment [4, 6)
    batch = dataclasses.replace(result.samples, observations=spans)
    reject(frames_of(dataclasses.replace(result, samples=batch)), "invalid_value", "do not tile [0, 8)")
    states = ["", b"", b"", b""]  # a str where bytes are expected
    reject(_set(P.SampleResult, ("samples", "episode"), states), "wrong_type", "episode[0]", "expected bytes")
    reject(_set(P.SampleResult, ("samples", "episode"), [b""] * 3), "invalid_value", "episode has 3 entries")


def test_rejects_truncated_and_padded_buffers() -> None:
    frames = framed_of(EXAMPLES[P.Lease])
    short = [*frames[:2], frames[2][:-1], *frames[3:]]
    reject(short, "bad_buffer", "Lease.lease_ids", "31 bytes, expected 4 x 8")
    padded = [*frames[:3], frames[3] + b"\x00", *frames[4:]]
    reject(padded, "bad_buffer", "Lease.budgets", "17 bytes, expected 4 x 4")


def test_rejects_unreferenced_buffer_frame() -> None:
    frames = framed_of(EXAMPLES[P.Lease])
    referenced = len(frames) - 2  # every array of the lease in its frame
    reject(
        [*frames, frames[2]], "bad_buffer", f"Lease: {referenced + 1} buffer frames, {referenced} referenced"
    )
    reject(
        [*frames_of(P.Abort(round_id=1)), b"\x00" * 8], "bad_buffer", "Abort: 1 buffer frames, 0 referenced"
    )


def test_rejects_swapped_buffers() -> None:
    frames = framed_of(EXAMPLES[P.Lease])
    swapped = [frames[0], frames[1], frames[3], frames[2], *frames[4:]]
    reject(swapped, "bad_buffer", "Lease.lease_ids")


def test_rejects_oversize() -> None:
    frames = frames_of(EXAMPLES[P.Lease])
    total = sum(len(f) for f in frames)
    reject(frames, "oversize", f"Lease: {total} bytes, limit 100", max_bytes=100)
    assert isinstance(P.decode(frames, max_bytes=total), P.Lease)  # the limit is inclusive


def test_every_reason_is_exercised() -> None:
    seen = {p.values[1] for p in FRAME_CASES} | {p.values[2] for p in BODY_CASES}
    assert seen == REASONS


# ---------------------------------------------------------------------------------------------------
# The generic codec paths no message uses today: enums.


class Color(enum.IntEnum):
    RED = 0
    GREEN = 1


@dataclass(frozen=True, slots=True)
class Painted:
    color: Color
    shade: Color | None


def _painted(color: Any, shade: Any = None) -> list[bytes]:
    return [header(1, 1), msgpack.packb({"color": color, "shade": shade})]


def test_enum_field_round_trip_and_range() -> None:
    frames = [bytes(f) for f in encode_frames(1, 1, Painted(Color.GREEN, Color.RED))]
    assert msgpack.unpackb(frames[1]) == {"color": 1, "shade": 0}
    assert decode_body(Painted, frames) == Painted(Color.GREEN, Color.RED)
    assert decode_body(Painted, _painted(0)) == Painted(Color.RED, None)
    for bad in (2, -1, "RED", [0]):
        with pytest.raises(ProtocolError) as info:
            decode_body(Painted, _painted(bad))
        assert info.value.reason == "invalid_value"
        assert "Painted.color" in str(info.value) and "is not one of 0, 1" in str(info.value)


def test_enum_field_rejects_bool_and_float() -> None:
    for bad in (True, 1.0):
        with pytest.raises(ProtocolError):
            decode_body(Painted, _painted(bad))


# ---------------------------------------------------------------------------------------------------
# Regression tests: inputs that once made decode raise something other than ProtocolError


def test_extra_fields_with_mixed_str_and_bytes_keys() -> None:
    reject([header(V, 1), msgpack.packb({"a": 1, b"b": 1}, use_bin_type=True)], "wrong_type", "map keys")


def test_deeply_nested_value_in_scalar_field() -> None:
    deep: Any = 0
    for _ in range(1000):
        deep = [deep]
    reject([header(V, P.KIND_OF[P.Disconnect]), msgpack.packb({"reason": deep})], "wrong_type", "reason")


def test_dict_fields_reject_bytes_keys() -> None:
    reject(_set(P.Batch, ("stats",), {b"aborted": 1.0}), "wrong_type", "Batch.stats")


def test_ledger_with_mixed_key_types_and_negative_count() -> None:
    reject(_set(P.Batch, ("ledger", "dropped"), {"failed": -1, b"x": 0}), "wrong_type", "dropped")


def test_offsets_that_overflow_int64() -> None:
    batch = SampleBatch.from_samples(
        [Sample(group_id=i, index=0, prompt_ids=np.zeros(0, np.int32)) for i in range(3)]
    )
    batch = dataclasses.replace(
        batch,
        prompt_ids=np.array([5, 6, 7], np.int32),
        prompt_offsets=np.array([0, 2**63 - 1, -2, 3], np.int64),
    )
    msg = P.SampleResult(lease_ids=np.arange(3, dtype=np.int64), samples=batch, credit=0)
    reject(frames_of(msg), "invalid_value", "prompt_offsets")


# ---------------------------------------------------------------------------------------------------
# Evolvable structs (the status records): defaulted fields may be absent, unknown ones are skipped.


@dataclass(frozen=True, slots=True)
class Gauge:
    EVOLVABLE: ClassVar[bool] = True
    name: str
    value: float
    unit: str = ""  # a field added later


@dataclass(frozen=True, slots=True)
class Panel:
    gauges: list[Gauge]
    label: str = ""  # closed struct: a default does not make the field optional on the wire


def _panel(body: Any) -> list[bytes]:
    return [header(1, 1), msgpack.packb(body)]


def test_evolvable_struct_takes_defaults_and_skips_unknown_fields() -> None:
    older = {"gauges": [{"name": "tok/s", "value": 3}], "label": "x"}  # a sender without `unit`
    decoded = decode_body(Panel, _panel(older))
    assert decoded == Panel([Gauge("tok/s", 3.0, "")], "x")
    newer = {"gauges": [{"name": "tok/s", "value": 3.5, "unit": "1/s", "colour": "red"}], "label": ""}
    assert decode_body(Panel, _panel(newer)) == Panel([Gauge("tok/s", 3.5, "1/s")], "")


def test_evolvable_struct_still_checks_every_field_it_knows() -> None:
    cases = [
        (
            {"gauges": [{"value": 3.0}], "label": ""},
            "missing_field",
            "Panel.gauges[0]: missing field(s) name",
        ),
        ({"gauges": [{"name": "a", "value": "3"}], "label": ""}, "wrong_type", "Panel.gauges[0].value"),
        ({"gauges": [{"name": "a", "value": 3.0, "unit": 1}], "label": ""}, "wrong_type", "gauges[0].unit"),
        ({"gauges": [{"name": "a", "value": 3.0, b"x": 1}], "label": ""}, "wrong_type", "map keys must be"),
        ({"gauges": []}, "missing_field", "Panel: missing field(s) label"),  # the closed struct
        ({"gauges": [], "label": "", "x": 1}, "extra_field", "Panel: unknown field(s) x"),
    ]
    for body, reason, fragment in cases:
        with pytest.raises(ProtocolError) as info:
            decode_body(Panel, [header(1, 1), msgpack.packb(body, use_bin_type=True)])
        assert info.value.reason == reason and fragment in str(info.value), (body, info.value)


def test_status_reply_skips_fields_a_newer_broker_adds() -> None:
    frames = frames_of(EXAMPLES[P.StatusReply])
    body = body_of(frames)
    body["status"]["gpu_hours"] = 1.5
    body["status"]["workers"][0]["gpu"] = {"name": "H100"}
    del body["status"]["learner"]["phase"]  # an older broker: the learner's phase is not sent
    msg = P.decode(with_body(frames, body))
    assert isinstance(msg, P.StatusReply)
    assert msg.status.learner is not None and msg.status.learner.phase == ""
    assert_same(msg.status.workers, EXAMPLES[P.StatusReply].status.workers)


# ---------------------------------------------------------------------------------------------------
# Property tests


def _leaves() -> st.SearchStrategy[Any]:
    dtypes = st.sampled_from(["<i4", "<i8", "<f4", "<f8", "|u1", ">i8", "int32", ""])
    return st.one_of(
        st.none(),
        st.booleans(),
        st.integers(min_value=INT64_MIN, max_value=2**64 - 1),
        st.integers(min_value=-2, max_value=20),
        st.floats(),
        st.text(max_size=8),
        st.binary(max_size=8),
        st.tuples(st.integers(-1, 20), dtypes, st.integers(-1, 10)).map(list),  # array-ref look-alikes
    )


MSGPACK_VALUES = st.recursive(
    _leaves(),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=6), children, max_size=4)
    ),
    max_leaves=10,
)
FIELD_NAMES = sorted(
    {name for cls in P.MESSAGE_TYPES for name, _ in struct_schema(cls).fields}
    | {name for name, _ in struct_schema(SampleBatch).fields}
    | {name for name, _ in struct_schema(Ledger).fields}
    | {name for cls in (WorkerStatus, LearnerStatus, EvalStatus) for name, _ in struct_schema(cls).fields}
)
KINDS = sorted(P.KIND_OF.values())
VALID_FRAMES = {cls: frames_of(msg) for cls, msg in EXAMPLES.items()}


def decode_checked(frames: list[bytes]) -> None:
    """The property: decode raises only ProtocolError (with a known reason) or returns a valid message."""
    try:
        msg = P.decode(frames)
    except ProtocolError as err:
        assert err.reason in REASONS, err.reason
        assert str(err)
        return
    assert_valid_message(msg)


def _random_frames(data: st.DataObject) -> list[bytes]:
    frames = data.draw(st.lists(st.binary(max_size=80), max_size=6), label="frames")
    if frames and data.draw(st.booleans(), label="valid header"):
        kind = data.draw(st.sampled_from([*KINDS, 0, 999]), label="kind")
        frames[0] = header(P.PROTOCOL_VERSION, kind)
        if len(frames) > 1 and data.draw(st.booleans(), label="msgpack body"):
            frames[1] = msgpack.packb(data.draw(MSGPACK_VALUES, label="body"), use_bin_type=True)
    return frames


def _paths(obj: Any, prefix: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, (*prefix, k))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, (*prefix, i))


def _at(obj: Any, path: tuple[Any, ...]) -> Any:
    for key in path:
        obj = obj[key]
    return obj


def _mutate_body(data: st.DataObject, frames: list[bytes]) -> None:
    try:
        body = msgpack.unpackb(frames[1], raw=False, strict_map_key=False)
    except Exception:  # already garbled by an earlier byte mutation: nothing to re-pack
        return
    op = data.draw(st.sampled_from(["remove", "add", "change"]), label="body op")
    paths = list(_paths(body))
    if op == "remove":
        candidates = [p for p in paths if p and isinstance(_at(body, p[:-1]), dict | list)]
        if not candidates:
            return
        path = data.draw(st.sampled_from(candidates), label="remove path")
        parent = _at(body, path[:-1])
        del parent[path[-1]]
    elif op == "add":
        maps = [p for p in paths if isinstance(_at(body, p), dict)]
        if not maps:
            return
        path = data.draw(st.sampled_from(maps), label="add to")
        key = data.draw(st.sampled_from(FIELD_NAMES) | st.text(max_size=6), label="key")
        _at(body, path)[key] = data.draw(MSGPACK_VALUES, label="added value")
    else:
        path = data.draw(st.sampled_from(paths), label="change path")
        value = data.draw(MSGPACK_VALUES, label="new value")
        if path:
            _at(body, path[:-1])[path[-1]] = value
        else:
            body = value
    frames[1] = msgpack.packb(body, use_bin_type=True)


# body edits and same-length buffer edits are weighted up: they reach the deep checks more often
MUTATIONS = ["flip", "insert", "delete", "truncate", "drop", "duplicate", "append", "swap"] + 3 * [
    "flip_buffer",
    "body",
]


def _edit_bytes(data: st.DataObject, op: str, frame: bytes) -> bytes:
    f = bytearray(frame)
    if op == "insert":
        pos = data.draw(st.integers(0, len(f)), label="pos")
        f[pos:pos] = data.draw(st.binary(min_size=1, max_size=4), label="bytes")
    elif f and op in ("flip", "flip_buffer"):
        pos = data.draw(st.integers(0, len(f) - 1), label="pos")
        f[pos] ^= data.draw(st.integers(1, 255), label="xor")
    elif f and op == "delete":
        pos = data.draw(st.integers(0, len(f) - 1), label="pos")
        del f[pos : pos + data.draw(st.integers(1, 4), label="count")]
    elif f and op == "truncate":
        del f[data.draw(st.integers(0, len(f) - 1), label="keep") :]
    return bytes(f)


def _mutate_once(data: st.DataObject, frames: list[bytes]) -> list[bytes]:
    op = data.draw(st.sampled_from(MUTATIONS), label="op")
    n = len(frames)
    if op in ("flip", "flip_buffer", "insert", "delete", "truncate"):
        first = 2 if op == "flip_buffer" else 0  # same-length buffer edits get past the codec to validate()
        if n > first:
            i = data.draw(st.integers(first, n - 1), label="frame")
            frames[i] = _edit_bytes(data, op, frames[i])
    elif op == "drop" and n:
        del frames[data.draw(st.integers(0, n - 1), label="drop")]
    elif op == "duplicate" and n:
        i = data.draw(st.integers(0, n - 1), label="dup")
        frames.insert(data.draw(st.integers(0, n), label="at"), frames[i])
    elif op == "append":
        frames.append(data.draw(st.binary(max_size=16), label="appended"))
    elif op == "swap" and n >= 2:
        i, j = data.draw(st.lists(st.integers(0, n - 1), min_size=2, max_size=2, unique=True), label="swap")
        frames[i], frames[j] = frames[j], frames[i]
    elif op == "body" and n >= 2:
        _mutate_body(data, frames)
    return frames


def _mutated_frames(data: st.DataObject) -> list[bytes]:
    cls = data.draw(st.sampled_from(P.MESSAGE_TYPES), label="kind")
    frames = list(VALID_FRAMES[cls])
    for _ in range(data.draw(st.integers(1, 3), label="mutations")):
        frames = _mutate_once(data, frames)
    return frames


FAST = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SLOW = settings(
    max_examples=20000,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@FAST
@given(st.data())
def test_random_frames_raise_only_protocol_error(data: st.DataObject) -> None:
    decode_checked(_random_frames(data))


@FAST
@given(st.data())
def test_mutated_frames_raise_only_protocol_error(data: st.DataObject) -> None:
    decode_checked(_mutated_frames(data))


@pytest.mark.slow
@SLOW
@given(st.data())
def test_random_frames_raise_only_protocol_error_slow(data: st.DataObject) -> None:
    decode_checked(_random_frames(data))


@pytest.mark.slow
@SLOW
@given(st.data())
def test_mutated_frames_raise_only_protocol_error_slow(data: st.DataObject) -> None:
    decode_checked(_mutated_frames(data))


@FAST
@given(st.lists(episodes(steps=10), max_size=6), st.booleans())
def test_episodes_round_trip_through_results(samples: list[Sample], framed: bool) -> None:
    """Random samples of episodes (several observation spans, aborts and resumes, single-turn ones with
    an empty state among them) in a SampleResult: decoded field by field equal, inline and in frames."""
    samples = [dataclasses.replace(s, group_id=g) for g, s in enumerate(samples)]
    msg = P.SampleResult(np.arange(len(samples), dtype=np.int64), SampleBatch.from_samples(samples), 1)
    decoded: Any = P.decode(framed_of(msg) if framed else frames_of(msg))
    assert_valid_message(decoded)
    back = decoded.samples.to_samples()
    assert len(back) == len(samples)
    for original, again in zip(samples, back, strict=True):
        assert_same(original, again)
        assert type(again.episode) is bytes and all(type(o) is Span for o in again.observations)
        again.check()


@FAST
@given(st.data())
def test_mutated_episode_frames_raise_only_protocol_error(data: st.DataObject) -> None:
    """The mutation property of `test_mutated_frames_raise_only_protocol_error`, from results of random
    episodes: edits of the observation spans and episode states are rejected or decode to valid ones."""
    samples = data.draw(st.lists(episodes(), min_size=1, max_size=3), label="episodes")
    samples = [dataclasses.replace(s, group_id=g) for g, s in enumerate(samples)]
    msg = P.SampleResult(np.arange(len(samples), dtype=np.int64), SampleBatch.from_samples(samples), 0)
    frames = data.draw(st.sampled_from([frames_of, framed_of]), label="form")(msg)
    for _ in range(data.draw(st.integers(1, 3), label="mutations")):
        frames = _mutate_once(data, frames)
    decode_checked(frames)


def test_error_messages_are_short_for_huge_values() -> None:
    """A bad value is quoted, not dumped: the message stays readable whatever the peer sent."""
    err = reject(_set(P.Disconnect, ("reason",), list(range(10000))), "wrong_type", "Disconnect.reason")
    assert len(str(err)) < 200
    assert "got list of 10000 items" in str(err)
