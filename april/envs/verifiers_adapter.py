"""verifiers environments run unchanged: `env.name = "verifiers:MODULE"`, `load_environment(**env.args)`.

`VerifiersEnvironment` is an april `Environment` that plays a verifiers `MultiTurnEnv` (`SingleTurnEnv`,
`ToolEnv`, ...: the classic API of verifiers 0.3, `import verifiers as vf`) one model turn at a time
through the environment's own hooks, in the order its `rollout` loop calls them: `init_state` and
`setup_state` at reset; per turn `add_model_response`, the stop conditions (`is_completed`), then
`get_prompt_messages` (its `env_response`: tool calls for a `ToolEnv`); at the end its cleanup handlers
and `rubric.score_rollout`, whose reward ends the episode (a rubric with group-level reward functions:
`score_group` of the episode alone, and the learner scores the whole group again with the rollout states
the episodes ended with, `score_group`). The verifiers state travels in april's JSON state
(`encode_state`): pydantic models by class, plain data as is. A state holding anything else (a live
object: a lock, a file, a game) stays in this process (`april.episode.live_state`), so its episode
resumes only on this worker and restarts from its prompt if the worker dies. `VerifiersPromptSource`
serves the environment's dataset.

Imports `verifiers` only when an environment is loaded (one line naming the extra when it is missing).
"""

from __future__ import annotations

import asyncio
import functools
import importlib
import json
import uuid
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

import numpy as np

from april.data.records import DatasetError, PromptRecord
from april.episode import (
    EnvStep,
    EpisodeError,
    Message,
    Role,
    Tool,
    live_handle,
    live_state,
    one_line,
    prompt_messages,
)

PREFIX = "verifiers:"
SOURCE = "verifiers"  # data.source: the environment's own dataset
INSTALL = "pip install 'april-rl[verifiers]' (or: pip install 'verifiers>=0.3,<0.4')"
INPUT_KEY = "verifiers_input"  # a record's metadata: the dataset row as verifiers reads it (JSON)
TOOL_TIMEOUT_S = 30.0  # a verifiers tool declares no time limit; one call may take this long
_PROMPT = "_april_prompt"  # the messages the pending model turn answers (kept in the state between steps)
_DROPPED = ("client", "usage_tracker", "usage")  # runtime objects, made again on each step
_MODEL = "__model__"
FINAL_STATE = "rollout_state"  # a done step's state, group-scored envs: the rollout state as it ended
T = TypeVar("T")


def is_verifiers(name: str) -> bool:
    return name.startswith(PREFIX)


def package() -> Any:
    try:
        vf = importlib.import_module("verifiers")
        vf.MultiTurnEnv  # noqa: B018  # the classic API: absent from verifiers 0.4
    except (ImportError, AttributeError) as exc:
        raise EpisodeError(
            f"verifiers (0.3, the classic API) is not usable ({one_line(exc)}); install it: {INSTALL}"
        ) from None
    return vf


@functools.lru_cache(maxsize=8)
def load(spec: str, args: str) -> Any:
    """The verifiers environment `verifiers:MODULE` names, made by `MODULE.load_environment(**args)`."""
    vf = package()
    module_name = spec.removeprefix(PREFIX)
    try:
        kwargs = json.loads(args) if args.strip() else {}
    except ValueError:
        raise EpisodeError(f"env.args = {args[:80]!r}: not JSON, expected an object") from None
    if not isinstance(kwargs, dict):
        raise EpisodeError(
            f"env.args = {args[:80]!r}: expected a JSON object of load_environment's arguments"
        )
    try:
        module = importlib.import_module(module_name)
    except Exception as exc:
        raise EpisodeError(f"env {spec!r}: importing {module_name!r} failed: {one_line(exc)}") from None
    if not callable(getattr(module, "load_environment", None)):
        raise EpisodeError(f"env {spec!r}: module {module_name!r} has no load_environment()")
    try:
        env = module.load_environment(**kwargs)
    except Exception as exc:
        raise EpisodeError(f"env {spec!r}: load_environment raised {one_line(exc)}") from None
    if not isinstance(env, vf.MultiTurnEnv):
        raise EpisodeError(
            f"env {spec!r}: load_environment gave {type(env).__name__}, expected a verifiers "
            "MultiTurnEnv (SingleTurnEnv, ToolEnv, ...)"
        )
    return env


