"""The ledger: conservation of issued groups (docs/design.md section 8).

Every group the data source issued is in exactly one state, so
`issued == trained + complete_waiting + in_flight + partial + sum(dropped.values())`.
`Ledger` is the immutable snapshot that travels in a Batch, lands in `metrics.jsonl` and in the broker's
state file; `check` raises `LedgerError` when the books do not balance. Who counts is the broker's business.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class LedgerError(AssertionError):
    """The books do not balance: a group was lost or counted twice. Always a bug."""


@dataclass(frozen=True, slots=True)
class Ledger:
    issued: int = 0
    trained: int = 0
    complete_waiting: int = 0
    in_flight: int = 0
    partial: int = 0
    dropped: dict[str, int] = field(default_factory=dict)  # reason -> groups

    @property
    def accounted(self) -> int:
        return (
            self.trained + self.complete_waiting + self.in_flight + self.partial + sum(self.dropped.values())
        )

    @property
    def balanced(self) -> bool:
        return self.issued == self.accounted and min(self.as_counts()) >= 0

    def as_counts(self) -> tuple[int, ...]:
        return (
            self.issued,
            self.trained,
            self.complete_waiting,
            self.in_flight,
            self.partial,
            *self.dropped.values(),
        )

    def check(self, where: str = "") -> None:
        if not self.balanced:
            raise LedgerError(f"ledger does not balance{' ' + where if where else ''}: {self.describe()}")

    def describe(self) -> str:
        dropped = ", ".join(f"{k}={v}" for k, v in sorted(self.dropped.items())) or "none"
        return (
            f"issued={self.issued} vs trained={self.trained} + complete_waiting={self.complete_waiting} + "
            f"in_flight={self.in_flight} + partial={self.partial} + dropped({dropped})"
        )

    def to_json(self) -> dict[str, Any]:
        """The `ledger` object of metrics.jsonl and summary.json."""
        return {
            "issued": self.issued,
            "trained": self.trained,
            "complete_waiting": self.complete_waiting,
            "in_flight": self.in_flight,
            "partial": self.partial,
            "dropped": dict(sorted(self.dropped.items())),
        }

    def validate(self) -> None:
        """Called by the codec: counts from a peer must be non-negative (balance is checked by users)."""
        if min(self.as_counts(), default=0) < 0:
            raise ValueError(f"negative ledger count: {self.describe()}")
