"""Every message that crosses a process boundary, and the registry that gives each its wire kind.

One frozen dataclass per message; `KIND_OF` is the explicit registry (kind codes are part of the wire
format: never renumber, only append). `encode(msg) -> frames` and `decode(frames) -> msg` wrap the strict
codec in `april.codec`. docs/protocol.md documents the same messages for implementers in other languages.

Directions: W = worker, B = broker, L = learner, S = any read-only client (`april status`). The weight
chunk messages (kinds 50-52) travel between a worker and the learner's weight service, never the broker.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from april.codec import (
    DEFAULT_MAX_BYTES,
    Frame,
    Int32Array,
    Int64Array,
    ProtocolError,
    UInt8Array,
    decode_body,
    encode_frames,
)
from april.codec import decode_header as _decode_header
from april.ledger import Ledger
from april.status import BrokerStatus
from april.wire_records import SampleBatch

PROTOCOL_VERSION = 5  # 2: small arrays inline in the body (april.codec); 3: episodes (SampleBatch); 4: lease
# spans (SampleBatch); 5: result acks (SampleResult.seq, Lease.acked, ResultAck), the worker's credit in its
# hello
INLINE_BYTES = 64 * 1024  # a message's small arrays travel in its body up to this many bytes in all


MAX_ACK_METRICS = 128  # bound on a BatchAck's metrics: a peer cannot grow the status feed without limit


def _check_non_negative(obj: Any, *names: str) -> None:
    for name in names:
        value = getattr(obj, name)
        if value < 0:
            raise ValueError(f"{name} = {value}, must be >= 0")


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """W<->B, L<->B. Liveness only; any message counts as a heartbeat."""


@dataclass(frozen=True, slots=True)
class Error:
    """B->W/L/S. The broker rejected a message from this peer. `code` is the counter reason."""

    code: str
    detail: str


@dataclass(frozen=True, slots=True)
class WorkerHello:
    """W->B. Register (or re-register). Resets the broker's view of this worker: leases it holds that are
    not in `held_leases` are reclaimed, and its credit becomes `credit` (-1: `slots` minus the leases it
    kept)."""

    worker_id: str
    engine: str
    slots: int
    version: int  # weights version the engine has loaded
    pid: int
    host: str
    held_leases: Int64Array  # leases still held: generated, scored, stepped, or results not yet acked
    credit: int = -1  # its free slots now (the results it sends again after the hello carry none)

    def validate(self) -> None:
        _check_non_negative(self, "version", "pid")
        if not 1 <= self.slots <= 65536:
            raise ValueError(f"slots = {self.slots}, must be in 1..65536")
        if not -1 <= self.credit <= 65536:
            raise ValueError(f"credit = {self.credit}, must be in -1..65536")
        if not 1 <= len(self.worker_id) <= 128:
            raise ValueError("worker_id must be 1..128 characters")


@dataclass(frozen=True, slots=True)
class Welcome:
    """B->W/L. Answer to a hello: the current weights and the sampling settings of the run."""

    peer_id: str
    mode: str
    version: int
    weights_uri: str  # empty for version 0 (the model the worker was started with)
    weights_sha256: str
    heartbeat_interval_s: float
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int

    def validate(self) -> None:
        _check_non_negative(self, "version", "max_new_tokens", "top_k")
        if self.heartbeat_interval_s <= 0:
            raise ValueError(f"heartbeat_interval_s = {self.heartbeat_interval_s}, must be > 0")


@dataclass(frozen=True, slots=True)
class LeaseRequest:
    """W->B. Grant `credit` more samples of work (free engine slots)."""

    credit: int

    def validate(self) -> None:
        if not 0 <= self.credit <= 65536:
            raise ValueError(f"credit = {self.credit}, must be in 0..65536")


@dataclass(frozen=True, slots=True)
class Lease:
    """B->W. Generate these samples. Each sample resumes from its response so far (empty for a fresh one)
    with `budgets[i]` new tokens at most; new tokens belong to a segment of the worker's loaded version.
    `greedy[i]` = 1 asks for greedy decoding (argmax: an evaluation sample), 0 for the run's sampling
    settings. `lease_ids[i]` must be echoed when the sample comes back."""

    lease_ids: Int64Array  # [S]
    budgets: Int32Array  # [S]
    greedy: UInt8Array  # [S], 0 or 1
    samples: SampleBatch
    acked: int = 0  # the worker's SampleResults up to this `seq` are acknowledged (see ResultAck)

    def validate(self) -> None:
        _check_non_negative(self, "acked")
        n = len(self.samples)
        if self.lease_ids.shape[0] != n or self.budgets.shape[0] != n or self.greedy.shape[0] != n:
            raise ValueError("lease_ids, budgets, greedy and samples differ in length")
        if n and int(self.greedy.max()) > 1:
            raise ValueError(f"greedy must be 0 or 1, got {int(self.greedy.max())}")


@dataclass(frozen=True, slots=True)
class SampleResult:
    """W->B. Samples that left the engine: FINISHED (scored), FAILED, or INTERRUPTED (after an Abort, or
    an engine failure), streamed as they leave. `credit` adds free slots, like a LeaseRequest. `seq`
    numbers the worker's results (1, 2, ...; 0: no acknowledgement wanted); the worker keeps a result
    until the broker acknowledges its `seq` (Lease.acked, ResultAck) and sends it again after a hello."""

    lease_ids: Int64Array  # [S], as received in the Lease
    samples: SampleBatch
    credit: int
    seq: int = 0

    def validate(self) -> None:
        if self.lease_ids.shape[0] != len(self.samples):
            raise ValueError(f"{self.lease_ids.shape[0]} lease_ids for {len(self.samples)} samples")
        if not 0 <= self.credit <= 65536:
            raise ValueError(f"credit = {self.credit}, must be in 0..65536")
        _check_non_negative(self, "seq")


@dataclass(frozen=True, slots=True)
class ResultAck:
    """B->W. The worker's SampleResults up to `seq` = `acked` are acknowledged: what the broker took of
    them is on its disk (a broker crash keeps it), so the worker forgets them. Sent when an acknowledgement
    is due and no Lease carried it."""

    acked: int

    def validate(self) -> None:
        _check_non_negative(self, "acked")


@dataclass(frozen=True, slots=True)
class Abort:
    """B->W. Stop generating; return every unfinished leased sample as INTERRUPTED (with its tokens and
    log-probs so far), then confirm with AbortDone once the engine is really idle."""

    round_id: int

    def validate(self) -> None:
        _check_non_negative(self, "round_id")


@dataclass(frozen=True, slots=True)
class AbortDone:
    """W->B. The engine is idle and every leased sample was returned, except `scoring`: samples that
    finished generating and whose reward is still being computed (their SampleResult follows; an abort
    never waits on a reward). Resets credit to `credit`."""

    round_id: int
    credit: int
    scoring: Int64Array  # lease ids still being scored

    def validate(self) -> None:
        _check_non_negative(self, "round_id", "credit")


@dataclass(frozen=True, slots=True)
class WeightsReady:
    """L->B (publish) and B->W (relay). Weights `version` are at `uri`, verify with `sha256` (hex)."""

    version: int
    uri: str
    sha256: str

    def validate(self) -> None:
        _check_non_negative(self, "version")
        if len(self.sha256) != 64 or any(c not in "0123456789abcdef" for c in self.sha256):
            raise ValueError("sha256 must be 64 lowercase hex characters")


@dataclass(frozen=True, slots=True)
class WeightsLoaded:
    """W->B. Result of loading a relayed version: ok, or the error (the worker keeps its old weights).
    `transport` is how the bytes came (`file`, `network`, `broadcast`); `sync_s` the seconds from the
    worker first hearing of the version to the engine serving it."""

    version: int
    ok: bool
    error: str
    transport: str = ""
    sync_s: float = 0.0

    def validate(self) -> None:
        _check_non_negative(self, "version", "sync_s")
        if len(self.transport) > 16:
            raise ValueError(f"transport {self.transport[:16]!r}... is longer than 16 characters")


@dataclass(frozen=True, slots=True)
class Disconnect:
    """W->B or L->B. Leaving cleanly; the broker reclaims anything still leased to the sender."""

    reason: str


@dataclass(frozen=True, slots=True)
class EngineUsage:
    """W->B. How the worker's engine slots were used since it started (cumulative, wall seconds): the
    broker takes differences between reports, so a lost report loses nothing. `busy_slot_s` = integral of
    running sequences, `slot_s` = integral of slots, `free_slot_s` = time the engine had a free slot and
    nothing to run (no local queue: a free slot means nothing to run), `elapsed_s` = time measured.
    An engine that models its own cost (the sim engine) also reports, in its model seconds, the time
    spent in decode steps (`model_busy_s`) and the part of it re-prefilling resumed partials
    (`reprefill_s`), and the tokens it drew attending to KV of older weights (`stale_kv_tokens`,
    resume_kv "reuse"); other engines report 0."""

    busy_slot_s: float
    slot_s: float
    free_slot_s: float
    elapsed_s: float
    model_busy_s: float = 0.0
    reprefill_s: float = 0.0
    stale_kv_tokens: int = 0

    def validate(self) -> None:
        fields = ("busy_slot_s", "slot_s", "free_slot_s", "elapsed_s", "model_busy_s", "reprefill_s")
        for name in (*fields, "stale_kv_tokens"):
            value = getattr(self, name)
            if not 0 <= value < float("inf"):  # NaN fails too
                raise ValueError(f"{name} = {value}, must be finite and >= 0")
        if self.busy_slot_s > self.slot_s * (1 + 1e-9) or self.free_slot_s > self.elapsed_s * (1 + 1e-9):
            raise ValueError(
                f"busy_slot_s {self.busy_slot_s} > slot_s {self.slot_s} or free_slot_s {self.free_slot_s} "
                f"> elapsed_s {self.elapsed_s}"
            )
        if self.reprefill_s > self.model_busy_s * (1 + 1e-9):
            raise ValueError(f"reprefill_s {self.reprefill_s} > model_busy_s {self.model_busy_s}")


MAX_ENGINE_DETAIL = 500  # characters: why an engine is down, one line
MAX_PLACEMENT = 200  # characters: where and how an engine runs (Engine.placement)


ENGINE_STARTING = "starting"  # EngineHealth.detail of an engine still being built


@dataclass(frozen=True, slots=True)
class EngineHealth:
    """W->B. Whether the worker's engine can serve, and what engine errors cost so far. Sent when either
    changes, and right after every WorkerHello once one is not at its start (down, or a count above 0).

    `ok` false: the engine as a whole cannot serve (its server is down or restarting); the worker has
    returned every sample it was generating, and the broker sets its credit to 0 and leases nothing to it
    (credit it grants meanwhile is ignored) until `ok` true, after which the worker grants its free slots
    again with a LeaseRequest. `detail` says why, for people; `ENGINE_STARTING` means the engine is being
    built (a worker starts so, until its first Welcome gave it the run's sampling settings and the engine
    came up: a vLLM or SGLang start can take minutes). `failed_by_engine` / `returned_by_engine`
    count, since the worker started, the samples it failed because the engine failed their request and
    those it returned as partials because of an engine error or an engine down (cumulative: a lost report
    loses nothing). `placement` says where and how the engine runs, for people ("cuda:0, cuda graphs",
    a server's URL; `Engine.placement`), "" until it is built; once it is, every hello is followed by a
    report, so a broker that lost the worker learns it again."""

    ok: bool
    detail: str
    failed_by_engine: int
    returned_by_engine: int
    placement: str = ""

    def validate(self) -> None:
        _check_non_negative(self, "failed_by_engine", "returned_by_engine")
        if len(self.detail) > MAX_ENGINE_DETAIL:
            raise ValueError(f"detail has {len(self.detail)} characters, at most {MAX_ENGINE_DETAIL} allowed")
        if len(self.placement) > MAX_PLACEMENT:
            raise ValueError(f"placement has {len(self.placement)} characters, at most {MAX_PLACEMENT}")


@dataclass(frozen=True, slots=True)
class LearnerHello:
    """L->B. Register the learner (rank 0). `version` is the weights version it holds."""

    learner_id: str
    version: int
    pid: int

    def validate(self) -> None:
        _check_non_negative(self, "version", "pid")
        if not 1 <= len(self.learner_id) <= 128:
            raise ValueError("learner_id must be 1..128 characters")


@dataclass(frozen=True, slots=True)
class BatchRequest:
    """L->B. Send the batch for `step` when it is ready (an unacked batch is sent again).

    `last_batch_id` is the last batch the learner trained (-1: none). It acks that batch if the broker
    still holds it, so an ack lost with a crashed broker or a dropped connection is never lost for good
    and a trained batch is never handed out again."""

    step: int
    last_batch_id: int

    def validate(self) -> None:
        _check_non_negative(self, "step")
        if self.last_batch_id < -1:
            raise ValueError(f"last_batch_id = {self.last_batch_id}, must be >= -1")


@dataclass(frozen=True, slots=True)
class Batch:
    """B->L. Exactly N = rollout_batch_size x n_samples_per_prompt FINISHED samples in complete groups.
    `stats` are the broker's figures for metrics.jsonl (aborted, resumed, partial_buffer, ...)."""

    batch_id: int
    step: int
    version: int
    samples: SampleBatch
    stats: dict[str, float]
    ledger: Ledger


@dataclass(frozen=True, slots=True)
class BatchAck:
    """L->B. The batch was trained; the broker forgets it and counts its groups as trained.
    `metrics` are the learner's figures of that step (loss, reward_mean, ...), relayed in the status feed."""

    batch_id: int
    metrics: dict[str, float]

    def validate(self) -> None:
        _check_non_negative(self, "batch_id")
        if len(self.metrics) > MAX_ACK_METRICS:
            raise ValueError(f"metrics has {len(self.metrics)} entries, at most {MAX_ACK_METRICS} allowed")
        for key in self.metrics:
            if len(key) > 64:
                raise ValueError(f"metrics key {key[:64]!r}... is longer than 64 characters")


class LearnerPhase(enum.IntEnum):
    """What the learner is doing, as it reports in `LearnerPhaseReport`. Values are the wire codes."""

    LOADING_MODEL = 1  # reading the model (and the frozen reference copy when KL is on)
    INITIALISING_ENGINE = 2  # the training engine: process group, DeepSpeed, optimizer
    RESTORING_CHECKPOINT = 3  # loading the checkpoint it resumes from
    WAITING_FOR_BATCH = 4  # asked for the next batch, none yet
    TRAINING = 5  # computing the step's update
    PUBLISHING_WEIGHTS = 6  # writing and announcing the next weights version
    CHECKPOINTING = 7  # saving a checkpoint


MAX_PHASE_DETAIL = 200  # characters: a model path, an engine, a step


@dataclass(frozen=True, slots=True)
class LearnerPhaseReport:
    """L->B. What the learner (rank 0) does from now on, sent at each change: while it starts (loading the
    model, initialising its engine, restoring a checkpoint) and in each step. `detail` says which model,
    engine or step. The broker keeps the latest for its status; nothing depends on it."""

    phase: LearnerPhase
    detail: str

    def validate(self) -> None:
        if len(self.detail) > MAX_PHASE_DETAIL:
            raise ValueError(f"detail has {len(self.detail)} characters, at most {MAX_PHASE_DETAIL} allowed")


@dataclass(frozen=True, slots=True)
class StatusRequest:
    """S->B. Ask for the broker's state."""


@dataclass(frozen=True, slots=True)
class StatusReply:
    """B->S, and published on the PUB socket under topic b"status": the broker's state (`april.status`,
    whose records are evolvable: fields may be added with a default, and readers skip fields they do
    not know)."""

    status: BrokerStatus


MAX_WEIGHTS_CHUNK = 64 * 1024 * 1024  # bytes: the most one WeightsChunkRequest may ask for (64 MiB)
MAX_WEIGHTS_WINDOW = 128  # chunk requests a worker keeps in flight at most (the service queues no more)


@dataclass(frozen=True, slots=True)
class WeightsChunkRequest:
    """W->L (the learner's weight service, not the broker). Send bytes [offset, offset + length) of the
    published file of `version`. A worker keeps a window of these in flight (`weights.window`)."""

    version: int
    offset: int
    length: int

    def validate(self) -> None:
        _check_non_negative(self, "version", "offset")
        if not 1 <= self.length <= MAX_WEIGHTS_CHUNK:
            raise ValueError(f"length = {self.length}, must be in 1..{MAX_WEIGHTS_CHUNK}")


@dataclass(frozen=True, slots=True)
class WeightsChunk:
    """L->W. Bytes of `version`'s file starting at `offset` (`data`, its own frame; shorter than asked
    only at the end of the file). `size` is the whole file's size in bytes."""

    version: int
    offset: int
    size: int
    data: UInt8Array

    def validate(self) -> None:
        _check_non_negative(self, "version", "offset", "size")
        if len(self.data) > MAX_WEIGHTS_CHUNK:
            raise ValueError(f"data has {len(self.data)} bytes, at most {MAX_WEIGHTS_CHUNK} allowed")
        if self.offset + len(self.data) > self.size:
            raise ValueError(f"offset {self.offset} + {len(self.data)} bytes runs past size {self.size}")


@dataclass(frozen=True, slots=True)
class WeightsGone:
    """L->W. The service no longer has (or never had) `version`: pruned by newer versions, or not
    published. `newest` is the newest version it serves (0: none). A gone version never comes back."""

    version: int
    newest: int

    def validate(self) -> None:
        _check_non_negative(self, "version", "newest")


# The registry. Kind codes are wire format: append only.
KIND_OF: dict[type, int] = {
    Heartbeat: 1,
    Error: 2,
    WorkerHello: 10,
    Welcome: 11,
    LeaseRequest: 12,
    Lease: 13,
    SampleResult: 14,
    Abort: 15,
    AbortDone: 16,
    WeightsReady: 17,
    WeightsLoaded: 18,
    Disconnect: 19,
    EngineUsage: 20,
    EngineHealth: 21,
    ResultAck: 22,
    LearnerHello: 30,
    BatchRequest: 31,
    Batch: 32,
    BatchAck: 33,
    LearnerPhaseReport: 34,
    StatusRequest: 40,
    StatusReply: 41,
    WeightsChunkRequest: 50,
    WeightsChunk: 51,
    WeightsGone: 52,
}
TYPE_OF: dict[int, type] = {kind: cls for cls, kind in KIND_OF.items()}
MESSAGE_TYPES = tuple(KIND_OF)

Message = (
    Heartbeat
    | Error
    | WorkerHello
    | Welcome
    | LeaseRequest
    | Lease
    | SampleResult
    | Abort
    | AbortDone
    | WeightsReady
    | WeightsLoaded
    | Disconnect
    | EngineUsage
    | EngineHealth
    | ResultAck
    | LearnerHello
    | BatchRequest
    | Batch
    | BatchAck
    | LearnerPhaseReport
    | StatusRequest
    | StatusReply
    | WeightsChunkRequest
    | WeightsChunk
    | WeightsGone
)


def encode(msg: Message) -> list[Frame]:
    """Frames `[header, body, *buffers]` for one message."""
    kind = KIND_OF.get(type(msg))
    if kind is None:
        raise TypeError(f"{type(msg).__name__} is not a registered message")
    return encode_frames(PROTOCOL_VERSION, kind, msg, INLINE_BYTES)


def decode(frames: Sequence[Frame], max_bytes: int = DEFAULT_MAX_BYTES) -> Message:
    """Decode one message; anything malformed raises ProtocolError (and nothing else)."""
    kind = _decode_header(frames, PROTOCOL_VERSION)
    cls = TYPE_OF.get(kind)
    if cls is None:
        raise ProtocolError("unknown_kind", f"unknown message kind {kind}")
    msg: Message = decode_body(cls, frames, max_bytes)
    return msg


def empty_lease_ids() -> np.ndarray[Any, np.dtype[np.int64]]:
    return np.zeros(0, dtype=np.int64)
