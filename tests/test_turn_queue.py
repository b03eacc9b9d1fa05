"""april.turn_queue: the order free slots go to waiting turns, the rule the episode driver and the
simulator's engines share (each tested with it in test_episode_driver.py and test_sim_episodes.py)."""

from __future__ import annotations

from april.turn_queue import TurnQueue


def test_answered_episodes_go_first_then_unstarted_leases_each_in_arrival_order() -> None:
    q: TurnQueue[str] = TurnQueue()
    q.put("lease a", started=False)
    q.put("episode b", started=True)
    q.put("lease c", started=False)
    q.put("episode d", started=True)
    assert len(q) == 4 and list(q) == ["episode b", "episode d", "lease a", "lease c"]
    assert q.take() == "episode b"
    q.remove("lease a")
    assert [q.take(), q.take(), q.take()] == ["episode d", "lease c", None]
    assert len(q) == 0


def test_drain_empties_the_queue_in_slot_order() -> None:
    q: TurnQueue[int] = TurnQueue()
    for item, started in [(1, False), (2, True), (3, False)]:
        q.put(item, started=started)
    assert q.drain() == [2, 1, 3]
    assert len(q) == 0 and q.take() is None
