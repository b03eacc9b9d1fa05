"""The broker's status record (`april.status.BrokerStatus`): what `april status` prints and the PUB socket
publishes, built from a `StatusView` the server gathers: the core's view (`broker.core.CoreView`: the
books' figures, the round, the worker registry, the evaluations, the sample errors), the learner session
and the rejection counts.

Read-only: a mapping of the view, changing nothing and knowing nothing of the Broker. The record's shape
and its wire and JSON forms are `april.status`'s.
"""

from __future__ import annotations

from dataclasses import dataclass

from april.status import (
    BrokerStatus,
    LearnerStatus,
    Rejected,
    RoundStatus,
    Totals,
    UnackedBatch,
    WorkerStatus,
)
from broker.core import CoreView
from broker.peers import LearnerPeer, Rejections


@dataclass(frozen=True, slots=True)
class StatusView:
    """What the status shows, gathered by the server at one moment."""

    run: str
    steps: int
    core: CoreView
    learner: LearnerPeer | None
    batch_held: bool  # a batch handed to the learner waits for its snapshot (the learner still waits)
    rejections: Rejections


def build_status(view: StatusView, now: float) -> BrokerStatus:
    core, learner, rejections = view.core, view.learner, view.rejections
    books, failures = core.books, core.failures
    batch = books.unacked
    return BrokerStatus(
        run=view.run,
        steps=view.steps,
        mode=str(books.mode),
        version=books.version,
        epoch=books.epoch,
        uptime_s=round(core.uptime_s, 3),
        round=RoundStatus(
            id=core.round.round_id,
            open=core.round.open,
            aborting=core.round.aborting,
            aborts_done=core.round.aborts_done,
        ),
        workers=_workers(view, now),
        learner=None
        if learner is None
        else LearnerStatus(
            id=learner.peer_id,
            last_seen_s=round(now - learner.last_seen, 3),
            waiting_for_batch=core.learner_waiting or view.batch_held,
            phase="" if learner.phase is None else learner.phase.name.lower().replace("_", " "),
            phase_detail=learner.phase_detail,
            phase_s=0.0 if learner.phase is None else round(now - learner.phase_since, 3),
            engine=learner.engine,
        ),
        learner_metrics=dict(core.learner_metrics),
        in_flight_groups=books.in_flight_groups,
        leased_samples=books.leased_samples,
        queued_samples=books.queued_samples,
        partial_groups=books.partial_groups,
        partial_buffer=books.partial_buffer,
        pinned=sum(books.pinned.values()),
        restarts=dict(books.restarts),
        partial_staleness={str(k): n for k, n in books.partial_staleness.items()},
        complete_groups=books.complete_groups,
        unacked_batch=None
        if batch is None
        else UnackedBatch(batch_id=batch.batch_id, step=batch.step, groups=len(batch.group_ids)),
        cursor=books.cursor,
        ledger=books.ledger,
        totals=Totals(
            aborted=books.totals.aborted,
            resumed=books.totals.resumed,
            tokens_generated=books.totals.tokens_generated,
            samples_finished=books.totals.samples_finished,
            batches_acked=core.batches_acked,
            restarted=books.totals.restarted,
            tokens_restarted=books.totals.tokens_restarted,
        ),
        eval=core.eval,
        rejected=Rejected(
            by_reason=dict(rejections.by_reason),
            by_peer={peer: dict(counts) for peer, counts in rejections.by_peer.items()},
        ),
        errors=dict(sorted(failures.counts.items())),
        error_lines=list(failures.lines.values()),
        stopped=failures.stopped,
    )


def _workers(view: StatusView, now: float) -> list[WorkerStatus]:
    core = view.core
    leases = core.books.leases
    return [
        WorkerStatus(
            id=p.peer_id,
            engine=p.engine,
            slots=p.slots,
            credit=p.credit,
            leases=leases.get(p.peer_id, 0),
            tokens_generated=p.tokens_generated,
            version=p.version,
            pid=p.pid,
            host=p.host,
            last_seen_s=round(now - p.last_seen, 3),
            restored=p.restored,
            alive=now - p.last_seen <= core.liveness_window_s,
            engine_ok=p.engine_ok,
            engine_detail=p.engine_detail,
            failed_by_engine=p.failed_by_engine,
            returned_by_engine=p.returned_by_engine,
            weights_transport=p.weights_transport,
            weights_sync_s=round(p.weights_sync_s, 4),
            messages=p.messages,
            samples_returned=p.samples_returned,
            placement=p.placement,
            pinned=core.books.pinned.get(p.peer_id, 0),
        )
        for p in core.workers
    ]
