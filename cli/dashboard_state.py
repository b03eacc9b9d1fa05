"""What the live dashboard knows: the state folded from the broker's published statuses.

Owns `DashboardState` (the last broker status, run-long `Series` for the sparklines, token-rate
`RateWindow`s, the event log, crash alerts and start-up errors), `apply_status` (folds one status into the
state and derives events from the difference with the previous one), `add_event` / `add_alert` /
`clear_alert` / `add_start_error`, and the
number formatters (`num`, `fmt`, `fmt_int`: a missing figure or NaN reads as a default or a dash, never
raises). Statuses arrive as typed records (`april.status`), already checked by the codec. It does not draw
anything (`cli/dashboard.py`) nor talk to sockets or run a loop (`cli/dashboard_feed.py`).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from april import protocol
from april.failures import NOTE_REASONS
from april.status import BrokerStatus

DASH = "\u2013"  # en dash: a figure the feed lacks
RATE_WINDOW_S = 5.0  # tokens/s over the last few seconds of broker time


@dataclass(frozen=True, slots=True)
class Event:
    t: float  # wall-clock seconds
    text: str
    style: str = ""


@dataclass(slots=True)
class Series:
    """A run-long series at bounded memory: past `capacity` points, neighbours are averaged in pairs."""

    capacity: int = 256
    values: list[float] = field(default_factory=list)
    stride: int = 1  # raw points per stored point
    pending: list[float] = field(default_factory=list)

    def add(self, value: float) -> None:
        if not math.isfinite(value):
            return
        self.pending.append(value)
        if len(self.pending) >= self.stride:
            self.values.append(sum(self.pending) / len(self.pending))
            self.pending.clear()
        if len(self.values) >= self.capacity and len(self.values) % 2 == 0:
            pairs = zip(self.values[0::2], self.values[1::2], strict=True)
            self.values = [(a + b) / 2 for a, b in pairs]
            self.stride *= 2

    def last(self) -> float | None:
        return self.values[-1] if self.values else None


@dataclass(slots=True)
class RateWindow:
    """A counter's rate of change over the last `window_s` seconds (a restarted counter starts over)."""

    window_s: float = RATE_WINDOW_S
    points: deque[tuple[float, float]] = field(default_factory=deque)

    def add(self, t: float, value: float) -> None:
        if self.points and (t < self.points[-1][0] or value < self.points[-1][1]):
            self.points.clear()
        self.points.append((t, value))
        while len(self.points) > 2 and t - self.points[1][0] >= self.window_s:
            self.points.popleft()

    def rate(self) -> float | None:
        if len(self.points) < 2 or self.points[-1][0] <= self.points[0][0]:
            return None
        (t0, v0), (t1, v1) = self.points[0], self.points[-1]
        return (v1 - v0) / (t1 - t0)


@dataclass(slots=True)
class DashboardState:
    source: str = ""  # where the statuses come from (the PUB address), shown in the header
    status: BrokerStatus | None = None  # the newest broker status
    received_at: float | None = None  # wall-clock time it arrived
    statuses: int = 0
    reward: Series = field(default_factory=Series)  # one point per learner step
    accuracy: Series = field(default_factory=Series)
    throughput: Series = field(default_factory=Series)  # generated tokens/s, one point per status
    tokens: RateWindow = field(default_factory=RateWindow)
    worker_tokens: dict[str, RateWindow] = field(default_factory=dict)
    last_step: int | None = None  # the learner's last step seen (status.step_figures.step)
    step_base: tuple[int, int] = (0, 0)  # totals (aborted, resumed) when the current step began
    events: deque[Event] = field(default_factory=lambda: deque(maxlen=200))
    events_total: int = 0  # events ever added (a headless printer prints those past its own count)
    alerts: dict[str, list[str]] = field(default_factory=dict)  # role -> tail of its log
    # children not restarted because a restart would fail alike: their one error line -> the children
    start_errors: dict[str, list[str]] = field(default_factory=dict)
    event_rows: int = 8  # events shown when the console height is unknown
    worker_rows: int = 16