def _run(coro: Coroutine[Any, Any, T]) -> T:
    return asyncio.run(coro)


class VerifiersEnvironment:
    """An april `Environment` over a verifiers `MultiTurnEnv` (see the module docstring)."""

    def __init__(self, spec: str, args: str = "") -> None:
        self.spec, self.args = spec, args
        self.env = load(spec, args)
        self.vf = package()
        # group-level reward functions: an episode's own reward is that of a group of one, and the learner
        # scores each group again when it holds all of it (`score_group`)
        self.group_scored: bool = bool(self.env.rubric.has_group_rewards)
        self.tools: tuple[Tool, ...] = tuple(
            # a user's Python callable: running it twice may not be harmless, so an abort waits for it
            Tool(t.name, t.description, dict(t.parameters), repeatable=False, timeout_s=TOOL_TIMEOUT_S)
            for t in self.env.tool_defs or []
        )
        self.live: dict[str, Any] = {}  # live state handle -> a verifiers state that is not JSON

    def release(self, state: str) -> None:
        """Free a live state whose episode ended elsewhere (cut off, failed)."""
        handle = live_handle(state)
        if handle is not None:
            self.live.pop(handle, None)

    def reset(self, prompt: PromptRecord) -> EnvStep:
        return _run(self._reset(prompt))

    def step(self, state: str, turn: Message) -> EnvStep:
        return _run(self._step(state, turn))

    async def _reset(self, prompt: PromptRecord) -> EnvStep:
        env = self.env
        state = await env.init_state(rollout_input(prompt), _client(self.vf), "april")
        state = await env.setup_state(state) or state
        if await env.is_completed(state):
            raise EpisodeError(
                f"verifiers env ended the episode before any turn ({state.get('stop_condition')})"
            )
        messages = await env.get_prompt_messages(state)
        state[_PROMPT] = messages
        return EnvStep(tuple(to_april(m) for m in messages), self._written(state, ""))

    def _written(self, state: Any, handle: str) -> str:
        """The state as text: JSON when it can be written down, else kept here under `handle` (a new one
        if "") and named by it."""
        try:
            return encode_state(state)
        except EpisodeError:
            handle = handle or uuid.uuid4().hex
            self.live[handle] = state
            return live_state(handle)

    def _state(self, text: str) -> tuple[Any, str]:
        """The verifiers state of `text` and its live handle ("" for a state written down)."""
        handle = live_handle(text)
        if handle is None:
            return decode_state(self.vf, text), ""
        state = self.live.pop(handle, None)  # a step that fails leaves nothing behind
        if state is None:
            raise EpisodeError(f"verifiers state {text[:60]!r}: this process keeps no such live state")
        return state, handle

    async def _step(self, text: str, turn: Message) -> EnvStep:
        env = self.env
        state, handle = self._state(text)
        asked = state.pop(_PROMPT)
        await env.add_model_response(state, asked, self._response(turn))
        if not await env.is_completed(state):
            messages = await env.get_prompt_messages(state)
            if not await env.is_completed(state):  # a final_env_response ends it here
                state[_PROMPT] = messages
                seen = len(asked) + len(state["trajectory"][-1]["completion"])
                return EnvStep(tuple(to_april(m) for m in messages[seen:]), self._written(state, handle))
        await env.cleanup(state)
        summary: dict[str, Any] = {}
        if self.group_scored:
            # the rollout as it ended, which the learner's `score_group` reads with the group's others
            try:
                summary[FINAL_STATE] = encode_state(state)
            except EpisodeError as exc:
                raise EpisodeError(f"group-level rewards need the last state written down: {exc}") from None
            await env.rubric.score_group([state])
        else:
            await env.rubric.score_rollout(state)
        await env.rubric.cleanup(state)
        reward = float(state["reward"])
        summary.update(reward=reward, stop_condition=state.get("stop_condition"))
        summary["metrics"] = state.get("metrics")
        return EnvStep((), json.dumps(summary, default=str), done=True, reward=reward)

    def score_group(self, finals: Sequence[str]) -> list[float]:
        """The rubric's rewards for a group of episodes that ended, scored together as verifiers'
        `run_group` scores them; `finals` are their last states (`EnvStep.state` of the done step)."""
        states = []
        for text in finals:
            final = json.loads(text).get(FINAL_STATE)
            if not isinstance(final, str):
                raise EpisodeError("verifiers group scoring: an episode's last state has no rollout state")
            states.append(decode_state(self.vf, final))
        _run(self.env.rubric.score_group(states))
        return [float(s["reward"]) for s in states]

    def _response(self, turn: Message) -> Any:
        """The model's turn as the verifiers `Response` a client would have returned."""
        types = self.vf.types
        calls = [
            types.ToolCall(
                id=c.id or f"call_{i}",
                name=c.name,
                # a call april could not read keeps it unreadable, so the environment answers its error
                arguments=c.error or json.dumps(dict(c.arguments)),
            )
            for i, c in enumerate(turn.tool_calls)
        ]
        message = types.ResponseMessage(
            content=turn.content,
            tool_calls=calls or None,
            finish_reason="tool_calls" if calls else "stop",
            is_truncated=False,
        )
        return types.Response(id="april", created=0, model="april", message=message)


