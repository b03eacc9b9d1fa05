"""The one simulated-engine cost model (april/sim/engine_cost.py): its formula, its defaults reaching every
command that simulates an engine, and `april up --engine sim` and `april simulate` modelling the same
machine step for step."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
from sim_setup import sim_config
from typer.testing import CliRunner

from actors.engine import GenerationRequest, SamplingParams
from actors.engines.sim_engine import SampleIdentity, SimEngine
from actors.factory import make_engine
from actors.lengths import LengthSpec
from april.config import AlgoConfig, ConfigError, Mode, WorkerConfig, load_config, replace_fields
from april.records import Sample, new_group_samples
from april.sim.engine_cost import DEFAULT_COST, EngineCost
from april.sim.sample_draw import sample_key
from broker.sim.engines import EngineModel
from broker.sim.figures import Meter
from cli.bench_plan import BenchSetting, bench_base, run_config
from cli.main import app

COST_FIELDS = ("decode_ms", "decode_ms_per_seq", "prefill_ms_per_token")
LENGTHS = "lognormal:median=30,sigma=0.8,cap=200"
PROMPT = np.arange(3, 43, dtype=np.int32)  # 40 prompt tokens: prefill is a visible part of a first step
MAX_NEW = 1000


def test_step_time_is_a_plus_b_per_sequence_plus_c_per_prefilled_token() -> None:
    cost = EngineCost(decode_ms=2.0, decode_ms_per_seq=0.5, prefill_ms_per_token=0.25)
    assert cost.step_ms(0) == 2.0
    assert cost.step_ms(4) == 2.0 + 0.5 * 4
    assert cost.step_ms(4, 8) == 2.0 + 0.5 * 4 + 0.25 * 8
    assert cost.step_s(4, 8) == pytest.approx(0.006)


@pytest.mark.parametrize("name", COST_FIELDS)
@pytest.mark.parametrize("value", [-1.0, math.nan])
def test_a_negative_or_nan_cost_is_refused_by_name(name: str, value: float) -> None:
    with pytest.raises(ValueError, match=f"{name} = "):
        EngineCost(**{name: value})  # type: ignore[arg-type]


def test_the_simulator_refuses_a_step_that_takes_no_time() -> None:
    EngineCost(0.0, 0.0, 0.0)  # a valid cost for the sim engine (it only scales a clock)
    with pytest.raises(ConfigError, match="a step takes time"):
        sim_config(Mode.SYNC, AlgoConfig(), cost=EngineCost(0.0, 0.0, 0.5))


def _simulate_json_setting(*args: str) -> dict[str, float]:
    small = ("--lengths", "fixed:4", "--steps", "1", "--modes", "sync", "--engines", "1", "--slots", "2")
    batch = ("--rollout-batch-size", "1", "--over-sampling-batch-size", "1", "--n-samples-per-prompt", "2")
    result = CliRunner().invoke(app, ["simulate", "--json", *small, *batch, "--max-new-tokens", "8", *args])
    assert result.exit_code == 0, result.output
    setting: dict[str, float] = json.loads(result.output)["setting"]
    return setting


def simulate_default_cost() -> EngineCost:
    """The step cost `april simulate` runs with when no cost option is given (as its --json reports)."""
    setting = _simulate_json_setting()
    return EngineCost(*(setting[name] for name in COST_FIELDS))


def test_every_simulated_engine_starts_from_the_one_set_of_defaults() -> None:
    assert WorkerConfig().sim_cost == DEFAULT_COST  # april up / april worker --engine sim
    assert load_config(env={}).worker.sim_cost == DEFAULT_COST  # resolved: no file, no environment
    assert simulate_default_cost() == DEFAULT_COST  # april simulate (its base layer: the paper's setting)
    for engine in ("sim", "torch"):  # april bench's base layers
        assert bench_base(engine).worker.sim_cost == DEFAULT_COST, engine


def test_a_chosen_cost_reaches_the_simulator_and_the_bench_workers_alike() -> None:
    """`--set worker.sim_decode_ms=9` (and B, C): april simulate uses it, and the worker config
    `april bench` writes for its runs (worker.sim_*) builds the same cost back."""
    cost = EngineCost(9.0, 0.3, 0.05)
    sets = (
        "worker.sim_decode_ms=9",
        "worker.sim_decode_ms_per_seq=0.3",
        "worker.sim_prefill_ms_per_token=0.05",
    )
    setting = _simulate_json_setting(*(arg for s in sets for arg in ("--set", s)))
    assert EngineCost(*(setting[name] for name in COST_FIELDS)) == cost
    base = replace_fields(bench_base("sim"), dict(s.split("=") for s in sets))
    bench = BenchSetting("sim", (Mode.SYNC,), base, "w", LengthSpec.parse("fixed:4"), 1)
    assert run_config(bench, bench.runs()[0], "run").worker.sim_cost == cost


# ------------------------------------------------------------------ one machine, step by step


def up_engine() -> SimEngine:
    """The sim engine a worker of `april up --engine sim` builds from the default config. Its time scale
    (model time -> wall time) is set to 0 so the test does not sleep: it is no part of the cost."""
    overrides = {"worker.engine": "sim", "worker.sim_lengths": LENGTHS, "worker.sim_time_scale": 0.0}
    cfg = load_config(env={}, overrides=overrides)

    def identify(req: GenerationRequest) -> SampleIdentity:
        return SampleIdentity.of_sample(0, req.request_id % 100, len(PROMPT))  # resumes: request id + 100

    engine = make_engine(cfg.worker, SamplingParams(seed=cfg.run.seed), identify, 0)
    assert isinstance(engine, SimEngine)
    return engine


def engine_step_times(engine: SimEngine, until_first_finish: bool) -> tuple[list[float], list[int]]:
    """Model seconds of each step, and the request ids finished, until the first finishes or all do."""
    times, finished = [], []
    while engine.active and not (until_first_finish and finished):
        before = engine.elapsed_s
        finished += [out.request_id for out in engine.step()]
        times.append(engine.elapsed_s - before)
    return times, finished


def model_step_times(model: EngineModel, until_first_finish: bool) -> tuple[list[float], list[int]]:
    """The same, from the simulator's engine brought forward one step boundary at a time."""
    times, finished = [], []
    while model.active and not (until_first_finish and finished):
        before, at = model.t_base, model.boundary(1)
        model.advance(at, 1)
        finished += [lease_id for lease_id, _ in model.take_finished()]
        times.append(at - before)
    return times, finished


