"""The episodes a worker holds whose next model turn waits for an engine slot, in the order slots go.

Owns the slot order of the worker core (april/worker_core.py, which the real worker and the simulator's
engines both drive; docs/episodes.md, "Slots"): an episode that has had a turn in this worker's engine,
answered by its environment since, takes a freed slot before a lease this worker has not started yet (a
new lease, or a resumed one whose owed step ran here first); within each kind, first come, first served.
An abort gives every waiting one back as it is, in that same order.

Knows nothing of slots, samples or engines: the core says when a slot is free; an item is a lease id.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Generic, TypeVar

T = TypeVar("T")


class TurnQueue(Generic[T]):
    def __init__(self) -> None:
        self._answered: deque[T] = deque()  # had a turn in this worker's engine: first to get a slot
        self._unstarted: deque[T] = deque()  # not yet in this worker's engine

    def put(self, item: T, *, started: bool) -> None:
        """`item` waits for a slot; `started`: it has had a turn in this worker's engine."""
        (self._answered if started else self._unstarted).append(item)

    def take(self) -> T | None:
        """The item the next free slot goes to (None: nothing waits)."""
        queue = self._answered or self._unstarted
        return queue.popleft() if queue else None

    def remove(self, item: T) -> None:
        """`item` stops waiting (it left the worker)."""
        (self._answered if item in self._answered else self._unstarted).remove(item)

    def drain(self) -> list[T]:
        """Every waiting item, in the order slots would have gone to them; the queue is left empty."""
        items = [*self._answered, *self._unstarted]
        self._answered.clear()
        self._unstarted.clear()
        return items

    def __len__(self) -> int:
        return len(self._answered) + len(self._unstarted)

    def __iter__(self) -> Iterator[T]:
        yield from self._answered
        yield from self._unstarted
