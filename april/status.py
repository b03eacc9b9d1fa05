"""The broker's status as typed records: what `april status` prints, what the broker publishes every
second on its PUB socket, what the dashboard, the Prometheus endpoint and the soak read.

Owns `BrokerStatus` and its parts (frozen records that cross the wire inside `protocol.StatusReply`
through the strict codec), its JSON form (`to_json` for `april status --json`, `from_json` reading it back
with the codec's checks) and `StepFigures`, the typed view of the learner's step figures. It does not
build a status (`broker/status.py` reads the broker's books) nor draw one (`cli/`).

Evolution: every record here is `EVOLVABLE` (`april.codec`). A field added later gets a default, so a
newer reader takes the default from an older broker; a reader skips fields it does not know, so an older
dashboard or `april status` keeps working with a newer broker. Every field a reader does know is checked
as strictly as any message field. Removing a field or changing its type is not evolution: that needs a
new message kind.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

from april.codec import decode_map, encode_map
from april.ledger import Ledger


@dataclass(frozen=True, slots=True)
class RoundStatus:
    """Abort rounds: the last round's id, whether a sync/april round is open for leasing, whether an
    abort is in progress, and how many aborts completed."""

    EVOLVABLE: ClassVar[bool] = True
    id: int
    open: bool
    aborting: bool
    aborts_done: int


@dataclass(frozen=True, slots=True)
class WorkerStatus:
    """One registered worker, as the broker sees it."""

    EVOLVABLE: ClassVar[bool] = True
    id: str
    engine: str
    slots: int
    credit: int
    leases: int  # held now, evaluation leases included
    tokens_generated: int  # new response tokens accepted since its last WorkerHello (evaluation included)
    version: int  # weights version it last reported loaded
    pid: int
    host: str
    last_seen_s: float  # seconds since the broker last heard from it
    restored: bool  # known only from a snapshot's leases; has not said hello to this broker
    alive: bool  # heard from within the liveness window
    engine_ok: bool = True  # its engine can serve (EngineHealth); False: leased nothing until it can
    engine_detail: str = ""  # why its engine is down ("" when up)
    failed_by_engine: int = 0  # samples it failed because the engine failed their request (since it started)
    returned_by_engine: int = 0  # samples it returned as partials because of engine errors or an engine down
    weights_transport: str = ""  # how its weights version came: file, network or broadcast ("" = none yet)
    weights_sync_s: float = 0.0  # seconds from hearing of that version to serving it
    messages: int = 0  # messages heard from it since its last WorkerHello (heartbeats, usage reports too)
    samples_returned: int = 0  # samples in its SampleResults since then (evaluation samples included)
    placement: str = ""  # where and how its engine runs ("cuda:0, cuda graphs"); "" until the engine is up
    pinned: int = 0  # partials pinned to it (their environment state is in its memory), waiting for it

    @property
    def engine_label(self) -> str:
        """Its engine and where it runs, for people: "torch · cuda:0"; the engine alone if it says no more."""
        shown = self.placement and self.placement != self.engine
        return f"{self.engine} · {self.placement}" if shown else self.engine

    @property
    def weights_sync(self) -> str:
        """How its weights came and how long that took, for people: "network 0.41s"; "-" before any."""
        return f"{self.weights_transport} {self.weights_sync_s:.2f}s" if self.weights_transport else "-"


@dataclass(frozen=True, slots=True)
class LearnerStatus:
    """The connected learner (rank 0). `phase` is what it last said it is doing (`LearnerPhase` in lower
    case with spaces: "loading model", "initialising engine", ..., "training"), `phase_detail` which
    model, engine or step, `phase_s` for how long; empty and 0 when it does not say. `engine` is the
    detail it gave when initialising its engine: backend, device, optimizer and ranks ("DeepSpeed ZeRO-0
    on cuda, torch fused AdamW, 1 rank"); empty until then."""

    EVOLVABLE: ClassVar[bool] = True
    id: str
    last_seen_s: float
    waiting_for_batch: bool
    phase: str = ""
    phase_detail: str = ""
    phase_s: float = 0.0
    engine: str = ""


@dataclass(frozen=True, slots=True)
class UnackedBatch:
    """The batch sent to the learner and not yet acked."""

    EVOLVABLE: ClassVar[bool] = True
    batch_id: int
    step: int
    groups: int


@dataclass(frozen=True, slots=True)
class Totals:
    """Counted over the run, across broker restarts (the books keep them), but `batches_acked`, since this
    broker process started (training samples only)."""

    EVOLVABLE: ClassVar[bool] = True
    aborted: int  # samples returned INTERRUPTED by an abort
    resumed: int  # samples leased again with a partial response
    tokens_generated: int  # new response tokens accepted from workers
    samples_finished: int  # results FINISHED or FAILED
    batches_acked: int
    restarted: int = 0  # pinned partials restarted from their prompt (their worker was lost)
    tokens_restarted: int = 0  # the model tokens those held, dropped


@dataclass(frozen=True, slots=True)
class EvalProgress:
    """The evaluation in progress: issued at `version`, `done` of `of` samples returned, `leased` out."""

    EVOLVABLE: ClassVar[bool] = True
    version: int
    done: int
    leased: int
    of: int


@dataclass(frozen=True, slots=True)
class EvalStatus:
    """Evaluation on the held-out prompts: the latest result (None / 0 before the first), the settings
    and the evaluation running now."""

    EVOLVABLE: ClassVar[bool] = True
    version: int | None  # weights version of the latest evaluation
    accuracy: float | None
    reward_mean: float | None  # None also when no sample was scored
    n: int  # held-out prompts evaluated (0 before the first)
    failed: int
    oldest_version: int | None  # oldest / newest weights version among its response tokens
    newest_version: int | None
    every: int  # run.eval_every
    completed: int  # evaluations finished
    tokens_generated: int  # by evaluation samples
    running: EvalProgress | None


@dataclass(frozen=True, slots=True)
class Rejected:
    """Messages and samples the broker rejected, by reason and by peer then reason (docs/protocol.md
    section 6)."""

    EVOLVABLE: ClassVar[bool] = True
    by_reason: dict[str, int]
    by_peer: dict[str, dict[str, int]]

    @property
    def total(self) -> int:
        return sum(self.by_reason.values())


@dataclass(frozen=True, slots=True)
class ErrorLine:
    """The first line of one distinct sample error (`april.failures`: it starts with its reason) and how
    many samples settled with it since the broker kept it."""

    EVOLVABLE: ClassVar[bool] = True
    reason: str
    text: str
    samples: int


@dataclass(frozen=True, slots=True)
class StepFigures:
    """The learner's figures of one step, typed: read from a status's `learner_metrics` (the relayed
    metrics of the last acked step) or from a metrics.jsonl line. A figure the source lacks, or that is not
    a number, is NaN (`step` and `version` are None). The learner's own figures may be namespaced as in
    metrics.jsonl (`learner/clip_frac`); both spellings are read."""

    step: int | None
    version: int | None
    loss: float
    reward_mean: float
    accuracy: float
    eval_accuracy: float
    samples_per_s: float
    tokens_per_s: float
    aborted: float
    resumed: float
    staleness_mean: float
    staleness_max: float
    offpolicy_token_frac: float
    clip_frac: float
    approx_kl: float
    entropy: float
    wait_s: float
    learner_time_s: float
    weight_sync_s: float

    @classmethod
    def read(cls, metrics: Mapping[str, object]) -> StepFigures:
        def number(name: str) -> float:
            value = metrics.get(name, metrics.get(f"learner/{name}"))
            if isinstance(value, bool) or not isinstance(value, int | float):
                return math.nan
            return float(value)

        def whole(name: str) -> int | None:
            value = number(name)
            return int(value) if math.isfinite(value) else None

        return cls(
            step=whole("step"),
            version=whole("version"),
            loss=number("loss"),
            reward_mean=number("reward_mean"),
            accuracy=number("accuracy"),
            eval_accuracy=number("eval_accuracy"),
            samples_per_s=number("samples_per_s"),
            tokens_per_s=number("tokens_per_s"),
            aborted=number("aborted"),
            resumed=number("resumed"),
            staleness_mean=number("staleness_mean"),
            staleness_max=number("staleness_max"),
            offpolicy_token_frac=number("offpolicy_token_frac"),
            clip_frac=number("clip_frac"),
            approx_kl=number("approx_kl"),
            entropy=number("entropy"),
            wait_s=number("wait_s"),
            learner_time_s=number("learner_time_s"),
            weight_sync_s=number("weight_sync_s"),
        )


@dataclass(frozen=True, slots=True)
class BrokerStatus:
    """The broker's state at one moment (docs/protocol.md section 12)."""

    EVOLVABLE: ClassVar[bool] = True
    run: str  # run.name
    steps: int  # learner steps the run trains
    mode: str  # "sync", "april" or "async"
    version: int  # the broker's weights version
    epoch: int  # lease epoch (0, +1 per resume)
    uptime_s: float  # seconds since this broker process started
    round: RoundStatus
    workers: list[WorkerStatus]
    learner: LearnerStatus | None
    learner_metrics: dict[str, float]  # the metrics of the last BatchAck accepted ({} before the first)
    in_flight_groups: int
    leased_samples: int  # training samples leased now
    queued_samples: int  # samples waiting in the dispatch queue
    partial_groups: int
    partial_buffer: int  # INTERRUPTED samples waiting to resume (pinned ones included)
    partial_staleness: dict[str, int]  # "<staleness>" -> queued INTERRUPTED samples that have tokens
    complete_groups: int  # complete groups not yet in a batch
    unacked_batch: UnackedBatch | None
    cursor: int  # prompts drawn from the data source
    ledger: Ledger
    totals: Totals
    eval: EvalStatus | None  # None when evaluation is off
    rejected: Rejected
    # samples that settled with an error since this broker started, by reason (april.failures): failed
    # ones, and finished ones that met a non-fatal error (a tool call that timed out)
    errors: dict[str, int] = field(default_factory=dict)
    pinned: int = 0  # partials pinned to a worker (WorkerStatus.pinned), waiting for it
    restarts: dict[str, int] = field(default_factory=dict)  # pinned partials restarted, by cause
    error_lines: list[ErrorLine] = field(default_factory=list)  # distinct errors' first lines, newest last
    stopped: str = ""  # why the broker stopped the run ("" while it runs): every recent sample failed alike

    @property
    def ledger_balanced(self) -> bool:
        return self.ledger.balanced

    @property
    def workers_alive(self) -> int:
        return sum(1 for w in self.workers if w.alive)

    @property
    def messages_per_sample(self) -> float | None:
        """Messages heard from the live workers per sample they returned, since their hellos: what a sample
        costs the broker in messages (None before any sample)."""
        alive = [w for w in self.workers if w.alive]
        samples = sum(w.samples_returned for w in alive)
        return sum(w.messages for w in alive) / samples if samples else None

    @property
    def pinned_text(self) -> str:
        """Pinned partials per worker and restarts from their prompt, in one line for people."""
        per = ", ".join(f"{w.id} {w.pinned}" for w in self.workers if w.pinned)
        causes = ", ".join(f"{cause.replace('_', ' ')} {n}" for cause, n in sorted(self.restarts.items()))
        t = self.totals
        return (
            f"{self.pinned} samples{f' ({per})' if per else ''} · restarted from prompt "
            f"{t.restarted}{f' ({causes})' if causes else ''}, {t.tokens_restarted} tokens"
        )

    @property
    def step_figures(self) -> StepFigures:
        """The learner's figures of its last acked step."""
        return StepFigures.read(self.learner_metrics)

    def to_json(self) -> dict[str, Any]:
        """The object `april status --json` prints: the record's fields as on the wire, plus the derived
        `ledger_balanced` and `rejected.total`. NaN figures stay NaN (Python's json writes `NaN`)."""
        out = encode_map(self)
        out["ledger_balanced"] = self.ledger_balanced
        out["rejected"]["total"] = self.rejected.total
        return out

    @classmethod
    def from_json(cls, obj: object) -> BrokerStatus:
        """Read a `to_json` object back, checked field by field (ProtocolError on a wrong or missing
        field); the derived keys and keys this version does not know are skipped."""
        status: BrokerStatus = decode_map(cls, obj, "status")
        return status
