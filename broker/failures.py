"""The broker's count of sample errors, the lines it shows of them, and the rule that stops a failing run.

`FailureBook` sees every sample as it settles (training and evaluation alike: a broken environment or
reward fails both). A FAILED sample counts under its failure's reason, a FINISHED one that carries an
error (a tool call that timed out) under that one's (`april.failures`): since the broker started, for the
status, and since the last batch formed, for that batch's metrics line (`errors/<reason>` in its stats).
It keeps the first line of each distinct error (a new one of a reason at most every `LINE_EVERY_S`, the
last `MAX_LINES`), logged once as it comes: the dashboard shows each as an event. The stop rule: once
`stop_after` samples in a row settled FAILED for one reason, none finishing between, the run is stopped
with one line naming the reason and its last error; the core then leases nothing and tells the learner.
No sockets, no clock of its own: times are passed in.
"""

from __future__ import annotations

import logging
from collections import Counter
from dataclasses import dataclass, field

from april.failures import STATS_PREFIX, reason_of
from april.records import Sample, SampleStatus
from april.status import ErrorLine

log = logging.getLogger("april.broker")
LINE_EVERY_S = 10.0  # a new error line of a reason is kept (logged, shown) at most this often
MAX_LINES = 16  # error lines kept for the status, newest last


@dataclass(slots=True)
class FailureBook:
    """See the module docstring. `stop_after`: broker.stop_after_failures (0: never stop)."""

    stop_after: int
    counts: Counter[str] = field(default_factory=Counter)  # reason -> samples, since the broker started
    window: Counter[str] = field(default_factory=Counter)  # the same since the last batch formed
    lines: dict[str, ErrorLine] = field(default_factory=dict)  # first line -> its record, oldest first
    line_at: dict[str, float] = field(default_factory=dict)  # reason -> when its last line was kept
    streak: int = 0  # samples settled FAILED in a row, all for `streak_reason`
    streak_reason: str = ""
    stopped: str = ""  # the line the run was stopped with ("" while it runs)

    def settled(self, sample: Sample, now: float) -> None:
        """Count one sample that settled (FINISHED or FAILED), and apply the stop rule."""
        reason = reason_of(sample.error).value if sample.error else ""
        if reason:
            self.counts[reason] += 1
            self.window[reason] += 1
            self._line(reason, sample.error, now)
        if sample.status != SampleStatus.FAILED:
            self.streak = 0
            return
        self.streak = self.streak + 1 if reason == self.streak_reason else 1
        self.streak_reason = reason
        if self.stop_after and self.streak >= self.stop_after and not self.stopped:
            self.stopped = (
                f"the run stopped: {self.streak} samples in a row failed alike "
                f"(broker.stop_after_failures = {self.stop_after}): {first_line(sample.error)}"
            )
            log.error("%s", self.stopped)

    def take_window(self) -> dict[str, float]:
        """The errors since the last batch, as a batch's stats (`errors/<reason>`), and a new window."""
        stats = {STATS_PREFIX + reason: float(n) for reason, n in sorted(self.window.items())}
        self.window.clear()
        return stats

    def _line(self, reason: str, error: str, now: float) -> None:
        text = first_line(error)
        kept = self.lines.get(text)
        if kept is not None:
            self.lines[text] = ErrorLine(kept.reason, text, kept.samples + 1)
            return
        last = self.line_at.get(reason)
        if last is not None and now - last < LINE_EVERY_S:
            return  # counted by its reason; a line of that reason was shown a moment ago
        self.line_at[reason] = now
        self.lines[text] = ErrorLine(reason, text, 1)
        while len(self.lines) > MAX_LINES:
            del self.lines[next(iter(self.lines))]
        log.warning("sample error: %s", text)


def first_line(error: str) -> str:
    """The first line of an error, at most 200 characters."""
    text = error.strip().splitlines()[0] if error.strip() else "(no message)"
    return text if len(text) <= 200 else text[:197] + "..."
