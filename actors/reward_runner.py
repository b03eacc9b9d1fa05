"""Scores finished samples in a long-lived child process, so that no reward can block the worker.

The worker-side API is non-blocking: `submit` queues a sample, `poll` returns the results ready so far,
`cancel_all` (on abort) drops everything at once, `close` stops the child. Every submitted key gets
exactly one `RewardResult` unless it is cancelled: a finite float, or None with a one-line error that
starts with its reason (`april.failures`); nothing is silently scored 0. This module owns the scoring
rules (timeouts counted from the child's start of a sample, who is blamed on a crash, what is re-sent);
`actors.supervisor` owns the children themselves. The child's pipe and the failure policy are
docs/protocol.md, section 18. Not thread-safe: one worker loop owns a runner. Knows nothing about
samples, sockets or the broker.
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from actors.child_process import encode_line, serve
from actors.rewards import RewardError, check_reward_value, load_reward, one_line_error
from actors.supervisor import Slot, Supervisor
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
    started_at: float = math.nan  # time.monotonic() when the child began scoring it ("start")


class RewardRunner(Supervisor[_Pending, RewardResult]):
    """Non-blocking reward scoring in a killable child process (see the module docstring). The child's
    slot holds the sample it is scoring, once it has said "start"."""

    module = "actors.reward_runner"
    noun = "reward"
    crash_reason = Reason.REWARD_CRASHED

    def __init__(self, spec: str, timeout_s: float, startup_timeout_s: float = 60.0) -> None:
        if not timeout_s > 0 or not startup_timeout_s > 0:
            raise ValueError(
                f"timeout_s and startup_timeout_s must be > 0, got {timeout_s}, {startup_timeout_s}"
            )
        load_reward(spec)  # validate at start-up, in this process: a bad spec is a RewardError here
        self.timeout_s = timeout_s
        self._pending: dict[int, _Pending] = {}  # submission order = the child's scoring order
        super().__init__(spec, [], 1, startup_timeout_s)

    # -- public API ---------------------------------------------------------------------------------

    @property
    def pending(self) -> int:
        """Submitted samples without a result yet."""
        return len(self._pending)

    def submit(self, key: int, response_text: str, answer: str, metadata: dict[str, str]) -> None:
        """Queue one sample for scoring; never blocks. `key` must not be pending already."""
        if self._refused(key):
            return
        if key in self._pending:
            raise ValueError(f"reward key {key} is already pending")
        msg = {"v": PROTOCOL_VERSION, "t": "score", "key": key, "response": response_text,
               "answer": answer, "metadata": dict(metadata)}  # fmt: skip
        item = _Pending(key, encode_line(msg))
        self._pending[key] = item
        slot = self._slots[0]
        if slot is None:
            self._slots[0] = slot = self._spawn()
        slot.child.send(item.line)
        self._pump()

    def cancel_all(self) -> None:
        """Drop every pending sample and every undelivered result; returns at once. A busy child is killed
        and restarted rather than waited on."""
        self._results.clear()
        if self._pending:
            self._pending.clear()
            self._replace(0)
        self._reaper.reap()

    # -- the job's rules --------------------------------------------------------------------------------

    def _failed(self, key: int, error: str) -> RewardResult:
        return RewardResult(key, None, error)

    def _busy(self) -> bool:
        return bool(self._pending)

    def _waiting(self) -> bool:
        return bool(self._pending)

    def _idle(self, slot: Slot[_Pending]) -> bool:
        return not self._pending

    def _on_message(self, i: int, slot: Slot[_Pending], kind: str, msg: dict[str, Any]) -> bool:
        key = msg.get("key")
        if kind == "start" and isinstance(msg.get("at"), float) and key in self._pending:
            slot.job = self._pending[key]
            slot.job.started_at = min(msg["at"], time.monotonic())
        elif kind == "done" and key in self._pending:
            reward, error = msg.get("reward"), msg.get("error")
            if not isinstance(error, str) or not (reward is None or _finite_float(reward)):
                return False
            if slot.job is self._pending[key]:
                slot.job = None
            del self._pending[key]
            self._results.append(RewardResult(key, None if reward is None else float(reward), error))
        else:
            return False
        return True

    def _job_deadline(self, job: _Pending) -> float:
        return job.started_at + self.timeout_s

    def _on_timeout(self, i: int, job: _Pending) -> None:
        self._fail(job.key, failure(Reason.REWARD_TIMEOUT, f"reward timed out after {self.timeout_s:g}s"))
        self._restart()

    def _died(self, i: int, how: str) -> str:
        if not self._pending or self._broken:
            return ""  # an idle child died (or a fatal one): restart lazily on the next submit
        return failure(Reason.REWARD_CRASHED, f"reward process died ({how}) while scoring")

    def _fail_running(self, i: int, error: str) -> None:
        """Blame the running (else the oldest) pending sample, restart the child for the rest."""
        first = next(iter(self._pending), None)
        if first is not None:
            self._fail(first, error)
        self._restart()

    def _fail_all(self, error: str) -> None:
        for key in list(self._pending):
            self._fail(key, error)

    def _fail_waiting(self, error: str) -> None:
        self._fail_all(error)

    def _drop_pending(self) -> None:
        self._pending.clear()

    def _restart(self) -> None:
        """Kill the child and re-send every pending sample, in order, to a fresh one."""
        self._kill(0)
        if self._pending and not self._closed:
            self._slots[0] = slot = self._spawn()
            for item in self._pending.values():
                slot.child.send(item.line)

    def _fail(self, key: int, error: str) -> None:
        del self._pending[key]
        self._results.append(RewardResult(key, None, error))


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


def _answer(reward: Any, msg: dict[str, Any], send: Callable[..., None]) -> None:
    send(t="start", key=msg["key"], at=time.monotonic())
    value, error = _score_one(reward, msg)
    send(t="done", key=msg["key"], reward=value, error=error)


def child_main(argv: list[str]) -> int:
    """Entry point of the child: `python -m actors.reward_runner SPEC`."""
    usage = "python -m actors.reward_runner SPEC"
    return serve(PROTOCOL_VERSION, usage, argv, (1,), load_reward, RewardError, _answer)


if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1:]))