def rollout_input(prompt: PromptRecord) -> dict[str, Any]:
    """The verifiers dataset row of a record: its own when the record came from the environment's
    dataset, else one built from its messages and answer (`data.source` another dataset)."""
    raw = prompt.metadata.get(INPUT_KEY)
    if raw:
        row: dict[str, Any] = json.loads(raw)
        return row
    return {
        "prompt": [m.to_openai() for m in prompt_messages(prompt)],
        "answer": prompt.metadata.get("answer", ""),
        "info": {},
        "example_id": prompt.prompt_index,
    }


def to_april(message: Any) -> Message:
    """A verifiers message (pydantic) as april's."""
    content = message.content
    if isinstance(content, list):  # content parts: their text
        content = "".join(str(getattr(p, "text", "") or "") for p in content)
    calls = getattr(message, "tool_calls", None) or []
    from april.episode import ToolCall

    return Message(
        Role(message.role),
        content or "",
        tuple(ToolCall(c.id, c.name, _arguments(c.arguments)) for c in calls),
        getattr(message, "tool_call_id", "") or "",
    )


def _arguments(text: str) -> dict[str, Any]:
    try:
        value = json.loads(text)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _client(vf: Any) -> Any:
    """A client that is never asked: april's engine answers the model's turns."""
    base = vf.legacy.clients.Client

    class AprilClient(base):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            pass

        def setup_client(self, config: Any) -> Any:
            return None

        async def to_native_tool(self, tool: Any) -> Any:
            raise NotImplementedError

        async def to_native_prompt(self, messages: Any) -> Any:
            raise NotImplementedError

        async def get_native_response(self, *args: Any, **kwargs: Any) -> Any:
            raise EpisodeError(
                "verifiers env asked its client for a model response: april's engine gives them"
            )

        async def raise_from_native_response(self, *args: Any, **kwargs: Any) -> Any:
            raise NotImplementedError

        async def from_native_response(self, *args: Any, **kwargs: Any) -> Any:
            raise NotImplementedError

        async def close(self) -> None:
            return None

    return AprilClient()


# ---------------------------------------------------------------------------------------------------
# the verifiers state as JSON text


