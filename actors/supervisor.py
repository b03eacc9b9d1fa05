"""Supervises killable child processes that answer requests over JSON-line pipes, never blocking the parent.

`Supervisor` owns what the tool runner and the reward runner share: a fixed number of slots, each holding
a child (`python -m MODULE ARGS`, `actors.child_process`) and the job it runs now; the "ready" / "fatal"
handshake and the start-up deadline; reading what has arrived (`_pump`), job deadlines, killing and
restarting (the dead go to a `Reaper`), waiting in `poll`, and `close`. A fatal child breaks the runner:
every request fails with its error from then on. Every failure line starts with the runner's crash reason.

A subclass owns its job's rules through the hooks below: what a request is and which child gets it, the
messages that answer it, its time limit, who is blamed when a child dies and what is restarted
(`actors.tool_runner`, `actors.reward_runner`). Knows nothing about environments or rewards.
"""

from __future__ import annotations

import json
import math
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass
from types import TracebackType
from typing import Any, ClassVar, Generic, Self, TypeVar

from actors.child_process import JsonLinesChild, Reaper, wait_readable
from april.failures import Reason, failure

JobT = TypeVar("JobT")
ResultT = TypeVar("ResultT")


@dataclass(slots=True)
class Slot(Generic[JobT]):
    """One child and the job it is running (None when idle or when its job lives elsewhere)."""

    child: JsonLinesChild
    ready: bool = False
    job: JobT | None = None


