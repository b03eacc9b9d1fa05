"""Runs environment steps (resets and tool calls) in killable child processes, so no tool blocks the worker.

The worker-side API is non-blocking: `submit(key, request)` queues a `ResetRequest` or `StepRequest`,
`poll` returns the results ready so far, `cancel(key)` withdraws one (an abort), `close` stops the
children. Every submitted key gets exactly one `ToolResult` unless it is cancelled: an `EnvStep`, or None
with a one-line error. `settings.processes` children each run one request at a time; the parent keeps the
queue and hands the oldest request to the first idle child. A child is `python -m actors.tool_runner SPEC`
(the pipe carries JSON lines, never pickle; `actors.child_process` owns the mechanics):

    worker -> child  {"v": 1, "t": "run", "key": K, "request": ResetRequest/StepRequest.to_json()}
    child -> worker  {"v": 1, "t": "ready"}                  environment loaded
                     {"v": 1, "t": "fatal", "error": str}    it could not be; the child exits
                     {"v": 1, "t": "done", "key": K, "step": EnvStep.to_json()}  or  "error": str

Time limits, counted from the request's hand-over to a ready child: a reset or a step without tool calls
gets `settings.step_timeout_s`; a step with tool calls that much plus the called tools' `timeout_s`. A step
with tool calls that overruns is answered with an error observation ("error: tool timed out after 5 s")
and the environment's state unchanged; a reset or call-less step that overruns, env code that raises, an
answer `april.episode.answer_problem` refuses (a reset without messages, a state that is not JSON) and a
child that dies fail the request. The child is then killed and restarted; one failure per restart. Every
error starts with its reason (`april.failures`).

`cancel(key)`: a queued request is dropped; a result already read (or answered in the pipe) is kept and
delivered, never dropped; a running one is killed if running it again is harmless (every tool it calls is
`repeatable`, or, calling none, the environment's `final_step_repeatable`: `april.episode.repeatable`),
else left to finish and delivered. A step's `StepKey` reaches an environment whose `step` takes a `key`.
An environment spec that cannot be loaded is a one-line EpisodeError at construction; a child that
reports "fatal" fails every request from then on. Not thread-safe: one worker loop owns a runner.
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from actors.child_process import JsonLinesChild, Reaper, child_protocol, encode_line, wait_readable
from actors.python_env import PythonEnvironment
from april.envs.calculator import CalculatorEnvironment
from april.envs.openenv_adapter import OpenEnvEnvironment, is_openenv
from april.envs.verifiers_adapter import VerifiersEnvironment, is_verifiers
from april.episode import (
    EnvFailed,
    Environment,
    EnvRequest,
    EnvStep,
    EpisodeError,
    Message,
    ResetRequest,
    Role,
    StepRequest,
    Tool,
    answer_problem,
    check_environment,
    final_step_repeatable,
    load_environment,
    one_line,
    repeatable,
    request_from_json,
    run_step,
    step_timeout_s,
    takes_key,
)
from april.failures import Reason, failure

PROTOCOL_VERSION = 1

BUILTIN_ENVIRONMENTS: dict[str, Callable[[], Environment]] = {
    "calculator": CalculatorEnvironment,
    "python": PythonEnvironment,
}


def load_env(spec: str, args: str = "") -> Environment:
    """The environment `spec` names (a built-in, `module:Class`, `verifiers:MODULE` or `openenv:URL`, the
    last two made with `args`), or a one-line EpisodeError."""
    if is_verifiers(spec) or is_openenv(spec):
        env: Environment = (VerifiersEnvironment if is_verifiers(spec) else OpenEnvEnvironment)(spec, args)
        check_environment(spec, env)
        return env
    return load_environment(spec, BUILTIN_ENVIRONMENTS)


@dataclass(frozen=True, slots=True)
class ToolRunnerSettings:
    processes: int = 2  # child processes, each running one request at a time
    step_timeout_s: float = 10.0  # a reset or a step's own code, on top of its tools' timeouts
    startup_timeout_s: float = 60.0  # a child's loading of the environment

    def __post_init__(self) -> None:
        if self.processes < 1 or not self.step_timeout_s > 0 or not self.startup_timeout_s > 0:
            raise ValueError(f"ToolRunnerSettings: got {self}, expected processes >= 1 and timeouts > 0")


@dataclass(frozen=True, slots=True)
class ToolResult:
    """The outcome of one request: `step`, or None and `error` (one line). `timed_out`: the step's tools
    ran out of time, `step` is the timeout observation and `error` says which (a tool_timeout)."""

    key: int
    step: EnvStep | None
    error: str = ""
    timed_out: bool = False

    @property
    def ok(self) -> bool:
        return self.step is not None


@dataclass(slots=True)
class _Job:
    key: int
    request: EnvRequest
    line: bytes
    tools_s: float  # the called tools' share of the time limit (0 for resets and call-less steps)
    repeatable: bool
    started_at: float = math.nan  # time.monotonic() at hand-over to a child

    @property
    def what(self) -> str:
        return "reset" if isinstance(self.request, ResetRequest) else "step"


@dataclass(slots=True)
class _Slot:
    child: JsonLinesChild
    ready: bool = False
    job: _Job | None = None


class ToolRunner:
    """Non-blocking environment steps in killable child processes (see the module docstring)."""

    def __init__(
        self, spec: str, settings: ToolRunnerSettings = ToolRunnerSettings(), args: str = ""
    ) -> None:
        env = load_env(spec, args)  # validate here: a bad spec raises at once
        self.tools: tuple[Tool, ...] = env.tools
        self.final_step_repeatable = final_step_repeatable(env)
        self.spec, self.args = spec, args
        self.settings = settings
        self._queue: dict[int, _Job] = {}  # waiting for a child, oldest first
        self._results: list[ToolResult] = []
        self._slots: list[_Slot | None] = [self._spawn() for _ in range(settings.processes)]
        self._reaper = Reaper()
        self._broken = ""  # a child's "fatal": every later request fails with it
        self._closed = False

    # -- public API ---------------------------------------------------------------------------------

    @property
    def pending(self) -> int:
        """Requests submitted without a result delivered by `poll` yet."""
        return len(self._queue) + len(self._results) + self.running

    @property
    def running(self) -> int:
        """Requests a child is running now (handed over, not yet answered)."""
        return sum(1 for s in self._slots if s is not None and s.job is not None)

    def submit(self, key: int, request: EnvRequest) -> None:
        """Queue one request; never blocks. `key` must not be pending already."""
        if self._closed:
            raise RuntimeError("ToolRunner is closed")
        if key in self._queue or any(s and s.job and s.job.key == key for s in self._slots):
            raise ValueError(f"tool runner key {key} is already pending")
        if self._broken:
            self._results.append(ToolResult(key, None, self._broken))
            return
        tools_s = step_timeout_s(self.tools, request.turn) if isinstance(request, StepRequest) else 0.0
        line = encode_line({"v": PROTOCOL_VERSION, "t": "run", "key": key, "request": request.to_json()})
        again = repeatable(self.tools, request, self.final_step_repeatable)
        self._queue[key] = _Job(key, request, line, tools_s, again)
        self._pump()

    def poll(self, wait_s: float = 0.0) -> list[ToolResult]:
        """Results ready so far (possibly none). With `wait_s` > 0, wait up to that long for at least one."""
        deadline = time.monotonic() + wait_s
        self._pump()
        while not self._results and self._busy() and (now := time.monotonic()) < deadline:
            children = [s.child for s in self._slots if s is not None]
            wait_readable(children, min(deadline - now, self._next_deadline() - now, 0.05))
            self._pump()
        out, self._results = self._results, []
        return out

    def cancel(self, key: int) -> bool:
        """Withdraw request `key`. True: no result will come (it was queued, or running and repeatable and
        is killed, or is unknown). False: its result will come from `poll`: it has been answered (a result
        read is never dropped: the step ran, and running it again could repeat its effects), or it is
        running and not repeatable."""
        self._read()  # an answer waiting in a pipe is a result too, not a step to kill
        if any(r.key == key for r in self._results):
            return False
        if self._queue.pop(key, None) is not None:
            return True
        for i, slot in enumerate(self._slots):
            if slot is not None and slot.job is not None and slot.job.key == key:
                if not slot.job.repeatable:
                    return False
                slot.job = None
                self._replace(i)
        return True

    def wait_s(self) -> float:
        """The longest any running request may still take (its time limit left; 0 when none runs)."""
        now = time.monotonic()
        left = [
            slot.job.started_at + self._limit_s(slot.job) - now
            for slot in self._slots
            if slot is not None and slot.job is not None
        ]
        return max([0.0, *left])

    def close(self) -> None:
        """Stop the children (busy ones killed, idle ones asked to exit) and drop pending work."""
        if self._closed:
            return
        self._closed = True
        for i, slot in enumerate(self._slots):
            if slot is not None:
                if slot.ready and slot.job is None and slot.child.idle_pipe:
                    slot.child.close_input(wait_s=1.0)  # EOF: an idle child exits by itself
                self._kill(i)
        self._queue.clear()
        self._reaper.wait()

    def __enter__(self) -> ToolRunner:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    # -- children ---------------------------------------------------------------------------------------

    def _spawn(self) -> _Slot:
        return _Slot(JsonLinesChild("actors.tool_runner", [self.spec, self.args]))

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

    def _busy(self) -> bool:
        return bool(self._queue) or self.running > 0

    # -- I/O ------------------------------------------------------------------------------------------

    def _pump(self) -> None:
        """Read what has arrived, apply time limits, hand queued requests to idle children. Never blocks."""
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
                    break  # replaced while handling: the rest of its output is moot
            else:
                if eof:
                    self._on_exit(i, slot)

    def _handle(self, i: int, slot: _Slot, line: bytes) -> None:
        try:
            msg = json.loads(line)
            kind = msg["t"]
        except (ValueError, TypeError, KeyError):
            kind, msg = None, {}
        job = slot.job
        if kind == "ready" and not slot.ready:
            slot.ready = True
        elif kind == "fatal":
            self._broken = failure(
                Reason.ENV_CRASHED,
                f"environment process could not load {self.spec!r}: {msg.get('error', '?')}",
            )
            self._fail_everything(self._broken)
        elif kind == "done" and job is not None and msg.get("key") == job.key:
            slot.job = None
            self._results.append(self._result(job, msg))
        else:
            self._fail_running(
                i, failure(Reason.ENV_CRASHED, f"environment process broke the protocol: {line[:80]!r}")
            )

    def _result(self, job: _Job, msg: dict[str, Any]) -> ToolResult:
        if "step" not in msg:
            return ToolResult(
                job.key,
                None,
                str(msg.get("error") or failure(Reason.ENV_CRASHED, "environment process gave no step")),
            )
        try:
            return ToolResult(job.key, EnvStep.from_json(msg["step"]))
        except EpisodeError as exc:
            return ToolResult(
                job.key, None, failure(Reason.ENV_ERROR, f"environment {job.what} returned a bad step: {exc}")
            )

    def _dispatch(self) -> None:
        for i, slot in enumerate(self._slots):
            if not self._queue or self._closed or self._broken:
                return
            if slot is None:
                self._slots[i] = slot = self._spawn()
            if slot.ready and slot.job is None:
                job = self._queue.pop(next(iter(self._queue)))
                job.started_at = time.monotonic()
                slot.job = job
                slot.child.send(job.line)

    # -- failures -------------------------------------------------------------------------------------

    def _limit_s(self, job: _Job) -> float:
        return self.settings.step_timeout_s + job.tools_s

    def _next_deadline(self) -> float:
        deadlines = [math.inf]
        for slot in self._slots:
            if slot is not None and slot.job is not None:
                deadlines.append(slot.job.started_at + self._limit_s(slot.job))
            elif slot is not None and not slot.ready and self._queue:
                deadlines.append(slot.child.spawned_at + self.settings.startup_timeout_s)
        return min(deadlines)

    def _check_deadlines(self) -> None:
        now = time.monotonic()
        for i, slot in enumerate(self._slots):
            if slot is None:
                continue
            job = slot.job
            if job is not None and now > job.started_at + self._limit_s(job):
                slot.job = None
                self._results.append(self._timed_out(job))
                self._replace(i)
            elif (
                not slot.ready
                and self._queue
                and now > slot.child.spawned_at + self.settings.startup_timeout_s
            ):
                self._fail_queued(
                    failure(
                        Reason.ENV_CRASHED,
                        f"environment process did not start within {self.settings.startup_timeout_s:g}s",
                    )
                )
                self._kill(i)

    def _timed_out(self, job: _Job) -> ToolResult:
        if not isinstance(job.request, StepRequest) or not job.tools_s:
            return ToolResult(
                job.key,
                None,
                failure(
                    Reason.ENV_TIMEOUT, f"environment {job.what} timed out after {self._limit_s(job):g}s"
                ),
            )
        text = f"error: tool timed out after {job.tools_s:g} s"
        calls = job.request.turn.tool_calls
        observation = tuple(Message(Role.TOOL, text, tool_call_id=call.id, name=call.name) for call in calls)
        names = ", ".join(sorted({call.name for call in calls}))
        note = failure(Reason.TOOL_TIMEOUT, f"tool call of {names} timed out after {job.tools_s:g} s")
        return ToolResult(job.key, EnvStep(observation, job.request.state), note, timed_out=True)

    def _on_exit(self, i: int, slot: _Slot) -> None:
        how = slot.child.exit_description()
        if slot.job is not None:
            self._fail_running(
                i, failure(Reason.ENV_CRASHED, f"environment process died ({how}) during a {slot.job.what}")
            )
        else:
            self._kill(i)  # an idle child died: another starts when there is work

    def _fail_running(self, i: int, error: str) -> None:
        slot = self._slots[i]
        if slot is not None and slot.job is not None:
            self._results.append(ToolResult(slot.job.key, None, error))
            slot.job = None
        self._replace(i)

    def _fail_queued(self, error: str) -> None:
        self._results.extend(ToolResult(key, None, error) for key in self._queue)
        self._queue.clear()

    def _fail_everything(self, error: str) -> None:
        for i, slot in enumerate(self._slots):
            if slot is not None and slot.job is not None:
                self._results.append(ToolResult(slot.job.key, None, error))
            self._kill(i)
        self._fail_queued(error)


# ---------------------------------------------------------------------------------------------------
# the child process


def _run(env: Environment, request: EnvRequest, with_key: bool) -> dict[str, Any]:
    what = "reset" if isinstance(request, ResetRequest) else "step"
    try:
        step = (
            env.reset(request.prompt)
            if isinstance(request, ResetRequest)
            else run_step(env, request, with_key)
        )
    except EnvFailed as exc:  # the environment names the reason itself
        return {"error": failure(exc.reason, f"environment {what}: {exc}")}
    except BaseException as exc:  # SystemExit/KeyboardInterrupt in an environment are its errors too
        return {"error": failure(Reason.ENV_ERROR, f"environment {what} raised {one_line(exc)}")}
    if not isinstance(step, EnvStep):
        return {
            "error": failure(
                Reason.ENV_ERROR, f"environment {what} returned {type(step).__name__}, expected an EnvStep"
            )
        }
    problem = answer_problem(request, step)
    return {"error": problem} if problem else {"step": step.to_json()}


def child_main(argv: list[str]) -> int:
    """Entry point of the child: `python -m actors.tool_runner SPEC [ARGS]`."""
    lines, send = child_protocol(PROTOCOL_VERSION)
    if len(argv) not in (1, 2):
        send(t="fatal", error=f"usage: python -m actors.tool_runner SPEC [ARGS], got {argv!r}")
        return 2
    try:
        env = load_env(*argv)
    except EpisodeError as exc:
        send(t="fatal", error=str(exc))
        return 1
    send(t="ready")
    with_key = takes_key(env)
    for line in lines:
        msg = json.loads(line)
        try:
            request = request_from_json(msg["request"])
        except EpisodeError as exc:
            send(t="done", key=msg["key"], error=failure(Reason.ENV_CRASHED, f"bad request: {exc}"))
            continue
        send(t="done", key=msg["key"], **_run(env, request, with_key))
    return 0


if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1:]))
