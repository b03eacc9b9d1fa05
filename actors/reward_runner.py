"""Scores finished samples in a long-lived child process, so that no reward can block the worker.

The worker-side API is non-blocking: `submit` queues a sample, `poll` returns the results ready so far,
`cancel_all` (on abort) drops everything at once, `close` stops the child. Every submitted key gets
exactly one `RewardResult` unless it is cancelled: a reward is either a finite float or `None` with a
one-line error that starts with its reason (`april.failures`): "reward_timeout: reward timed out after 5s",
"reward_error: reward raised ValueError: ...", "reward_crashed: reward process died ...". Nothing is ever
silently scored 0.

Why a child process: a Python thread running a hung user function cannot be stopped; a process can be
killed. The child is `python -m actors.reward_runner SPEC`; it scores one sample at a time, in submission
order. The pipe carries JSON lines, never pickle:

    worker -> child  {"v": 1, "t": "score", "key": K, "response": str, "answer": str, "metadata": {str: str}}
    child -> worker  {"v": 1, "t": "ready"}                      reward loaded, ready to score
                     {"v": 1, "t": "fatal", "error": str}        reward could not be loaded; child exits
                     {"v": 1, "t": "start", "key": K, "at": T}    scoring K began at time.monotonic() T
                     {"v": 1, "t": "done", "key": K, "reward": float | null, "error": str}

The timeout clock of a sample starts at the child's "start" (CLOCK_MONOTONIC is system-wide), so time
spent queued behind other samples or in the child's start-up (importing sympy for `math`) never counts.

Failure policy (one rule: the sample that was running is blamed; the others did not run and are re-sent):
- timeout: the running sample fails with "reward timed out after Xs"; the child is killed and a new one
  started; the samples queued behind it are re-submitted to the new child, in order.
- crash (the child exits or breaks the protocol): the running sample (or, if none had started, the oldest
  one) fails with "reward process died (...)"; the rest are re-submitted to a restarted child. Each
  restart fails one sample, so a reward that always crashes cannot loop forever.
- start-up: a child that sends no "ready" within `startup_timeout_s`, or reports "fatal", fails every
  sample in flight; after a "fatal" every later submission fails at once with the same error.
- `cancel_all`: pending results are dropped; a busy child is killed (never waited on) and restarted.

The child's stdout is moved to stderr before any user code runs (a `print` in a reward cannot corrupt
the protocol) and its stdin is /dev/null. It runs in its own session (Ctrl-C in a terminal is the
worker's to handle) and, on Linux, is killed when the thread that started it exits.

Not thread-safe: one worker loop owns a runner. Knows nothing about samples, sockets or the broker.
"""

from __future__ import annotations

import json
import math
import sys
import time
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from actors.child_process import JsonLinesChild, Reaper, child_protocol, encode_line, wait_readable
from actors.rewards import RewardError, check_reward_value, load_reward, one_line_error
from april.failures import Reason, failure

PROTOCOL_VERSION = 1


@dataclass(frozen=True, slots=True)
class RewardResult:
    """The outcome of scoring one submitted sample: `reward` is a finite float, or None and `error` says
    why (one line)."""

    key: int
    reward: float | None
    error: str = ""

    @property
    def ok(self) -> bool:
        return self.reward is not None


@dataclass(slots=True)
class _Pending:
    key: int
    line: bytes  # the encoded "score" message, kept to re-send after a restart
    started_at: float | None = None  # time.monotonic() when the child began scoring it


