"""A verifiers environment whose rubric scores groups, written as verifiers' docs teach (importable as
`verifiers:verifiers_group_env`): a `MultiTurnEnv` of `TURNS` turns, scored by an individual reward that
depends on every model turn and a group reward function (plural parameters, a list back) that ranks each
completion's length among its group's, so an episode's reward depends on the others of its group.
"""

from __future__ import annotations

from typing import Any

import verifiers as vf
from datasets import Dataset

TURNS = 2


class EchoEnv(vf.MultiTurnEnv):
    @vf.stop
    async def enough_turns(self, state: vf.State) -> bool:
        return len(state["trajectory"]) >= TURNS

    async def env_response(self, messages: vf.Messages, state: vf.State, **kwargs: Any) -> vf.Messages:
        return [vf.UserMessage(content=f"you said {len(str(messages[-1].content or ''))} characters")]


def said(completion: vf.Messages) -> int:
    return sum(len(str(m.content or "")) for m in completion if m.role == "assistant")


def turn_lengths(completion: vf.Messages) -> float:
    return (said(completion) % 7) / 7


def longer_than_the_group(completions: list[vf.Messages]) -> list[float]:
    """1 for a completion longer than its group's mean, 0 otherwise: needs the whole group."""
    lengths = [said(c) for c in completions]
    mean = sum(lengths) / len(lengths)
    return [1.0 if n > mean else 0.0 for n in lengths]


def load_environment(n: int = 32, **kwargs: Any) -> vf.Environment:
    rows = [{"question": f"talk about {i}", "answer": str(i)} for i in range(n)]
    return EchoEnv(
        dataset=Dataset.from_list(rows),
        rubric=vf.Rubric(funcs=[turn_lengths, longer_than_the_group], weights=[1.0, 0.5]),
        system_prompt="Say anything.",
        max_turns=TURNS + 2,
    )
