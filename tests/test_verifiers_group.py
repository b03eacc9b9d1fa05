"""verifiers rubrics with group reward functions (april/envs/verifiers_adapter.py, learner/group_rewards.py),
against the real package: an episode's own reward is verifiers' score of a group of one; the learner's
rescoring of a group gives the rewards verifiers' own rollouts and `score_group` give the same model turns;
an episode cut off keeps its reward; a scoring that raises keeps the group's rewards and is counted;
`algo.dynamic_sampling` is refused in one line; and a real `april up` trains with group rewards through
APRIL's aborts, every recorded reward the one verifiers computes for its group's transcripts."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest
import verifiers_group_env
from test_up import check_run, run_up, wait_all_exited
from test_verifiers_env import ScriptedClient, model_turns, vf_run_config

from actors.tokenizer import HFTokenizer
from april import protocol
from april.chat import chat_format
from april.config import Config, load_config
from april.envs.verifiers_adapter import INPUT_KEY, VerifiersEnvironment, VerifiersPromptSource
from april.episode import EpisodeError, EpisodeState, Message, Role
from april.ledger import Ledger
from april.records import FinishReason, Sample
from april.wire_records import SampleBatch
from learner.group_rewards import GroupRewards, group_rewards

SPEC = "verifiers:verifiers_group_env"


def own_group(env: Any, rows: list[dict[str, Any]], turns: list[list[Message]]) -> list[float]:
    """verifiers' own: each rollout played by its model, then the group scored as `run_group` does."""

    async def play() -> list[float]:
        states = [await env.rollout(r, ScriptedClient(t), "m", {}) for r, t in zip(rows, turns, strict=True)]
        await env.rubric.score_group(states)
        return [float(s["reward"]) for s in states]

    return asyncio.run(play())


def played(env: VerifiersEnvironment, record: Any, turns: list[Message]) -> tuple[str, float]:
    """april's side of one episode: its done step's state and reward."""
    step = env.reset(record)
    for turn in turns:
        step = env.step(step.state, turn)
    assert step.done and step.reward is not None
    return step.state, step.reward


def episode_sample(group: int, index: int, final: str, reward: float, reason: FinishReason) -> Sample:
    s = Sample(group, index, np.array([1], np.int32)).resumed().extend([2, 3], [-1.0, -1.0], 0, reason)
    return s.with_episode(EpisodeState(final, 2).to_bytes()).scored(reward)


TALKS = [
    [Message(Role.ASSISTANT, "a"), Message(Role.ASSISTANT, "bb")],
    [Message(Role.ASSISTANT, "a long first turn"), Message(Role.ASSISTANT, "and more")],
    [Message(Role.ASSISTANT, "mid"), Message(Role.ASSISTANT, "dle")],
]


def test_a_group_is_scored_as_verifiers_scores_it() -> None:
    env = VerifiersEnvironment(SPEC, '{"n": 4}')
    assert env.group_scored
    record = VerifiersPromptSource(SPEC, '{"n": 4}').get(1)
    finals, alone = zip(*(played(env, record, t) for t in TALKS), strict=True)
    row = json.loads(record.metadata[INPUT_KEY])
    reference = verifiers_group_env.load_environment(n=4)
    # alone, each episode is a group of one: the reward verifiers gives a lone rollout
    assert list(alone) == pytest.approx([own_group(reference, [row], [t])[0] for t in TALKS])
    together = own_group(reference, [row] * 3, TALKS)
    assert env.score_group(list(finals)) == pytest.approx(together)
    assert together != pytest.approx(list(alone))  # the group term changed something: the check can fail

    ended = zip(finals, alone, strict=True)
    samples = [episode_sample(7, i, f, r, FinishReason.STOP) for i, (f, r) in enumerate(ended)]
    cut = episode_sample(7, 3, "{}", -1.0, FinishReason.LENGTH)  # cut off by a limit: not the env's to score
    batch = protocol.Batch(1, 0, 0, SampleBatch.from_samples([*samples, cut]), {}, Ledger())
    rescored = GroupRewards(env.score_group).rescore(batch)
    assert list(rescored.samples.reward) == pytest.approx([*together, -1.0])


def test_a_scoring_that_raises_keeps_the_rewards_and_is_counted() -> None:
    samples = [episode_sample(3, i, "{}", 0.25, FinishReason.STOP) for i in range(2)]
    batch = protocol.Batch(1, 0, 0, SampleBatch.from_samples(samples), {}, Ledger())
    env = VerifiersEnvironment(SPEC, "")
    rescoring = GroupRewards(env.score_group)  # "{}" holds no rollout state: scoring raises
    assert list(rescoring.rescore(batch).samples.reward) == [0.25, 0.25]
    assert rescoring.figures() == {"group_scoring_failed": 1.0}


def config_of(tmp_path: Path, extra: str = "") -> Config:
    path = tmp_path / "c.toml"
    path.write_text(f'[env]\nname = "{SPEC}"\n[algo]\n{extra}')
    return load_config(path)


def test_dynamic_sampling_is_refused_in_one_line(tmp_path: Path) -> None:
    assert isinstance(group_rewards(config_of(tmp_path)), GroupRewards)
    with pytest.raises(EpisodeError) as info:
        group_rewards(config_of(tmp_path, "dynamic_sampling = true\n"))
    assert "algo.dynamic_sampling" in str(info.value) and "\n" not in str(info.value)


def test_april_up_trains_with_group_rewards_through_aborts(tmp_path: Path) -> None:
    cfg, env = vf_run_config(tmp_path, '{"n": 40}', "verifiers_group_env")
    run_dir = tmp_path / "run"
    code, out, children = run_up(["--config", str(cfg), "--run-dir", str(run_dir), "--steps", "3"], 300, env)
    assert code == 0, out
    check_run(run_dir, 3, samples=8)
    rows = [
        r
        for f in sorted((run_dir / "rollouts" / "train").glob("*.parquet"))
        for r in pq.read_table(f).to_pylist()
    ]
    assert len(rows) == 3 * 8
    assert any(r["aborts"] > 0 for r in rows), "no episode was aborted"
    chat = chat_format(HFTokenizer(str(tmp_path / "tiny")).tok)
    reference = verifiers_group_env.load_environment(n=40)
    groups: dict[int, list[dict[str, Any]]] = {}
    for row in rows:
        assert row["finish_reason"] == "stop" and row["status"] == "finished", row["error"]
        groups.setdefault(row["group_id"], []).append(row)
    changed = 0
    for members in groups.values():
        inputs = [json.loads(json.loads(r["metadata"])[INPUT_KEY]) for r in members]
        turns = [model_turns(r, chat) for r in members]
        own = own_group(reference, inputs, turns)
        assert [r["reward"] for r in members] == pytest.approx(own)
        alone = [own_group(reference, [i], [t])[0] for i, t in zip(inputs, turns, strict=True)]
        changed += own != pytest.approx(alone)
    assert changed, "no group's rewards differed from its episodes' own: the group term went unchecked"
    metrics = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert all(m.get("learner/group_scoring_failed") == 0.0 for m in metrics), metrics
    assert not wait_all_exited(children)