class RewardRunner:
    """Non-blocking reward scoring in a killable child process (see the module docstring)."""

    def __init__(self, spec: str, timeout_s: float, startup_timeout_s: float = 60.0) -> None:
        if not timeout_s > 0 or not startup_timeout_s > 0:
            raise ValueError(
                f"timeout_s and startup_timeout_s must be > 0, got {timeout_s}, {startup_timeout_s}"
            )
        load_reward(spec)  # validate at start-up, in this process: a bad spec is a RewardError here
        self.spec = spec
        self.timeout_s = timeout_s
        self.startup_timeout_s = startup_timeout_s
        self._pending: dict[int, _Pending] = {}  # submission order = the child's scoring order
        self._results: list[RewardResult] = []
        self._child: JsonLinesChild | None = None
        self._ready = False
        self._reaper = Reaper()  # killed children to reap without waiting
        self._broken = ""  # set by a "fatal" from the child: every later submission fails with it
        self._closed = False
        self._spawn()

    # -- public API ---------------------------------------------------------------------------------

    @property
    def pending(self) -> int:
        """Submitted samples without a result yet."""
        return len(self._pending)

    def submit(self, key: int, response_text: str, answer: str, metadata: dict[str, str]) -> None:
        """Queue one sample for scoring; never blocks. `key` must not be pending already."""
        if self._closed:
            raise RuntimeError("RewardRunner is closed")
        if key in self._pending:
            raise ValueError(f"reward key {key} is already pending")
        if self._broken:
            self._results.append(RewardResult(key, None, self._broken))
            return
        msg = {"v": PROTOCOL_VERSION, "t": "score", "key": key, "response": response_text,
               "answer": answer, "metadata": dict(metadata)}  # fmt: skip
        item = _Pending(key, encode_line(msg))
        self._pending[key] = item
        if self._child is None:
            self._spawn()
        assert self._child is not None
        self._child.send(item.line)
        self._pump()

    def poll(self, wait_s: float = 0.0) -> list[RewardResult]:
        """Results ready so far (possibly none). With `wait_s` > 0, wait up to that long for at least one."""
        deadline = time.monotonic() + wait_s
        self._pump()
        while not self._results and self._pending and (now := time.monotonic()) < deadline:
            children = [] if self._child is None else [self._child]
            wait_readable(children, min(deadline - now, self._next_deadline() - now, 0.05))
            self._pump()
        out, self._results = self._results, []
        return out

    def cancel_all(self) -> None:
        """Drop every pending sample and every undelivered result; returns at once. A busy child is killed
        and restarted rather than waited on."""
        self._results.clear()
        if self._pending:
            self._pending.clear()
            self._kill()
            if not self._closed and not self._broken:
                self._spawn()
        self._reaper.reap()

    def close(self) -> None:
        """Stop the child (killed if busy, else asked to exit) and drop pending work."""
        if self._closed:
            return
        self._closed = True
        child, self._child = self._child, None
        if child is not None:
            if self._ready and not self._pending and child.idle_pipe:
                child.close_input(wait_s=1.0)  # EOF: an idle child exits by itself
            child.kill()
            self._reaper.add(child)
        self._pending.clear()
        self._reaper.wait()

    def __enter__(self) -> RewardRunner:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- child process management -------------------------------------------------------------------

    def _spawn(self) -> None:
        self._child = JsonLinesChild("actors.reward_runner", [self.spec])
        self._ready = False

    def _kill(self) -> None:
        if self._child is not None:
            self._child.kill()
            self._reaper.add(self._child)
            self._child = None

    def _restart(self) -> None:
        """Kill the child and re-send every pending sample to a fresh one."""
        self._kill()
        for item in self._pending.values():
            item.started_at = None
        if self._pending and not self._closed:
            self._spawn()
            assert self._child is not None
            for item in self._pending.values():
                self._child.send(item.line)

    # -- I/O ------------------------------------------------------------------------------------------

    def _pump(self) -> None:
        """Write what the pipe takes, read what has arrived, then apply timeouts. Never blocks."""
        self._reaper.reap()
        child = self._child
        if child is None:
            return
        lines, eof = child.receive()
        for line in lines:
            if not self._handle(line):
                self._fail_running(f"reward process broke the protocol: {line[:80]!r}")
            if self._child is not child:
                return  # killed or restarted while handling: its remaining output is moot
        if eof:
            self._on_crash()
        else:
            self._check_deadlines()

    def _handle(self, line: bytes) -> bool:
        """Apply one message from the child; False if it is malformed."""
        try:
            msg = json.loads(line)
            kind = msg["t"]
        except (ValueError, TypeError, KeyError):
            return False
        if kind == "ready":
            self._ready = True
        elif kind == "fatal":
            self._broken = failure(
                Reason.REWARD_CRASHED, f"reward process could not load {self.spec!r}: {msg.get('error', '?')}"
            )
            self._fail_all(self._broken)
        elif kind == "start" and isinstance(msg.get("at"), float) and msg.get("key") in self._pending:
            self._pending[msg["key"]].started_at = min(msg["at"], time.monotonic())
        elif kind == "done" and msg.get("key") in self._pending:
            reward, error = msg.get("reward"), msg.get("error")
            if not isinstance(error, str) or not (reward is None or _finite_float(reward)):
                return False
            del self._pending[msg["key"]]
            self._results.append(RewardResult(msg["key"], None if reward is None else float(reward), error))
        else:
            return False
        return True

    # -- failures -------------------------------------------------------------------------------------

    def _next_deadline(self) -> float:
        running = self._running()
        if running is not None and running.started_at is not None:
            return running.started_at + self.timeout_s
        if not self._ready and self._pending and self._child is not None:
            return self._child.spawned_at + self.startup_timeout_s
        return math.inf

    def _check_deadlines(self) -> None:
        now = time.monotonic()
        running = self._running()
        if (
            running is not None
            and running.started_at is not None
            and now > running.started_at + self.timeout_s
        ):
            self._fail(
                running.key, failure(Reason.REWARD_TIMEOUT, f"reward timed out after {self.timeout_s:g}s")
            )
            self._restart()
        elif (
            not self._ready
            and self._pending
            and self._child is not None
            and now > self._child.spawned_at + self.startup_timeout_s
        ):
            self._fail_all(
                failure(
                    Reason.REWARD_CRASHED, f"reward process did not start within {self.startup_timeout_s:g}s"
                )
            )

    def _on_crash(self) -> None:
        assert self._child is not None
        how = self._child.exit_description()
        if self._pending and not self._broken:
            self._fail_running(f"reward process died ({how}) while scoring")
        else:
            self._kill()  # idle child died (or fatal): restart lazily on the next submit

    def _running(self) -> _Pending | None:
        """The sample the child is scoring: the oldest pending one, once it has started."""
        first = next(iter(self._pending.values()), None)
        return first if first is not None and first.started_at is not None else None

    def _fail_running(self, error: str) -> None:
        """Blame the running (else the oldest) pending sample, restart the child for the rest."""
        first = next(iter(self._pending), None)
        if first is not None:
            self._fail(first, failure(Reason.REWARD_CRASHED, error))
        self._restart()

    def _fail(self, key: int, error: str) -> None:
        del self._pending[key]
        self._results.append(RewardResult(key, None, error))

    def _fail_all(self, error: str) -> None:
        for key in list(self._pending):
            self._fail(key, error)
        self._kill()


