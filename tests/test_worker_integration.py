"""Real `april worker` processes (sim engine) against a real broker and the scripted learner: rounds
complete, partials come back on abort and are resumed (on another worker too), a killed worker's leases
are taken over, and every trained sample carries consistent tokens, log-probs and version tags."""

from __future__ import annotations

import signal
from collections.abc import Callable
from typing import Any

from harness import Cluster, wait_for


def train_with_two_workers(c: Cluster, steps: int) -> list[dict[str, Any]]:
    """Broker, workers w0 and w1 and the scripted learner for `steps` steps: the batches, each one ok."""
    c.start_broker()
    c.start_worker("w0")
    c.start_worker("w1")
    c.start_learner(steps=steps, train_s=0.05)
    c.wait_exit("learner", 90)
    batches = c.batches()
    assert len(batches) == steps and all(b["ok"] for b in batches)
    return batches


def test_april_run_with_real_workers(cluster: Callable[..., Cluster]) -> None:
    c = cluster(run={"mode": "april"}, algo={"max_new_tokens": 40})
    # 6 steps: on a loaded machine every abort of a 4-step run once fell in its last round (none resumed)
    batches = train_with_two_workers(c, steps=6)
    status = c.status()
    assert status.ledger_balanced and status.ledger.trained == 24
    assert status.totals.aborted > 0 and status.totals.resumed > 0
    multi_version = [segs for b in batches for segs in b["segments"] if len({v for v, _, _ in segs}) > 1]
    assert multi_version, "no resumed sample spans two policy versions"
    assert {w.id for w in status.workers} == {"w0", "w1"}
    assert all(w.version >= 3 for w in status.workers)  # sim:// weights relayed and acked


def test_worker_sigterm_returns_leases_and_sigkill_is_survived(cluster: Callable[..., Cluster]) -> None:
    c = cluster(
        run={"mode": "async"}, algo={"max_new_tokens": 40, "max_staleness": 1}, worker={"sim_time_scale": 1.0}
    )
    c.start_broker()
    # Two slots each and 40-token samples of ~3 s: the first worker to register needs ~20 s to finish
    # the work the broker admits without a learner, so the second one (which may start seconds later on a
    # loaded machine) still finds work, and both come to hold leases.
    slow = (
        "worker.slots=2",
        "worker.sim_time_scale=5.0",
        "worker.sim_lengths=lognormal:median=40,sigma=0.01,cap=40",
    )
    c.start_worker("leaver", *slow)
    c.start_worker("victim", *slow)

    def both_hold_leases() -> bool:  # a registered worker has installed its signal handlers
        leases = {w.id: w.leases for w in c.status().workers}
        return leases.get("leaver", 0) > 0 and leases.get("victim", 0) > 0

    wait_for(both_hold_leases, 60, "both workers to hold leases")
    c.kill("leaver", signal.SIGTERM)  # clean exit: partials returned, Disconnect
    c.kill("victim")  # SIGKILL: leases re-queued after the liveness window
    c.start_worker("w2")
    c.start_learner(steps=3, train_s=0.05)
    c.wait_exit("learner", 90)
    status = c.status()
    assert status.ledger_balanced and status.ledger.trained == 12
    assert [w.id for w in status.workers] == ["w2"]
    broker_log = (c.tmp / "broker.log").read_text()
    assert "worker leaver disconnected: shutdown" in broker_log  # SIGTERM: a clean goodbye
    assert "worker victim silent for" in broker_log  # SIGKILL: found dead by liveness, leases re-queued


def test_workers_that_hold_their_results_lose_nothing_across_aborts(cluster: Callable[..., Cluster]) -> None:
    """`worker.result_hold_ms` (actors/outbox.py) with real processes: each worker gathers what it owes for
    up to 200 ms, across async's abort at every new version; every sample is trained once, the ledger
    balances, and partials are aborted and resumed."""
    c = cluster(
        run={"mode": "async"},
        algo={"max_new_tokens": 40, "max_staleness": 1},
        worker={"result_hold_ms": 200.0},
    )
    batches = train_with_two_workers(c, steps=4)
    keys = [(g, i) for b in batches for g, i in b["keys"]]
    assert len(keys) == len(set(keys)), "a sample was trained twice"
    status = c.status()
    assert status.ledger_balanced and status.ledger.trained == 16
    assert status.totals.aborted > 0 and status.totals.resumed > 0
    assert all(w.version >= 3 for w in status.workers)
