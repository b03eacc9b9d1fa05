"""The live dashboard's rendering: what `april up` and `april status --watch` show.

Owns `render(state, now)`, a pure function of a `DashboardState` (tested against a fixed-width capture
console), `export_svg` (a screenshot of it) and the display helpers (`sparkline`, `bar`, `si`,
`duration`). It never changes the state: folding statuses and deriving events is `cli/dashboard_state.py`;
the socket and the Live loop are `cli/dashboard_feed.py`. It reads the typed status (`april.status`) by
attribute; figures the learner has not sent (NaN) render as a dash, never raise.
"""

from __future__ import annotations

import io
import math
import time
from collections.abc import Iterable, Mapping
from pathlib import Path

from rich.console import Console, ConsoleOptions, Group, RenderableType, RenderResult
from rich.markup import escape
from rich.panel import Panel
from rich.segment import Segment
from rich.table import Table
from rich.text import Text

from april import protocol
from april.status import BrokerStatus, LearnerStatus, StepFigures, WorkerStatus
from cli.dashboard_state import DASH, DashboardState, fmt, fmt_int, num

SPARK_CHARS = "▁▂▃▄▅▆▇█"
WIDE = 110  # columns from which the header takes a line less and the workers table shows hosts
STALE_S = 3.0  # the broker publishes every second: silence past this is shown in the header
ENGINE_WIDE, ENGINE_NARROW = 32, 18  # most columns a worker's "engine · placement" takes


# ---------------------------------------------------------------------------------------------------
# formatting


def si(value: float | None) -> str:
    """1234 -> "1.2k"; missing or NaN -> DASH."""
    x = num(value)
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
        state, wide, status = self.state, options.max_width >= WIDE, self.state.status
        parts: list[RenderableType] = [_header(state, self.now, wide)]
        parts += [_start_error(line, roles) for line, roles in state.start_errors.items()]
        parts += [_alert(role, tail) for role, tail in state.alerts.items()]
        if status is not None:
            figures = status.step_figures
            parts.append(_workers_panel(state, status, wide))
            parts.append(_side_by_side(_rollout_panel(state, status, figures), _learner_panel(status, wide)))
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


def _header(state: DashboardState, now: float, wide: bool) -> Panel:
    source = escape(state.source) or None
    status = state.status
    if status is None or state.received_at is None:
        waiting = Text(f"waiting for the first status from {state.source or 'the broker'}...", "yellow")
        return _panel(waiting, "april", subtitle=source)
    m = status.step_figures
    done = m.step + 1 if m.step is not None else status.version
    progress = f" [green]{bar(done / status.steps if status.steps > 0 else math.nan, 12)}[/]" if wide else ""
    silent = now - state.received_at
    elapsed = status.uptime_s + min(max(0.0, silent), STALE_S)
    alive, workers = status.workers_alive, len(status.workers)
    word, style = _learner_word(status.learner)
    lines = [
        f"[dim]run[/] [bold]{escape(status.run)}[/]  [dim]mode[/] "
        f"[bold magenta]{escape(status.mode)}[/]  "
        f"[dim]step[/] [bold]{done}/{status.steps}[/]{progress}  "
        f"[dim]policy[/] [bold cyan]v{status.version}[/]  [dim]elapsed[/] "
        f"[bold]{duration(elapsed)}[/]",
        f"[dim]throughput[/] [bold]{si(state.tokens.rate())} tok/s[/] generated · "
        f"[bold]{fmt(m.samples_per_s, '.2f')} samples/s[/] trained",
        f"[dim]workers[/] [{'bold' if alive == workers else 'bold red'}]{alive}/{workers} alive[/]"
        "  "
        f"[dim]learner[/] [{style}]{escape(word)}[/]",
    ]
    if wide:
        lines[1:] = [f"{lines[1]}  {lines[2]}"]
    if silent > STALE_S:
        lines.append(f"[bold red]no status for {silent:.0f}s: is the broker running?[/]")
    return _panel(Text.from_markup("\n".join(lines)), "april", subtitle=source)


STARTING = ("loading model", "initialising engine", "restoring checkpoint")  # learner phases before step 1


def _learner_word(learner: LearnerStatus | None) -> tuple[str, str]:
    """What the learner is doing: its start-up phase with the detail and for how long (a start can take
    minutes), else waiting or training."""
    if learner is None:
        return "not connected", "bold red"
    if learner.phase in STARTING:
        detail = f" ({learner.phase_detail})" if learner.phase_detail else ""
        return f"{learner.phase}{detail} · {learner.phase_s:.0f}s", "yellow"
    if learner.waiting_for_batch:
        return "waiting for a batch", "yellow"
    return learner.phase or "training", "green"


