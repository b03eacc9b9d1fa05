"""The simulation engine and the response-length specs it draws from."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from actors.engine import EngineError, GenerationOutput, GenerationRequest, WeightLoadError
from actors.engines.sim_engine import SampleIdentity, SimEngine
from actors.lengths import (
    EmpiricalLength,
    FixedLength,
    LengthSpec,
    LengthSpecError,
    LogNormalLength,
    MixtureLength,
)
from april.records import FinishReason, Sample
from april.sim.engine_cost import EngineCost

MIXTURE = "mixture:0.9*lognormal:median=500,sigma=0.6,cap=16384+0.1*lognormal:median=8000,sigma=0.5,cap=16384"

# -- length specs ---------------------------------------------------------------------------------


def test_parse_kinds_and_round_trip(tmp_path: Path) -> None:
    assert LengthSpec.parse("fixed:7") == FixedLength(7)
    ln = LengthSpec.parse(" lognormal: median=2000, sigma=1.0, cap=16384 ")
    assert ln == LogNormalLength(2000.0, 1.0, 16384)
    mix = LengthSpec.parse(MIXTURE)
    assert isinstance(mix, MixtureLength)
    assert mix.weights == pytest.approx((0.9, 0.1))
    assert mix.components[1] == LogNormalLength(8000.0, 0.5, 16384)
    for spec in (ln, mix, LengthSpec.parse("mixture:1*fixed:3+3*fixed:5")):
        assert LengthSpec.parse(spec.describe()) == spec
    assert LengthSpec.parse("lognormal:median=10,sigma=0").describe() == "lognormal:median=10,sigma=0"


def test_file_spec_plain_and_jsonl(tmp_path: Path) -> None:
    plain = tmp_path / "lens+1.txt"  # a "+" in a path is fine
    plain.write_text("# measured with: april generate ...\n5\n\n7\n  # a comment\n9\n")
    spec = LengthSpec.parse(f"file:{plain}")
    assert isinstance(spec, EmpiricalLength)
    assert sorted(set(spec.sample(np.random.default_rng(0), 200).tolist())) == [5, 7, 9]
    jsonl = tmp_path / "samples.jsonl"
    jsonl.write_text(json.dumps({"response_len": 11}) + "\n" + json.dumps({"len": 13, "x": 1}) + "\n")
    assert set(LengthSpec.parse(f"file:{jsonl}").sample(np.random.default_rng(0), 50).tolist()) == {11, 13}
    mixed = LengthSpec.parse(f"mixture:0.5*file:{plain}+0.5*fixed:1")
    assert set(mixed.sample(np.random.default_rng(0), 200).tolist()) == {1, 5, 7, 9}


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("2000", "missing 'kind:'"),
        ("gamma:k=2", "unknown kind 'gamma'"),
        ("fixed:0", "N must be >= 1"),
        ("fixed:abc", "expected an integer"),
        ("lognormal:median=100", "missing sigma"),
        ("lognormal:median=100,sigma=1,mu=3", "bad item 'mu=3'"),
        ("lognormal:median=-1,sigma=1", "median must be > 0"),
        ("lognormal:median=10,sigma=x", "sigma = 'x', expected a number"),
        ("lognormal:median=10,sigma=1,cap=0", "cap must be >= 1"),
        ("mixture:fixed:3", "is not WEIGHT*SPEC"),
        ("mixture:0*fixed:3+1*fixed:4", "weight 0 must be > 0"),
        ("mixture:1*mixture:1*fixed:2", "cannot contain a mixture"),
        ("file:/no/such/file", "cannot read"),
    ],
)
def test_bad_specs_give_one_line_errors(spec: str, message: str) -> None:
    with pytest.raises(LengthSpecError) as err:
        LengthSpec.parse(spec)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_bad_file_lines(tmp_path: Path) -> None:
    f = tmp_path / "bad.jsonl"
    f.write_text('{"tokens": 3}\n')
    with pytest.raises(LengthSpecError, match='line 1 has no "response_len"'):
        LengthSpec.parse(f"file:{f}")
    f.write_text("12\n-3\n")
    with pytest.raises(LengthSpecError, match="line 2: length -3 must be >= 1"):
        LengthSpec.parse(f"file:{f}")


def test_lognormal_is_long_tailed_and_capped() -> None:
    x = LengthSpec.parse("lognormal:median=2000,sigma=1.0,cap=16384").sample(np.random.default_rng(1), 20000)
    assert x.dtype == np.int64 and x.min() >= 1 and x.max() == 16384
    median, p99 = np.median(x), np.percentile(x, 99)
    assert 1900 < median < 2100
    assert p99 > 5 * median  # the tail that keeps a synchronous batch waiting
    mix = LengthSpec.parse(MIXTURE).sample(np.random.default_rng(1), 20000)
    assert np.median(mix) < 700 and np.percentile(mix, 99) > 8000


# -- the engine -----------------------------------------------------------------------------------


def req(rid: int, input_ids: list[int] | np.ndarray, budget: int) -> GenerationRequest:
    return GenerationRequest(rid, np.asarray(input_ids, dtype=np.int32), budget)


def run_all(engine: SimEngine, limit: int = 100000) -> dict[int, GenerationOutput]:
    done: dict[int, GenerationOutput] = {}
    for _ in range(limit):
        for out in engine.step():
            done[out.request_id] = out
        if engine.active == 0:
            return done
    raise AssertionError("engine did not finish")


def sim(spec: str = "fixed:5", **kw: object) -> SimEngine:
    return SimEngine(spec, sleep=False, **kw)  # type: ignore[arg-type]


def test_same_seed_same_outputs_different_seed_different() -> None:
    outs = []
    for seed in (3, 3, 4):
        e = sim("lognormal:median=20,sigma=1.0,cap=200", slots=8, seed=seed)
        e.add([req(i, [1, 5, i], 500) for i in range(8)])
        outs.append(run_all(e))
    same = [len(outs[0][i].token_ids) for i in range(8)]
    assert same == [len(outs[1][i].token_ids) for i in range(8)]
    assert all(np.array_equal(outs[0][i].token_ids, outs[1][i].token_ids) for i in range(8))
    assert same != [len(outs[2][i].token_ids) for i in range(8)]


def test_step_semantics_stop_and_length() -> None:
    e = sim("fixed:5", slots=4, stop_token_id=2)
    e.add([req(1, [9, 9], 10), req(2, [9, 8], 3)])
    assert e.active == 2
    finished: list[tuple[int, int]] = []
    for step in range(1, 7):
        finished += [(step, o.request_id) for o in e.step()]
    assert finished == [(3, 2), (5, 1)]  # one token per request per step
    assert e.active == 0 and e.step() == []


def test_outputs_are_well_formed() -> None:
    e = sim("fixed:6", slots=2, vocab_size=50, stop_token_id=2)
    e.add([req(1, [4, 4], 10), req(2, [4, 4], 4)])
    done = run_all(e)
    stop, length = done[1], done[2]
    assert stop.finish_reason == FinishReason.STOP and len(stop.token_ids) == 6
    assert stop.token_ids[-1] == 2 and np.all((stop.token_ids[:-1] >= 3) & (stop.token_ids[:-1] < 50))
    assert length.finish_reason == FinishReason.LENGTH and len(length.token_ids) == 4
    assert 2 not in length.token_ids.tolist()
    for o in (stop, length):
        assert o.token_ids.dtype == np.int32 and o.logprobs.dtype == np.float32
        assert o.versions.dtype == np.int32 and np.all(o.versions == 0)
        assert np.all(np.isfinite(o.logprobs)) and np.all(o.logprobs < 0)
        assert o.stats["drawn_len"] == 6.0


def test_budget_zero_is_length_at_once() -> None:
    e = sim("fixed:5")
    e.add([req(1, [3], 0)])
    assert e.active == 1
    (out,) = e.step()
    assert out.finish_reason == FinishReason.LENGTH and len(out.token_ids) == 0
    assert e.elapsed_s == 0.0 and e.active == 0


def test_slots_enforced() -> None:
    e = sim(slots=2)
    e.add([req(1, [3], 4), req(2, [3], 4)])
    with pytest.raises(EngineError, match="> 2 slots"):
        e.add([req(3, [3], 4)])
    with pytest.raises(EngineError, match="already active"):
        sim(slots=4).add([req(1, [3], 4), req(1, [4], 4)])


def test_abort_returns_partials_and_finished_at_once() -> None:
    e = sim("fixed:100", slots=4)
    e.add([req(1, [5, 6], 100), req(2, [5, 7], 2)])
    for _ in range(2):
        e.step()
    e.add([req(3, [5, 8], 0)])  # finished with LENGTH but not yet returned
    outs = {o.request_id: o for o in e.abort()}
    assert e.active == 0 and e.step() == []
    assert outs[1].finish_reason == FinishReason.ABORT and len(outs[1].token_ids) == 2
    assert outs[3].finish_reason == FinishReason.LENGTH
    assert 2 not in outs  # returned by the step that finished it


@pytest.mark.parametrize("with_hook", [False, True])
def test_abort_resume_keeps_drawn_total(with_hook: bool) -> None:
    """Interrupt twice and resume with prompt + partial and the reduced budget: the sample ends with STOP
    at its drawn total, token for token the uninterrupted response. Without a hook the resume is
    recognised by the same engine; with one, by a fresh engine (another worker process)."""
    spec, prompt, max_new = "lognormal:median=60,sigma=0.3,cap=400", [7, 8, 9, 10], 1000

    def make() -> SimEngine:
        if not with_hook:
            return sim(spec, seed=11)
        return sim(spec, seed=11, identify=lambda r: SampleIdentity(key=1234, prompt_len=len(prompt)))

    full_engine = make()
    full_engine.add([req(1, prompt, max_new)])
    full = run_all(full_engine)[1]
    assert full.finish_reason == FinishReason.STOP and len(full.token_ids) > 12

    sample = Sample(group_id=0, index=0, prompt_ids=np.asarray(prompt, dtype=np.int32))
    e = make()
    e.add([req(1, prompt, max_new)])  # lease 1: the same draw as full_engine's without a hook
    for steps, lease in ((7, 2), (5, 3)):
        for _ in range(steps):
            e.step()
        (part,) = e.abort()
        assert part.finish_reason == FinishReason.ABORT and len(part.token_ids) == steps
        sample = sample.extend(part.token_ids, part.logprobs, 0, part.finish_reason)
        e = e if not with_hook else make()
        e.add([req(lease, sample.resume_input(), sample.budget(max_new))])
    last = run_all(e)[3]
    sample = sample.extend(last.token_ids, last.logprobs, 0, last.finish_reason)
    assert last.finish_reason == FinishReason.STOP
    assert sample.response_len == last.stats["drawn_len"] == len(full.token_ids)
    assert np.array_equal(sample.response_ids, full.token_ids)
    assert np.array_equal(sample.response_logprobs, full.logprobs)


def test_group_samples_draw_different_lengths() -> None:
    e = sim(
        "lognormal:median=50,sigma=1.0",
        slots=8,
        identify=lambda r: SampleIdentity.of_sample(7, r.request_id, 3),
    )
    e.add([req(i, [5, 5, 5], 10000) for i in range(8)])  # one prompt, eight samples
    assert len({len(o.token_ids) for o in run_all(e).values()}) > 4


def test_resume_on_other_engine_without_hook_draws_afresh() -> None:
    """Documented limit: without `identify`, only the engine that aborted recognises the resume."""
    a, b = sim("fixed:50"), sim("fixed:50")
    a.add([req(1, [1, 2], 50)])
    a.step()
    (part,) = a.abort()
    b.add([req(2, [1, 2, *part.token_ids.tolist()], 49)])
    (out,) = run_all(b).values()
    assert out.finish_reason == FinishReason.LENGTH and len(out.token_ids) == 49  # prompt taken as 3 long


@pytest.mark.parametrize(("max_new", "reason"), [(20, FinishReason.LENGTH), (30, FinishReason.STOP)])
def test_resume_with_reduced_budget(max_new: int, reason: FinishReason) -> None:
    prompt = [4, 4, 4]
    e = sim("fixed:30")
    e.add([req(1, prompt, max_new)])
    for _ in range(12):
        e.step()
    (part,) = e.abort()
    e.add([req(2, [*prompt, *part.token_ids.tolist()], max_new - 12)])
    (rest,) = run_all(e).values()
    assert rest.finish_reason == reason and len(part.token_ids) + len(rest.token_ids) == max_new
    assert (rest.token_ids[-1] == 2) == (reason == FinishReason.STOP)


def test_versions_split_on_load() -> None:
    e = sim("fixed:10", slots=2)
    e.add([req(1, [3, 3], 10)])
    for _ in range(4):
        e.step()
    e.load_weights(Path("sim://v1"), 1)
    e.load_weights(Path(""), 2)  # two loads between the same steps: only the last counts
    e.add([req(2, [3, 4], 3)])
    done = run_all(e)
    assert done[1].versions.tolist() == [0] * 4 + [2] * 6
    assert done[2].versions.tolist() == [2, 2, 2]
    sample = Sample(group_id=0, index=0, prompt_ids=np.asarray([3, 3], dtype=np.int32))
    for v in (0, 2):
        mask = done[1].versions == v
        sample = sample.extend(done[1].token_ids[mask], done[1].logprobs[mask], v, FinishReason.NONE)
    assert [(s.version, s.start, s.end) for s in sample.segments] == [(0, 0, 4), (2, 4, 10)]


def test_load_weights_errors(tmp_path: Path) -> None:
    e = sim()
    with pytest.raises(WeightLoadError, match="does not exist"):
        e.load_weights(tmp_path / "missing.safetensors", 1)
    (tmp_path / "w.safetensors").write_bytes(b"x")
    e.load_weights(tmp_path / "w.safetensors", 3)
    with pytest.raises(WeightLoadError, match="older than loaded 3"):
        e.load_weights(Path("sim://"), 2)
    assert e.version == 3


def test_step_time_model_virtual() -> None:
    cost = EngineCost(decode_ms=10.0, decode_ms_per_seq=0.5, prefill_ms_per_token=0.25)
    e = sim("fixed:3", slots=4, cost=cost)
    e.add([req(1, [1, 2, 3, 4], 10), req(2, [1, 2], 2)])
    e.step()  # prefill 6 tokens, 2 decoding
    assert e.elapsed_s == pytest.approx((10 + 0.5 * 2 + 0.25 * 6) / 1000)
    e.step()  # request 2 finishes (budget 2) in this step: still 2 active during it
    assert e.elapsed_s == pytest.approx((10 + 1 + 1.5 + 10 + 1) / 1000)
    e.step()  # only request 1 now
    assert e.elapsed_s == pytest.approx((10 + 1 + 1.5 + 10 + 1 + 10 + 0.5) / 1000)
    assert e.steps == 3 and e.active == 0
    before = e.elapsed_s
    assert e.step() == [] and e.elapsed_s == before  # idle steps cost nothing


class FakeClock:
    """Stands in for the `time` module of the sim engine: time passes only when the engine sleeps."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.slept: list[float] = []

    def monotonic(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)
        self.now += seconds


def test_real_sleep_follows_time_scale(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock()
    monkeypatch.setattr("actors.engines.sim_engine.time", clock)
    cost = EngineCost(decode_ms=1000.0, decode_ms_per_seq=0.0, prefill_ms_per_token=0.0)
    e = SimEngine("fixed:100", slots=1, cost=cost, time_scale=1e-3)  # 1 s model steps -> 1 ms wall
    e.add([req(1, [1], 100)])
    run_all(e)
    assert e.elapsed_s == pytest.approx(100.0)
    assert clock.slept == pytest.approx([1e-3] * 100)  # 1 ms a step: ~0.1 s in all, not 100 s
