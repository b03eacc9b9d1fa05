"""`april simulate`: the discrete-event model (broker.sim) against hand-solved runs, the books and the
bounds on long-tailed runs, the vectorised engine against the sim engine stepped token by token, and the
command (lengths files, sweeps, the --json schema)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import numpy.typing as npt
import pytest
from sim_setup import sim_config
from typer.testing import CliRunner

from actors.engine import GenerationRequest
from actors.engines.sim_engine import SampleIdentity, SimEngine
from actors.lengths import EmpiricalLength, LengthSpec, LengthSpecError
from april.config import AlgoConfig, ConfigError, Mode
from april.records import new_group_samples
from april.sim.engine_cost import EngineCost
from broker.sim.engines import EngineModel
from broker.sim.figures import ARRIVAL_WINDOW_S, ArrivalMeter, Meter
from broker.sim.model import SimResult, simulate
from cli.main import app
from cli.sim_options import LengthsError, paper_config, point_config, resolve_lengths, sweep_points

MS = 1e-3
UNIT_COST = EngineCost(1.0, 0.0, 0.0)  # 1 ms a step, no per-sequence or prefill cost
LONG_TAIL = LengthSpec.parse("mixture:0.85*lognormal:median=60,sigma=0.6,cap=600+0.15*fixed:600")
FIGURE_KEYS = {
    "wall_s",
    "rollout_s",
    "samples_per_s",
    "tokens_per_s",
    "effective_tokens_per_s",
    "slot_utilization",
    "bubble_frac",
    "wasted_tokens",
    "buffered_tokens",
    "offpolicy_token_frac",
    "staleness_mean",
    "staleness_max",
    "aborted",
    "resumed",
    "accuracy_final",
    "speedup",
    "reprefill_frac",
    "stale_kv_token_frac",
    "broker_arrivals_per_s_mean",
    "broker_arrivals_per_s_peak",
}


class Pattern:
    """Lengths repeating `pattern` in sample order: group g, index i gets pattern[(g * n + i) % len]."""

    def __init__(self, *pattern: int) -> None:
        self.pattern = np.asarray(pattern, dtype=np.int64)

    def sample(self, rng: np.random.Generator, n: int) -> npt.NDArray[np.int64]:
        assert n % len(self.pattern) == 0  # chunks start at a pattern boundary
        return np.resize(self.pattern, n)


def run(
    mode: Mode,
    lengths: Pattern | LengthSpec,
    *,
    b: int = 1,
    over: int = 2,
    n: int = 2,
    eta: int = 1,
    max_new: int = 1000,
    engines: int = 1,
    slots: int = 4,
    cost: EngineCost = UNIT_COST,
    learner_s: float = 0.0,
    steps: int = 3,
    prompt_len: int = 10,
) -> SimResult:
    algo = AlgoConfig(
        rollout_batch_size=b,
        over_sampling_batch_size=over,
        n_samples_per_prompt=n,
        max_new_tokens=max_new,
        max_staleness=eta,
    )
    cfg = sim_config(
        mode,
        algo,
        engines=engines,
        slots=slots,
        cost=cost,
        learner_step_s=learner_s,
        steps=steps,
        prompt_len=prompt_len,
        check_ledger_every_event=True,
    )
    result = simulate(cfg, lengths)
    assert result.ledger.balanced and result.ledger.trained == b * steps
    assert result.figures.wasted_tokens == 0
    return result


# ---------------------------------------------------------------------------------------------------
# hand-solved runs (1 ms a step, no prefill, no learner time unless stated)


@pytest.mark.parametrize("mode", list(Mode))
def test_fixed_lengths_one_engine_every_mode_is_sync(mode: Mode) -> None:
    """One group fills the engine: 10 steps a batch whatever the mode; nothing is aborted."""
    r = run(mode, Pattern(10), over=1 if mode == Mode.SYNC else 2, n=4, slots=4, steps=2)
    f = r.figures
    assert f.wall_s == pytest.approx(0.020)
    assert f.samples_per_s == pytest.approx(8 / 0.020)
    assert f.tokens_per_s == pytest.approx(80 / 0.020) == pytest.approx(f.effective_tokens_per_s)
    assert f.slot_utilization == pytest.approx(1.0)
    if mode == Mode.ASYNC:  # group 1 starts at 10 ms; v1, published then, aborts it after one step
        assert (f.aborted, f.resumed, f.buffered_tokens, f.staleness_max) == (4, 4, 0, 1)
    else:
        assert (f.aborted, f.resumed, f.buffered_tokens, f.staleness_max) == (0, 0, 0, 0)


def test_sync_two_engines_with_learner_time() -> None:
    """Two groups of 2 on 2 engines x 2 slots: 10 ms of decode, then 5 ms of training, twice."""
    r = run(Mode.SYNC, Pattern(10), b=2, over=2, engines=2, slots=2, learner_s=5 * MS, steps=2)
    f = r.figures
    assert f.wall_s == pytest.approx(0.030)
    assert f.rollout_s == pytest.approx(0.020)
    assert f.samples_per_s == pytest.approx(8 / 0.030)
    assert f.slot_utilization == pytest.approx(1.0)  # over the rollout phases
    assert f.bubble_frac == pytest.approx(10 / 30)  # both engines idle while the learner trains
    assert [s.trained_s for s in r.steps] == pytest.approx([0.015, 0.030])


def test_april_long_tail_aborts_resumes_and_beats_sync() -> None:
    """Groups alternate 10-token and 100-token pairs; B=1, over-sampling 2, one engine of 4 slots.

    sync: 10 + 100 + 10 = 120 ms. april: round 1 ends at 10 ms (group 0), group 1 aborted at 10 tokens;
    round 2 resumes it beside group 2, which ends at 20 ms (group 1 at 20 tokens); round 3 resumes it
    beside group 3 and it ends at 100 ms, trained at version 2 with tokens of versions 0, 1 and 2."""
    sync = run(Mode.SYNC, Pattern(10, 10, 100, 100), over=1)
    april = run(Mode.APRIL, Pattern(10, 10, 100, 100))
    assert sync.figures.wall_s == pytest.approx(0.120)
    assert april.figures.wall_s == pytest.approx(0.100)
    assert [s.groups for s in april.steps] == [(0,), (2,), (1,)]
    assert [s.trained_s for s in april.steps] == pytest.approx([0.010, 0.020, 0.100])
    f = april.figures
    assert (f.aborted, f.resumed, f.staleness_max) == (6, 4, 2)
    assert f.offpolicy_token_frac == pytest.approx(40 / 240)  # group 1: 20 of 100 tokens each
    assert f.buffered_tokens == 160  # group 3, aborted at 80 tokens each: kept, not wasted
    assert f.wasted_tokens == 0
    assert april.abort_rounds == 3


def test_april_resume_pays_prefill_of_prompt_and_partial() -> None:
    """n=1, lengths 10 / 100 alternating, prompt 10 tokens, 0.1 ms per prefilled token.

    round 1: g0 + g1 prefill 20 tokens (3 ms first step), g0 ends at 12 ms; g1 aborted at 10 tokens.
    round 2: g1 re-prefills 10 + 10, g2 10 (4 ms first step): g2 ends at 25 ms, g1 at 20 tokens.
    round 3: g1 re-prefills 10 + 20, g3 10 (5 ms first step): g1 ends after 80 more, at 109 ms."""
    cost = EngineCost(1.0, 0.0, 0.1)
    april = run(Mode.APRIL, Pattern(10, 100), n=1, slots=2, cost=cost)
    assert [s.trained_s for s in april.steps] == pytest.approx([0.012, 0.025, 0.109])
    sync = run(Mode.SYNC, Pattern(10, 100), n=1, over=1, slots=2, cost=cost)
    assert sync.figures.wall_s == pytest.approx(0.011 + 0.101 + 0.011)


def test_leases_are_spread_over_the_engines() -> None:
    """One group of 4 on 2 engines x 4 slots, 1 ms + 1 ms per sequence a step: two sequences on each engine
    take 3 ms a step (30 ms for 10 tokens), where all four on one engine would take 5 ms (50 ms)."""
    cost = EngineCost(1.0, 1.0, 0.0)
    r = run(Mode.SYNC, Pattern(10), b=1, over=1, n=4, engines=2, slots=4, cost=cost, steps=2)
    assert [s.trained_s for s in r.steps] == pytest.approx([0.030, 0.060])
    assert r.figures.slot_utilization == pytest.approx(0.5)


def test_async_waits_for_a_due_group_and_trains_while_generating() -> None:
    """async, eta 1: group 0 trains at 10 ms and v1 aborts group 1 (10 tokens of v0), which is then due,
    so the batch at v1 waits for it (100 ms) although group 2 completed at 20 ms; group 2 follows."""
    r = run(Mode.ASYNC, Pattern(10, 10, 100, 100))
    assert [s.groups for s in r.steps] == [(0,), (1,), (2,)]
    assert [s.trained_s for s in r.steps] == pytest.approx([0.010, 0.100, 0.100])
    assert r.figures.staleness_max == 1


def test_async_generates_while_the_learner_trains() -> None:
    """Fixed 10-token samples, 20 ms learner steps: async overlaps, sync adds the two."""
    kw = {"b": 1, "n": 2, "slots": 2, "learner_s": 20 * MS, "steps": 4}
    sync = run(Mode.SYNC, Pattern(10), over=1, **kw)  # type: ignore[arg-type]
    asyn = run(Mode.ASYNC, Pattern(10), eta=1, **kw)  # type: ignore[arg-type]
    assert sync.figures.wall_s == pytest.approx(4 * 0.030)
    assert asyn.figures.wall_s == pytest.approx(0.010 + 4 * 0.020)  # learner-bound after the first batch


# ---------------------------------------------------------------------------------------------------
# long tails: the books, the bounds, the modes


@pytest.mark.parametrize("mode", list(Mode))
def test_long_tail_books_balance_and_nothing_is_wasted(mode: Mode) -> None:
    r = run(mode, LONG_TAIL, b=4, over=8, n=4, engines=2, slots=8, learner_s=0.05, steps=6, max_new=500)
    f = r.figures
    assert f.wasted_tokens == 0
    assert f.samples_per_s == pytest.approx(6 * 16 / f.wall_s)
    assert 0 < f.slot_utilization <= 1 and 0 <= f.bubble_frac <= 1
    if mode == Mode.SYNC:
        assert (f.aborted, f.resumed, f.offpolicy_token_frac, f.buffered_tokens) == (0, 0, 0.0, 0)
    else:
        assert f.aborted > 0 and f.resumed > 0 and f.offpolicy_token_frac > 0


@pytest.mark.parametrize("eta", [0, 1])
def test_async_never_exceeds_the_staleness_bound(eta: int) -> None:
    r = run(
        Mode.ASYNC,
        LONG_TAIL,
        b=4,
        over=8,
        n=4,
        eta=eta,
        engines=2,
        slots=8,
        learner_s=0.05,
        steps=8,
        max_new=600,
    )
    assert r.figures.staleness_max <= eta
    assert all(s.staleness_max <= eta for s in r.steps)


def test_async_staleness_bound_with_eta_2() -> None:
    """eta 2, B=1, n=1, lengths 10, 100, 100, 10, 10, ...: g0 trains at v0; g3 (all v1 tokens) at v1
    while g1 and g2 (v0 tokens, not due yet) run; at v2 both are due, only one fits: g2 trains at v3."""
    r = run(Mode.ASYNC, Pattern(10, 100, 100, 10, 10, 10, 10, 10), n=1, eta=2, steps=4)
    assert r.figures.staleness_max <= 2


def test_april_beats_sync_on_a_long_tail_and_the_same_seed_gives_the_same_samples() -> None:
    kw = {"b": 4, "n": 4, "engines": 2, "slots": 8, "steps": 6, "max_new": 600}
    sync = run(Mode.SYNC, LONG_TAIL, over=4, **kw)  # type: ignore[arg-type]
    april = run(Mode.APRIL, LONG_TAIL, over=8, **kw)  # type: ignore[arg-type]
    assert april.figures.samples_per_s > sync.figures.samples_per_s
    again = run(Mode.SYNC, LONG_TAIL, over=4, **kw)  # type: ignore[arg-type]
    assert again.figures == sync.figures


# ---------------------------------------------------------------------------------------------------
# the vectorised engine against the sim engine, token by token


def test_engine_model_matches_the_sim_engine_step_by_step() -> None:
    """Same lengths, same cost: finish times agree, including a sample admitted when the first finishes."""
    cost = EngineCost(2.0, 0.5, 0.01)
    samples = new_group_samples(0, 6, np.arange(3, 13, dtype=np.int32), "", {})
    first, later = samples[:5], samples[5]

    def identify(req: GenerationRequest) -> SampleIdentity:
        return SampleIdentity.of_sample(0, req.request_id, 10)

    ref = SimEngine(
        "lognormal:median=30,sigma=0.8,cap=200", slots=8, cost=cost, sleep=False, identify=identify
    )
    drawn = {
        s.index: ref.drawn_length(identify(GenerationRequest(s.index, s.prompt_ids, 0)).key) for s in samples
    }
    ref.add([GenerationRequest(s.index, s.prompt_ids, 1000) for s in first])
    ref_done: dict[int, float] = {}
    while ref.active:
        outs = ref.step()
        for out in outs:
            ref_done[out.request_id] = ref.elapsed_s
        if outs and later.index not in ref_done and len(ref_done) == 1:
            ref.add([GenerationRequest(later.index, later.prompt_ids, 1000)])
            ref_done[later.index] = -1.0

    meter = Meter(1)
    model = EngineModel(0, 8, cost, meter, lambda s: drawn[s.index])
    model.admit([(s.index, 1000, s.resumed()) for s in first])
    done: dict[int, float] = {}
    while model.active:
        at = model.next_finish()
        assert at is not None
        model.advance(*at)
        finished = model.take_finished()
        for lease_id, sample in finished:
            done[lease_id] = at[0]
            assert sample.response_len == drawn[lease_id]
        if finished and later.index not in done and len(done) == 1:
            model.admit([(later.index, 1000, later.resumed())])
            done[later.index] = -1.0
    assert done == pytest.approx(ref_done)
    assert model.tokens == sum(drawn.values())


# ---------------------------------------------------------------------------------------------------
# the command


def test_lengths_file_of_integers_and_jsonl(tmp_path: Path) -> None:
    ints = tmp_path / "lengths.txt"
    ints.write_text("12\n\n40\n7\n")
    rows = tmp_path / "run.jsonl"
    rows.write_text('{"response_len": 12, "step": 1}\n{"len": 40}\n')
    for path, expected in ((ints, [7, 12, 40]), (rows, [12, 40])):
        spec = resolve_lengths(str(path))
        assert isinstance(spec, EmpiricalLength)
        assert sorted(spec.lengths.tolist()) == expected
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"tokens": 3}\n')
    with pytest.raises(LengthSpecError, match="line 1"):
        resolve_lengths(str(bad))


def test_lengths_workloads_by_name_spec_and_toml(tmp_path: Path) -> None:
    for name in ("math-long-tail", "short-answer"):
        x = resolve_lengths(name).sample(np.random.default_rng(0), 20000)
        assert x.min() >= 1 and x.max() <= 16384
    long = resolve_lengths("math-long-tail").sample(np.random.default_rng(0), 20000)
    assert 2000 < np.median(long) < 5000 and 0.01 < (long >= 16384).mean() < 0.06
    assert resolve_lengths("fixed:64").describe() == "fixed:64"
    (tmp_path / "mine.toml").write_text('lengths = "fixed:9"\n')
    assert resolve_lengths("mine", workloads=tmp_path).describe() == "fixed:9"
    assert resolve_lengths(str(tmp_path / "mine.toml")).describe() == "fixed:9"
    with pytest.raises(LengthsError, match="no such workload"):
        resolve_lengths("nope", workloads=tmp_path)


def test_a_sweep_is_a_grid_over_any_config_field_checked_as_set_checks_it() -> None:
    base = paper_config()
    points = sweep_points(["engines=2,4", "algo.over_sampling_batch_size=48"], base)
    assert points == [
        {"engines": "2", "algo.over_sampling_batch_size": "48"},
        {"engines": "4", "algo.over_sampling_batch_size": "48"},
    ]
    cfg, engines = point_config(base, points[1])
    assert (engines, cfg.algo.over_sampling_batch_size, cfg.algo.rollout_batch_size) == (4, 48, 32)
    assert point_config(base, {"worker.resume_kv": "reuse"})[0].worker.resume_kv.value == "reuse"
    assert sweep_points([], base) == [{}]
    for bad, match in [
        ("engines", "section.key=V1"),
        ("colour=1", "section.key=V1"),
        ("algo.colour=1", "colour"),
        ("engines=1.5", "engines"),
        ("algo.max_staleness=x", "algo.max_staleness"),
        ("algo.over_sampling_batch_size=8", "over_sampling_batch_size"),
    ]:
        with pytest.raises(ConfigError, match=match):
            sweep_points([bad], base)
    with pytest.raises(ConfigError, match="--modes"):
        sweep_points(["run.mode=sync,async"], base)
    with pytest.raises(ConfigError, match="swept twice"):
        sweep_points(["run.seed=1", "run.seed=2"], base)


def invoke(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(app, ["simulate", *args], env={"COLUMNS": "200"})
    return result.exit_code, result.output


SMALL: tuple[str, ...] = (
    *("--rollout-batch-size", "2", "--over-sampling-batch-size", "4", "--n-samples-per-prompt", "2"),
    *("--max-new-tokens", "200", "--engines", "2", "--slots", "4", "--steps", "3"),
    *("--set", "learner.sim_step_s=0.1"),
)


def test_cli_json_schema(tmp_path: Path) -> None:
    lengths = tmp_path / "lengths.txt"
    lengths.write_text("\n".join(str(n) for n in (5, 20, 200, 40, 7, 90)) + "\n")
    code, out = invoke(*SMALL, "--lengths", str(lengths), "--json")
    assert code == 0, out
    doc = json.loads(out)
    assert set(doc) == {"setting", "modes"}
    assert doc["setting"]["engines"] == 2 and doc["setting"]["lengths"] == f"file:{lengths}"
    assert list(doc["modes"]) == ["sync", "april", "async"]
    for figures in doc["modes"].values():
        waits = figures.pop("learner_wait_s")  # seconds the learner waited, by cause
        assert set(waits) == {"admission", "generation", "staleness"}
        assert sum(waits.values()) == pytest.approx(figures["rollout_s"])
        assert set(figures) == FIGURE_KEYS
        assert figures["accuracy_final"] is None and figures["wasted_tokens"] == 0
        assert 0 <= figures["reprefill_frac"] < 1
        assert figures["stale_kv_token_frac"] == 0.0  # resume_kv recompute: never KV of older weights
    assert doc["modes"]["sync"]["speedup"] == 1.0
    assert doc["modes"]["sync"]["reprefill_frac"] == 0.0  # nothing is ever resumed in sync


def test_cli_sweep_json_and_table() -> None:
    code, out = invoke(
        *SMALL, "--lengths", "fixed:30", "--sweep", "algo.max_staleness=0,1", "--modes", "async", "--json"
    )
    assert code == 0, out
    doc = json.loads(out)
    assert [p["point"] for p in doc["sweep"]] == [{"algo.max_staleness": 0}, {"algo.max_staleness": 1}]
    assert all(list(p["modes"]) == ["async"] and p["modes"]["async"]["speedup"] is None for p in doc["sweep"])
    code, out = invoke(*SMALL, "--lengths", "short-answer")
    assert code == 0, out
    assert "samples/s" in out and "april" in out and "1.00x" in out


def test_cli_simulates_the_config_file_a_run_trains_with(tmp_path: Path) -> None:
    """`april simulate --config run.toml --set algo.max_staleness=2`: the file's fields (its own defaults
    under them, not the paper's setting), then --set; the same run as one given by options alone."""
    run = tmp_path / "run.toml"
    run.write_text(
        "[run]\nsteps = 3\nseed = 4\n[algo]\nrollout_batch_size = 2\nover_sampling_batch_size = 4\n"
        'n_samples_per_prompt = 2\nmax_new_tokens = 200\n[worker]\nslots = 4\nsim_lengths = "fixed:30"\n'
        "[learner]\nsim_step_s = 0.1\n"
    )
    code, out = invoke("--config", str(run), "--set", "algo.max_staleness=2", "--engines", "2", "--json")
    assert code == 0, out
    doc = json.loads(out)
    setting = doc["setting"]
    assert (setting["max_staleness"], setting["slots"], setting["steps"], setting["seed"]) == (2, 4, 3, 4)
    assert setting["lengths"] == "fixed:30" and setting["prompt_len"] == 64  # [data]'s own default
    flags = (
        "--lengths",
        "fixed:30",
        "--max-staleness",
        "2",
        "--seed",
        "4",
        "--set",
        "data.synthetic_prompt_len_min=8",
    )
    code, same = invoke(*SMALL, *flags, "--set", "data.synthetic_prompt_len_max=64", "--json")
    assert code == 0, same
    assert json.loads(same)["modes"] == doc["modes"]


