"""The broker's state as one JSON object: what `april status` prints and the PUB socket publishes, and the
run's totals the broker leaves in the run directory when it stops.

Read-only: builds plain dicts from the broker's books and peer registry; changes nothing.
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from broker.server import Broker


def build_status(broker: Broker, now: float) -> dict[str, Any]:
    state = broker.state
    partials = state.partial_samples()
    staleness = Counter(str(s.staleness(state.version)) for s in partials if s.response_len)
    leases = Counter(lease.worker_id for lease in state.leases.values())
    if broker.evals.run is not None:
        leases.update(worker_id for worker_id, _ in broker.evals.run.leases.values())
    learner = broker.learner
    run = broker.config.run
    return {
        "run": run.name,
        "steps": run.steps,
        "mode": state.mode.value,
        "version": state.version,
        "epoch": state.epoch,
        "uptime_s": round(now - broker.started, 3),
        "round": {
            "id": broker.round_id,
            "open": state.round_open,
            "aborting": broker.abort is not None,
            "aborts_done": broker.aborts_done,
        },
        "workers": [
            {
                "id": p.peer_id,
                "engine": p.engine,
                "slots": p.slots,
                "credit": p.credit,
                "leases": leases.get(p.peer_id, 0),
                "tokens_generated": p.tokens_generated,
                "version": p.version,
                "pid": p.pid,
                "host": p.host,
                "last_seen_s": round(now - p.last_seen, 3),
                "restored": p.restored,
                "alive": now - p.last_seen <= broker.workers.liveness * broker.workers.interval,
            }
            for p in broker.workers.peers.values()
        ],
        "learner": None
        if learner is None
        else {
            "id": learner.peer_id,
            "last_seen_s": round(now - learner.last_seen, 3),
            "waiting_for_batch": broker.learner_waiting is not None,
        },
        "learner_metrics": broker.learner_metrics,
        "in_flight_groups": state.in_flight,
        "leased_samples": state.leased_samples,
        "queued_samples": len(state.queue),
        "partial_groups": state.partial,
        "partial_buffer": len(partials),
        "partial_staleness": dict(sorted(staleness.items(), key=lambda kv: int(kv[0]))),
        "complete_groups": len(state.complete),
        "unacked_batch": None
        if state.batch is None
        else {
            "batch_id": state.batch.batch_id,
            "step": state.batch.step,
            "groups": len(state.batch.group_ids),
        },
        "cursor": state.cursor,
        "ledger": state.ledger().to_json(),
        "ledger_balanced": state.ledger().balanced,
        "totals": {
            "aborted": state.totals.aborted,
            "resumed": state.totals.resumed,
            "tokens_generated": state.totals.tokens_generated,
            "samples_finished": state.totals.samples_finished,
            "batches_acked": broker.batches_acked,
        },
        "eval": broker.evals.status(),
        "rejected": {
            "total": broker.rejections.total,
            "by_reason": dict(broker.rejections.by_reason),
            "by_peer": {p: dict(c) for p, c in broker.rejections.by_peer.items()},
        },
    }


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
