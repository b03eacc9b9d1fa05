"""What an episode is made of: messages, tool calls, tools, environment steps, and the Environment protocol.

An environment turns a prompt record into the first observation (`reset`) and answers each model turn with
an observation or done-with-reward (`step`), pure over its JSON-text state, so any worker can continue an
episode from the sample alone. Messages and tool calls are OpenAI-style (`to_openai` / `from_openai`, the
form chat templates take); the same JSON crosses the tool runner's pipe and fills a sample's `episode`
bytes (`EpisodeState`). `load_environment` resolves an env spec (a built-in name or `module:Class`) with
one-line errors; `call_tools` answers a turn's tool calls, malformed and unknown ones with an error message.
Each step has a `StepKey` (the sample's identity and the step's index), the same for every run of it, which
`run_step` hands to an environment whose `step` takes a `key`: side effects can be deduplicated by it.

Does not tokenize (`april.chat`), run anything in a child process (`actors.tool_runner`) nor hold the
built-in environments (`april.envs`, `actors.python_env`). No torch, no transformers.
"""

from __future__ import annotations

import importlib
import inspect
import json
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

import numpy as np

from april.data import PromptRecord
from april.failures import Reason, failure

EPISODE_VERSION = 1  # of `EpisodeState.to_bytes`


class EpisodeError(Exception):
    """Bad episode input (a message, a spec, a state, an environment's answer); the message is one line."""