def test_cli_simulates_the_slurm_example_whose_prompts_are_text() -> None:
    """docs/slurm/april.toml trains on the built-in task, whose prompts arrive as text: the simulated
    workers tokenize them as the sim engine's worker does (one id a byte), and every prompt's length is its
    text's."""
    slurm = Path(__file__).resolve().parents[1] / "docs" / "slurm" / "april.toml"
    code, out = invoke("--config", str(slurm), "--set", "algo.max_staleness=2", "--steps", "2", "--json")
    assert code == 0, out
    doc = json.loads(out)
    assert doc["setting"]["prompts"] == "task" and doc["setting"]["max_staleness"] == 2
    assert all(m["samples_per_s"] > 0 and m["wasted_tokens"] == 0 for m in doc["modes"].values())


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (("--lengths", "nope"), "no such workload"),
        (("--lengths", "lognormal:median=0,sigma=1"), "median must be > 0"),
        (("--modes", "sync,fast"), "--modes"),
        (("--sweep", "colour=1"), "--sweep"),
        (("--sweep", "algo.colour=1,2"), "colour"),
        (("--over-sampling-batch-size", "8"), "over_sampling_batch_size"),
        (("--set", "worker.sim_decode_ms=0", "--set", "worker.sim_decode_ms_per_seq=0"), "a step takes time"),
        (("--set", "algo.max_staleness=-1"), "max_staleness"),
    ],
)
def test_cli_user_errors_are_one_line(args: tuple[str, ...], expected: str) -> None:
    code, out = invoke(*args)
    assert code == 2
    assert out.startswith("april: error:") and expected in out and out.count("\n") == 1


