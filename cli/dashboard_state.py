"""What the live dashboard knows: the state folded from the broker's published statuses.

Owns `DashboardState` (the last broker status, run-long `Series` for the sparklines, token-rate
`RateWindow`s, the event log and crash alerts), `apply_status` (folds one status into the state and derives
events from the difference with the previous one), `add_event` / `add_alert` / `clear_alert`, and the
tolerant readers of a status dict (`num`, `as_dict`, `workers_of`, `fmt`, `fmt_int`: a missing key or NaN
reads as a default or a dash, never raises). It does not draw anything (`cli/dashboard.py`) nor talk to
sockets or run a loop (`cli/dashboard_feed.py`).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

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
    status: dict[str, Any] | None = None  # the newest broker status (broker/status.py)
    received_at: float | None = None  # wall-clock time it arrived
    statuses: int = 0
    reward: Series = field(default_factory=Series)  # one point per learner step
    accuracy: Series = field(default_factory=Series)
    throughput: Series = field(default_factory=Series)  # generated tokens/s, one point per status
    tokens: RateWindow = field(default_factory=RateWindow)
    worker_tokens: dict[str, RateWindow] = field(default_factory=dict)
    last_step: int | None = None  # learner_metrics["step"] last seen
    step_base: tuple[int, int] = (0, 0)  # totals (aborted, resumed) when the current step began
    events: deque[Event] = field(default_factory=lambda: deque(maxlen=200))
    events_total: int = 0  # events ever added (a headless printer prints those past its own count)
    alerts: dict[str, list[str]] = field(default_factory=dict)  # role -> tail of its log
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


def apply_status(state: DashboardState, status: dict[str, Any], now: float) -> None:
    """Fold one published status into the state: series, token rates, and events derived from the diff."""
    prev = state.status
    if prev is None:
        add_event(
            state,
            now,
            f"attached to {state.source or 'the broker'}: run {status.get('run', DASH)}, "
            f"mode {status.get('mode', DASH)}, v{status.get('version', DASH)}, "
            f"{len(workers_of(status))} workers",
            "bold",
        )
    elif num(status.get("uptime_s"), 0.0) < num(prev.get("uptime_s"), 0.0):
        add_event(state, now, "broker restarted", "bold yellow")
        state.worker_tokens.clear()
    else:
        _diff_events(state, prev, status, now)
    totals = as_dict(status.get("totals"))
    if prev is None or status.get("version") != prev.get("version"):
        state.step_base = (int(num(totals.get("aborted"), 0)), int(num(totals.get("resumed"), 0)))
    _update_rates(state, status)
    metrics = as_dict(status.get("learner_metrics"))
    step = metrics.get("step")
    if isinstance(step, int | float) and math.isfinite(step) and int(step) != state.last_step:
        state.last_step = int(step)
        state.reward.add(num(metrics.get("reward_mean")))
        state.accuracy.add(num(metrics.get("accuracy")))
    state.status, state.received_at = status, now
    state.statuses += 1


def _update_rates(state: DashboardState, status: Mapping[str, Any]) -> None:
    t = num(status.get("uptime_s"))
    if not math.isfinite(t):
        return
    state.tokens.add(t, num(as_dict(status.get("totals")).get("tokens_generated"), 0.0))
    rate = state.tokens.rate()
    if rate is not None:
        state.throughput.add(rate)
    seen = set()
    for w in workers_of(status):
        wid = str(w.get("id", "?"))
        seen.add(wid)
        state.worker_tokens.setdefault(wid, RateWindow()).add(t, num(w.get("tokens_generated"), 0.0))
    for wid in set(state.worker_tokens) - seen:
        del state.worker_tokens[wid]


def _diff_events(state: DashboardState, prev: Mapping[str, Any], new: Mapping[str, Any], now: float) -> None:
    for text, style in _worker_events(prev, new):
        add_event(state, now, text, style)
    old_learner, learner = as_dict(prev.get("learner")), as_dict(new.get("learner"))
    if learner.get("id") != old_learner.get("id"):
        if learner:
            add_event(state, now, f"learner {learner.get('id')} connected", "green")
        else:
            add_event(state, now, f"learner {old_learner.get('id')} disconnected", "red")
    if new.get("mode") != prev.get("mode"):
        add_event(state, now, f"mode {prev.get('mode')} → {new.get('mode')}", "bold")
    abort = _abort_event(prev, new)
    if abort:
        add_event(state, now, abort, "yellow")
    if num(new.get("version"), 0) > num(prev.get("version"), 0):
        m = as_dict(new.get("learner_metrics"))
        figures = f"reward {fmt(m.get('reward_mean'))}, loss {fmt(m.get('loss'), '.4g')}"
        after = f" (step {fmt_int(m.get('step'))}: {figures})" if m else ""
        jump = int(num(new.get("version"), 0) - num(prev.get("version"), 0))
        versions = f"v{fmt_int(new.get('version'))}" + (f" ({jump} versions)" if jump > 1 else "")
        add_event(state, now, f"weights {versions} published{after}", "cyan")
    if prev.get("ledger_balanced", True) and not new.get("ledger_balanced", True):
        add_event(state, now, "ledger NOT balanced", "bold red")
    rejected = num(as_dict(new.get("rejected")).get("total"), 0)
    if rejected > num(as_dict(prev.get("rejected")).get("total"), 0):
        add_event(state, now, f"{rejected:.0f} messages rejected so far (see `april status`)", "yellow")


def _abort_event(prev: Mapping[str, Any], new: Mapping[str, Any]) -> str:
    """One line for the abort rounds begun or confirmed since `prev` (several may fit in one second)."""
    old, rnd = as_dict(prev.get("round")), as_dict(new.get("round"))
    first, last = int(num(old.get("id"), 0)) + 1, int(num(rnd.get("id"), 0))
    confirmed = num(rnd.get("aborts_done"), 0) > num(old.get("aborts_done"), 0)
    if last < first and not confirmed:
        return ""
    label = f"abort round {last}" if last <= first else f"abort rounds {first}-{last}"
    if rnd.get("aborting"):
        return f"{label} started: interrupting {fmt_int(new.get('leased_samples'))} leased samples"
    interrupted = num(as_dict(new.get("totals")).get("aborted")) - num(
        as_dict(prev.get("totals")).get("aborted")
    )
    partial = fmt_int(new.get("partial_buffer"))
    return f"{label} done: {fmt_int(interrupted)} samples interrupted, {partial} now partial"


def _worker_events(prev: Mapping[str, Any], new: Mapping[str, Any]) -> Iterator[tuple[str, str]]:
    before = {str(w.get("id")): w for w in workers_of(prev)}
    after = {str(w.get("id")): w for w in workers_of(new)}
    for wid, w in after.items():
        old = before.get(wid)
        if old is None:
            where = f"{w.get('host', DASH)} pid {w.get('pid', DASH)}"
            yield (
                f"worker {wid} joined ({w.get('engine', DASH)}, {w.get('slots', DASH)} slots, {where})",
                "green",
            )
        elif old.get("pid") and w.get("pid") and old.get("pid") != w.get("pid"):
            yield f"worker {wid} restarted (pid {old.get('pid')} → {w.get('pid')})", "yellow"
        elif old.get("alive", True) and not w.get("alive", True):
            yield f"worker {wid} died: silent for {num(w.get('last_seen_s'), 0):.1f}s", "bold red"
        elif not old.get("alive", True) and w.get("alive", True):
            yield f"worker {wid} is back", "green"
    for wid in before.keys() - after.keys():
        yield f"worker {wid} left", "red"


# ---------------------------------------------------------------------------------------------------
# reading a status


def num(value: Any, default: float = math.nan) -> float:
    """`value` as a float if it is a number (not a bool), else `default`."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return default
    return float(value)


def as_dict(value: Any) -> dict[str, Any]:
    """`value` if it is a dict, else an empty one."""
    return value if isinstance(value, dict) else {}


def workers_of(status: Mapping[str, Any]) -> list[dict[str, Any]]:
    """The status's worker entries that are dicts (none if `workers` is missing or not a list)."""
    workers = status.get("workers")
    return [w for w in workers if isinstance(w, dict)] if isinstance(workers, list) else []


def fmt(value: Any, spec: str = ".3f") -> str:
    """A number formatted with `spec` (a "d" spec truncates to an int); missing or NaN -> DASH."""
    x = num(value)
    if not math.isfinite(x):
        return DASH
    return format(int(x), spec) if spec.endswith("d") else format(x, spec)


def fmt_int(value: Any) -> str:
    """A number as an integer; missing or NaN -> DASH."""
    return fmt(value, "d")
