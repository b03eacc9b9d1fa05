"""`april simulate`'s episodes (april/sim/episode_plans.py, broker/sim/engines.py, broker/sim/model.py):
timelines solved by hand, the slot a tool call frees, aborts mid-turn and mid-tool, budgets, the token
accounting, and the workloads (specs, recorded episodes, `--episodes`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from sim_setup import sim_config
from typer.testing import CliRunner

from actors.lengths import EpisodeFile, LengthSpec, LengthSpecError, UniformLength
from april.config import AlgoConfig, Config, Mode, replace_fields
from april.records import FinishReason, SampleStatus, Segment, Span, new_group_samples
from april.sim.engine_cost import EngineCost
from april.sim.episode_plans import DrawnEpisodes, EpisodePlan, EpisodePlans, EpisodeWorkload
from broker.sim.engines import EngineModel
from broker.sim.figures import Meter, Tally
from broker.sim.model import SimConfig, SimResult, Simulation, simulate
from cli.main import app
from cli.sim_options import LengthsError, episode_fields

MS = 1e-3
PROMPT = 10
UNIT_COST = EngineCost(1.0, 0.0, 0.0)  # 1 ms a step, no per-sequence or prefill cost


def workload(turns: str, turn_tokens: str, tool_ms: str | None, observations: str) -> EpisodeWorkload:
    obs = LengthSpec.parse(observations)
    sampler = DrawnEpisodes(
        LengthSpec.parse(turns),
        LengthSpec.parse(turn_tokens),
        None if tool_ms is None else LengthSpec.parse(tool_ms),
        obs,
    )
    return EpisodeWorkload(sampler, obs)


def config(
    mode: Mode,
    *,
    b: int = 1,
    n: int = 1,
    over: int = 1,
    slots: int = 1,
    engines: int = 1,
    cost: EngineCost = UNIT_COST,
    max_new: int = 1000,
    steps: int = 1,
    fields: dict[str, Any] | None = None,
) -> SimConfig:
    algo = AlgoConfig(
        rollout_batch_size=b, over_sampling_batch_size=over, n_samples_per_prompt=n, max_new_tokens=max_new
    )
    cfg = sim_config(
        mode,
        algo,
        engines=engines,
        slots=slots,
        cost=cost,
        learner_step_s=0.0,
        steps=steps,
        prompt_len=PROMPT,
        check_ledger_every_event=True,
    )
    return SimConfig(replace_fields(cfg.config, fields or {}), engines, check_ledger_every_event=True)


def run_with_samples(cfg: SimConfig, episodes: EpisodeWorkload) -> tuple[SimResult, list[Any]]:
    """Run, and keep every trained sample (the batches handed to the learner)."""
    sim = Simulation(cfg, LengthSpec.parse("fixed:1"), episodes)
    trained: list[Any] = []
    hand_out = sim._hand_out

    def keep(batch: Any) -> None:
        trained.extend(batch.samples)
        hand_out(batch)

    sim._hand_out = keep  # type: ignore[method-assign]
    result = sim.run()
    assert result.ledger.balanced and result.figures.wasted_tokens == 0
    return result, trained


# ---------------------------------------------------------------------------------------------------
# timelines solved by hand (A = 1 ms a step, no per-sequence cost)

TWO_TURNS = workload("fixed:2", "fixed:10", "fixed:50", "fixed:4")


def test_two_turns_and_a_tool_call_by_hand() -> None:
    """Turn 1 prefills the 10-token prompt (1 + 10 ms) and decodes 9 more steps: ends at 20 ms. The tool
    answers 50 ms later (70 ms) with 4 tokens; the context is cached, so turn 2 prefills only those:
    1 + 4 ms, then 9 steps: done at 84 ms. The slot was busy for the two turns only."""
    cfg = config(Mode.SYNC, cost=EngineCost(1.0, 0.0, 1.0))
    result, trained = run_with_samples(cfg, TWO_TURNS)
    f = result.figures
    assert f.wall_s == pytest.approx(84 * MS)
    assert f.slot_utilization == pytest.approx((20 + 14) / 84)
    (s,) = trained
    assert s.response_len == 24 and s.model_tokens == 20
    assert s.segments == (Segment(0, 0, 10), Segment(0, 14, 24)) and s.observations == (Span(10, 14),)
    assert (s.status, s.finish_reason) == (SampleStatus.FINISHED, FinishReason.STOP)
    assert f.reprefill_frac == 0.0  # nothing the engine had seen was prefilled again
    assert f.tokens_per_s * f.wall_s == pytest.approx(20)  # model tokens only
    assert f.effective_tokens_per_s * f.wall_s == pytest.approx(20)


def test_without_a_prefix_cache_the_next_turn_prefills_the_whole_context() -> None:
    """Cache of 0 tokens: turn 2 prefills prompt + turn 1 + the answer (24 tokens): 1 + 24 ms, then 9."""
    cost = EngineCost(1.0, 0.0, 1.0, prefix_cache_tokens=0)
    result, _ = run_with_samples(config(Mode.SYNC, cost=cost), TWO_TURNS)
    assert result.figures.wall_s == pytest.approx((20 + 50 + 25 + 9) * MS)
    busy = 20 + 25 + 9
    assert result.figures.reprefill_frac == pytest.approx(20 / busy)  # prompt + turn 1; the answer is new


def test_a_tool_call_frees_its_slot_for_another_sample() -> None:
    """One slot, two samples of 2 x 10 tokens, tools of 50 ms. A runs 0-10 ms; while its tool runs, B
    takes the slot (10-20); A's answer (60) finds the slot free: 60-70; B's (70) takes the slot A frees
    at 70, ahead of anything else: 70-80. Holding the slot through the tool would take 140 ms."""
    result, trained = run_with_samples(config(Mode.SYNC, n=2), TWO_TURNS)
    assert result.figures.wall_s == pytest.approx(80 * MS)
    assert result.figures.slot_utilization == pytest.approx(40 / 80)
    assert sorted(s.response_len for s in trained) == [24, 24]


def test_a_tool_call_without_latency_keeps_its_slot() -> None:
    """No latency: the answer comes with the turn's end, so the episode goes on in its slot (its second
    turn prefills nothing here) and B waits: A 0-20 ms, B 20-40."""
    episodes = workload("fixed:2", "fixed:10", None, "fixed:4")
    result, _ = run_with_samples(config(Mode.SYNC, n=2), episodes)
    assert result.figures.wall_s == pytest.approx(40 * MS)
    assert result.figures.slot_utilization == pytest.approx(1.0)


# ---------------------------------------------------------------------------------------------------
# the engine model driven by hand: aborts mid-turn and mid-tool


def engine(repeatable: bool = True) -> EngineModel:
    plans = EpisodePlans(EpisodeWorkload(_Fixed(), LengthSpec.parse("fixed:4")), 0, 16, 4096)
    return EngineModel(0, 2, UNIT_COST, Meter(1), plans, repeatable_tools=repeatable)


class _Fixed:
    """Every episode: two turns of 10 tokens, a tool call of 50 ms between them answering 4 tokens."""

    def episode(self, rng: np.random.Generator) -> tuple[list[int], list[float], list[int]]:
        return [10, 10], [50.0], [4]


def fresh(group: int = 0) -> Any:
    return new_group_samples(group, 1, np.arange(PROMPT, dtype=np.int32), "", {})[0].resumed()


def steps(model: EngineModel, n: int) -> None:
    model.advance(model.boundary(n), n)


def test_an_abort_mid_turn_returns_the_turns_so_far_and_the_resume_finishes_the_turn() -> None:
    model = engine()
    assert model.admit([(1, 1000, fresh())]) == []
    steps(model, 5)
    ((lease, partial),) = model.abort()
    assert lease == 1 and partial.status == SampleStatus.INTERRUPTED
    assert partial.response_len == 5 and partial.observations == ()
    model.admit([(2, 1000 - 5, partial.resumed())])
    steps(model, 5)
    assert model.take_finished() == []  # the first turn ended: its tool runs, holding no slot
    assert model.active == 0 and list(model.tools) == [2] and model.grant() == 1


@pytest.mark.parametrize("repeatable", [True, False])
def test_an_abort_mid_tool_kills_a_repeatable_call_and_waits_for_the_others(repeatable: bool) -> None:
    model = engine(repeatable)
    model.admit([(1, 1000, fresh())])
    steps(model, 10)
    assert model.take_finished() == [] and model.started_tools == [pytest.approx(model.t_base + 0.05)]
    ended = model.t_base
    returned = model.abort()
    if repeatable:  # back at once, owing the call: a resume runs it again, in no slot
        ((_, sample),) = returned
        assert sample.status == SampleStatus.INTERRUPTED and sample.response_len == 10
        assert sample.observations == () and model.waited_for() == [] and not model.tools
        model.admit([(2, 990, sample.resumed())])
        assert model.active == 0 and model.tools[2].due == pytest.approx(model.t_base + 0.05)
    else:  # waited for: named in the AbortDone, back when the tool answers, with the answer
        assert returned == [] and model.waited_for() == [1]
        assert model.complete_tools(ended + 0.049) == []
        ((lease, sample),) = model.complete_tools(ended + 0.05)
        assert lease == 1 and sample.status == SampleStatus.INTERRUPTED
        assert sample.observations == (Span(10, 14),) and sample.response_len == 14
        model.admit([(2, 986, sample.resumed())])  # the next turn starts at once
        assert model.active == 1 and not model.tools


def test_an_abort_returns_answered_episodes_and_unstarted_leases_as_they_are() -> None:
    model = engine()
    model.admit([(1, 1000, fresh(0)), (2, 1000, fresh(1))])
    steps(model, 10)
    model.take_finished()  # both tools run; both slots free
    assert model.grant() == 2
    model.admit([(3, 1000, fresh(2))])
    model.complete_tools(model.t_base + 0.05)  # both answer: 1 takes the free slot, 2 waits
    model.fill()
    model.admit([(5, 1000, fresh(4))])  # no free slot: it waits in the worker
    steps(model, 3)
    out = dict(model.abort())
    assert set(out) == {1, 2, 3, 5}
    assert all(s.status == SampleStatus.INTERRUPTED for s in out.values())
    assert out[1].observations == (Span(10, 14),) and out[1].response_len == 17  # its next turn's 3
    assert out[2].observations == (Span(10, 14),) and out[2].response_len == 14  # as it waited
    assert out[3].response_len == 3 and out[5].response_len == 0
    assert model.core.credit == model.slots and not model.core.ready


def test_answered_episodes_take_freed_slots_before_leases_held_unstarted() -> None:
    model = engine()
    model.admit([(1, 1000, fresh(0)), (2, 1000, fresh(1))])
    steps(model, 10)
    model.take_finished()
    assert model.grant() == 2  # the two slots the turns gave up
    model.admit([(3, 1000, fresh(2))])  # the broker leases one of them
    model.complete_tools(model.t_base + 0.05)
    assert model.fill() == [] and [s.lease_id for s in model.seqs] == [3, 1]  # 1 takes the other
    model.admit([(5, 1000, fresh(4))])  # on the credit 1 took: it waits in the worker
    assert list(model.core.waiting) == [2, 5]  # the answered episode first
    steps(model, 10)  # 3 ends its first turn, 1 its last: two slots free
    assert model.take_finished() == []  # their steps run: 3's tool call, 1's end (answered at once)
    (finished,) = model.complete_tools(model.t_base)
    assert finished[0] == 1 and finished[1].status == SampleStatus.FINISHED
    assert model.fill() == [] and [s.lease_id for s in model.seqs] == [2, 5]  # the episode first
    assert model.grant() == 0  # nothing was left to grant


def test_an_owed_call_runs_at_lease_and_its_episode_waits_as_unstarted() -> None:
    """The episode driver's rules (actors/episode_driver.py `lease`, april.turn_queue): a lease owing a
    step runs it at once, holding no slot, even with the engine full; answered, the episode has not had a
    turn on this worker, so it waits behind the leases held unstarted before it and behind every episode
    answered after a turn here."""
    model = engine()
    model.admit([(1, 1000, fresh(0)), (2, 1000, fresh(1))])
    steps(model, 10)
    model.take_finished()  # 1's and 2's tools run
    model.admit([(3, 1000, fresh(2)), (4, 1000, fresh(3))])  # on the two slots granted: both full
    killed = dict(model.abort())[1]  # (2 is killed too; 3 and 4 come back as partials)
    assert killed.response_len == 10 and killed.observations == ()
    model.admit([(5, 1000, fresh(4)), (6, 1000, fresh(5))])  # two slots again: 5 and 6 run
    model.admit([(7, 1000, fresh(6)), (8, 990, killed.resumed())])  # the engine is full
    assert model.active == 2 and list(model.tools) == [8]  # 8's owed call runs now, 7 waits
    steps(model, 10)  # 5 and 6 end their first turns; their tools run
    model.take_finished()
    model.complete_tools(model.t_base + 1.0)  # every call answers: 8's, then 5's and 6's
    assert list(model.core.waiting) == [5, 6, 7, 8]


# ---------------------------------------------------------------------------------------------------
# budgets


def test_max_turns_and_tokens_per_turn_bound_the_plan() -> None:
    """Five turns drawn, two allowed, 30 tokens a turn: turn 1 (0-30 ms), its tool (1 ms), turn 2
    (31-61 ms), then the step of turn 2 runs (61-62 ms) and, not done, the episode is cut off without its
    answer: LENGTH and reward 0, the rule of the episode driver (tests/test_episode_driver.py)."""
    episodes = workload("fixed:5", "fixed:100", "fixed:1", "fixed:4")
    fields = {"env.max_turns": "2", "env.max_turn_tokens": "30"}
    result, (s,) = run_with_samples(config(Mode.SYNC, fields=fields), episodes)
    assert s.segments == (Segment(0, 0, 30), Segment(0, 34, 64)) and s.observations == (Span(30, 34),)
    assert s.response_len == 64  # the last call's answer is not appended
    assert (s.finish_reason, s.reward) == (FinishReason.LENGTH, 0.0)
    assert result.figures.wall_s == pytest.approx(62 * MS)
    plans = EpisodePlans(episodes, 0, max_turns=2, max_turn_tokens=30)
    assert plans(s) == EpisodePlan((30,) * 5, (0.001,) * 4, (4,) * 4)  # the cut is the worker core's


def test_the_episode_budget_counts_observations() -> None:
    episodes = workload("fixed:3", "fixed:10", "fixed:1", "fixed:4")
    _, (s,) = run_with_samples(config(Mode.SYNC, max_new=20), episodes)
    assert s.response_len == 20 and s.model_tokens == 16  # 10, an answer of 4, then 6 of 10: cut
    assert s.finish_reason == FinishReason.LENGTH
    _, (s,) = run_with_samples(config(Mode.SYNC, max_new=12), episodes)
    # an answer (4) that leaves no budget for another turn (2 left) ends the episode, not appended
    assert s.observations == () and s.response_len == 10 and s.finish_reason == FinishReason.LENGTH


# ---------------------------------------------------------------------------------------------------
# whole runs: the books, the token accounting, staleness over model tokens


@pytest.mark.parametrize("repeatable", ["true", "false"])
@pytest.mark.parametrize("mode", [Mode.APRIL, Mode.ASYNC])
def test_episodes_under_aborts_keep_the_books(mode: Mode, repeatable: str) -> None:
    episodes = workload("uniform:min=1,max=5", "lognormal:median=20,sigma=1,cap=200", "fixed:30", "fixed:3")
    cfg = config(
        mode, b=2, n=2, over=4, slots=3, engines=2, steps=6, fields={"worker.sim_tool_repeatable": repeatable}
    )
    result, trained = run_with_samples(cfg, episodes)
    f = result.figures
    assert f.aborted > 0 and any(s.observations for s in trained)
    model = sum(s.model_tokens for s in trained)
    assert f.effective_tokens_per_s * f.wall_s == pytest.approx(model)
    tally = Tally()
    for step in result.steps:
        tally.add_batch([s for s in trained if s.group_id in step.groups], step.version)
    assert tally.tokens == model  # observations are trained on by no one


def test_the_off_policy_share_and_staleness_count_model_tokens_only() -> None:
    s = new_group_samples(0, 1, np.arange(4, dtype=np.int32), "", {})[0].resumed()
    s = s.extend([1] * 10, [-0.5] * 10, 0, FinishReason.NONE).observed([7] * 90)
    s = s.extend([1] * 10, [-0.5] * 10, 1, FinishReason.STOP).scored(1.0)
    tally = Tally()
    tally.add_batch([s], 1)
    assert (tally.tokens, tally.offpolicy_tokens, tally.staleness_max) == (20, 10, 1)


def test_every_mode_sees_the_same_episodes() -> None:
    episodes = workload("uniform:min=1,max=6", "lognormal:median=20,sigma=1,cap=200", "fixed:5", "fixed:2")
    plans = [EpisodePlans(episodes, seed, 16, 4096) for seed in (0, 0, 1)]
    sample = fresh(3)
    assert plans[0](sample) == plans[1](sample) != plans[2](sample)


# ---------------------------------------------------------------------------------------------------
# workloads


def test_uniform_spec() -> None:
    spec = LengthSpec.parse("uniform: min=2, max=10")
    assert spec == UniformLength(2, 10) and LengthSpec.parse(spec.describe()) == spec
    drawn = spec.sample(np.random.default_rng(0), 2000)
    assert set(drawn.tolist()) == set(range(2, 11))
    for bad in ("uniform:min=0,max=3", "uniform:min=4,max=3", "uniform:min=2", "uniform:min=2,max=x"):
        with pytest.raises(LengthSpecError, match="uniform"):
            LengthSpec.parse(bad)


def test_recorded_episodes(tmp_path: Path) -> None:
    path = tmp_path / "episodes.jsonl"
    path.write_text(
        "# two recorded episodes\n"
        '{"turns": [5, 6, 7], "tool_ms": [100, 2000.5], "observation_tokens": [3, 4]}\n'
        '{"turns": [9]}\n'
    )
    recorded = EpisodeFile.load(str(path))
    assert recorded.episodes == (((5, 6, 7), (100.0, 2000.5), (3, 4)), ((9,), (), None))
    plans = EpisodePlans(EpisodeWorkload(recorded, LengthSpec.parse("fixed:8")), 0, 2, 6)
    seen = {plans(fresh(g)) for g in range(40)}
    # turns of at most 6 tokens (max_turns is the worker core's to apply)
    assert seen == {EpisodePlan((5, 6, 6), (0.1, 2.0005), (3, 4)), EpisodePlan((6,))}
    for line, error in [
        ('{"turns": []}', '"turns", a non-empty'),
        ('{"turns": [3, 0], "tool_ms": [1]}', '"turns" = '),
        ('{"turns": [3, 4]}', '"tool_ms" has 0 entries, expected 1'),
        ('{"turns": [3, 4], "tool_ms": [1], "observation_tokens": [1.5]}', "whole numbers"),
        ("[1, 2]", "expected an object"),
        ("{", "not valid JSON"),
    ]:
        path.write_text(line + "\n")
        with pytest.raises(LengthSpecError, match="line 1") as err:
            EpisodeFile.load(str(path))
        assert error in str(err.value)


def test_episode_workloads_set_config_fields(tmp_path: Path) -> None:
    fields = episode_fields("agentic")
    assert fields["worker.sim_turns"] == "uniform:min=2,max=10"
    assert fields["worker.sim_tool_ms"] == "lognormal:median=1000,sigma=1.46,cap=30000"
    assert set(fields) == {
        "worker.sim_lengths",
        "worker.sim_turns",
        "worker.sim_tool_ms",
        "worker.sim_observation_tokens",
    }
    (tmp_path / "x.toml").write_text('turns = "fixed:2"\ntool_ms = ""\n')
    assert episode_fields(str(tmp_path / "x.toml")) == {
        "worker.sim_turns": "fixed:2",
        "worker.sim_tool_ms": "",
    }
    (tmp_path / "bad.toml").write_text('lengths = "fixed:2"\n')
    with pytest.raises(LengthsError, match='"turns"'):
        episode_fields(str(tmp_path / "bad.toml"))
    with pytest.raises(LengthsError, match="episode workloads: agentic"):
        episode_fields("no-such")


def test_simulate_episodes_command(tmp_path: Path) -> None:
    small = [
        "--engines", "2", "--slots", "4", "--rollout-batch-size", "2", "--over-sampling-batch-size", "4",
        "--n-samples-per-prompt", "2", "--steps", "2", "--max-new-tokens", "4096", "--json",
    ]  # fmt: skip
    runner = CliRunner()
    got = runner.invoke(app, ["simulate", "--episodes", "agentic", *small])
    assert got.exit_code == 0, got.output
    doc = json.loads(got.output)
    assert doc["setting"]["episodes"]["turns"] == "uniform:min=2,max=10"
    assert doc["setting"]["lengths"] == "lognormal:median=400,sigma=0.8,cap=4096"  # each turn's
    assert set(doc["modes"]) == {"sync", "april", "async"} and doc["modes"]["sync"]["wasted_tokens"] == 0
    recorded = tmp_path / "e.jsonl"
    recorded.write_text('{"turns": [30, 40], "tool_ms": [20]}\n')
    got = runner.invoke(app, ["simulate", "--episodes", str(recorded), "--modes", "sync", *small])
    assert got.exit_code == 0, got.output
    assert json.loads(got.output)["setting"]["episodes"]["recorded"] == str(recorded.resolve())
    args = ["simulate", "--episodes", "agentic", "--set", "worker.sim_tool_ms=", "--modes", "sync", *small]
    got = runner.invoke(app, args)  # --set changes a field --episodes set
    assert got.exit_code == 0 and json.loads(got.output)["setting"]["episodes"]["tool_ms"] is None
    got = runner.invoke(app, ["simulate", "--set", "worker.sim_turns=fixed:0", "--modes", "sync", *small])
    assert got.exit_code != 0 and "april: error: worker.sim_turns" in got.output
    assert "Traceback" not in got.output


def test_single_turn_runs_are_unchanged_by_the_episode_settings() -> None:
    """Episode fields without worker.sim_turns or sim_episodes simulate single-turn samples, as before."""
    base = config(Mode.APRIL, b=2, n=2, over=4, slots=4, steps=3)
    other = SimConfig(
        replace_fields(base.config, {"worker.sim_tool_ms": "fixed:7", "env.max_turn_tokens": "3"}), 1
    )
    lengths = LengthSpec.parse("lognormal:median=20,sigma=1,cap=200")
    assert simulate(base, lengths).figures == simulate(other, lengths).figures
    assert Config().worker.sim_turns == ""