def test_the_arrival_meter_counts_samples_per_window() -> None:
    meter = ArrivalMeter()
    for now, samples in ((0.2, 3), (0.7, 2), (ARRIVAL_WINDOW_S + 0.5, 4), (3 * ARRIVAL_WINDOW_S, 1)):
        meter.add(now, samples)
    assert meter.total == 10
    assert meter.peak_per_s() == 5 / ARRIVAL_WINDOW_S


def test_the_broker_load_counts_every_returned_sample() -> None:
    """The arrival figures count each sample the engines return: every trained sample came back at least
    once (async here: nothing is aborted, so exactly once), and no window holds more than the run."""
    lengths = LengthSpec.parse("lognormal:median=400,sigma=0.5,cap=2000")
    f = run(Mode.ASYNC, lengths, b=2, over=4, n=2, engines=2, slots=4, steps=4, learner_s=0.5).figures
    assert f.broker_arrivals_per_s_mean is not None and f.broker_arrivals_per_s_peak is not None
    returned = f.broker_arrivals_per_s_mean * f.wall_s
    assert returned == pytest.approx(round(returned))
    assert round(returned) >= 4 * 2 * 2  # steps x groups x samples trained
    assert f.aborted == 0 and f.broker_arrivals_per_s_peak * ARRIVAL_WINDOW_S <= round(returned)
    assert f.broker_arrivals_per_s_peak >= f.broker_arrivals_per_s_mean * min(
        1.0, f.wall_s / ARRIVAL_WINDOW_S
    )
    code, out = invoke(*SMALL, "--lengths", "fixed:30", "--modes", "async")
    assert code == 0 and "broker load:" in out and "samples/s returned by the engines" in out
