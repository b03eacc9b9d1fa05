"""Simulated tools: the environment of `env.name = "sim"`, answering in the worker's process on a clock.

Owns the tool side of an episode a worker plays with no model (`worker.engine = "sim"`): each sample's
episode plan (`april.sim.episode_plans`, drawn from `worker.sim_*` and the run's seed, the plans
`april simulate --episodes` draws), and when each step answers. A reset answers at once with the
prompt's text; the step of turn k answers after the plan's tool latency, `tool_s[k]` x
`worker.sim_time_scale` wall seconds, with an observation of `observations[k]` bytes (one token each in
the byte chat, `april.sim.byte_chat`); the step after the plan's last turn answers at once, done, reward
0.0. An abort kills a step that has not answered when `worker.sim_tool_repeatable` (the sample owes it),
else the step is waited for.

In the process, as the sim engine is: the simulator runs any number of tool calls at once, and a worker
of 64 slots can hold more episodes in tools than a machine has processes. Speaks the tool runner's
interface (`actors.tool_runner.ToolRunner`) to the episode driver; knows nothing of engines or credit.
"""

from __future__ import annotations

import heapq
import time
from collections.abc import Callable

import numpy as np

from actors.lengths import EpisodeFile, LengthSpec
from actors.tool_runner import ToolResult
from april.config import Config, WorkerConfig
from april.episode import EnvRequest, EnvStep, EpisodeError, Message, ResetRequest, Role, Tool
from april.records import Sample
from april.sim.episode_plans import DrawnEpisodes, EpisodePlans, EpisodeSampler, EpisodeWorkload
from april.sim.sample_draw import LengthSampler

SIM_ENV = "sim"  # env.name of these tools
Resolve = Callable[[str, str], LengthSampler]  # (a length spec, the field that gave it) -> its sampler


def parse(spec: str, field: str) -> LengthSampler:
    """A `worker.sim_*` length spec as the worker reads it (`april simulate` also takes workload names)."""
    del field  # LengthSpecError names the spec
    return LengthSpec.parse(spec)


def episode_workload(
    w: WorkerConfig, turn_tokens: LengthSampler, resolve: Resolve = parse
) -> EpisodeWorkload | None:
    """The episodes `worker.sim_turns` or `worker.sim_episodes` describe, each turn's tokens from
    `turn_tokens` (None: single-turn samples), specs read by `resolve`."""
    if not (w.sim_turns or w.sim_episodes):
        return None
    observations = resolve(w.sim_observation_tokens, "worker.sim_observation_tokens")
    sampler: EpisodeSampler
    if w.sim_episodes:
        sampler = EpisodeFile.load(w.sim_episodes)
    else:
        turns = resolve(w.sim_turns, "worker.sim_turns")
        tool_ms = resolve(w.sim_tool_ms, "worker.sim_tool_ms") if w.sim_tool_ms else None
        sampler = DrawnEpisodes(turns, turn_tokens, tool_ms, observations)
    return EpisodeWorkload(sampler, observations)


SIM_ONLY = "env.name = 'sim' plays simulated episodes: worker.engine = 'sim', no worker.model"


def check_sim(w: WorkerConfig) -> None:
    """What simulated episodes need of the worker, or a one-line EpisodeError: the sim engine without a
    model (the byte chat), and an episode workload."""
    if w.engine != "sim" or w.model:
        raise EpisodeError(f"{SIM_ONLY} (got worker.engine = {w.engine!r}, worker.model = {w.model!r})")
    if not (w.sim_turns or w.sim_episodes):
        raise EpisodeError(
            "env.name = 'sim' plays simulated episodes: set worker.sim_turns or worker.sim_episodes"
        )


def episode_plans(config: Config) -> EpisodePlans | None:
    """The plans a worker of `config` plays (env.name = "sim"), as `april simulate` draws them: the
    run's seed, the env section's budgets. None for any other environment; `check_sim`'s errors."""
    if config.env.name != SIM_ENV:
        return None
    w = config.worker
    check_sim(w)
    workload = episode_workload(w, LengthSpec.parse(w.sim_lengths))
    assert workload is not None  # (check_sim: sim_turns or sim_episodes is set)
    return EpisodePlans(workload, config.run.seed, config.env.max_turns, config.env.max_turn_tokens)


class SimTools:
    """Steps answered from `plans` after their latency x `time_scale` (see the module docstring)."""

    tools: tuple[Tool, ...] = ()

    def __init__(self, plans: EpisodePlans, time_scale: float, repeatable: bool) -> None:
        self.plans = plans
        self.time_scale = time_scale
        self.repeatable = repeatable
        self._due: list[tuple[float, int, int]] = []  # (when, order, key): answers, soonest first
        self._answers: dict[int, EnvStep] = {}  # key -> its answer (a key killed is absent)
        self._order = 0

    @property
    def pending(self) -> int:
        return len(self._answers)

    def submit(self, key: int, request: EnvRequest) -> None:
        now = time.monotonic()
        if isinstance(request, ResetRequest):
            self._answer(key, now, EnvStep((Message(Role.USER, request.prompt.text),), "{}"))
            return
        step = request.key
        assert step is not None, "a sim step runs under its key"
        empty = np.zeros(0, dtype=np.int32)
        plan = self.plans(Sample(group_id=step.group_id, index=step.index, prompt_ids=empty))
        if plan.ends_after(step.step):
            self._answer(key, now, EnvStep((), request.state, done=True, reward=0.0))
            return
        observation = Message(Role.TOOL, "x" * plan.observations[step.step])
        due = now + plan.tool_s[step.step] * self.time_scale
        self._answer(key, due, EnvStep((observation,), request.state))

    def poll(self, wait_s: float = 0.0) -> list[ToolResult]:
        """The answers due by now, soonest first."""
        del wait_s
        now, out = time.monotonic(), []
        while self._due and self._due[0][0] <= now:
            _, _, key = heapq.heappop(self._due)
            step = self._answers.pop(key, None)
            if step is not None:
                out.append(ToolResult(key, step))
        return out

    def next_answer_s(self) -> float | None:
        """Seconds until the soonest answer is due (None: none is)."""
        while self._due and self._due[0][2] not in self._answers:
            heapq.heappop(self._due)
        return max(0.0, self._due[0][0] - time.monotonic()) if self._due else None

    def cancel(self, key: int) -> bool:
        """A step not yet answered is killed when repeatable (True), else waited for (False)."""
        if key not in self._answers:  # unknown, or its answer already taken by `poll`
            return True
        if not self.repeatable:
            return False
        del self._answers[key]
        return True

    def release(self, state: str) -> None:
        """No state is kept here."""

    def wait_s(self) -> float:
        """Seconds until the last answer still to come is due (how long a worker stopping waits)."""
        last = max((when for when, _, key in self._due if key in self._answers), default=0.0)
        return max(0.0, last - time.monotonic())

    def close(self) -> None:
        self._due.clear()
        self._answers.clear()

    def _answer(self, key: int, when: float, step: EnvStep) -> None:
        self._order += 1
        self._answers[key] = step
        heapq.heappush(self._due, (when, self._order, key))
