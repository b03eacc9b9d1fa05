"""Episode plans: how each sample's multi-turn episode will play out, drawn from its identity.

Owns `EpisodePlan` (a sample's model turns, the tool calls between them and their observations) and
`EpisodePlans`, the rule that gives every sample its plan: drawn once from (seed, group, index) by an
`EpisodeSampler` (distributions, `DrawnEpisodes`; or recorded episodes, `actors.lengths.EpisodeFile`),
its turns held to `env.max_turn_tokens` tokens (what the model generates under that limit). Cutting an
episode off (`env.max_turns`, budgets) is the worker core's (`april.worker_core`), as for a real worker.
Every mode of one seed sees the same episodes. `SingleTurn` is a single-turn sample as a plan of one
turn (its drawn response length), so the engines run both through one path.

Knows nothing of engines, time or scheduling: `april simulate`'s engines (`broker.sim.engines`) play the
plans out in virtual time, a worker's sim engine and sim tools (`actors.sim_tools`) in real processes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

from april.records import Sample
from april.sim.sample_draw import MASK64, LengthSampler, sample_key

EPISODE_SALT = 0x6570  # keeps an episode's draws apart from the sample's single-turn length draw


@dataclass(frozen=True, slots=True)
class EpisodePlan:
    """One sample's episode: `turns[k]` model tokens in turn k (>= 1), then, between turns k and k + 1,
    a tool call of `tool_s[k]` seconds whose result is `observations[k]` tokens (>= 1)."""

    turns: tuple[int, ...]
    tool_s: tuple[float, ...] = ()
    observations: tuple[int, ...] = ()

    def ends_after(self, turn: int) -> bool:
        """Whether the episode ends with turn `turn` (no tool call follows it)."""
        return turn == len(self.turns) - 1

    def turn_of(self, model_tokens: int, calls_done: int) -> tuple[int, int]:
        """Where a sample with `model_tokens` generated and `calls_done` observations stands: (its turn,
        the model tokens that turn still has to generate; 0: the turn is over)."""
        done_before = sum(self.turns[:calls_done])
        return calls_done, self.turns[calls_done] - (model_tokens - done_before)


class EpisodeSampler(Protocol):
    """One episode from `rng`: model tokens per turn, tool ms per call, observation tokens per call (None:
    the plans draw them)."""

    def episode(
        self, rng: np.random.Generator
    ) -> tuple[Sequence[int], Sequence[float], Sequence[int] | None]: ...


@dataclass(frozen=True, slots=True)
class DrawnEpisodes:
    """Episodes from distributions: the number of turns, each turn's model tokens, each tool call's ms
    (None: no latency) and each observation's tokens."""

    turns: LengthSampler
    turn_tokens: LengthSampler
    tool_ms: LengthSampler | None
    observation_tokens: LengthSampler

    def episode(
        self, rng: np.random.Generator
    ) -> tuple[Sequence[int], Sequence[float], Sequence[int] | None]:
        n = int(self.turns.sample(rng, 1)[0])
        lengths = self.turn_tokens.sample(rng, n).tolist()
        calls = n - 1
        tool_ms: npt.NDArray[np.float64] = (
            np.zeros(calls) if self.tool_ms is None else self.tool_ms.sample(rng, calls).astype(np.float64)
        )
        return lengths, tool_ms.tolist(), self.observation_tokens.sample(rng, calls).tolist()


@dataclass(frozen=True, slots=True)
class EpisodeWorkload:
    """What `april simulate` draws episodes from: `sampler`, and the observations' tokens where it gives
    none (recorded episodes without them)."""

    sampler: EpisodeSampler
    observation_tokens: LengthSampler


class EpisodePlans:
    """Each sample's plan (module docstring), drawn when first asked for and kept until `forget`."""

    def __init__(self, workload: EpisodeWorkload, seed: int, max_turns: int, max_turn_tokens: int) -> None:
        self.sampler = workload.sampler
        self.observation_tokens = workload.observation_tokens
        self.seed = seed
        self.max_turns = max_turns
        self.max_turn_tokens = max_turn_tokens
        self.plans: dict[tuple[int, int], EpisodePlan] = {}

    def __call__(self, sample: Sample) -> EpisodePlan:
        plan = self.plans.get(sample.key)
        if plan is None:
            plan = self.plans[sample.key] = self._draw(sample_key(*sample.key))
        return plan

    def of_key(self, key: int) -> EpisodePlan:
        """The plan of the sample whose identity is `key` (`sample_key(group_id, index)`), not kept."""
        return self._draw(key)

    def forget(self, sample: Sample) -> None:
        """`sample` finished: its plan is not asked for again."""
        self.plans.pop(sample.key, None)

    def _draw(self, key: int) -> EpisodePlan:
        rng = np.random.default_rng([self.seed & MASK64, key & MASK64, EPISODE_SALT])
        turns, tool_ms, observations = self.sampler.episode(rng)
        if observations is None:
            observations = self.observation_tokens.sample(rng, len(turns) - 1).tolist()
        return EpisodePlan(
            tuple(min(int(t), self.max_turn_tokens) for t in turns),
            tuple(float(ms) / 1000.0 for ms in tool_ms[: len(turns) - 1]),
            tuple(int(o) for o in observations[: len(turns) - 1]),
        )


class SingleTurn:
    """A single-turn sample as a plan: one turn of its drawn response length."""

    def __init__(self, length_of: Callable[[Sample], int]) -> None:
        self.length_of = length_of

    def __call__(self, sample: Sample) -> EpisodePlan:
        return EpisodePlan((self.length_of(sample),))

    def forget(self, sample: Sample) -> None:
        """Nothing is kept per sample (the length tables keep the draws)."""


Plans = EpisodePlans | SingleTurn
