"""Simulated episodes in real processes (`env.name = "sim"`, actors/sim_tools.py, the sim engine's plans):
the tools answer on the plan's clock with its observations; the engine generates each turn's planned
tokens; and a real `april up` run with aborts trains samples whose every turn and answer is their plan's,
cut off by `env.max_turns` as the worker core cuts."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from test_rollouts_run import metrics_lines
from test_up import check_run, run_up

from actors.engine import GenerationOutput, GenerationRequest
from actors.engines.sim_engine import SampleIdentity, SimEngine
from actors.sim_tools import SimTools, episode_plans
from april.config import load_config
from april.data import PromptRecord
from april.episode import EpisodeError, Message, ResetRequest, Role, StepKey, StepRequest
from april.records import Sample
from april.rollouts import MODEL, OBSERVATION, train_dir
from april.sim.episode_plans import EpisodePlan, EpisodePlans

pd = pytest.importorskip("pandas")

FIELDS = {
    "env.name": "sim",
    "env.max_turns": "3",
    "env.max_turn_tokens": "12",
    "worker.engine": "sim",
    "worker.model": "",
    "worker.sim_lengths": "uniform:min=4,max=16",
    "worker.sim_turns": "uniform:min=1,max=5",
    "worker.sim_tool_ms": "uniform:min=20,max=800",
    "worker.sim_observation_tokens": "uniform:min=1,max=9",
}


def plans_of(fields: dict[str, str] = FIELDS) -> EpisodePlans:
    plans = episode_plans(load_config(env={}, overrides=fields))
    assert plans is not None
    return plans


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def step(group: int, turn: int) -> StepRequest:
    return StepRequest("{}", Message(Role.ASSISTANT, "turn"), StepKey(group, 0, turn))


def plan(plans: EpisodePlans, group: int) -> EpisodePlan:
    return plans(Sample(group_id=group, index=0, prompt_ids=np.zeros(0, dtype=np.int32)))


def a_group_with_a_call(plans: EpisodePlans) -> int:
    return next(g for g in range(100) if len(plan(plans, g).turns) >= 3)


@pytest.mark.parametrize("repeatable", [True, False])
def test_steps_answer_on_the_plans_clock(repeatable: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    clock = Clock()
    monkeypatch.setattr("actors.sim_tools.time.monotonic", clock)
    plans = plans_of()
    tools = SimTools(plans, time_scale=0.5, repeatable=repeatable)
    g = a_group_with_a_call(plans)
    p = plan(plans, g)
    record = PromptRecord(g, np.zeros(0, dtype=np.int32), "the prompt", {})
    tools.submit(1, ResetRequest(record))
    (reset,) = tools.poll()  # a reset answers at once with the prompt's text
    assert reset.key == 1 and reset.step is not None and reset.step.observation[0].content == "the prompt"
    tools.submit(2, step(g, 0))
    due = p.tool_s[0] * 0.5
    assert tools.next_answer_s() == pytest.approx(due) and tools.pending == 1
    clock.now += due * 0.99
    assert tools.poll() == []
    clock.now += due * 0.02
    (answer,) = tools.poll()
    assert answer.step is not None and not answer.step.done
    assert answer.step.observation[0].content == "x" * p.observations[0]
    last = len(p.turns) - 1
    tools.submit(3, step(g, last))  # the step after the plan's last turn: done at once, reward 0
    (done,) = tools.poll()
    assert done.step is not None and done.step.done and done.step.reward == 0.0
    tools.submit(4, step(g, 1))  # an abort: killed (the sample owes it) or waited for
    assert tools.cancel(4) is repeatable
    clock.now += 1000.0
    assert [r.key for r in tools.poll()] == ([] if repeatable else [4])
    assert tools.pending == 0 and tools.next_answer_s() is None


def test_the_sim_engine_generates_each_turns_planned_tokens() -> None:
    plans = plans_of()
    g = a_group_with_a_call(plans)
    p = plan(plans, g)
    where: dict[int, SampleIdentity] = {}
    engine = SimEngine(
        "fixed:1", slots=2, time_scale=0.0, plans=plans, identify=lambda r: where[r.request_id]
    )
    prompt = [5] * 8
    first = SampleIdentity.of_sample(g, 0, len(prompt))
    where[1] = first
    engine.add([GenerationRequest(1, np.asarray(prompt, dtype=np.int32), 100)])
    out: list[GenerationOutput] = []
    while not out:
        out = engine.step()
    assert out[0].token_ids.shape[0] == p.turns[0]
    # its second turn, after an answer of 3 tokens, resumed after 2 of its tokens on another request
    answered = len(prompt) + p.turns[0] + 3
    where[2] = SampleIdentity(first.key, len(prompt), 0, p.turns[0] + 2, 1, 0)
    engine.add([GenerationRequest(2, np.zeros(answered + 2, dtype=np.int32), 100)])
    out = []
    while not out:
        out = engine.step()
    assert out[0].token_ids.shape[0] == p.turns[1] - 2


def test_the_simulated_env_needs_the_sim_engine_and_its_plans() -> None:
    from actors.episode_driver import check_env

    config = load_config(env={}, overrides={**FIELDS, "worker.engine": "torch"})
    with pytest.raises(EpisodeError, match=r"plays simulated episodes: worker\.engine"):
        check_env(config.env, config.worker)
    check_env(config.env, load_config(env={}, overrides=FIELDS).worker)
    without = load_config(env={}, overrides={k: v for k, v in FIELDS.items() if k != "worker.sim_turns"})
    with pytest.raises(EpisodeError, match=r"set worker\.sim_turns or worker\.sim_episodes"):
        check_env(without.env, without.worker)


def pieces_by_kind(pieces: list[dict[str, object]]) -> tuple[list[int], list[int]]:
    """A transcript's model turns (tokens each, pieces of one turn merged) and observations (tokens)."""
    turns: list[int] = []
    observations: list[int] = []
    previous = OBSERVATION
    for piece in pieces:
        n = int(piece["end"]) - int(piece["start"])  # type: ignore[call-overload]
        if piece["kind"] == MODEL:
            if previous == MODEL:
                turns[-1] += n
            else:
                turns.append(n)
        else:
            observations.append(n)
        previous = str(piece["kind"])
    return turns, observations


