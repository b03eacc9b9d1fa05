"""april.episode: OpenAI-style messages, environment steps, the episode bytes of a sample, the requests that
cross the tool runner's pipe, spec loading with one-line errors, and the tool-call helpers."""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from april.data import PromptRecord
from april.episode import (
    EnvStep,
    EpisodeError,
    EpisodeState,
    Message,
    ResetRequest,
    Role,
    StepRequest,
    Tool,
    ToolCall,
    ToolError,
    call_tools,
    load_environment,
    prompt_messages,
    repeatable,
    request_from_json,
    step_timeout_s,
)

SLOW = Tool("slow", "", {}, repeatable=False, timeout_s=7.0)
FAST = Tool("fast", "", {}, repeatable=True, timeout_s=0.5)
TURN = Message(
    Role.ASSISTANT,
    "thinking",
    (
        ToolCall("call_0", "fast", {"x": [1, {"y": "é"}]}),
        ToolCall("call_1", "slow", {}),
        ToolCall("c", "", {}, "bad"),
    ),
)


def record(text: str = "What is 2+2?", **metadata: str) -> PromptRecord:
    return PromptRecord(3, np.zeros(0, dtype=np.int32), text, {"prompt_index": "3", **metadata})


def test_messages_round_trip_through_the_openai_form_and_json() -> None:
    messages = [
        Message(Role.SYSTEM, "be brief"),
        TURN,
        Message(Role.TOOL, "4", tool_call_id="call_0", name="fast"),
    ]
    for m in messages:
        wire = json.loads(json.dumps(m.to_openai()))
        assert Message.from_openai(wire) == m
    assert TURN.to_openai()["tool_calls"][0] == {
        "id": "call_0",
        "type": "function",
        "function": {"name": "fast", "arguments": {"x": [1, {"y": "é"}]}},
    }
    assert (
        "error" not in TURN.to_openai()["tool_calls"][0]
        and TURN.to_openai()["tool_calls"][2]["error"] == "bad"
    )


def test_openai_api_forms_are_read() -> None:
    """The HTTP API's forms: content null beside tool calls, arguments as a JSON string."""
    api = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "x", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}],
    }
    assert Message.from_openai(api) == Message(Role.ASSISTANT, "", (ToolCall("x", "f", {"a": 1}),))


@pytest.mark.parametrize(
    ("obj", "message"),
    [
        ("hi", "message: got str, expected an object"),
        ({"role": "robot", "content": ""}, "message role: got 'robot', expected one of system, user"),
        ({"role": "user", "content": 3}, "message content: got int, expected a string"),
        ({"role": "user", "content": "", "tool_calls": {}}, "message tool_calls: got dict, expected a list"),
        (
            {"role": "assistant", "content": "", "tool_calls": [{"function": {}}]},
            "tool call: got {'function': {}}, expected a function with a string name",
        ),
        (
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"function": {"name": "f", "arguments": "{"}}],
            },
            "tool call 'f': arguments '{' are not JSON",
        ),
        (
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"function": {"name": "f", "arguments": [1]}}],
            },
            "tool call 'f': arguments are list, expected an object",
        ),
        ({"role": "tool", "content": "", "tool_call_id": 5}, "tool_call_id: got int, expected a string"),
    ],
)
def test_bad_messages_are_one_line_errors(obj: object, message: str) -> None:
    with pytest.raises(EpisodeError) as err:
        Message.from_openai(obj)
    assert str(err.value).startswith(message)
    assert "\n" not in str(err.value)


def test_env_step_checks_its_reward_and_state() -> None:
    assert EnvStep((), "{}", done=True, reward=1).reward == 1
    for bad in (
        lambda: EnvStep((), "{}", done=True),
        lambda: EnvStep((), "{}", done=True, reward=float("nan")),
        lambda: EnvStep((), "{}", done=False, reward=1.0),
        lambda: EnvStep((), {"a": 1}),  # type: ignore[arg-type]
        lambda: EnvStep(("text",), "{}"),  # type: ignore[arg-type]
    ):
        with pytest.raises(EpisodeError):
            bad()
    step = EnvStep((Message(Role.TOOL, "4", tool_call_id="call_0"),), '{"n": 1}', done=True, reward=0.5)
    assert EnvStep.from_json(json.loads(json.dumps(step.to_json()))) == step
    with pytest.raises(EpisodeError, match="expected an object with an observation list"):
        EnvStep.from_json({"state": "{}"})


def test_episode_state_bytes_round_trip() -> None:
    for state in (EpisodeState('{"answer": 4}'), EpisodeState("{}", turns=3, owed=TURN)):
        data = state.to_bytes()
        assert isinstance(data, bytes)
        assert EpisodeState.from_bytes(data) == state


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (b"\xff", "episode state: 1 bytes that are not JSON"),
        (b'{"v": 99, "env_state": "", "turns": 0}', "episode state: version 99, expected 1"),
        (b"[1]", "episode state: version 'list', expected 1"),
        (b'{"v": 1, "env_state": "", "turns": -1}', "expected env_state text and turns >= 0"),
        (b'{"v": 1, "env_state": "", "turns": 0, "owed": {"role": "x"}}', "message role: got 'x'"),
    ],
)
def test_bad_episode_bytes_are_one_line_errors(data: bytes, message: str) -> None:
    with pytest.raises(EpisodeError, match=message):
        EpisodeState.from_bytes(data)