def score_now(
    spec: str, response_text: str, answer: str, metadata: dict[str, str], timeout_s: float
) -> RewardResult:
    """Score one sample synchronously in a fresh child process (tests, one-shot use); key 0.

    Start-up of the child is not counted in `timeout_s`. Raises RewardError for a bad spec."""
    with RewardRunner(spec, timeout_s) as runner:
        runner.submit(0, response_text, answer, metadata)
        while True:
            results = runner.poll(wait_s=1.0)
            if results:
                return results[0]


def _finite_float(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


# ---------------------------------------------------------------------------------------------------
# the child process


def _score_one(reward: Any, msg: dict[str, Any]) -> tuple[float | None, str]:
    try:
        value = reward.fn(msg["response"], msg["answer"], msg["metadata"])
    except BaseException as exc:  # SystemExit/KeyboardInterrupt in a reward are its errors too
        return None, failure(Reason.REWARD_ERROR, f"reward raised {one_line_error(exc)}")
    try:
        return check_reward_value(value), ""
    except (TypeError, ValueError) as exc:
        return None, failure(Reason.REWARD_ERROR, str(exc))


def child_main(argv: list[str]) -> int:
    """Entry point of the child: `python -m actors.reward_runner SPEC`."""
    lines, send = child_protocol(PROTOCOL_VERSION)
    if len(argv) != 1:
        send(t="fatal", error=f"usage: python -m actors.reward_runner SPEC, got {argv!r}")
        return 2
    try:
        reward = load_reward(argv[0])
    except RewardError as exc:
        send(t="fatal", error=str(exc))
        return 1
    send(t="ready")
    for line in lines:
        msg = json.loads(line)
        send(t="start", key=msg["key"], at=time.monotonic())
        value, error = _score_one(reward, msg)
        send(t="done", key=msg["key"], reward=value, error=error)
    return 0


if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1:]))
