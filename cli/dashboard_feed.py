"""How the broker's status feed reaches a user: the PUB subscription, the full-screen Live loop, the
headless progress lines.

`StatusFeed` subscribes to the broker's PUB socket (topic b"status", a `protocol.StatusReply` per second)
and hands out the newest status (an `april.status.BrokerStatus`); a message it cannot decode is counted
and skipped, never raised.
`watch` runs a rich `Live` screen that only polls the feed, folds statuses into a `DashboardState` and
refreshes; `run_headless` prints one line per learner step and the events instead. Both are read-only:
they never send to the broker, so stopping them never affects training. The rendering is in
`cli/dashboard.py`.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import Any, TextIO

import zmq
from rich.console import Console
from rich.live import Live

from april import protocol
from april.codec import ProtocolError
from april.keys import ClientKeys
from april.status import BrokerStatus, StepFigures
from april.transport import configure, curve_client
from cli.dashboard import render, si
from cli.dashboard_state import DashboardState, apply_status

TOPIC = b"status"
MAX_DRAIN = 1000  # messages read per poll at most: a flooding publisher cannot stall the screen

Tick = Callable[[DashboardState], bool]  # called every refresh; False ends the loop


class StatusFeed:
    """A SUB socket on the broker's status feed. Never blocks longer than the timeout it is given."""

    def __init__(self, address: str, curve: ClientKeys | None = None) -> None:
        self.address = address
        self.received = 0  # statuses decoded
        self.undecodable = 0  # messages skipped (malformed, wrong topic or kind)
        self.last_error = ""
        self._ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._sock = curve_client(configure(self._ctx.socket(zmq.SUB)), curve)
        self._sock.setsockopt(zmq.SUBSCRIBE, TOPIC)
        self._sock.setsockopt(zmq.RECONNECT_IVL, 100)
        self._sock.setsockopt(zmq.RECONNECT_IVL_MAX, 2000)
        try:
            self._sock.connect(address)
        except zmq.ZMQError:
            self.close()
            raise

    def poll(self, timeout_ms: int) -> BrokerStatus | None:
        """The newest status that arrived within `timeout_ms` (older queued ones are skipped), or None."""
        if not self._sock.poll(timeout_ms, zmq.POLLIN):
            return None
        newest: BrokerStatus | None = None
        for _ in range(MAX_DRAIN):
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            status = self._parse(frames)
            if status is not None:
                newest = status
        return newest

    def wait(self, timeout_s: float) -> BrokerStatus | None:
        """The first status within `timeout_s` seconds, or None."""
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            status = self.poll(max(1, int(left * 1000)))
            if status is not None:
                return status
        return None

    def _parse(self, frames: list[bytes]) -> BrokerStatus | None:
        try:
            if len(frames) < 2 or frames[0] != TOPIC:
                raise ProtocolError("bad_topic", f"expected topic frame {TOPIC!r}, got {frames[:1]!r}")
            msg = protocol.decode(frames[1:])
            if not isinstance(msg, protocol.StatusReply):
                raise ProtocolError("bad_kind", f"got {type(msg).__name__}, expected StatusReply")
        except ProtocolError as exc:
            self.undecodable += 1
            self.last_error = str(exc)
            return None
        self.received += 1
        return msg.status

    def close(self) -> None:
        self._sock.close(linger=0)
        self._ctx.term()

    def __enter__(self) -> StatusFeed:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def watch(
    feed: StatusFeed,
    state: DashboardState,
    tick: Tick | None = None,
    refresh_per_second: float = 4.0,
    console: Console | None = None,
) -> None:
    """Show the dashboard full screen until `tick` returns False or Ctrl-C. The loop only polls the feed
    (at most one refresh period), folds in what came, calls `tick`, and redraws."""
    period_ms = max(1, int(1000 / refresh_per_second))
    with Live(console=console, screen=True, auto_refresh=False) as live:
        try:
            while True:
                status = feed.poll(period_ms)
                now = time.time()
                if status is not None:
                    apply_status(state, status, now)
                if tick is not None and not tick(state):
                    break
                live.update(render(state, now, live.console.size.height), refresh=True)
        except KeyboardInterrupt:
            pass


def progress_line(m: StepFigures, steps: int | None) -> str | None:
    """One line for a learner step (for `april up --headless`), or None when `m` has no step; `steps` is
    the run's length (None: not known yet)."""
    if m.step is None:
        return None

    def f(value: float | None, spec: str = ".3f") -> str:
        return "-" if value is None or not math.isfinite(value) else format(value, spec)

    return (
        f"step {m.step + 1}/{'?' if steps is None else steps} v{f(m.version, '.0f')}  "
        f"reward {f(m.reward_mean)}  acc {f(m.accuracy)}  loss {f(m.loss, '.4g')}  "
        f"{f(m.samples_per_s, '.2f')} samples/s  {si(m.tokens_per_s)} tok/s  aborted {f(m.aborted, '.0f')}  "
        f"resumed {f(m.resumed, '.0f')}"
    )


class MetricsTail:
    """New lines of a run's metrics.jsonl (the learner appends one per step), read without blocking."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.offset = 0
        self.partial = b""

    def new_records(self) -> list[dict[str, Any]]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                data = f.read()
        except OSError:
            return []
        self.offset += len(data)
        *complete, self.partial = (self.partial + data).split(b"\n")
        out = []
        for line in complete:
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if isinstance(record, dict):
                out.append(record)
        return out


def run_headless(
    feed: StatusFeed,
    state: DashboardState,
    tick: Tick | None = None,
    out: TextIO = sys.stdout,
    period_s: float = 0.5,
    metrics: Path | None = None,
) -> None:
    """Print the events and one progress line per learner step, until `tick` returns False or Ctrl-C.

    With `metrics` (the run's metrics.jsonl) the progress lines come from it, so no step is skipped
    however fast steps go; otherwise from the status feed (at most one line per published status)."""
    printed_events, printed_step = state.events_total, state.last_step
    tail = MetricsTail(metrics) if metrics is not None else None
    try:
        while True:
            status = feed.poll(max(1, int(period_s * 1000)))
            now = time.time()
            if status is not None:
                apply_status(state, status, now)
            going = tick is None or tick(state)
            new = min(state.events_total - printed_events, len(state.events))
            for event in list(state.events)[len(state.events) - new :]:
                out.write(f"{time.strftime('%H:%M:%S', time.localtime(event.t))} {event.text}\n")
            printed_events = state.events_total
            steps = None if state.status is None else state.status.steps
            if tail is not None:
                for record in tail.new_records():
                    line = progress_line(StepFigures.read(record), steps)
                    out.write(f"{line}\n" if line else "")
            elif state.status is not None and state.last_step != printed_step:
                printed_step = state.last_step
                line = progress_line(state.status.step_figures, steps)
                if line:
                    out.write(line + "\n")
            out.flush()
            if not going:
                break
    except KeyboardInterrupt:
        pass