# ---------------------------------------------------------------------------------------------------
# updating


def add_event(state: DashboardState, now: float, text: str, style: str = "") -> None:
    state.events.append(Event(now, text, style))
    state.events_total += 1


def add_alert(state: DashboardState, role: str, tail_lines: Iterable[str], keep: int = 12) -> None:
    """Show a red panel for `role` (a crashed child) with the last `keep` lines of its log."""
    state.alerts[role] = [line.rstrip("\n") for line in tail_lines][-keep:]


def clear_alert(state: DashboardState, role: str) -> None:
    state.alerts.pop(role, None)


def add_start_error(state: DashboardState, role: str, line: str) -> None:
    """`role` exited with an error a restart would meet again, saying `line` (several workers of one
    config fail alike: the line is shown once, with every child that said it)."""
    state.start_errors.setdefault(line, []).append(role)


def apply_status(state: DashboardState, status: BrokerStatus, now: float) -> None:
    """Fold one published status into the state: series, token rates, and events derived from the diff."""
    prev = state.status
    if prev is None:
        add_event(
            state,
            now,
            f"attached to {state.source or 'the broker'}: run {status.run}, mode {status.mode}, "
            f"v{status.version}, {len(status.workers)} workers",
            "bold",
        )
        _error_events(state, None, status, now)
    elif status.uptime_s < prev.uptime_s:
        add_event(state, now, "broker restarted", "bold yellow")
        state.worker_tokens.clear()
    else:
        _diff_events(state, prev, status, now)
    if prev is None or status.version != prev.version:
        state.step_base = (status.totals.aborted, status.totals.resumed)
    _update_rates(state, status)
    figures = status.step_figures
    if figures.step is not None and figures.step != state.last_step:
        state.last_step = figures.step
        state.reward.add(figures.reward_mean)
        state.accuracy.add(figures.accuracy)
    state.status, state.received_at = status, now
    state.statuses += 1


def _update_rates(state: DashboardState, status: BrokerStatus) -> None:
    t = status.uptime_s
    if not math.isfinite(t):
        return
    state.tokens.add(t, status.totals.tokens_generated)
    rate = state.tokens.rate()
    if rate is not None:
        state.throughput.add(rate)
    for w in status.workers:
        state.worker_tokens.setdefault(w.id, RateWindow()).add(t, w.tokens_generated)
    for wid in set(state.worker_tokens) - {w.id for w in status.workers}:
        del state.worker_tokens[wid]


def _diff_events(state: DashboardState, prev: BrokerStatus, new: BrokerStatus, now: float) -> None:
    for text, style in _worker_events(prev, new):
        add_event(state, now, text, style)
    old_learner, learner = prev.learner, new.learner
    if learner is not None and (old_learner is None or learner.id != old_learner.id):
        add_event(state, now, f"learner {learner.id} connected", "green")
    elif learner is None and old_learner is not None:
        add_event(state, now, f"learner {old_learner.id} disconnected", "red")
    if new.mode != prev.mode:
        add_event(state, now, f"mode {prev.mode} → {new.mode}", "bold")
    abort = _abort_event(prev, new)
    if abort:
        add_event(state, now, abort, "yellow")
    restarted = new.totals.restarted - prev.totals.restarted
    if restarted > 0:
        tokens = new.totals.tokens_restarted - prev.totals.tokens_restarted
        add_event(
            state,
            now,
            f"{restarted} pinned partials restarted from their prompt (their worker's memory was lost: "
            f"{tokens} tokens dropped)",
            "yellow",
        )
    if new.version > prev.version:
        m = new.step_figures
        figures = f"reward {fmt(m.reward_mean)}, loss {fmt(m.loss, '.4g')}"
        after = f" (step {fmt_int(m.step)}: {figures})" if new.learner_metrics else ""
        jump = new.version - prev.version
        versions = f"v{new.version}" + (f" ({jump} versions)" if jump > 1 else "")
        add_event(state, now, f"weights {versions} published{after}", "cyan")
    if prev.ledger_balanced and not new.ledger_balanced:
        add_event(state, now, "ledger NOT balanced", "bold red")
    rejected = new.rejected.total
    if rejected > prev.rejected.total:
        add_event(state, now, f"{rejected} messages rejected so far (see `april status`)", "yellow")
    _error_events(state, prev, new, now)