def test_a_run_trains_the_planned_episodes(tmp_path: Path) -> None:
    """april mode (aborts mid-turn and mid-tool), 2 workers x 2 slots, simulated episodes: every trained
    sample is its plan, turn by turn and answer by answer, up to `env.max_turns` (then cut off: LENGTH,
    no answer appended), whichever workers and resumes played it."""
    run_dir = tmp_path / "run"
    sets = [f"--set={k}={v}" for k, v in FIELDS.items()]
    sets += ["--set=worker.sim_time_scale=0.5", "--set=learner.backend=sim", "--set=learner.sim_step_s=1"]
    sets += ["--set=algo.rollout_batch_size=2", "--set=algo.over_sampling_batch_size=4"]
    sets += ["--set=algo.n_samples_per_prompt=2", "--set=algo.max_new_tokens=200", "--set=worker.slots=2"]
    code, output, _ = run_up(
        ["--mode", "april", "--steps", "3", "--workers", "2", "--run-dir", str(run_dir), *sets], 240
    )
    assert code == 0, output
    check_run(run_dir, 3, samples=4)
    assert sum(line["aborted"] for line in metrics_lines(run_dir)) > 0  # the runs were cut mid-episode
    frame = pd.read_parquet(train_dir(run_dir))
    assert set(frame["finish_reason"]) == {"stop", "length"} and frame["resumes"].sum() > 0
    plans = plans_of()
    for row in frame.itertuples():
        p = plans(Sample(group_id=row.group_id, index=row.sample_index, prompt_ids=np.zeros(0, np.int32)))
        turns, observations = pieces_by_kind(list(row.pieces))
        allowed = min(len(p.turns), 3)
        assert turns == list(p.turns[:allowed]), row
        assert observations == list(p.observations[: allowed - 1]), row
        assert row.finish_reason == ("stop" if len(p.turns) <= 3 else "length"), row