def test_requests_round_trip_through_json() -> None:
    reset = ResetRequest(record(answer="4"))
    back = request_from_json(json.loads(json.dumps(reset.to_json())))
    assert isinstance(back, ResetRequest)
    assert (back.prompt.prompt_index, back.prompt.text, back.prompt.metadata) == (
        3,
        "What is 2+2?",
        {"prompt_index": "3", "answer": "4"},
    )
    step = StepRequest('{"n": 1}', TURN)
    assert request_from_json(json.loads(json.dumps(step.to_json()))) == step
    with pytest.raises(EpisodeError, match="expected a reset or a step"):
        request_from_json({"t": "jump"})


def test_prompt_messages_reads_chat_records() -> None:
    assert prompt_messages(record("hi")) == (Message(Role.USER, "hi"),)
    chat = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]
    assert prompt_messages(record("u", messages=json.dumps(chat))) == (
        Message(Role.SYSTEM, "s"),
        Message(Role.USER, "u"),
    )
    with pytest.raises(EpisodeError, match="prompt 3: metadata messages are not JSON"):
        prompt_messages(record("u", messages="[oops"))


def test_call_tools_answers_every_call_in_order() -> None:
    def fast(arguments: Any) -> str:
        if "x" not in arguments:
            raise ToolError("fast needs x")
        return f"got {arguments['x']}"

    turn = Message(
        Role.ASSISTANT,
        "",
        (
            ToolCall("a", "fast", {"x": 1}),
            ToolCall("b", "nope", {}),
            ToolCall("c", "", {}, "tool call is not valid JSON"),
            ToolCall("d", "fast", {}),
        ),
    )
    out = call_tools(turn, {"fast": fast})
    assert [(m.role, m.tool_call_id, m.content) for m in out] == [
        (Role.TOOL, "a", "got 1"),
        (Role.TOOL, "b", "error: unknown tool 'nope'; tools: fast"),
        (Role.TOOL, "c", "error: tool call is not valid JSON"),
        (Role.TOOL, "d", "error: fast needs x"),
    ]

    def buggy(arguments: Any) -> str:
        raise KeyError("bug")

    with pytest.raises(KeyError):  # a bug in the environment is not the model's error
        call_tools(Message(Role.ASSISTANT, "", (ToolCall("a", "fast", {}),)), {"fast": buggy})


def test_timeouts_and_repeatability_follow_the_called_tools() -> None:
    tools = (SLOW, FAST)
    assert step_timeout_s(tools, TURN) == 7.5  # the malformed call runs nothing
    assert not repeatable(tools, StepRequest("{}", TURN))
    only_fast = Message(Role.ASSISTANT, "", (ToolCall("a", "fast", {}), ToolCall("b", "unknown", {})))
    assert repeatable(tools, StepRequest("{}", only_fast)) and step_timeout_s(tools, only_fast) == 0.5
    assert repeatable(tools, ResetRequest(record()))
    with pytest.raises(EpisodeError, match="timeout_s: got 0, expected a number > 0"):
        Tool("t", "", {}, timeout_s=0)


ENV_SOURCE = """
from april.episode import EnvStep, Tool

class Good:
    tools = (Tool("t", "d", {}),)
    def reset(self, prompt):
        return EnvStep((), "{}")
    def step(self, state, turn):
        return EnvStep((), state, done=True, reward=1.0)

class Raises:
    def __init__(self):
        raise RuntimeError("no\\nway")

class NoStep:
    tools = ()
    def reset(self, prompt):
        return None

class ListTools(Good):
    tools = [Tool("t", "d", {})]

class Twice(Good):
    tools = (Tool("t", "d", {}), Tool("t", "e", {}))

NOT_A_CLASS = 3
"""


@pytest.fixture
def env_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    name = "april_test_user_envs"
    (tmp_path / f"{name}.py").write_text(ENV_SOURCE)
    (tmp_path / f"{name}_broken.py").write_text("raise ValueError('at import')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield name
    sys.modules.pop(name, None)
    sys.modules.pop(name + "_broken", None)


def test_load_environment_builtins_and_user_classes(env_module: str) -> None:
    class Builtin:
        tools = ()

        def reset(self, prompt: PromptRecord) -> EnvStep:
            return EnvStep((), "")

        def step(self, state: str, turn: Message) -> EnvStep:
            return EnvStep((), state)

    assert isinstance(load_environment("mine", {"mine": Builtin}), Builtin)
    env = load_environment(f"{env_module}:Good", {})
    assert env.tools[0].name == "t"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("nothing", "env: got 'nothing', expected one of mine or 'module:Class'"),
        (
            "april_no_such_module_xyz:C",
            "env 'april_no_such_module_xyz:C': module 'april_no_such_module_xyz' not found",
        ),
        ("{m}:Missing", "env '{m}:Missing': module '{m}' has no attribute 'Missing'"),
        ("{m}:NOT_A_CLASS", "env '{m}:NOT_A_CLASS': 'NOT_A_CLASS' is a int, not a class"),
        ("{m}:Raises", "env '{m}:Raises': constructing it raised RuntimeError: no way"),
        ("{m}:NoStep", "env '{m}:NoStep': NoStep has no step() method"),
        ("{m}:ListTools", "env '{m}:ListTools': tools is list, expected a tuple of april.episode.Tool"),
        ("{m}:Twice", r"env '{m}:Twice': tool names \['t', 't'\] repeat"),
        ("{m}_broken:C", "env '{m}_broken:C': importing '{m}_broken' failed: ValueError: at import"),
    ],
)
def test_load_environment_errors_are_one_line(env_module: str, spec: str, message: str) -> None:
    with pytest.raises(EpisodeError) as err:
        load_environment(spec.format(m=env_module), {"mine": object})  # type: ignore[dict-item]
    assert str(err.value) == message.format(m=env_module).replace("\\", "")
