"""What the learner is doing, said as it changes: to the broker (rank 0, `LearnerPhaseReport`, shown in its
status) and, for start-up, to the log with how long each phase took.

Start-up is the time from the process start to the end of its first trained step: loading the model,
initialising the engine, restoring a checkpoint, waiting for the first batch, then training, publishing
and (maybe) checkpointing it. Once that first step is done one line sums it up (`first step done 12.3s
after the learner started: loading_model 4.4s, ...`); later phases go to the broker only.
Owns no decision about what happens when: the loop and the trainer enter the phases.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from april.protocol import LearnerPhase

log = logging.getLogger("april.learner")

Send = Callable[[LearnerPhase, str], None]  # BrokerClient.report_phase on rank 0


class PhaseClock:
    def __init__(self, send: Send | None, clock: Callable[[], float] = time.monotonic) -> None:
        self.send = send  # None on the ranks that do not talk to the broker
        self.clock = clock
        self.started = clock()
        self.phase: LearnerPhase | None = None
        self.since = self.started
        self.starting = True  # until the first trained step is done
        self.durations: dict[LearnerPhase, float] = {}  # start-up seconds per phase

    def enter(self, phase: LearnerPhase, detail: str = "") -> None:
        """From now on the learner is in `phase` (`detail`: which model, engine or step)."""
        now = self.clock()
        self._close(now)
        self.phase, self.since = phase, now
        if self.starting:
            log.info("%s%s", phase.name.lower(), f" ({detail})" if detail else "")
        if self.send is not None:
            self.send(phase, detail)

    def first_step_done(self) -> None:
        """The first trained step is complete: log how start-up went, once."""
        if not self.starting:
            return
        now = self.clock()
        self._close(now)
        self.phase, self.since, self.starting = None, now, False
        parts = ", ".join(f"{p.name.lower()} {s:.1f}s" for p, s in self.durations.items())
        log.info("first step done %.1fs after the learner started: %s", now - self.started, parts)

    def _close(self, now: float) -> None:
        if self.starting and self.phase is not None:
            self.durations[self.phase] = self.durations.get(self.phase, 0.0) + now - self.since