class Supervisor(ABC, Generic[JobT, ResultT]):
    """Children in slots, the results not yet delivered, and the broken/closed states."""

    module: ClassVar[str]  # the child's `python -m` module
    noun: ClassVar[str]  # "environment", "reward": begins "... process died", "... process broke ..."
    crash_reason: ClassVar[Reason]  # the reason of a child that dies, breaks the protocol or cannot load

    def __init__(self, spec: str, args: list[str], processes: int, startup_timeout_s: float) -> None:
        self.spec = spec
        self.startup_timeout_s = startup_timeout_s
        self._args = args
        self._results: list[ResultT] = []
        self._reaper = Reaper()  # killed children, reaped without waiting
        self._broken = ""  # a child's "fatal": every later request fails with it
        self._closed = False
        self._slots: list[Slot[JobT] | None] = [self._spawn() for _ in range(processes)]

    # -- the job's rules (hooks) ------------------------------------------------------------------------

    @abstractmethod
    def _failed(self, key: int, error: str) -> ResultT:
        """The result of request `key` that failed with `error`."""

    @abstractmethod
    def _busy(self) -> bool:
        """Work submitted whose result has not been read yet (`poll` waits while there is)."""

    @abstractmethod
    def _waiting(self) -> bool:
        """Work that waits for a child to start (a child's start-up deadline runs only then)."""

    @abstractmethod
    def _on_message(self, i: int, slot: Slot[JobT], kind: str, msg: dict[str, Any]) -> bool:
        """Apply a message other than "ready"/"fatal" from child `i`; False if it breaks the protocol."""

    @abstractmethod
    def _job_deadline(self, job: JobT) -> float:
        """When (time.monotonic()) `job`, running, runs out of time."""

    @abstractmethod
    def _on_timeout(self, i: int, job: JobT) -> None:
        """`job` ran out of time on child `i` (already taken off the slot): answer it, restart."""

    @abstractmethod
    def _died(self, i: int, how: str) -> str:
        """The error for what child `i` was running when it exited `how` ("" when it was idle)."""

    @abstractmethod
    def _fail_running(self, i: int, error: str) -> None:
        """Child `i` died or broke the protocol: blame its job with `error`, restart what must be."""

    @abstractmethod
    def _fail_all(self, error: str) -> None:
        """Fail every request submitted and not answered (the children are killed after)."""

    @abstractmethod
    def _fail_waiting(self, error: str) -> None:
        """A child did not start in time: fail the work waiting for it (the child is killed after)."""

    @abstractmethod
    def _drop_pending(self) -> None:
        """At close: forget every request."""

    def _idle(self, slot: Slot[JobT]) -> bool:
        """At close: the child runs nothing and may be asked to exit."""
        return slot.job is None

    def _dispatch(self) -> None:
        """Hand waiting work to children (after reading and deadlines, in `_pump`)."""

    # -- shared API -------------------------------------------------------------------------------------

    def poll(self, wait_s: float = 0.0) -> list[ResultT]:
        """Results ready so far (possibly none). With `wait_s` > 0, wait up to that long for at least one."""
        deadline = time.monotonic() + wait_s
        self._pump()
        while not self._results and self._busy() and (now := time.monotonic()) < deadline:
            children = [s.child for s in self._slots if s is not None]
            wait_readable(children, min(deadline - now, self._next_deadline() - now, 0.05))
            self._pump()
        out, self._results = self._results, []
        return out

    def close(self) -> None:
        """Stop the children (busy ones killed, idle ones asked to exit) and drop pending work."""
        if self._closed:
            return
        self._closed = True
        for i, slot in enumerate(self._slots):
            if slot is not None:
                if slot.ready and self._idle(slot) and slot.child.idle_pipe:
                    slot.child.close_input(wait_s=1.0)  # EOF: an idle child exits by itself
                self._kill(i)
        self._drop_pending()
        self._reaper.wait()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- for subclasses ---------------------------------------------------------------------------------

    def _refused(self, key: int) -> bool:
        """Before taking request `key`: RuntimeError if closed; True (its failure queued) if broken."""
        if self._closed:
            raise RuntimeError(f"{type(self).__name__} is closed")
        if self._broken:
            self._results.append(self._failed(key, self._broken))
            return True
        return False

    def _spawn(self) -> Slot[JobT]:
        return Slot(JsonLinesChild(self.module, [self.spec, *self._args]))

    def _kill(self, i: int) -> None:
        slot = self._slots[i]
        if slot is not None:
            slot.child.kill()
            self._reaper.add(slot.child)
            self._slots[i] = None

    def _replace(self, i: int) -> None:
        """Kill child `i` (its job already settled) and start another unless closed or broken."""
        self._kill(i)
        if not self._closed and not self._broken:
            self._slots[i] = self._spawn()

    def _pump(self) -> None:
        """Read what has arrived, apply time limits, hand work to idle children. Never blocks."""
        self._read()
        self._check_deadlines()
        self._dispatch()

    def _read(self) -> None:
        """Take in what the children have written (answers, exits). Never blocks."""
        self._reaper.reap()
        for i, slot in enumerate(self._slots):
            if slot is None:
                continue
            lines, eof = slot.child.receive()
            for line in lines:
                self._handle(i, slot, line)
                if self._slots[i] is not slot:
                    break  # killed or replaced while handling: the rest of its output is moot
            else:
                if eof:
                    error = self._died(i, slot.child.exit_description())
                    if error:
                        self._fail_running(i, error)
                    else:
                        self._kill(i)  # an idle child died: another starts when there is work

    def _handle(self, i: int, slot: Slot[JobT], line: bytes) -> None:
        try:
            msg = json.loads(line)
            kind = msg["t"]
        except (ValueError, TypeError, KeyError):
            kind, msg = None, {}
        if kind == "ready" and not slot.ready:
            slot.ready = True
        elif kind == "fatal":
            self._broken = failure(
                self.crash_reason,
                f"{self.noun} process could not load {self.spec!r}: {msg.get('error', '?')}",
            )
            self._fail_all(self._broken)
            for j in range(len(self._slots)):
                self._kill(j)
        elif not isinstance(kind, str) or not self._on_message(i, slot, kind, msg):
            self._fail_running(
                i, failure(self.crash_reason, f"{self.noun} process broke the protocol: {line[:80]!r}")
            )

    def _next_deadline(self) -> float:
        deadlines = [math.inf]
        for slot in self._slots:
            if slot is not None and slot.job is not None:
                deadlines.append(self._job_deadline(slot.job))
            elif slot is not None and not slot.ready and self._waiting():
                deadlines.append(slot.child.spawned_at + self.startup_timeout_s)
        return min(deadlines)

    def _check_deadlines(self) -> None:
        now = time.monotonic()
        for i, slot in enumerate(self._slots):
            if slot is None:
                continue
            job = slot.job
            if job is not None and now > self._job_deadline(job):
                slot.job = None
                self._on_timeout(i, job)
            elif not slot.ready and self._waiting() and now > slot.child.spawned_at + self.startup_timeout_s:
                self._fail_waiting(
                    failure(
                        self.crash_reason,
                        f"{self.noun} process did not start within {self.startup_timeout_s:g}s",
                    )
                )
                self._kill(i)
