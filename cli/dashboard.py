"""The live dashboard's state and its rendering: what `april up` and `april status --watch` show.

Owns `DashboardState` (the last broker status, run-long series for the sparklines, token-rate windows,
the event log and crash alerts), `apply_status` (folds one published status into the state and derives
events from the difference with the previous one) and `render(state, now)`, a pure function of the state
(tested against a fixed-width capture console). It does not talk to sockets or run a loop: that is
`cli/dashboard_feed.py`. Figures the feed lacks (missing keys, NaN) render as a dash, never raise.
"""

from __future__ import annotations

import io
import math
import time
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.markup import escape
from rich.panel import Panel
from rich.segment import Segment
from rich.table import Table
from rich.text import Text

DASH = "\u2013"  # en dash: a figure the feed lacks
SPARK_CHARS = "▁▂▃▄▅▆▇█"
WIDE = 110  # columns from which the header takes a line less and the workers table shows hosts
STALE_S = 3.0  # the broker publishes every second: silence past this is shown in the header
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
            f"{len(_workers(status))} workers",
            "bold",
        )
    elif _num(status.get("uptime_s"), 0.0) < _num(prev.get("uptime_s"), 0.0):
        add_event(state, now, "broker restarted", "bold yellow")
        state.worker_tokens.clear()
    else:
        _diff_events(state, prev, status, now)
    totals = _dict(status.get("totals"))
    if prev is None or status.get("version") != prev.get("version"):
        state.step_base = (int(_num(totals.get("aborted"), 0)), int(_num(totals.get("resumed"), 0)))
    _update_rates(state, status)
    metrics = _dict(status.get("learner_metrics"))
    step = metrics.get("step")
    if isinstance(step, int | float) and math.isfinite(step) and int(step) != state.last_step:
        state.last_step = int(step)
        state.reward.add(_num(metrics.get("reward_mean")))
        state.accuracy.add(_num(metrics.get("accuracy")))
    state.status, state.received_at = status, now
    state.statuses += 1


def _update_rates(state: DashboardState, status: Mapping[str, Any]) -> None:
    t = _num(status.get("uptime_s"))
    if not math.isfinite(t):
        return
    state.tokens.add(t, _num(_dict(status.get("totals")).get("tokens_generated"), 0.0))
    rate = state.tokens.rate()
    if rate is not None:
        state.throughput.add(rate)
    seen = set()
    for w in _workers(status):
        wid = str(w.get("id", "?"))
        seen.add(wid)
        state.worker_tokens.setdefault(wid, RateWindow()).add(t, _num(w.get("tokens_generated"), 0.0))
    for wid in set(state.worker_tokens) - seen:
        del state.worker_tokens[wid]


def _diff_events(state: DashboardState, prev: Mapping[str, Any], new: Mapping[str, Any], now: float) -> None:
    for text, style in _worker_events(prev, new):
        add_event(state, now, text, style)
    old_learner, learner = _dict(prev.get("learner")), _dict(new.get("learner"))
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
    if _num(new.get("version"), 0) > _num(prev.get("version"), 0):
        m = _dict(new.get("learner_metrics"))
        figures = f"reward {_fmt(m.get('reward_mean'))}, loss {_fmt(m.get('loss'), '.4g')}"
        after = f" (step {_i(m.get('step'))}: {figures})" if m else ""
        jump = int(_num(new.get("version"), 0) - _num(prev.get("version"), 0))
        versions = f"v{_i(new.get('version'))}" + (f" ({jump} versions)" if jump > 1 else "")
        add_event(state, now, f"weights {versions} published{after}", "cyan")
    if prev.get("ledger_balanced", True) and not new.get("ledger_balanced", True):
        add_event(state, now, "ledger NOT balanced", "bold red")
    rejected = _num(_dict(new.get("rejected")).get("total"), 0)
    if rejected > _num(_dict(prev.get("rejected")).get("total"), 0):
        add_event(state, now, f"{rejected:.0f} messages rejected so far (see `april status`)", "yellow")


