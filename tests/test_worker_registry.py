"""The broker's worker registry (`broker.peers.Workers`) answers who is dead, who is due a heartbeat and
who has credit from its orders, without a scan of every worker; here every answer is checked against
the scan that defines it, over random runs of registrations, messages, credit changes and removals."""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from broker.peers import Workers

INTERVAL, LIVENESS = 1.0, 3
WORKER_IDS = [f"w{i}" for i in range(6)]

step = st.tuples(
    st.sampled_from(["register", "restored", "heard", "sent", "credit", "engine", "remove"]),
    st.sampled_from(WORKER_IDS),
    st.integers(0, 4),  # credit, or whether the engine serves
    st.floats(0.0, 2.5),  # time passing before the step
)


def scanned(workers: Workers, now: float) -> tuple[list[str], list[str], list[str]]:
    """What each question means: a pass over every worker, in registration order."""
    peers = workers.peers.values()
    dead = [p.peer_id for p in peers if now - p.last_seen > workers.window]
    due = [p.peer_id for p in peers if now - p.last_sent >= workers.interval]
    credit = [p.peer_id for p in peers if p.credit > 0 and p.leasable]
    return dead, due, credit


@settings(max_examples=300, deadline=None)
@given(st.lists(step, max_size=60))
def test_the_registry_answers_as_a_scan_of_every_worker(steps: list[tuple[str, str, int, float]]) -> None:
    workers = Workers(INTERVAL, LIVENESS)
    now = 0.0
    for action, worker_id, value, elapsed in steps:
        now += elapsed
        peer = workers.get(worker_id)
        if action in ("register", "restored"):
            workers.register(worker_id, now, slots=4, credit=value, restored=action == "restored")
        elif peer is None or action == "remove":
            workers.remove(worker_id)
        elif action == "heard":
            workers.heard(peer, now)
        elif action == "sent":
            workers.sent(peer, now)
        elif action == "credit":
            workers.set_credit(peer, value)
        else:
            peer.engine_ok = value % 2 == 0
        dead, due, credit = scanned(workers, now)
        assert sorted(workers.dead(now)) == sorted(dead)
        assert sorted(p.peer_id for p in workers.due_heartbeat(now)) == sorted(due)
        assert [p.peer_id for p in workers.with_credit()] == credit  # registration order, as leases go


def test_the_longest_silent_is_found_dead_first_and_a_new_worker_is_due_a_heartbeat_at_once() -> None:
    workers = Workers(INTERVAL, LIVENESS)
    a = workers.register("a", 0.0, slots=2)
    workers.register("b", 1.0, slots=2)
    assert a is not None
    assert sorted(p.peer_id for p in workers.due_heartbeat(1.0)) == ["a", "b"]  # never sent to
    workers.sent(a, 1.0)
    assert [p.peer_id for p in workers.due_heartbeat(1.5)] == ["b"]
    assert workers.dead(3.5) == ["a"] and workers.dead(4.5) == ["a", "b"]
    workers.heard(a, 4.5)
    assert workers.dead(4.5) == ["b"]