def _start_error(line: str, roles: list[str]) -> Panel:
    title = f"{escape(', '.join(roles))}: not restarted (a restart would fail alike)"
    return _panel(Text(line, "bold red"), title, "red")


def _alert(role: str, tail: list[str]) -> Panel:
    body = Text("\n".join(tail) or "(empty log)", overflow="ellipsis", no_wrap=True)
    return _panel(body, f"{escape(role)} crashed: last lines of its log", "red")


def _workers_panel(state: DashboardState, status: BrokerStatus, wide: bool) -> Panel:
    table = Table(box=None, padding=(0, 1), expand=True, header_style="dim")
    table.add_column("worker", overflow="ellipsis", no_wrap=True, ratio=1)
    names = ("engine", "host", "pid", "busy", "tok/s", "ver", "sync", "seen", "state")
    for name in names if wide else [n for n in names if n not in ("host", "pid")]:
        left = name in ("engine", "host", "busy", "state")
        # the engine's placement gives way before the worker ids do
        most = (ENGINE_WIDE if wide else ENGINE_NARROW) if name == "engine" else None
        table.add_column(
            name, no_wrap=True, justify="left" if left else "right", overflow="ellipsis", max_width=most
        )
    workers = sorted(status.workers, key=lambda w: w.id)
    for w in workers[: state.worker_rows]:
        window = state.worker_tokens.get(w.id)
        where: list[RenderableType] = [Text(w.host or DASH), str(w.pid)] if wide else []
        table.add_row(
            Text(w.id),  # Text, not markup: names come from the peers
            Text(w.engine_label),  # and where it runs: "torch · cuda:0"
            *where,
            f"{w.leases}/{w.slots} {bar(w.leases / w.slots if w.slots else 0.0, 10 if wide else 5)}",
            si(window.rate() if window else None),
            Text(f"v{w.version}", "yellow" if w.version < status.version else ""),
            Text(w.weights_sync),  # how the version came, seconds to serve it
            f"{w.last_seen_s:.1f}s",
            _worker_state(w),
        )
    if len(workers) > state.worker_rows:
        table.add_row(f"... {len(workers) - state.worker_rows} more")
    if not workers:
        table.add_row(Text("no workers connected", "yellow"))
    notes = _engine_notes(workers, state.worker_rows)
    return _panel(Group(table, *notes) if notes else table, "workers")


def _worker_state(w: WorkerStatus) -> Text:
    if not w.alive:
        return Text("dead", "bold red")
    if not w.engine_ok:
        starting = w.engine_detail == protocol.ENGINE_STARTING
        return Text("starting", "yellow") if starting else Text("engine down", "bold red")
    return Text("restored", "yellow") if w.restored else Text("up", "green")


def _engine_notes(workers: list[WorkerStatus], rows: int) -> list[Text]:
    """Under the table: why each down engine is down (a server's error is long: lines of its own, wrapped),
    and what engine errors cost so far over all workers."""
    down = [w for w in workers if w.alive and not w.engine_ok and w.engine_detail != protocol.ENGINE_STARTING]
    notes = [
        Text.assemble((f"{w.id}: ", "bold"), ("engine down: ", "bold red"), (w.engine_detail or DASH, "red"))
        for w in down[:rows]
    ]
    if len(down) > rows:
        notes.append(Text(f"... {len(down) - rows} more engines down", "red"))
    failed = sum(w.failed_by_engine for w in workers)
    returned = sum(w.returned_by_engine for w in workers)
    if failed or returned:
        notes.append(
            Text(f"engine errors: {failed} samples failed · {returned} returned as partials", "yellow")
        )
    return notes


def _rollout_panel(state: DashboardState, s: BrokerStatus, m: StepFigures) -> Panel:
    stale = f"mean {fmt(m.staleness_mean, '.2f')} · max {fmt_int(m.staleness_max)}"
    rows: list[tuple[str, str | Text | Table]] = [
        ("in flight", f"{s.in_flight_groups} groups · {s.leased_samples} leased"),
        ("queued", f"{s.queued_samples} samples"),
        ("partial", f"{s.partial_buffer} samples · {s.partial_groups} groups"),
        *([("pinned", _pinned(s))] if s.pinned or s.totals.restarted else []),
        ("complete", f"{s.complete_groups} groups waiting"),
        *_abort_rows(state, s, m),
        ("off-policy", f"{_pct(m.offpolicy_token_frac)} of tokens"),
        ("staleness", stale),
        ("buffer age", _histogram(s.partial_staleness)),
        ("ledger", _ledger(s)),
    ]
    if s.round.aborting:
        rows.append(("round", f"[bold yellow]abort round {s.round.id} running[/]"))
    return _panel(_pairs(rows), "rollouts")