def _abort_event(prev: Mapping[str, Any], new: Mapping[str, Any]) -> str:
    """One line for the abort rounds begun or confirmed since `prev` (several may fit in one second)."""
    old, rnd = _dict(prev.get("round")), _dict(new.get("round"))
    first, last = int(_num(old.get("id"), 0)) + 1, int(_num(rnd.get("id"), 0))
    confirmed = _num(rnd.get("aborts_done"), 0) > _num(old.get("aborts_done"), 0)
    if last < first and not confirmed:
        return ""
    label = f"abort round {last}" if last <= first else f"abort rounds {first}-{last}"
    if rnd.get("aborting"):
        return f"{label} started: interrupting {_i(new.get('leased_samples'))} leased samples"
    interrupted = _num(_dict(new.get("totals")).get("aborted")) - _num(
        _dict(prev.get("totals")).get("aborted")
    )
    return f"{label} done: {_i(interrupted)} samples interrupted, {_i(new.get('partial_buffer'))} now partial"


def _worker_events(prev: Mapping[str, Any], new: Mapping[str, Any]) -> Iterator[tuple[str, str]]:
    before = {str(w.get("id")): w for w in _workers(prev)}
    after = {str(w.get("id")): w for w in _workers(new)}
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
            yield f"worker {wid} died: silent for {_num(w.get('last_seen_s'), 0):.1f}s", "bold red"
        elif not old.get("alive", True) and w.get("alive", True):
            yield f"worker {wid} is back", "green"
    for wid in before.keys() - after.keys():
        yield f"worker {wid} left", "red"


# ---------------------------------------------------------------------------------------------------
# formatting


def _num(value: Any, default: float = math.nan) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return default
    return float(value)


