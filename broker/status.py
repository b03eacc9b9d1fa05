"""The broker's status record (`april.status.BrokerStatus`): what `april status` prints and the PUB socket
publishes, built from the broker's books and peer registry; and the run's totals the broker leaves in the
run directory when it stops.

Read-only: reads the broker's books, changes nothing. The record's shape and its wire and JSON forms are
`april.status`'s.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

from april.status import (
    BrokerStatus,
    LearnerStatus,
    Rejected,
    RoundStatus,
    Totals,
    UnackedBatch,
    WorkerStatus,
)

if TYPE_CHECKING:
    from broker.server import Broker


def build_status(broker: Broker, now: float) -> BrokerStatus:
    state = broker.state
    partials = state.partial_samples()
    staleness = Counter(s.staleness(state.version) for s in partials if s.response_len)
    learner, batch, rejections = broker.learner, state.batch, broker.rejections
    ledger = state.ledger()
    return BrokerStatus(
        run=broker.config.run.name,
        steps=broker.config.run.steps,
        mode=state.mode.value,
        version=state.version,
        epoch=state.epoch,
        uptime_s=round(now - broker.started, 3),
        round=RoundStatus(
            id=broker.round_id,
            open=state.round_open,
            aborting=broker.abort is not None,
            aborts_done=broker.aborts_done,
        ),
        workers=_workers(broker, now),
        learner=None
        if learner is None
        else LearnerStatus(
            id=learner.peer_id,
            last_seen_s=round(now - learner.last_seen, 3),
            waiting_for_batch=broker.learner_waiting is not None,
            phase="" if learner.phase is None else learner.phase.name.lower().replace("_", " "),
            phase_detail=learner.phase_detail,
            phase_s=0.0 if learner.phase is None else round(now - learner.phase_since, 3),
            engine=learner.engine,
        ),
        learner_metrics=dict(broker.learner_metrics),
        in_flight_groups=state.in_flight,
        leased_samples=state.leased_samples,
        queued_samples=len(state.queue),
        partial_groups=state.partial,
        partial_buffer=len(partials),
        partial_staleness={str(k): n for k, n in sorted(staleness.items())},
        complete_groups=len(state.complete),
        unacked_batch=None
        if batch is None
        else UnackedBatch(batch_id=batch.batch_id, step=batch.step, groups=len(batch.group_ids)),
        cursor=state.cursor,
        ledger=ledger,
        totals=Totals(
            aborted=state.totals.aborted,
            resumed=state.totals.resumed,
            tokens_generated=state.totals.tokens_generated,
            samples_finished=state.totals.samples_finished,
            batches_acked=broker.batches_acked,
        ),
        eval=broker.evals.status(),
        rejected=Rejected(
            by_reason=dict(rejections.by_reason),
            by_peer={peer: dict(counts) for peer, counts in rejections.by_peer.items()},
        ),
    )


def _workers(broker: Broker, now: float) -> list[WorkerStatus]:
    leases = Counter(lease.worker_id for lease in broker.state.leases.values())
    if broker.evals.run is not None:
        leases.update(worker_id for worker_id, _ in broker.evals.run.leases.values())
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
            alive=broker.workers.alive(p, now),
            engine_ok=p.engine_ok,
            engine_detail=p.engine_detail,
            failed_by_engine=p.failed_by_engine,
            returned_by_engine=p.returned_by_engine,
            weights_transport=p.weights_transport,
            weights_sync_s=round(p.weights_sync_s, 4),
            messages=p.messages,
            samples_returned=p.samples_returned,
            placement=p.placement,
        )
        for p in broker.workers.peers.values()
    ]


def run_totals(broker: Broker) -> dict[str, Any]:
    """What the broker saw so far: taken when the run's last step is acked and when the broker stops,
    both written to RUN_DIR/broker_totals.json (for `april bench`): tokens generated and still held
    (`buffered_tokens`: partials, complete groups, an unacked batch), aborts and resumes, and the
    workers' slot integrals (broker.usage)."""
    state = broker.state
    return {
        "tokens_generated": state.totals.tokens_generated,
        "buffered_tokens": sum(s.response_len for g in state.groups.values() for s in g.samples),
        "trained_groups": state.trained,
        "aborted": state.totals.aborted,
        "resumed": state.totals.resumed,
        "samples_finished": state.totals.samples_finished,
        "usage": broker.usage.total.stats(),
        "ledger": state.ledger().to_json(),
    }
