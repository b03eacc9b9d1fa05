"""The `python` environment: the model may run Python code in the sandbox before it answers.

Each `run_python` call runs its `code` in a fresh sandboxed process (`actors.sandbox`) and the observation
is the program's output with a status line when it did not exit cleanly. Pure code in a fresh process
with no network has no effects outside it, so the tool is repeatable: a call an abort interrupts is run
again on resume. A turn without tool calls ends the episode, scored by the built-in `exact` reward against
the record's "answer" (the final answer rule of `actors.rewards.extract_final_answer`).

Knows nothing about processes beyond the sandbox; the tool runner runs this environment in its child.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from actors.rewards import exact_reward
from actors.sandbox import Sandbox, SandboxError, SandboxLimits
from april.data import PromptRecord
from april.episode import EnvStep, EpisodeError, Message, Tool, ToolError, call_tools, prompt_messages

TOOL_NAME = "run_python"
TIMEOUT_SLACK_S = 10.0  # the tool's timeout over the sandbox's wall limit: the sandbox reports first


class PythonEnvironment:
    def __init__(self, limits: SandboxLimits | None = None) -> None:
        limits = limits or SandboxLimits()
        try:
            self.sandbox = Sandbox(limits)
        except SandboxError as exc:
            raise EpisodeError(str(exc)) from None
        self.tools: tuple[Tool, ...] = (
            Tool(
                name=TOOL_NAME,
                description=(
                    "Run a Python 3 program in a fresh sandbox (no network; limited CPU time, memory and "
                    f"output; {limits.wall_s:g} s at most) and return what it prints."
                ),
                parameters={
                    "type": "object",
                    "properties": {"code": {"type": "string", "description": "the program's source"}},
                    "required": ["code"],
                },
                repeatable=True,
                timeout_s=limits.wall_s + TIMEOUT_SLACK_S,
            ),
        )

    def reset(self, prompt: PromptRecord) -> EnvStep:
        return EnvStep(prompt_messages(prompt), json.dumps({"answer": prompt.metadata.get("answer", "")}))

    def step(self, state: str, turn: Message) -> EnvStep:
        if turn.tool_calls:
            return EnvStep(call_tools(turn, {TOOL_NAME: self._run}), state)
        reward = exact_reward(turn.content, json.loads(state)["answer"], {})
        return EnvStep((), state, done=True, reward=reward)

    def _run(self, arguments: Mapping[str, Any]) -> str:
        code = arguments.get("code")
        if not isinstance(code, str) or set(arguments) != {"code"}:
            raise ToolError(
                f"{TOOL_NAME} takes one string argument, code; got {json.dumps(dict(arguments))[:80]}"
            )
        return self.sandbox.run(code).describe()
