"""Group-level rewards: rewards that need every episode of a group, scored where the whole group is.

An environment whose reward compares a group's episodes (a verifiers rubric with group reward functions)
sets `group_scored` and defines `score_group` (april/episode.py). A worker sees one episode, so the reward
it sends is that of a group of one; rank 0 of the learner holds each batch's groups whole, and
`GroupRewards.rescore` replaces those rewards with the environment's group scores before advantages are
computed, so training, metrics.jsonl and the rollout records all read the group's rewards.

In a group, the episodes the environment ended (finish reason stop) are scored together; one cut off by a
token or turn limit keeps the reward it came with. A group whose scoring raises keeps its rewards, with one
logged line. This module does not decide which samples form a batch (the broker) nor the advantages
(`learner.advantages`). Contract: docs/environments.md.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence

import numpy as np

from april import protocol
from april.config import Config
from april.envs.verifiers_adapter import VerifiersEnvironment, is_verifiers
from april.episode import EpisodeError, EpisodeState, one_line
from april.records import FinishReason

log = logging.getLogger(__name__)

GroupScore = Callable[[Sequence[str]], list[float]]  # the done steps' states of a group -> their rewards


class GroupRewards:
    """Rescoring of each batch's groups by one environment's `score_group`."""

    def __init__(self, score: GroupScore) -> None:
        self.score = score
        self.failed_groups = 0  # groups whose scoring raised (their rewards kept)

    def rescore(self, batch: protocol.Batch) -> protocol.Batch:
        samples = batch.samples
        reward = samples.reward.copy()
        ended = samples.finish_reason == int(FinishReason.STOP)
        for group in np.unique(samples.group_id):
            rows = np.flatnonzero((samples.group_id == group) & ended)
            if rows.size == 0:
                continue
            try:
                finals = [EpisodeState.from_bytes(samples.episode[i]).env_state for i in rows]
                scores = self.score(finals)
                if len(scores) != rows.size:
                    raise EpisodeError(f"score_group gave {len(scores)} rewards for {rows.size} episodes")
            except Exception as exc:  # the environment's own code: the group keeps its rewards
                self.failed_groups += 1
                log.error("group %d: scoring failed, rewards kept: %s", group, one_line(exc))
                continue
            reward[rows] = scores
        return dataclasses.replace(batch, samples=dataclasses.replace(samples, reward=reward))

    def figures(self) -> dict[str, float]:
        """For the step's metrics: the groups whose scoring failed so far."""
        return {"group_scoring_failed": float(self.failed_groups)}


def group_rewards(config: Config) -> GroupRewards | None:
    """The rescoring `config`'s environment asks for, or None (single-turn, or rewards per episode).
    Only a verifiers environment can score groups: it alone is loaded in this process (the others may
    start sandboxes or reach servers the learner has no business with). One-line EpisodeError when it
    does not load, or when `algo.dynamic_sampling` would have the broker drop groups by the rewards of
    groups of one."""
    if not is_verifiers(config.env.name):
        return None
    env = VerifiersEnvironment(config.env.name, config.env.args)
    if not env.group_scored:
        return None
    if config.algo.dynamic_sampling:
        raise EpisodeError(
            f"algo.dynamic_sampling = true with env {config.env.name!r}, whose rewards are scored by group "
            "in the learner: the broker would filter groups by each episode's own reward; expected false"
        )
    return GroupRewards(env.score_group)