def _pinned(s: BrokerStatus) -> str:
    """Pinned partials per worker and restarts from their prompt (`april status` says more)."""
    per = ", ".join(f"{w.id} {w.pinned}" for w in s.workers if w.pinned)
    return f"{s.pinned} samples{f' ({per})' if per else ''} · {s.totals.restarted} restarted"


def _abort_rows(
    state: DashboardState, status: BrokerStatus, m: StepFigures
) -> list[tuple[str, str | Text | Table]]:
    """Samples aborted and resumed: in the step under way, in the last trained batch, over the run."""
    base_aborted, base_resumed = state.step_base
    rows: list[tuple[str, str | Text | Table]] = [("", _cells(["this step", "last", "run"], "dim"))]
    for key, total, base, last in (
        ("aborted", status.totals.aborted, base_aborted, m.aborted),
        ("resumed", status.totals.resumed, base_resumed, m.resumed),
    ):
        rows.append((key, _cells([str(total - base), fmt_int(last), str(total)])))
    return rows


def _cells(values: list[str], style: str = "") -> Table:
    """Right-aligned cells of fixed widths, so that consecutive rows line up as columns."""
    grid = Table.grid(padding=(0, 1))
    for width in (9, 6, 7):
        grid.add_column(width=width, justify="right", no_wrap=True, style=style)
    grid.add_row(*values)
    return grid


def _pct(value: float) -> str:
    return f"{100 * value:.1f}%" if math.isfinite(value) else DASH


def _histogram(counts: Mapping[str, int], width: int = 12, rows: int = 6) -> Text:
    """Partial samples by staleness (policy versions behind): one bar per level, the tail merged."""
    levels = sorted((int(k), n) for k, n in counts.items() if k.isdigit())
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


def _ledger(status: BrokerStatus) -> str:
    ledger = status.ledger
    dropped = sum(ledger.dropped.values())
    rejected = status.rejected.total
    return (
        ("[green]balanced[/]" if status.ledger_balanced else "[bold red]NOT BALANCED[/]")
        + f" · issued {ledger.issued} · trained {ledger.trained}"
        + (f" · dropped {dropped}" if dropped else "")
        + (f" · [yellow]{rejected} rejected[/]" if rejected else "")
    )


def _learner_panel(status: BrokerStatus, wide: bool) -> Panel:
    m, learner = status.step_figures, status.learner
    word, style = _learner_word(learner)
    seen = f" · {learner.last_seen_s:.1f}s ago" if learner else ""
    evaluated = f" · eval {fmt(m.eval_accuracy)}" if math.isfinite(m.eval_accuracy) else ""
    rows: list[tuple[str, str | Text | Table]] = [
        ("learner", f"[{style}]{escape(word)}[/]{seen}"),
        ("engine", Text(learner.engine if learner and learner.engine else DASH)),  # backend, device, AdamW
        ("last step", f"{fmt_int(m.step)} -> v{fmt_int(m.version)}"),
        ("loss", fmt(m.loss, ".4g")),
        ("reward", fmt(m.reward_mean)),
        ("accuracy", fmt(m.accuracy) + evaluated),
        ("clip frac", fmt(m.clip_frac)),
        ("approx KL", fmt(m.approx_kl, ".2e")),
        ("entropy", fmt(m.entropy)),
        ("step time", _step_split(m, wide)),
        ("samples/s", f"{fmt(m.samples_per_s, '.2f')} ({si(m.tokens_per_s)} tok/s)"),
    ]
    return _panel(_pairs(rows), "learner")


def _step_split(m: StepFigures, wide: bool) -> Text:
    """Where a step's time went (wait for the batch | train | publish weights): one bar, then seconds."""
    parts = [
        ("wait", m.wait_s, "yellow"),
        ("train", m.learner_time_s, "green"),
        ("sync", m.weight_sync_s, "cyan"),
    ]
    total = sum(x for _, x, _ in parts if math.isfinite(x))
    if total <= 0:
        return Text(DASH)
    text = Text(f"{total:.2f}s ")
    for _, x, style in parts:
        text.append("█" * round((24 if wide else 16) * x / total) if math.isfinite(x) else "", style)
    for i, (name, x, style) in enumerate(parts):
        text.append("\n" if i == 0 or (i == 2 and not wide) else "  ")
        text.append(f"{name} ", "dim").append(fmt(x, ".2f"), style)
    return text


def _trends_panel(state: DashboardState, width: int) -> Panel:
    rows: list[tuple[str, str | Text | Table]] = []
    for label, series, last, style in (
        ("reward", state.reward, fmt(state.reward.last()), "green"),
        ("accuracy", state.accuracy, fmt(state.accuracy.last()), "blue"),
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