def encode_state(state: dict[str, Any]) -> str:
    """The state as JSON: plain data as is, pydantic models as {"__model__": class, "v": fields}; runtime
    objects (`_DROPPED`) left out. Anything else raises a one-line EpisodeError naming the key."""
    out = {}
    for key, value in dict.items(state):
        if key in _DROPPED:
            continue
        try:
            out[key] = _encode(value)
        except TypeError as exc:
            raise EpisodeError(
                f"verifiers state[{key!r}] holds {exc}: not JSON, so the episode cannot travel in its sample"
            ) from None
    return json.dumps(out, separators=(",", ":"))


def _encode(value: Any) -> Any:
    if value is None or isinstance(value, str | int | float | bool):
        return value
    if isinstance(value, list | tuple):
        return [_encode(v) for v in value]
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise TypeError("a dict with keys that are not strings")
        return {k: _encode(v) for k, v in value.items()}
    if hasattr(value, "model_dump") and type(value).__module__.startswith("verifiers."):
        cls = type(value)
        return {_MODEL: f"{cls.__module__}:{cls.__qualname__}", "v": value.model_dump(mode="json")}
    raise TypeError(f"a {type(value).__module__}.{type(value).__qualname__}")


def decode_state(vf: Any, text: str) -> Any:
    try:
        raw = json.loads(text)
    except ValueError:
        raise EpisodeError(f"verifiers state: {text[:60]!r} is not JSON") from None
    state = vf.types.State()
    dict.update(state, {k: _decode(v) for k, v in raw.items()})
    state["client"] = _client(vf)
    return state


def _decode(value: Any) -> Any:
    if isinstance(value, list):
        return [_decode(v) for v in value]
    if isinstance(value, dict):
        if _MODEL in value:
            module_name, _, name = str(value[_MODEL]).partition(":")
            if not module_name.startswith("verifiers."):
                raise EpisodeError(f"verifiers state: model class {value[_MODEL]!r} is not verifiers'")
            cls: Any = importlib.import_module(module_name)
            for part in name.split("."):
                cls = getattr(cls, part)
            return cls.model_validate(value["v"])
        return {k: _decode(v) for k, v in value.items()}
    return value


# ---------------------------------------------------------------------------------------------------
# the environment's dataset as a prompt source


class VerifiersPromptSource:
    """`data.source = "verifiers"`: the rows of the environment's dataset (`get_dataset()`), in order;
    each record's metadata carries the row as verifiers reads it (`INPUT_KEY`) and its chat messages."""

    kind = SOURCE

    def __init__(self, spec: str, args: str) -> None:
        try:
            env = load(spec, args)
        except EpisodeError as exc:
            raise DatasetError(f"data.source = 'verifiers': {exc}") from None
        self.spec = spec
        self.rows = [dict(r) for r in env.get_dataset()]
        if not self.rows:
            raise DatasetError(f"data.source = 'verifiers': {spec}'s dataset is empty")

    def __len__(self) -> int:
        return len(self.rows)

    def get(self, cursor: int) -> PromptRecord:
        if cursor < 0:
            raise ValueError(f"prompt cursor must be >= 0, got {cursor}")
        index = cursor % len(self.rows)
        row = self.rows[index]
        keep = {k: row[k] for k in ("prompt", "answer", "info", "example_id", "task") if k in row}
        prompt = row.get("prompt") or []
        text = prompt[-1].get("content", "") if prompt and isinstance(prompt[-1], dict) else str(prompt)
        metadata = {
            "prompt_index": str(index),
            "answer": str(row.get("answer", "")),
            "messages": json.dumps(prompt, default=str),
            INPUT_KEY: json.dumps(keep, default=str),
        }
        ids = np.zeros(0, dtype=np.int32)
        ids.flags.writeable = False
        return PromptRecord(index, ids, str(text), metadata)

    def describe(self) -> str:
        return f"verifiers({self.spec.removeprefix(PREFIX)}, {len(self.rows)} rows)"
