"""What a worker owes the broker for samples that left its engine, gathered into few messages.

Each sample that leaves an engine owes the broker its result (finished and scored, failed, or a partial)
and, when it freed a slot, one credit. Sent at once, an engine that finishes its samples one at a time
(as engines do: lengths differ) costs the broker one message per result and one per credit, and the
broker's work per message (decode, checks, dispatch, a Lease back) is several times its work per sample
in a result of 32 (docs/bench.md, "The broker at cluster scale"). `worker.result_hold_ms` lets a worker
hold what it owes for up to that long, and then send it all as one `SampleResult` whose `credit` carries
the slots freed meanwhile (`LeaseRequest` when only credit is owed): the protocol allows a result of any
number of samples, and credit in a result adds as a LeaseRequest's does (docs/protocol.md, section 3).

The outbox only keeps and packs; the worker decides when to send (`due`) and keeps the two rules that
make holding safe:
- nothing overtakes a held result: the worker sends the outbox before any other message of its own, so
  an `AbortDone` (which replaces credit and names what is still being scored) or a `Disconnect` comes
  after every result it follows, as if nothing had been held. The one exception is the usage report
  (`EngineUsage`): cumulative, it commutes with results, and sent every `worker.usage_report_s` while
  the engine runs it would otherwise cut every longer hold short;
- nothing held is forgotten: a hello after a reconnect names the held leases (`lease_ids`) as leases the
  worker still holds, so a broker that lost the worker keeps them and accepts their results when sent;
  the hello tells the broker the worker's free slots, so the credit held is dropped (`drop_credit`).

`hold_s` 0 (the default) sends every result and credit at once, exactly as a worker without an outbox.
A full engine's worth of held samples (`max_samples`) is sent without waiting out the hold.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from april import protocol
from april.records import Sample
from april.wire_records import SampleBatch


class Outbox:
    """Results and credit owed to the broker, oldest first, held at most `hold_s` from the oldest."""

    def __init__(self, hold_s: float, max_samples: int) -> None:
        if hold_s < 0 or max_samples < 1:
            raise ValueError(f"Outbox: hold_s {hold_s} must be >= 0 and max_samples {max_samples} >= 1")
        self.hold_s = hold_s
        self.max_samples = max_samples
        self._items: list[tuple[int, Sample]] = []  # (lease id, sample), in the order they left the engine
        self._credit = 0
        self._since: float | None = None  # when the oldest thing held was owed

    def __len__(self) -> int:
        return len(self._items)

    @property
    def credit(self) -> int:
        return self._credit

    def add(self, items: Sequence[tuple[int, Sample]], credit: int, now: float) -> None:
        """Owe the broker these results (lease id, sample) and `credit` freed slots, from `now`."""
        if credit < 0:
            raise ValueError(f"Outbox: credit {credit} must be >= 0")
        if not items and not credit:
            return
        self._items.extend(items)
        self._credit += credit
        if self._since is None:
            self._since = now

    def due(self, now: float) -> bool:
        """Whether what is held must go now: its oldest part has waited the hold, or it fills an engine."""
        if self._since is None:
            return False
        return now - self._since >= self.hold_s or len(self._items) >= self.max_samples

    def wait_s(self, now: float) -> float | None:
        """Seconds until `due` (0: now), or None when nothing is held: how long the worker may block."""
        if self._since is None:
            return None
        return 0.0 if self.due(now) else self._since + self.hold_s - now

    def drop_credit(self) -> None:
        """Forget the credit held: a hello has just told the broker the free slots it stood for."""
        self._credit = 0
        if not self._items:
            self._since = None

    def lease_ids(self) -> list[int]:
        """The leases whose results are held: still the worker's until they are sent."""
        return [lease_id for lease_id, _ in self._items]

    def take(self) -> protocol.SampleResult | protocol.LeaseRequest | None:
        """Everything held, as one message (None when nothing is held); the outbox is empty after."""
        items, credit = self._items, self._credit
        self._items, self._credit, self._since = [], 0, None
        if items:
            return protocol.SampleResult(
                lease_ids=np.array([lease_id for lease_id, _ in items], dtype=np.int64),
                samples=SampleBatch.from_samples([s for _, s in items]),
                credit=credit,
            )
        return protocol.LeaseRequest(credit) if credit else None