def _error_events(state: DashboardState, prev: BrokerStatus | None, new: BrokerStatus, now: float) -> None:
    """An event for each sample error line the broker kept since `prev` (the first line of each distinct
    error; the broker keeps a new one of a reason at most every few seconds), and for a stopped run."""
    seen = set() if prev is None else {line.text for line in prev.error_lines}
    for line in new.error_lines:
        if line.text not in seen:
            add_event(state, now, line.text, "yellow" if line.reason in NOTE_REASONS else "red")
    if new.stopped and (prev is None or not prev.stopped):
        add_event(state, now, new.stopped, "bold red")


def _abort_event(prev: BrokerStatus, new: BrokerStatus) -> str:
    """One line for the abort rounds begun or confirmed since `prev` (several may fit in one second)."""
    first, last = prev.round.id + 1, new.round.id
    confirmed = new.round.aborts_done > prev.round.aborts_done
    if last < first and not confirmed:
        return ""
    label = f"abort round {last}" if last <= first else f"abort rounds {first}-{last}"
    if new.round.aborting:
        return f"{label} started: interrupting {new.leased_samples} leased samples"
    interrupted = new.totals.aborted - prev.totals.aborted
    return f"{label} done: {interrupted} samples interrupted, {new.partial_buffer} now partial"


def _worker_events(prev: BrokerStatus, new: BrokerStatus) -> Iterator[tuple[str, str]]:
    before = {w.id: w for w in prev.workers}
    after = {w.id: w for w in new.workers}
    for wid, w in after.items():
        old = before.get(wid)
        if old is None:
            where = f"{w.host or DASH} pid {w.pid}"
            yield f"worker {wid} joined ({w.engine}, {w.slots} slots, {where})", "green"
        elif old.pid and w.pid and old.pid != w.pid:
            yield f"worker {wid} restarted (pid {old.pid} → {w.pid})", "yellow"
        elif old.alive and not w.alive:
            yield f"worker {wid} died: silent for {w.last_seen_s:.1f}s", "bold red"
        elif not old.alive and w.alive:
            yield f"worker {wid} is back", "green"
        if w.engine_detail == protocol.ENGINE_STARTING:
            continue  # a worker's engine being built is not news, nor is its coming up
        was_ok = old is None or old.engine_ok or old.engine_detail == protocol.ENGINE_STARTING
        if was_ok and not w.engine_ok:
            yield f"worker {wid}: engine down: {w.engine_detail or 'no reason given'}", "bold red"
        elif not was_ok and w.engine_ok:
            yield f"worker {wid}: engine back", "green"
    for wid in before.keys() - after.keys():
        yield f"worker {wid} left", "red"


# ---------------------------------------------------------------------------------------------------
# formatting figures


def num(value: float | None, default: float = math.nan) -> float:
    """`value` as a float if it is a number (not a bool), else `default`."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return default
    return float(value)


def fmt(value: float | None, spec: str = ".3f") -> str:
    """A number formatted with `spec` (a "d" spec truncates to an int); missing or NaN -> DASH."""
    x = num(value)
    if not math.isfinite(x):
        return DASH
    return format(int(x), spec) if spec.endswith("d") else format(x, spec)


def fmt_int(value: float | None) -> str:
    """A number as an integer; missing or NaN -> DASH."""
    return fmt(value, "d")
