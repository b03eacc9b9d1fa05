"""verifiers environments written as verifiers' own docs teach (a Hub-style module whose
`load_environment(**kwargs)` returns a `vf.Environment`), importable as `verifiers:verifiers_envs` and
`verifiers:verifiers_tool_env` (tests/ is on the path of the processes the tests start).

`load_environment` here: a `MultiTurnEnv` that answers every model turn with a user message about it and
stops after `TURNS` turns (a `@vf.stop` condition), its state a plain list, scored by a rubric whose
reward depends on every model turn's text, so a transcript that lost or repeated anything scores
differently. `live=True` keeps a game object in the state (a lock and the moves so far, as a sandbox
handle would be kept): it cannot be written down, and the reward reads its moves.
"""

from __future__ import annotations

import threading
from typing import Any

import verifiers as vf
from datasets import Dataset

TURNS = 3


class Game:
    """A live object: what the environment's turns did to it, behind a lock."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.moves: list[int] = []


class CountingEnv(vf.MultiTurnEnv):
    def __init__(self, live: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.live = live

    async def setup_state(self, state: vf.State) -> vf.State:
        state["lengths"] = []
        if self.live:
            state["game"] = Game()
        return state

    @vf.stop
    async def enough_turns(self, state: vf.State) -> bool:
        return len(state["trajectory"]) >= TURNS

    async def env_response(self, messages: vf.Messages, state: vf.State, **kwargs: Any) -> vf.Messages:
        text = str(messages[-1].content or "")
        state["lengths"].append(len(text))
        if "game" in state:
            with state["game"].lock:
                state["game"].moves.append(len(text) % 7)
        return [vf.UserMessage(content=f"turn {len(state['lengths'])}: {len(text)} characters")]


def turns_reward(completion: vf.Messages, state: vf.State) -> float:
    """Depends on every model turn's text and on the environment's own record of them."""
    said = [str(m.content or "") for m in completion if m.role == "assistant"]
    reward = (sum(len(t) * (i + 1) for i, t in enumerate(said)) % 10) / 10 + 0.05 * len(state["lengths"])
    game = state.get("game")
    return reward + (0.01 * sum(game.moves) + 0.001 * len(game.moves) if game is not None else 0.0)


def load_environment(n: int = 32, live: bool = False, **kwargs: Any) -> vf.Environment:
    rows = [{"question": f"count for {i}", "answer": str(i)} for i in range(n)]
    return CountingEnv(
        live=live,
        dataset=Dataset.from_list(rows),
        rubric=vf.Rubric(funcs=[turns_reward]),
        system_prompt="Say anything.",
        max_turns=TURNS + 2,
    )
