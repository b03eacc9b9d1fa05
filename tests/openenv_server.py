"""A small OpenEnv environment, written as OpenEnv's template teaches (`openenv init`'s
openenv/cli/templates/openenv_env: Action/Observation models, an `Environment` with reset/step/state,
served by `openenv.core.env_server.http_server.create_app` under uvicorn). Run with the venv that has the
real openenv-core (`make .venv-openenv`):

    python tests/openenv_server.py serve PORT       the server, on 127.0.0.1:PORT
    python tests/openenv_server.py replay URL       stdin: [{"seed": int, "turns": [str]}, ...]; stdout:
                                                   the rewards openenv's own client gets for each

A counting game whose state lives only on the server: reset(seed) starts a count at seed % 5; each step
adds the words of the message; the step's reward depends on the count so far; the episode ends after TURNS
steps. The message HANG makes a step take a minute.
"""

from __future__ import annotations

import json
import sys
import time
from uuid import uuid4

from openenv.core.env_server.http_server import create_app
from openenv.core.env_server.interfaces import Environment
from openenv.core.env_server.types import Action, Observation, State
from pydantic import Field

TURNS = 3
HANG = "hang for a minute"  # a message the server takes a minute to answer


class CountAction(Action):
    message: str = Field(..., description="The model's turn")


class CountObservation(Observation):
    prompt: str = Field(default="", description="What the player is told")
    count: int = Field(default=0, description="The count so far")


class CountEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS: bool = True

    def __init__(self) -> None:
        self._state = State(episode_id=str(uuid4()), step_count=0)
        self.count = 0

    def reset(self, seed: int | None = None, **kwargs: object) -> CountObservation:
        self._state = State(episode_id=str(uuid4()), step_count=0)
        self.count = (seed or 0) % 5
        return CountObservation(prompt=f"The count is {self.count}. Say some words.", count=self.count)

    def step(self, action: CountAction) -> CountObservation:  # type: ignore[override]
        if action.message == HANG:
            time.sleep(60)  # a server that stops answering
        self._state.step_count += 1
        self.count += len(action.message.split())
        reward = (self.count % 7) / 7 + 0.25 * self._state.step_count
        done = self._state.step_count >= TURNS
        return CountObservation(
            prompt=f"The count is {self.count}. Say some more.", count=self.count, done=done, reward=reward
        )

    @property
    def state(self) -> State:
        return self._state


app = create_app(CountEnvironment, CountAction, CountObservation, env_name="count", max_concurrent_envs=64)


def replay(url: str) -> None:
    from openenv.core.generic_client import GenericEnvClient

    out = []
    for job in json.loads(sys.stdin.read()):
        with GenericEnvClient(base_url=url).sync() as env:
            env.reset(seed=job["seed"])
            out.append([env.step({"message": turn}).reward for turn in job["turns"]])
    print(json.dumps(out))


if __name__ == "__main__":
    if sys.argv[1] == "serve":
        import uvicorn

        uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[2]), log_level="warning")
    else:
        replay(sys.argv[2])
