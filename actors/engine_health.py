"""A worker's view of its engine's health: up or down (and why), when to probe a down engine next, and
what engine errors have cost so far, as the worker reports it to the broker in `EngineHealth`.

Owns the probe schedule: the first probe `BACKOFF_MIN_S` after the engine went down, each failed probe
doubling the wait up to `BACKOFF_MAX_S` (the peer link's reconnect backoff, docs/protocol.md section 7,
so a worker backs off from a dead server as it does from a dead broker), and the cumulative counts of
samples failed and returned because of the engine, and where the engine runs once it is built (its
`placement`). Knows nothing of engines or sockets: the worker calls
`Engine.probe` when `probe_due` says so and sends `report()` when `unsent()` says it changed.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from april import protocol
from april.peer_link import BACKOFF_MAX_S, BACKOFF_MIN_S


def one_line(text: str, limit: int = protocol.MAX_ENGINE_DETAIL) -> str:
    """An error message as one line of at most `limit` characters (servers answer multi-line bodies)."""
    return " ".join(text.split())[:limit]


@dataclass(slots=True)
class EngineHealth:
    down: bool = False
    detail: str = ""  # why the engine is down; "" when up
    failed: int = 0  # samples failed because the engine failed their request
    returned: int = 0  # samples returned as partials because of an engine error or an engine down
    wait_s: float = BACKOFF_MIN_S  # before the next probe
    next_probe: float = float("inf")  # monotonic seconds
    probes_failed: int = 0  # since the engine went down
    placement: str = ""  # where and how the engine runs (Engine.placement); "" until it is built
    # the last report sent to the broker; before any, what a broker assumes of a worker that said hello
    sent: protocol.EngineHealth = field(default_factory=lambda: protocol.EngineHealth(True, "", 0, 0))

    def go_down(self, detail: str, now: float) -> None:
        """The engine cannot serve: probe it `BACKOFF_MIN_S` from now (again if it was down already)."""
        self.down, self.detail = True, one_line(detail) or "engine unavailable"
        self.wait_s, self.next_probe, self.probes_failed = BACKOFF_MIN_S, now + BACKOFF_MIN_S, 0

    def probe_due(self, now: float) -> bool:
        return self.down and now >= self.next_probe

    def probe_failed(self, detail: str, now: float) -> None:
        """A probe failed: wait twice as long (at most `BACKOFF_MAX_S`) before the next one."""
        self.detail = one_line(detail) or self.detail
        self.probes_failed += 1
        self.wait_s = min(self.wait_s * 2, BACKOFF_MAX_S)
        self.next_probe = now + self.wait_s

    def come_up(self) -> None:
        self.down, self.detail, self.next_probe = False, "", float("inf")

    @property
    def pristine(self) -> bool:
        """Nothing a broker that lost this worker needs to hear: up, no sample lost to the engine, and no
        placement to tell (none built)."""
        return not self.down and self.failed == 0 and self.returned == 0 and not self.placement

    def report(self) -> protocol.EngineHealth:
        return protocol.EngineHealth(not self.down, self.detail, self.failed, self.returned, self.placement)

    def unsent(self) -> protocol.EngineHealth | None:
        """The report if it differs from the last one sent (marking it sent), else None."""
        report = self.report()
        if report == self.sent:
            return None
        self.sent = report
        return report
