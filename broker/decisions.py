"""What the broker core decides: the records `broker.core.BrokerCore` hands its driver after each event.

The driver carries them out in the order given: the server (`broker.server`) turns them into messages on
its sockets, log records and files; the simulator (`broker.sim.model`) into its engines' inboxes. A
decision says what is to happen, never how: no sockets, no encoding, no clock. Equal events give equal
decisions, so two drivers of one core can be compared decision by decision.
"""

from __future__ import annotations

from dataclasses import dataclass

from april.protocol import Message
from april.records import Sample
from broker.evaluation import EvalResult
from broker.state import PendingBatch

Work = list[tuple[int, int, Sample]]  # (lease id, token budget, the sample as leased) per leased sample


@dataclass(frozen=True, slots=True)
class LeaseOut:
    """Lease `work` to a worker in one Lease; its first `greedy` items are evaluation samples."""

    worker_id: str
    work: Work
    greedy: int = 0


@dataclass(frozen=True, slots=True)
class Send:
    """One message to one worker: its Welcome, an Abort, a relayed WeightsReady, a Heartbeat, an Error."""

    worker_id: str
    message: Message


@dataclass(frozen=True, slots=True)
class Refuse:
    """A peer's message (or part of it) was refused: counted under `reason`; `reply`: the peer is sent
    Error(reason, detail)."""

    peer_id: str
    reason: str
    detail: str
    reply: bool = True


@dataclass(frozen=True, slots=True)
class Settled:
    """Samples of one SampleResult the books took for good (FINISHED or FAILED) and that belong to a
    group still held, as the books keep them: they are logged once (`broker.complete_log`). `whole`:
    every sample of the result settled and is here, in the result's order (then the result may be logged
    as it came, with these samples' lease spans)."""

    samples: list[Sample]
    whole: bool


@dataclass(frozen=True, slots=True)
class BatchFormed:
    """Hand `batch` to the waiting learner: the core counts it handed out at once; the driver sends it (the
    server once its snapshot is durable). `again`: the unacked batch, handed again to a learner that asked
    again without acking it (its snapshot was written when it was formed)."""

    batch: PendingBatch
    again: bool = False


@dataclass(frozen=True, slots=True)
class ToLearner:
    """One message to the learner session: its Welcome, or an Error answering a refused message."""

    message: Message


@dataclass(frozen=True, slots=True)
class WorkerLost:
    """A worker left, fell silent past the liveness window or never confirmed an abort: its leases are
    back in the queue and it is out of the registry (the driver forgets what it kept for it)."""

    worker_id: str


@dataclass(frozen=True, slots=True)
class EvalFinished:
    """An evaluation on the held-out prompts finished."""

    result: EvalResult


@dataclass(frozen=True, slots=True)
class RunStopped:
    """The run is stopped (every recent sample failed alike: `broker.failures`): the learner, waiting for
    a batch, is told `line` (Error run_failed) instead; nothing more is leased."""

    line: str


Decision = (
    LeaseOut | Send | Refuse | Settled | BatchFormed | ToLearner | WorkerLost | EvalFinished | RunStopped
)
