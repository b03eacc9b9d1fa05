"""How a worker's engine slots are used over time: the worker's side of `slot_utilization` and `bubble_frac`.

Owns three time integrals (wall seconds, cumulative since the worker started) of a piecewise-constant
occupancy: running sequences x time (`busy_slot_s`), slots x time (`slot_s`) and time with at least one
free slot (`free_slot_s`: a worker keeps no local queue, so a free slot means nothing to run). The worker
calls `observe(now, active)` once per loop iteration (the count holds until the next call) and sends
`report()` as an `EngineUsage` when `due(now, active)` says so (with the engine's own cost counters when
it models its cost, `actors.engine.CostModelled`). Knows nothing of phases or batches: the
broker differences the reports and splits them over its rollout phases.
"""

from __future__ import annotations

from dataclasses import replace

from actors.engine import CostModelled
from april.protocol import EngineUsage


class SlotMeter:
    def __init__(self, slots: int, now: float, busy_period_s: float) -> None:
        self.slots = slots
        self.busy_period_s = busy_period_s  # report period while sequences run (worker.usage_report_s)
        self.active = 0  # sequences running since `last`
        self.last = now
        self.started = now
        self.busy_slot_s = 0.0
        self.slot_s = 0.0
        self.free_slot_s = 0.0
        self.reported_at = now
        self.reported_active = 0

    def observe(self, now: float, active: int) -> None:
        """Account the time since the last call at the old count; `active` holds from `now` on."""
        dt = max(0.0, now - self.last)
        self.busy_slot_s += min(self.active, self.slots) * dt
        self.slot_s += self.slots * dt
        if self.active < self.slots:
            self.free_slot_s += dt
        self.last, self.active = now, active

    def due(self, now: float, idle_period_s: float) -> bool:
        """A report is due: every `busy_period_s` while running, at once when the engine went idle, and
        every `idle_period_s` while idle (with the heartbeat)."""
        since = now - self.reported_at
        if self.active:
            return since >= self.busy_period_s
        return self.reported_active > 0 or since >= idle_period_s

    def report(self, now: float, engine: object = None) -> EngineUsage:
        """The cumulative report; `engine`'s own cost counters join it when it models its cost."""
        self.observe(now, self.active)
        self.reported_at, self.reported_active = now, self.active
        usage = EngineUsage(self.busy_slot_s, self.slot_s, self.free_slot_s, now - self.started)
        if isinstance(engine, CostModelled):
            usage = replace(
                usage,
                model_busy_s=engine.elapsed_s,
                reprefill_s=engine.reprefill_s,
                stale_kv_tokens=engine.stale_kv_tokens,
            )
        return usage
