"""Runs environment steps (resets and tool calls) in killable child processes, so no tool blocks the worker.

The worker-side API is non-blocking: `submit(key, request)` queues a `ResetRequest` or `StepRequest`,
`poll` returns the results ready so far, `cancel(key)` withdraws one (an abort), `close` stops the
children. Every submitted key gets exactly one `ToolResult` unless it is cancelled: an `EnvStep`, or None
with a one-line error. `settings.processes` children each run one request at a time; the parent keeps the
queue and hands the oldest request to the first idle child. A child is `python -m actors.tool_runner SPEC`
(JSON lines, never pickle; `actors.supervisor` owns the children and their handshake):

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

Live states (`april.episode.live_state`): a state an environment keeps in its process is at home in the
child that answered it; its steps run there only, that child is never killed for a `cancel` (its job is
waited for), `release(state)` frees it there (`{"t": "free", "state": S}`, no answer), and a step of a
state whose child is gone fails (ENV_CRASHED).
"""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from actors.child_process import JsonLinesChild, encode_line, serve
from actors.python_env import PythonEnvironment
from actors.supervisor import Slot, Supervisor
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
    live_handle,
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
LOST = "environment state lost: the process that kept it (a live state) is gone"

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


class ToolRunner(Supervisor[_Job, ToolResult]):
    """Non-blocking environment steps in killable child processes (see the module docstring)."""

    module = "actors.tool_runner"
    noun = "environment"
    crash_reason = Reason.ENV_CRASHED

    def __init__(
        self, spec: str, settings: ToolRunnerSettings = ToolRunnerSettings(), args: str = ""
    ) -> None:
        env = load_env(spec, args)  # validate here: a bad spec raises at once
        self.tools: tuple[Tool, ...] = env.tools
        self.final_step_repeatable = final_step_repeatable(env)
        self.args = args
        self.settings = settings
        self._queue: dict[int, _Job] = {}  # waiting for a child, oldest first
        self._homes: dict[str, JsonLinesChild] = {}  # live state handle -> the child that keeps it
        super().__init__(spec, [args], settings.processes, settings.startup_timeout_s)

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
        if self._refused(key):
            return
        if key in self._queue or any(s and s.job and s.job.key == key for s in self._slots):
            raise ValueError(f"tool runner key {key} is already pending")
        if self._lost(request):
            self._results.append(ToolResult(key, None, failure(Reason.ENV_CRASHED, LOST)))
            return
        tools_s = step_timeout_s(self.tools, request.turn) if isinstance(request, StepRequest) else 0.0
        line = encode_line({"v": PROTOCOL_VERSION, "t": "run", "key": key, "request": request.to_json()})
        again = repeatable(self.tools, request, self.final_step_repeatable)
        self._queue[key] = _Job(key, request, line, tools_s, again)
        self._pump()

    def next_answer_s(self) -> float | None:
        """Unknown: a step answers when its child does (the worker polls)."""
        return None

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
                if not slot.job.repeatable or slot.child in self._homes.values():  # (live states in it)
                    return False
                slot.job = None
                self._replace(i)
        return True

    def release(self, state: str) -> None:
        """Free a live state (an episode that ended without the step that frees it); others are no-ops."""
        handle = live_handle(state)
        child = self._homes.pop(handle, None) if handle is not None else None
        if child is not None and any(s is not None and s.child is child for s in self._slots):
            child.send({"v": PROTOCOL_VERSION, "t": "free", "state": state})

    @property
    def live_states(self) -> int:
        """Live states kept in the children now."""
        return len(self._homes)

    def _home(self, request: EnvRequest) -> JsonLinesChild | None:
        handle = live_handle(request.state) if isinstance(request, StepRequest) else None
        return None if handle is None else self._homes.get(handle)

    def _lost(self, request: EnvRequest) -> bool:
        """A step of a live state that no child keeps (its child died, or another worker's state)."""
        return (
            isinstance(request, StepRequest)
            and live_handle(request.state) is not None
            and (self._home(request) is None)
        )

    def wait_s(self) -> float:
        """The longest any running request may still take (its time limit left; 0 when none runs)."""
        now = time.monotonic()
        left = [self._job_deadline(s.job) - now for s in self._slots if s is not None and s.job is not None]
        return max([0.0, *left])

    # -- the job's rules --------------------------------------------------------------------------------

    def _failed(self, key: int, error: str) -> ToolResult:
        return ToolResult(key, None, error)

    def _kill(self, i: int) -> None:
        slot = self._slots[i]
        if slot is not None:
            self._homes = {h: c for h, c in self._homes.items() if c is not slot.child}  # lost with it
        super()._kill(i)

    def _busy(self) -> bool:
        return bool(self._queue) or self.running > 0

    def _waiting(self) -> bool:
        return bool(self._queue)

    def _on_message(self, i: int, slot: Slot[_Job], kind: str, msg: dict[str, Any]) -> bool:
        job = slot.job
        if kind != "done" or job is None or msg.get("key") != job.key:
            return False
        slot.job = None
        result = self._result(job, msg)
        handle = live_handle(result.step.state) if result.step is not None else None
        asked = live_handle(job.request.state) if isinstance(job.request, StepRequest) else None
        if asked is not None and asked != handle:  # its episode ended (or failed) with the step
            self._homes.pop(asked, None)
        if handle is not None:
            self._homes[handle] = slot.child
        self._results.append(result)
        return True

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
                # the oldest job this child may run: a live state's step runs only in its home
                child = slot.child
                key = next(
                    (k for k, j in self._queue.items() if self._home(j.request) in (None, child)), None
                )
                if key is None:
                    continue
                job = self._queue.pop(key)
                if self._lost(job.request):  # its home died while it waited
                    self._results.append(ToolResult(key, None, failure(Reason.ENV_CRASHED, LOST)))
                    continue
                job.started_at = time.monotonic()
                slot.job = job
                slot.child.send(job.line)

    def _limit_s(self, job: _Job) -> float:
        return self.settings.step_timeout_s + job.tools_s

    def _job_deadline(self, job: _Job) -> float:
        return job.started_at + self._limit_s(job)

    def _on_timeout(self, i: int, job: _Job) -> None:
        self._results.append(self._timed_out(job))
        self._replace(i)

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

    def _died(self, i: int, how: str) -> str:
        slot = self._slots[i]
        if slot is None or slot.job is None:
            return ""
        return failure(Reason.ENV_CRASHED, f"environment process died ({how}) during a {slot.job.what}")

    def _fail_running(self, i: int, error: str) -> None:
        slot = self._slots[i]
        if slot is not None and slot.job is not None:
            self._results.append(ToolResult(slot.job.key, None, error))
            slot.job = None
        self._replace(i)

    def _fail_waiting(self, error: str) -> None:
        self._results.extend(ToolResult(key, None, error) for key in self._queue)
        self._queue.clear()

    def _fail_all(self, error: str) -> None:
        for slot in self._slots:
            if slot is not None and slot.job is not None:
                self._results.append(ToolResult(slot.job.key, None, error))
                slot.job = None
        self._fail_waiting(error)

    def _drop_pending(self) -> None:
        self._queue.clear()


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


def _load(spec: str, args: str = "") -> tuple[Environment, bool]:
    env = load_env(spec, args)
    return env, takes_key(env)


def _answer(loaded: tuple[Environment, bool], msg: dict[str, Any], send: Callable[..., None]) -> None:
    if msg.get("t") == "free":  # a live state's episode ended elsewhere: drop it
        release = getattr(loaded[0], "release", None)
        if callable(release):
            release(str(msg.get("state", "")))
        return
    try:
        request = request_from_json(msg["request"])
    except EpisodeError as exc:
        send(t="done", key=msg["key"], error=failure(Reason.ENV_CRASHED, f"bad request: {exc}"))
        return
    send(t="done", key=msg["key"], **_run(loaded[0], request, loaded[1]))


def child_main(argv: list[str]) -> int:
    """Entry point of the child: `python -m actors.tool_runner SPEC [ARGS]`."""
    usage = "python -m actors.tool_runner SPEC [ARGS]"
    return serve(PROTOCOL_VERSION, usage, argv, (1, 2), _load, EpisodeError, _answer)


if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1:]))
