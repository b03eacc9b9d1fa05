"""Slot utilisation and bubble of the workers' engines, per batch and over the run: the broker's side.

Workers report cumulative slot integrals (`EngineUsage`); this module differences consecutive reports of
each worker and adds them to the figures of the batch being gathered:
  - slot_utilization = busy slot-seconds / slot-seconds over the rollout phases (sync/april: from the
    round opening, i.e. the previous batch's ack, to this batch being formed; async: all the time);
  - bubble_frac = engine-seconds with a free slot and nothing to run / engine-seconds, all the time;
  - for engines that model their cost (the sim engine), the model seconds in decode steps, of which
    re-prefilling resumed partials, and the tokens drawn attending to KV of older weights, all the time
    (the re-prefill share and stale-KV fraction of `april bench`'s measured figures).
Nothing counts before generation starts (the first lease) nor after the run's last step was trained, as
in the simulator, whose engines start at t = 0 with work and whose run ends with its last step. A report
covers the broker-time interval since the worker's previous report (the first one, and the first of a
restarted worker process, since its start); its in-phase share is the overlap of that interval with the
phases (rates assumed even inside one interval, which workers keep short: ~0.1 s while generating). The
same definitions as `broker.sim.figures` (virtual time there).
Knows nothing of sockets; times are passed in.
"""

from __future__ import annotations

from dataclasses import dataclass

from april.protocol import EngineUsage

MAX_PHASE_EDGES = 4096  # bound on remembered phase boundaries (reports are far more frequent)
ZERO = EngineUsage(0.0, 0.0, 0.0, 0.0)


@dataclass(slots=True)
class Integrals:
    """Slot integrals, seconds."""

    busy_phase_slot_s: float = 0.0  # busy slot-seconds inside rollout phases
    phase_slot_s: float = 0.0  # slot-seconds inside rollout phases
    free_engine_s: float = 0.0  # engine-seconds with a free slot, all time
    engine_s: float = 0.0  # engine-seconds, all time
    # engines that model their cost (the sim engine): model seconds in decode steps, of which re-prefill
    model_busy_s: float = 0.0
    reprefill_s: float = 0.0
    stale_kv_tokens: float = 0.0  # tokens drawn attending to KV of older weights (resume_kv reuse)

    def add(self, other: Integrals) -> None:
        self.busy_phase_slot_s += other.busy_phase_slot_s
        self.phase_slot_s += other.phase_slot_s
        self.free_engine_s += other.free_engine_s
        self.engine_s += other.engine_s
        self.model_busy_s += other.model_busy_s
        self.reprefill_s += other.reprefill_s
        self.stale_kv_tokens += other.stale_kv_tokens

    def stats(self) -> dict[str, float]:
        """Batch stats: the two ratios (NaN without data) and the integrals behind them."""
        nan = float("nan")
        return {
            "slot_utilization": self.busy_phase_slot_s / self.phase_slot_s if self.phase_slot_s > 0 else nan,
            "bubble_frac": self.free_engine_s / self.engine_s if self.engine_s > 0 else nan,
            "busy_phase_slot_s": self.busy_phase_slot_s,
            "phase_slot_s": self.phase_slot_s,
            "free_engine_s": self.free_engine_s,
            "engine_s": self.engine_s,
            "model_busy_s": self.model_busy_s,
            "reprefill_s": self.reprefill_s,
            "stale_kv_tokens": self.stale_kv_tokens,
        }


class SlotUsage:
    def __init__(self, now: float) -> None:
        self.edges: list[tuple[float, bool]] = [(now, False)]  # (time, in phase from then on)
        self.started: float | None = None  # generation started (the first lease): nothing counts before
        self.stopped = float("inf")  # the run's last step was trained: nothing counts after
        self.last: dict[str, tuple[float, EngineUsage]] = {}  # worker -> (received at, its report)
        self.window = Integrals()  # since the last batch was formed
        self.total = Integrals()  # the whole run

    @property
    def in_phase(self) -> bool:
        return self.edges[-1][1]

    def start(self, now: float) -> None:
        """Generation starts (the first lease): the run's first rollout phase opens."""
        if self.started is None:
            self.started = now
            self.set_phase(now, True)

    def stop(self, now: float) -> None:
        """The run's last step was trained: what workers do after it (until they are stopped) is not the
        run's (the simulator's run ends there too)."""
        if self.started is not None and self.stopped == float("inf"):
            self.set_phase(now, False)
            self.stopped = now

    def set_phase(self, now: float, in_phase: bool) -> None:
        if self.started is not None and self.stopped == float("inf") and in_phase != self.in_phase:
            self.edges.append((now, in_phase))
            if len(self.edges) > MAX_PHASE_EDGES:
                del self.edges[: len(self.edges) - MAX_PHASE_EDGES]

    def phase_share(self, start: float, end: float) -> float:
        """Share of [start, end] that was inside a rollout phase."""
        if end <= start:
            return 1.0 if self.in_phase else 0.0
        inside, t_next = 0.0, end
        for t, on in reversed(self.edges):  # newest first: reports cover the recent past
            if on:
                inside += max(0.0, min(t_next, end) - max(t, start))
            if t <= start:
                break
            t_next = t
        return inside / (end - start)

    def report(self, worker_id: str, usage: EngineUsage, now: float) -> None:
        """A worker's cumulative report: its increase since the previous one joins the window."""
        at, before = self.last.get(worker_id, (-1.0, ZERO))
        if at < 0 or usage.elapsed_s < before.elapsed_s:  # first report, or a restarted worker process
            at, before = now - usage.elapsed_s, ZERO
        self.last[worker_id] = (now, usage)
        busy = max(0.0, usage.busy_slot_s - before.busy_slot_s)
        slots = max(0.0, usage.slot_s - before.slot_s)
        if self.started is None:
            return
        share = self.phase_share(at, now)
        overlap = min(now, self.stopped) - max(at, self.started)
        running = (
            1.0 if at >= self.started and now <= self.stopped else max(0.0, overlap) / max(now - at, 1e-12)
        )
        delta = Integrals(
            busy_phase_slot_s=busy * share,
            phase_slot_s=slots * share,
            free_engine_s=max(0.0, usage.free_slot_s - before.free_slot_s) * running,
            engine_s=max(0.0, usage.elapsed_s - before.elapsed_s) * running,
            model_busy_s=max(0.0, usage.model_busy_s - before.model_busy_s) * running,
            reprefill_s=max(0.0, usage.reprefill_s - before.reprefill_s) * running,
            stale_kv_tokens=max(0, usage.stale_kv_tokens - before.stale_kv_tokens) * running,
        )
        self.window.add(delta)
        self.total.add(delta)

    def take_window(self) -> dict[str, float]:
        """The figures since the last batch (for this batch's stats); starts a new window."""
        stats = self.window.stats()
        self.window = Integrals()
        return stats