def _dict(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _workers(status: Mapping[str, Any]) -> list[dict[str, Any]]:
    workers = status.get("workers")
    return [w for w in workers if isinstance(w, dict)] if isinstance(workers, list) else []


def metric(metrics: Mapping[str, Any], name: str) -> Any:
    """A learner figure under its flat name or namespaced as in metrics.jsonl (`learner/clip_frac`)."""
    return metrics.get(name, metrics.get(f"learner/{name}"))


def _fmt(value: Any, spec: str = ".3f") -> str:
    x = _num(value)
    if not math.isfinite(x):
        return DASH
    return format(int(x), spec) if spec.endswith("d") else format(x, spec)


def _i(value: Any) -> str:
    return _fmt(value, "d")


def si(value: Any) -> str:
    """1234 -> "1.2k"; missing or NaN -> DASH."""
    x = _num(value)
    if not math.isfinite(x):
        return DASH
    for unit, scale in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= scale:
            return f"{x / scale:.1f}{unit}"
    return f"{x:.0f}" if abs(x) >= 10 else f"{x:.1f}"


def duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return DASH
    s = int(max(0.0, seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60:02d}:{s % 60:02d}"


def sparkline(values: list[float], width: int) -> str:
    """`values` as one line of ▁..█ at most `width` wide (averaged into buckets when longer)."""
    if not values or width <= 0:
        return ""
    if len(values) > width:
        n = len(values)
        values = [
            sum(values[i * n // width : (i + 1) * n // width]) / ((i + 1) * n // width - i * n // width)
            for i in range(width)
        ]
    low, high = min(values), max(values)
    if high - low < 1e-12:
        return SPARK_CHARS[3] * len(values)
    top = len(SPARK_CHARS) - 1
    return "".join(SPARK_CHARS[round((v - low) / (high - low) * top)] for v in values)


def bar(fraction: float, width: int) -> str:
    full = round(max(0.0, min(1.0, fraction)) * width) if math.isfinite(fraction) else 0
    return "█" * full + "░" * (width - full)


# ---------------------------------------------------------------------------------------------------
# rendering


def render(state: DashboardState, now: float, height: int | None = None) -> RenderableType:
    """The whole dashboard (pure). From 110 columns the header takes one line less and the workers table
    shows hosts. Given a `height` (the full screen's), the event log takes the lines the rest leaves;
    otherwise it shows the last `state.event_rows` events."""
    return _View(state, now, height)


class _View:
    def __init__(self, state: DashboardState, now: float, height: int | None) -> None:
        self.state, self.now, self.height = state, now, height

    def __rich_console__(self, console: Console, options: ConsoleOptions) -> RenderResult:
        state, wide, status = self.state, options.max_width >= WIDE, self.state.status or {}
        parts: list[RenderableType] = [_header(state, status, self.now, wide)]
        parts += [_alert(role, tail) for role, tail in state.alerts.items()]
        if state.status is not None:
            parts.append(_workers_panel(state, status, wide))
            parts.append(_side_by_side(_rollout_panel(state, status), _learner_panel(status, wide)))
            parts.append(_trends_panel(state, options.max_width - 24))
        if self.height is None:
            yield Group(*parts, _events_panel(state, state.event_rows))
            return
        lines = console.render_lines(Group(*parts), options.update(height=None), pad=False)
        for line in lines:
            yield from line
            yield Segment.line()
        yield _events_panel(state, max(3, self.height - len(lines) - 2), fill=True)


def _side_by_side(left: RenderableType, right: RenderableType) -> Table:
    grid = Table.grid(expand=True)
    grid.add_column(ratio=1)
    grid.add_column(ratio=1)
    grid.add_row(left, right)
    return grid


def _panel(body: RenderableType, title: str, style: str = "", subtitle: str | None = None) -> Panel:
    return Panel(
        body, title=title, title_align="left", border_style=style, subtitle=subtitle, subtitle_align="right"
    )


def _pairs(rows: Iterable[tuple[str, str | Text | Table]]) -> Table:
    """A label column and a value column; str values are rich markup."""
    grid = Table.grid(padding=(0, 1))
    grid.add_column(style="dim", no_wrap=True)
    grid.add_column()
    for label, value in rows:
        grid.add_row(label, Text.from_markup(value) if isinstance(value, str) else value)
    return grid


def _header(state: DashboardState, status: Mapping[str, Any], now: float, wide: bool) -> Panel:
    source = escape(state.source) or None
    if state.status is None or state.received_at is None:
        waiting = Text(f"waiting for the first status from {state.source or 'the broker'}...", "yellow")
        return _panel(waiting, "april", subtitle=source)
    m = _dict(status.get("learner_metrics"))
    step, steps = _num(m.get("step")), _num(status.get("steps"))
    done = int(step) + 1 if math.isfinite(step) else int(_num(status.get("version"), 0))
    progress = f" [green]{bar(done / steps if steps > 0 else math.nan, 12)}[/]" if wide else ""
    silent = now - state.received_at
    elapsed = _num(status.get("uptime_s")) + min(max(0.0, silent), STALE_S)
    workers = _workers(status)
    alive = sum(1 for w in workers if w.get("alive", True))
    word, style = _learner_word(_dict(status.get("learner")))
    lines = [
        f"[dim]run[/] [bold]{escape(str(status.get('run', DASH)))}[/]  [dim]mode[/] "
        f"[bold magenta]{escape(str(status.get('mode', DASH)))}[/]  [dim]step[/] [bold]{done}/{_i(steps)}[/]"
        f"{progress}  [dim]policy[/] [bold cyan]v{_i(status.get('version'))}[/]  [dim]elapsed[/] "
        f"[bold]{duration(elapsed)}[/]",
        f"[dim]throughput[/] [bold]{si(state.tokens.rate())} tok/s[/] generated · "
        f"[bold]{_fmt(m.get('samples_per_s'), '.2f')} samples/s[/] trained",
        f"[dim]workers[/] [{'bold' if alive == len(workers) else 'bold red'}]{alive}/{len(workers)} alive[/]"
        "  "
        f"[dim]learner[/] [{style}]{word}[/]",
    ]
    if wide:
        lines[1:] = [f"{lines[1]}  {lines[2]}"]
    if silent > STALE_S:
        lines.append(f"[bold red]no status for {silent:.0f}s: is the broker running?[/]")
    return _panel(Text.from_markup("\n".join(lines)), "april", subtitle=source)


def _learner_word(learner: Mapping[str, Any]) -> tuple[str, str]:
    if not learner:
        return "not connected", "bold red"
    return ("waiting for a batch", "yellow") if learner.get("waiting_for_batch") else ("training", "green")


def _alert(role: str, tail: list[str]) -> Panel:
    body = Text("\n".join(tail) or "(empty log)", overflow="ellipsis", no_wrap=True)
    return _panel(body, f"{escape(role)} crashed: last lines of its log", "red")


def _workers_panel(state: DashboardState, status: Mapping[str, Any], wide: bool) -> Panel:
    table = Table(box=None, padding=(0, 1), expand=True, header_style="dim")
    table.add_column("worker", overflow="ellipsis", no_wrap=True, ratio=1)
    names = ("engine", "host", "pid", "busy", "tok/s", "ver", "seen", "state")
    for name in names if wide else [n for n in names if n not in ("host", "pid")]:
        left = name in ("engine", "host", "busy", "state")
        table.add_column(name, no_wrap=True, justify="left" if left else "right", overflow="ellipsis")
    workers = sorted(_workers(status), key=lambda w: str(w.get("id")))
    for w in workers[: state.worker_rows]:
        slots, busy, loaded = _num(w.get("slots"), 0), _num(w.get("leases"), 0), _num(w.get("version"))
        window = state.worker_tokens.get(str(w.get("id")))
        where: list[RenderableType] = [Text(str(w.get("host") or DASH)), _i(w.get("pid"))] if wide else []
        table.add_row(
            Text(str(w.get("id", "?"))),  # Text, not markup: names come from the peers
            Text(str(w.get("engine", DASH))),
            *where,
            f"{busy:.0f}/{slots:.0f} {bar(busy / slots if slots else 0.0, 10 if wide else 5)}",
            si(window.rate() if window else None),
            Text(f"v{_i(loaded)}", "yellow" if loaded < _num(status.get("version"), 0) else ""),
            f"{_fmt(w.get('last_seen_s'), '.1f')}s",
            _worker_state(w),
        )
    if len(workers) > state.worker_rows:
        table.add_row(f"... {len(workers) - state.worker_rows} more")
    if not workers:
        table.add_row(Text("no workers connected", "yellow"))
    return _panel(table, "workers")


def _worker_state(w: Mapping[str, Any]) -> Text:
    if not w.get("alive", True):
        return Text("dead", "bold red")
    return Text("restored", "yellow") if w.get("restored") else Text("up", "green")


def _rollout_panel(state: DashboardState, status: Mapping[str, Any]) -> Panel:
    m, s = _dict(status.get("learner_metrics")), status
    stale = f"mean {_fmt(metric(m, 'staleness_mean'), '.2f')} · max {_i(metric(m, 'staleness_max'))}"
    rows: list[tuple[str, str | Text | Table]] = [
        ("in flight", f"{_i(s.get('in_flight_groups'))} groups · {_i(s.get('leased_samples'))} leased"),
        ("queued", f"{_i(s.get('queued_samples'))} samples"),
        ("partial", f"{_i(s.get('partial_buffer'))} samples · {_i(s.get('partial_groups'))} groups"),
        ("complete", f"{_i(s.get('complete_groups'))} groups waiting"),
        *_abort_rows(state, status),
        ("off-policy", f"{_pct(metric(m, 'offpolicy_token_frac'))} of tokens"),
        ("staleness", stale),
        ("buffer age", _histogram(_dict(s.get("partial_staleness")))),
        ("ledger", _ledger(s)),
    ]
    if _dict(s.get("round")).get("aborting"):
        rows.append(("round", f"[bold yellow]abort round {_i(_dict(s.get('round')).get('id'))} running[/]"))
    return _panel(_pairs(rows), "rollouts")


def _abort_rows(state: DashboardState, status: Mapping[str, Any]) -> list[tuple[str, str | Text | Table]]:
    """Samples aborted and resumed: in the step under way, in the last trained batch, over the run."""
    m, totals = _dict(status.get("learner_metrics")), _dict(status.get("totals"))
    rows: list[tuple[str, str | Text | Table]] = [("", _cells(["this step", "last", "run"], "dim"))]
    for key, base in zip(("aborted", "resumed"), state.step_base, strict=True):
        total = _num(totals.get(key))
        rows.append((key, _cells([_i(total - base), _i(m.get(key)), _i(total)])))
    return rows


def _cells(values: list[str], style: str = "") -> Table:
    """Right-aligned cells of fixed widths, so that consecutive rows line up as columns."""
    grid = Table.grid(padding=(0, 1))
    for width in (9, 6, 7):
        grid.add_column(width=width, justify="right", no_wrap=True, style=style)
    grid.add_row(*values)
    return grid


def _pct(value: Any) -> str:
    x = _num(value)
    return f"{100 * x:.1f}%" if math.isfinite(x) else DASH


def _histogram(counts: Mapping[str, Any], width: int = 12, rows: int = 6) -> Text:
    """Partial samples by staleness (policy versions behind): one bar per level, the tail merged."""
    levels = sorted((int(k), int(_num(v, 0))) for k, v in counts.items() if str(k).isdigit())
    if not levels:
        return Text("(partial buffer empty)", "dim")
    merged = len(levels) > rows
    if merged:
        levels = [*levels[: rows - 1], (levels[rows - 1][0], sum(n for _, n in levels[rows - 1 :]))]
    top = max(n for _, n in levels) or 1
    lines = []
    for i, (k, n) in enumerate(levels):
        label = f">={k}" if merged and i == rows - 1 else str(k)
        lines.append(Text.assemble((f"{label:>3} ", "dim"), (bar(n / top, width), "magenta"), f" {n}"))
    return Text("\n").join(lines)


def _ledger(status: Mapping[str, Any]) -> str:
    ledger = _dict(status.get("ledger"))
    dropped = sum(int(_num(v, 0)) for v in _dict(ledger.get("dropped")).values())
    rejected = int(_num(_dict(status.get("rejected")).get("total"), 0))
    ok = status.get("ledger_balanced", True)
    return (
        ("[green]balanced[/]" if ok else "[bold red]NOT BALANCED[/]")
        + f" · issued {_i(ledger.get('issued'))} · trained {_i(ledger.get('trained'))}"
        + (f" · dropped {dropped}" if dropped else "")
        + (f" · [yellow]{rejected} rejected[/]" if rejected else "")
    )


def _learner_panel(status: Mapping[str, Any], wide: bool) -> Panel:
    m, learner = _dict(status.get("learner_metrics")), _dict(status.get("learner"))
    word, style = _learner_word(learner)
    seen = f" · {_fmt(learner.get('last_seen_s'), '.1f')}s ago" if learner else ""
    evaluated = f" · eval {_fmt(m.get('eval_accuracy'))}" if "eval_accuracy" in m else ""
    rows: list[tuple[str, str | Text | Table]] = [
        ("learner", f"[{style}]{word}[/]{seen}"),
        ("last step", f"{_i(m.get('step'))} -> v{_i(m.get('version'))}"),
        ("loss", _fmt(m.get("loss"), ".4g")),
        ("reward", _fmt(m.get("reward_mean"))),
        ("accuracy", _fmt(m.get("accuracy")) + evaluated),
        ("clip frac", _fmt(metric(m, "clip_frac"))),
        ("approx KL", _fmt(metric(m, "approx_kl"), ".2e")),
        ("entropy", _fmt(metric(m, "entropy"))),
        ("step time", _step_split(m, wide)),
        ("samples/s", f"{_fmt(m.get('samples_per_s'), '.2f')} ({si(m.get('tokens_per_s'))} tok/s)"),
    ]
    return _panel(_pairs(rows), "learner")


def _step_split(m: Mapping[str, Any], wide: bool) -> Text:
    """Where a step's time went (wait for the batch | train | publish weights): one bar, then seconds."""
    parts = [
        ("wait", "wait_s", "yellow"),
        ("train", "learner_time_s", "green"),
        ("sync", "weight_sync_s", "cyan"),
    ]
    secs = [_num(metric(m, key)) for _, key, _ in parts]
    total = sum(x for x in secs if math.isfinite(x))
    if total <= 0:
        return Text(DASH)
    text = Text(f"{total:.2f}s ")
    for (_, _, style), x in zip(parts, secs, strict=True):
        text.append("█" * round((24 if wide else 16) * x / total) if math.isfinite(x) else "", style)
    for i, ((name, _, style), x) in enumerate(zip(parts, secs, strict=True)):
        text.append("\n" if i == 0 or (i == 2 and not wide) else "  ")
        text.append(f"{name} ", "dim").append(_fmt(x, ".2f"), style)
    return text


def _trends_panel(state: DashboardState, width: int) -> Panel:
    rows: list[tuple[str, str | Text | Table]] = []
    for label, series, last, style in (
        ("reward", state.reward, _fmt(state.reward.last()), "green"),
        ("accuracy", state.accuracy, _fmt(state.accuracy.last()), "blue"),
        ("tok/s", state.throughput, si(state.throughput.last()), "magenta"),
    ):
        spark = sparkline(series.values, max(8, width)) or "(no data yet)"
        rows.append((label, Text.assemble((spark, style), " ", (last, "bold"))))
    return _panel(_pairs(rows), "over the run")


def _events_panel(state: DashboardState, rows: int, fill: bool = False) -> Panel:
    text = Text(no_wrap=True, overflow="ellipsis")
    for i, e in enumerate(list(state.events)[-rows:]):
        text.append("\n" if i else "").append(time.strftime("%H:%M:%S ", time.localtime(e.t)), "dim")
        text.append(e.text, e.style)
    panel = _panel(text if state.events else Text("no events yet", "dim"), "events")
    panel.height = rows + 2 if fill else None
    return panel


def export_svg(state: DashboardState, path: Path, width: int = 120, now: float | None = None) -> None:
    """Save the dashboard as an SVG screenshot (the README embeds one)."""
    console = Console(width=width, record=True, file=io.StringIO(), force_terminal=True)
    console.print(render(state, time.time() if now is None else now))
    console.save_svg(str(path), title="april")