def test_april_up_and_april_simulate_model_the_same_machine() -> None:
    """A full engine of fresh samples runs until the first finishes, is aborted, new weights are loaded,
    and every partial is resumed (re-prefilling prompt + partial) and run to the end: each step takes the
    same model time in the sim engine of `april up --engine sim` (default config) as in `april
    simulate`'s engines (default options), and the same samples finish at the same steps."""
    engine = up_engine()
    slots = engine.slots
    samples = new_group_samples(0, slots, PROMPT, "", {})
    drawn = {s.index: engine.drawn_length(sample_key(0, s.index)) for s in samples}
    model = EngineModel(0, slots, simulate_default_cost(), Meter(1), lambda s: drawn[s.index])

    engine.add([GenerationRequest(s.index, s.prompt_ids, MAX_NEW) for s in samples])
    model.admit([(s.index, MAX_NEW, s.resumed()) for s in samples])
    fresh, fresh_done = engine_step_times(engine, until_first_finish=True)
    model_fresh, model_fresh_done = model_step_times(model, until_first_finish=True)
    assert model_fresh == pytest.approx(fresh, rel=1e-12) and model_fresh_done == fresh_done

    partials = {out.request_id: out.token_ids for out in engine.abort()}
    aborted: dict[int, Sample] = dict(model.abort())
    assert {i: s.response_len for i, s in aborted.items()} == {i: len(t) for i, t in partials.items()}
    # the next round runs on new weights (resume_kv "recompute", the default): the prefix caches are
    # emptied, so every partial re-prefills prompt + partial in both engines
    engine.load_weights("", 1)
    model.load(1)
    engine.add(
        [
            GenerationRequest(i + 100, np.concatenate([PROMPT, tokens]), MAX_NEW - len(tokens))
            for i, tokens in partials.items()
        ]
    )
    model.admit([(i + 100, MAX_NEW - s.response_len, s.resumed()) for i, s in aborted.items()])
    resumed, resumed_done = engine_step_times(engine, until_first_finish=False)
    model_resumed, model_resumed_done = model_step_times(model, until_first_finish=False)
    assert model_resumed == pytest.approx(resumed, rel=1e-12)
    assert sorted(model_resumed_done) == sorted(resumed_done) == sorted(i + 100 for i in partials)

    # what the comparison covered: first steps that pay for the prefill (a resumed one for prompt +
    # partial, more than the fresh prompt alone) and a batch that shrinks as samples finish
    assert len(fresh_done) >= 1 and len(partials) == slots - len(fresh_done)
    assert resumed[0] > fresh[0] > fresh[1] == pytest.approx(DEFAULT_COST.step_s(slots))
    assert resumed[1] > resumed[-1] == pytest.approx(DEFAULT_COST.step_s(1))
