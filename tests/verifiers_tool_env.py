"""A verifiers `ToolEnv` as its docs teach: Python callables as tools, a rubric on the final answer
(`verifiers:verifiers_tool_env`, for tests/test_verifiers_env.py)."""

from __future__ import annotations

from typing import Any

import verifiers as vf
from datasets import Dataset


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


def correct(completion: vf.Messages, answer: str) -> float:
    return float(answer in str(completion[-1].content or ""))


def load_environment(n: int = 8, single_turn: bool = False, **kwargs: Any) -> vf.Environment:
    rows = [{"question": f"What is {i} + {i + 3}?", "answer": str(2 * i + 3)} for i in range(n)]
    rubric = vf.Rubric(funcs=[correct])
    if single_turn:
        return vf.SingleTurnEnv(dataset=Dataset.from_list(rows), rubric=rubric)
    return vf.ToolEnv(
        dataset=Dataset.from_list(rows), tools=[add], rubric=rubric, max_turns=4, system_prompt="Use add."
    )