class EnvFailed(EpisodeError):
    """Raised by an environment's reset or step to fail its sample for `reason` (`april.failures`) with
    this one-line message, instead of the `env_error` any other exception gives."""

    def __init__(self, reason: Reason, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class ToolError(Exception):
    """Raised by a tool handler for a bad call: the model sees `error: <message>`, the episode goes on."""


class Role(StrEnum):
    SYSTEM = "system"
    USER = "user"
    ASSISTANT = "assistant"
    TOOL = "tool"


@dataclass(frozen=True, slots=True)
class ToolCall:
    """One call the model made. `error` is non-empty when its text could not be read as a call (bad JSON,
    no name): the call is answered with that error and never run."""

    id: str
    name: str
    arguments: Mapping[str, Any] = field(default_factory=dict)
    error: str = ""

    def to_openai(self) -> dict[str, Any]:
        """`{"id", "type": "function", "function": {"name", "arguments"}}`, arguments as an object (as chat
        templates take them; the OpenAI HTTP API sends a JSON string, which `from_openai` accepts too)."""
        function = {"name": self.name, "arguments": dict(self.arguments)}
        return _with_present({"id": self.id, "type": "function", "function": function}, error=self.error)

    @classmethod
    def from_openai(cls, obj: object) -> ToolCall:
        if not isinstance(obj, dict):
            raise EpisodeError(f"tool call: got {_kind(obj)}, expected an object")
        fn = obj.get("function", obj)
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise EpisodeError(f"tool call: got {_short(obj)}, expected a function with a string name")
        arguments = fn.get("arguments", {})
        if isinstance(arguments, str):
            try:
                arguments = json.loads(arguments) if arguments.strip() else {}
            except ValueError:
                raise EpisodeError(
                    f"tool call {fn['name']!r}: arguments {_short(arguments)} are not JSON"
                ) from None
        if not isinstance(arguments, dict):
            raise EpisodeError(
                f"tool call {fn['name']!r}: arguments are {_kind(arguments)}, expected an object"
            )
        return cls(_str(obj, "id"), fn["name"], arguments, _str(obj, "error"))


@dataclass(frozen=True, slots=True)
class Message:
    role: Role
    content: str
    tool_calls: tuple[ToolCall, ...] = ()  # an assistant turn's calls
    tool_call_id: str = ""  # a tool message: the call it answers
    name: str = ""  # a tool message: the tool's name

    def to_openai(self) -> dict[str, Any]:
        return _with_present(
            {"role": self.role.value, "content": self.content},
            tool_calls=[call.to_openai() for call in self.tool_calls],
            tool_call_id=self.tool_call_id,
            name=self.name,
        )

    @classmethod
    def from_openai(cls, obj: object) -> Message:
        if not isinstance(obj, dict):
            raise EpisodeError(f"message: got {_kind(obj)}, expected an object with role and content")
        try:
            role = Role(str(obj.get("role")))
        except ValueError:
            roles = ", ".join(r.value for r in Role)
            raise EpisodeError(
                f"message role: got {_short(obj.get('role'))}, expected one of {roles}"
            ) from None
        content = obj.get("content")
        if content is None:
            content = ""  # an assistant message with only tool calls has content null in the OpenAI API
        if not isinstance(content, str):
            raise EpisodeError(f"message content: got {_kind(content)}, expected a string")
        calls = obj.get("tool_calls")
        if calls is None:
            calls = []
        if not isinstance(calls, list):
            raise EpisodeError(f"message tool_calls: got {_kind(calls)}, expected a list")
        return cls(
            role,
            content,
            tuple(ToolCall.from_openai(c) for c in calls),
            _str(obj, "tool_call_id"),
            _str(obj, "name"),
        )


@dataclass(frozen=True, slots=True)
class Tool:
    """A tool an environment offers. `repeatable`: running a call twice is harmless (pure code, a lookup),
    so a call running when an abort comes is killed and run again on resume; otherwise its result is
    waited for and kept. `timeout_s`: how long one call may take before it is answered with a timeout."""

    name: str
    description: str
    parameters: Mapping[str, Any]  # JSON schema of the arguments object
    repeatable: bool = True
    timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if not self.name or not isinstance(self.name, str):
            raise EpisodeError(f"tool name: got {self.name!r}, expected a non-empty string")
        if not (
            isinstance(self.timeout_s, int | float) and math.isfinite(self.timeout_s) and self.timeout_s > 0
        ):
            raise EpisodeError(f"tool {self.name!r} timeout_s: got {self.timeout_s!r}, expected a number > 0")

    def to_openai(self) -> dict[str, Any]:
        """The tool as chat templates and the OpenAI API take it."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": dict(self.parameters),
            },
        }


@dataclass(frozen=True, slots=True)
class EnvStep:
    """An environment's answer: the observation messages, its new state, and whether the episode ended
    (then `reward` is a finite float; otherwise None)."""

    observation: tuple[Message, ...]
    state: str
    done: bool = False
    reward: float | None = None

    def __post_init__(self) -> None:
        if not isinstance(self.state, str):
            raise EpisodeError(f"environment state: got {_kind(self.state)}, expected a string (JSON text)")
        if not all(isinstance(m, Message) for m in self.observation):
            raise EpisodeError("environment observation: expected a tuple of Message")
        if self.done and not _finite(self.reward):
            raise EpisodeError(
                f"environment ended the episode with reward {self.reward!r}, expected a finite number"
            )
        if not self.done and self.reward is not None:
            raise EpisodeError(f"environment gave reward {self.reward!r} without ending the episode")

    def to_json(self) -> dict[str, Any]:
        return {
            "observation": [m.to_openai() for m in self.observation],
            "state": self.state,
            "done": self.done,
            "reward": self.reward,
        }

    @classmethod
    def from_json(cls, obj: object) -> EnvStep:
        if not isinstance(obj, dict) or not isinstance(obj.get("observation"), list):
            raise EpisodeError(
                f"environment step: got {_short(obj)}, expected an object with an observation list"
            )
        reward: Any = obj.get("reward")
        return cls(
            tuple(Message.from_openai(m) for m in obj["observation"]),
            obj.get("state"),  # type: ignore[arg-type]  # checked in __post_init__
            obj.get("done") is True,
            float(reward) if _finite(reward) else reward,
        )


class Environment(Protocol):
    """A multi-turn task. `reset` is deterministic in the record (all samples of a group share it); `step`
    depends only on (state, turn), where `turn` is the parsed model turn (`april.chat.parse_turn`). A `step`
    may also take a keyword `key: StepKey` (`run_step` passes it then). An environment may set
    `final_step_repeatable = False`: a step whose turn calls no tool (the final, scoring one) then has
    effects, and an abort waits for it as for a non-repeatable tool (absent: True). A state that cannot
    be written down (live objects) may stay in the environment's process: `step` answers
    `live_state(handle)` for it, and the environment then has `release(state)`, called when the episode
    ends without a step that frees it (the worker's tool runner routes its steps to that process). An
    environment whose reward needs the whole group sets `group_scored = True` and defines
    `score_group(finals) -> rewards` over the done steps' states of a group's episodes; the learner calls
    it (`learner.group_rewards`)."""

    tools: tuple[Tool, ...]

    def reset(self, prompt: PromptRecord) -> EnvStep: ...

    def step(self, state: str, turn: Message) -> EnvStep: ...


# ---------------------------------------------------------------------------------------------------
# what crosses the tool runner's pipe and what a sample's `episode` bytes hold


@dataclass(frozen=True, slots=True)
class ResetRequest:
    prompt: PromptRecord  # its text and metadata cross the pipe; token ids do not (environments read text)

    def to_json(self) -> dict[str, Any]:
        p = self.prompt
        return {"t": "reset", "index": p.prompt_index, "text": p.text, "metadata": dict(p.metadata)}


@dataclass(frozen=True, slots=True)
class StepKey:
    """Which step this is: the sample's identity (`group_id`, `index` in its group) and the step's index
    (`step`: the model turns of the episode stepped before it, 0 for the first). Every run of one step has
    the same key: one run only across aborts (docs/episodes.md), and a replay after a worker crash
    carries the key of the run it repeats, so an environment with side effects can recognise it. Unique
    within a run (group ids are never reused); `str(key)` is `"group-index-step"`."""

    group_id: int
    index: int
    step: int

    def __str__(self) -> str:
        return f"{self.group_id}-{self.index}-{self.step}"

    def to_json(self) -> list[int]:
        return [self.group_id, self.index, self.step]

    @classmethod
    def from_json(cls, obj: object) -> StepKey:
        if not (isinstance(obj, list) and len(obj) == 3 and all(type(x) is int and x >= 0 for x in obj)):
            raise EpisodeError(f"step key: got {_short(obj)}, expected [group_id, index, step] (ints >= 0)")
        return cls(obj[0], obj[1], obj[2])


@dataclass(frozen=True, slots=True)
class StepRequest:
    state: str
    turn: Message
    key: StepKey | None = None  # None: a step no sample owns (a demonstration's, a test's)

    def to_json(self) -> dict[str, Any]:
        key = None if self.key is None else self.key.to_json()
        return {"t": "step", "state": self.state, "turn": self.turn.to_openai(), "key": key}


EnvRequest = ResetRequest | StepRequest


def request_from_json(obj: object) -> EnvRequest:
    if not isinstance(obj, dict):
        raise EpisodeError(f"environment request: got {_kind(obj)}, expected an object")
    if obj.get("t") == "reset":
        metadata = obj.get("metadata")
        if not isinstance(metadata, dict) or not isinstance(obj.get("index"), int):
            raise EpisodeError(f"reset request: got {_short(obj)}, expected index, text and metadata")
        ids = np.zeros(0, dtype=np.int32)
        ids.flags.writeable = False
        return ResetRequest(
            PromptRecord(obj["index"], ids, _str(obj, "text"), {str(k): str(v) for k, v in metadata.items()})
        )
    if obj.get("t") == "step" and isinstance(obj.get("state"), str):
        key = None if obj.get("key") is None else StepKey.from_json(obj["key"])
        return StepRequest(obj["state"], Message.from_openai(obj.get("turn")), key)
    raise EpisodeError(f"environment request: got {_short(obj)}, expected a reset or a step")


@dataclass(frozen=True, slots=True)
class EpisodeState:
    """The episode part of a sample (`Sample.episode`): the environment's state after its last step, the
    model turns finished, and `owed`: a finished model turn whose step has not been applied yet (it was
    killed by an abort and is run again on resume), or None."""

    env_state: str
    turns: int = 0
    owed: Message | None = None

    def to_bytes(self) -> bytes:
        obj = {
            "v": EPISODE_VERSION,
            "env_state": self.env_state,
            "turns": self.turns,
            "owed": None if self.owed is None else self.owed.to_openai(),
        }
        return json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> EpisodeState:
        try:
            obj = json.loads(data)
        except ValueError:
            raise EpisodeError(f"episode state: {len(data)} bytes that are not JSON") from None
        if not isinstance(obj, dict) or obj.get("v") != EPISODE_VERSION:
            got = obj.get("v") if isinstance(obj, dict) else _kind(obj)
            raise EpisodeError(f"episode state: version {got!r}, expected {EPISODE_VERSION}")
        turns, env_state = obj.get("turns"), obj.get("env_state")
        if not isinstance(env_state, str) or type(turns) is not int or turns < 0:
            raise EpisodeError(f"episode state: got {_short(obj)}, expected env_state text and turns >= 0")
        owed = obj.get("owed")
        return cls(env_state, turns, None if owed is None else Message.from_openai(owed))


LIVE_STATE = "april-live:"  # an environment state kept in a worker's memory, named by the text after it


def live_state(handle: str) -> str:
    """The state text of a state the environment keeps in its process under `handle` (live objects)."""
    return LIVE_STATE + handle


def live_handle(state: str) -> str | None:
    """The handle of a live state (`live_state`), or None for a state written down in full."""
    return state[len(LIVE_STATE) :] if state.startswith(LIVE_STATE) else None


def holds_live_state(episode: bytes) -> bool:
    """Whether a sample's episode (`Sample.episode`) names a state kept in its worker's memory: such a
    sample can resume only there (docs/protocol.md, "Pinned partials")."""
    if LIVE_STATE.encode() not in episode:  # the common case, without parsing the state
        return False
    try:
        return live_handle(EpisodeState.from_bytes(episode).env_state) is not None
    except EpisodeError:
        return False


# ---------------------------------------------------------------------------------------------------
# helpers for environments


def prompt_messages(prompt: PromptRecord) -> tuple[Message, ...]:
    """The record's chat messages (metadata "messages", as JSONL chat datasets carry them), else one user
    message with its text."""
    raw = prompt.metadata.get("messages")
    if raw:
        try:
            items = json.loads(raw)
        except ValueError:
            raise EpisodeError(f"prompt {prompt.prompt_index}: metadata messages are not JSON") from None
        if not isinstance(items, list):
            raise EpisodeError(
                f"prompt {prompt.prompt_index}: metadata messages are {_kind(items)}, expected a list"
            )
        return tuple(Message.from_openai(m) for m in items)
    return (Message(Role.USER, prompt.text),)


ToolHandler = Callable[[Mapping[str, Any]], str]


def call_tools(turn: Message, handlers: Mapping[str, ToolHandler]) -> tuple[Message, ...]:
    """One tool message per call of `turn`, in order: the handler's text, or `error: ...` for a malformed
    call, an unknown tool, or a handler that raised ToolError. Any other exception propagates (a bug in
    the environment fails the sample)."""
    out = []
    for call in turn.tool_calls:
        if call.error:
            text = f"error: {call.error}"
        elif call.name not in handlers:
            text = f"error: unknown tool {call.name!r}; tools: {', '.join(sorted(handlers)) or 'none'}"
        else:
            try:
                text = handlers[call.name](call.arguments)
            except ToolError as exc:
                text = f"error: {exc}"
        out.append(Message(Role.TOOL, text, tool_call_id=call.id, name=call.name))
    return tuple(out)


def answer_problem(request: EnvRequest, step: EnvStep) -> str:
    """What makes `step` no answer to `request`, as a sample's error (`april.failures`), or "": a reset
    that answers no messages (the episode's prompt is made of them), a state that is not JSON text (the
    next step could not read it)."""
    what = "reset" if isinstance(request, ResetRequest) else "step"
    if what == "reset" and not step.observation:
        return failure(Reason.ENV_EMPTY_RESET, "environment reset answered no messages: there is no prompt")
    if live_handle(step.state) is not None:  # kept in the environment's process (`live_state`)
        return ""
    try:
        json.loads(step.state)
    except ValueError:
        return failure(
            Reason.ENV_BAD_STATE, f"environment {what} answered state {_short(step.state)}: not JSON"
        )
    return ""


def step_timeout_s(tools: Sequence[Tool], turn: Message) -> float:
    """The time the calls of `turn` may take together: the sum of the called tools' timeouts (unknown and
    malformed calls run nothing)."""
    by_name = {t.name: t for t in tools}
    return sum(by_name[c.name].timeout_s for c in turn.tool_calls if not c.error and c.name in by_name)


def repeatable(tools: Sequence[Tool], request: EnvRequest, final_step_repeatable: bool = True) -> bool:
    """Whether running `request` twice is harmless: a reset always; a step that runs tools if every tool
    it calls is; a step that runs none (its turn calls no tool, or none it has) if the environment says
    so (`final_step_repeatable`)."""
    if isinstance(request, ResetRequest):
        return True
    by_name = {t.name: t for t in tools}
    called = [by_name[c.name] for c in request.turn.tool_calls if not c.error and c.name in by_name]
    if not called:
        return final_step_repeatable
    return all(tool.repeatable for tool in called)


def final_step_repeatable(env: object) -> bool:
    """The environment's `final_step_repeatable` (checked by `check_environment`), True when absent."""
    value = getattr(env, "final_step_repeatable", True)
    return value is True


def takes_key(env: object) -> bool:
    """Whether the environment's `step` takes a `key` keyword (or any keyword)."""
    try:
        params = inspect.signature(env.step).parameters  # type: ignore[attr-defined]
    except (TypeError, ValueError):  # a builtin or C callable without a signature: called without it
        return False
    return "key" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def run_step(env: Environment, request: StepRequest, with_key: bool) -> EnvStep:
    """The environment's answer to `request`, its key passed when `with_key` (`takes_key(env)`)."""
    if with_key and request.key is not None:
        return env.step(request.state, request.turn, key=request.key)  # type: ignore[call-arg]
    return env.step(request.state, request.turn)


# ---------------------------------------------------------------------------------------------------
# start-up validation


def load_environment(spec: str, builtins: Mapping[str, Callable[[], Environment]]) -> Environment:
    """Build the environment `spec` names: a key of `builtins`, or `module:Class` (imported, never
    evaluated; called with no arguments). Raises a one-line EpisodeError when it cannot."""
    if spec in builtins:
        env = builtins[spec]()
    else:
        module_name, sep, attr = spec.partition(":")
        if not sep or not module_name or not attr or ":" in attr:
            names = ", ".join(sorted(builtins))
            raise EpisodeError(f"env: got {spec!r}, expected one of {names} or 'module:Class'")
        factory = _resolve(spec, module_name, attr)
        try:
            env = factory()
        except EpisodeError as exc:
            raise EpisodeError(f"env {spec!r}: {exc}") from None
        except Exception as exc:
            raise EpisodeError(f"env {spec!r}: constructing it raised {one_line(exc)}") from None
    check_environment(spec, env)
    return env


def check_environment(spec: str, env: object) -> None:
    """The environment has callable reset and step and a tuple of uniquely named Tools."""
    for method in ("reset", "step"):
        if not callable(getattr(env, method, None)):
            raise EpisodeError(f"env {spec!r}: {type(env).__name__} has no {method}() method")
    tools = getattr(env, "tools", None)
    if not isinstance(tools, tuple) or not all(isinstance(t, Tool) for t in tools):
        raise EpisodeError(f"env {spec!r}: tools is {_kind(tools)}, expected a tuple of april.episode.Tool")
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise EpisodeError(f"env {spec!r}: tool names {names} repeat")
    final = getattr(env, "final_step_repeatable", True)
    if not isinstance(final, bool):
        raise EpisodeError(f"env {spec!r}: final_step_repeatable is {_short(final)}, expected True or False")


def _resolve(spec: str, module_name: str, attr: str) -> Callable[[], Environment]:
    try:
        obj: object = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name is not None and (module_name + ".").startswith(exc.name + "."):
            raise EpisodeError(f"env {spec!r}: module {module_name!r} not found") from None
        raise EpisodeError(f"env {spec!r}: importing {module_name!r} failed: {one_line(exc)}") from None
    except Exception as exc:
        raise EpisodeError(f"env {spec!r}: importing {module_name!r} failed: {one_line(exc)}") from None
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise EpisodeError(f"env {spec!r}: module {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise EpisodeError(f"env {spec!r}: {attr!r} is a {type(obj).__name__}, not a class")
    return obj


def one_line(exc: BaseException) -> str:
    """`Type: message` on one line, at most ~300 characters."""
    message = " ".join(str(exc).split())
    text = f"{type(exc).__name__}: {message}" if message else type(exc).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def _with_present(out: dict[str, Any], **optional: Any) -> dict[str, Any]:
    """`out` and those `optional` fields that are not empty: the OpenAI form leaves absent ones out."""
    return out | {key: value for key, value in optional.items() if value}


def _finite(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _str(obj: dict[str, Any], key: str) -> str:
    value = obj.get(key, "")
    if value is None:
        return ""
    if not isinstance(value, str):
        raise EpisodeError(f"{key}: got {_kind(value)}, expected a string")
    return value


def _kind(value: object) -> str:
    return "null" if value is None else type(value).__name__


def _short(value: object) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."
