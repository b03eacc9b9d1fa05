"""`april bench`: the bench.json schema, a smoke run with real processes (`--engine sim --steps 2`), and
the agreement of `april bench --engine sim` with `april simulate` on the same setting (the test of the
simulator: the same samples, scheduling and cost model, once in virtual time, once as real processes)."""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from actors.lengths import LengthSpec
from april.config import ConfigError, Mode, ResumeKV, config_to_dict, replace_fields
from april.hf import TINY_MODEL
from broker.sim.figures import Figures, with_speedups
from cli.bench_cmd import staleness_bounds
from cli.bench_plan import (
    BenchRun,
    BenchSetting,
    bench_base,
    parse_variant,
    predict,
    run_config,
    sim_config,
)
from cli.bench_report import bench_json
from cli.main import app
from cli.sim_options import resolve, sweep_points

FLOATS = (
    "wall_s", "rollout_s", "samples_per_s", "tokens_per_s", "effective_tokens_per_s", "slot_utilization",
    "bubble_frac", "offpolicy_token_frac", "staleness_mean",
)  # fmt: skip
INTS = ("wasted_tokens", "buffered_tokens", "staleness_max", "aborted", "resumed")
WORKLOAD = ("engine", "workload", "lengths", "rollout_batch_size", "n_samples_per_prompt", "steps", "seed")
MACHINE = ("cpu_count", "platform", "python", "torch", "git_commit")


def check_schema(doc: dict[str, Any], modes: list[str]) -> None:
    assert list(doc["modes"]) == modes
    for mode, figures in doc["modes"].items():
        for key in FLOATS:
            assert isinstance(figures[key], float), (mode, key, figures[key])
        for key in INTS:
            assert type(figures[key]) is int, (mode, key, figures[key])
        assert figures["accuracy_final"] is None or isinstance(figures["accuracy_final"], float)
    assert set(doc["speedup"]) == set(modes)
    assert doc["speedup"]["sync"] == 1.0
    assert all(isinstance(v, float) and v > 0 for v in doc["speedup"].values())
    assert set(WORKLOAD) <= set(doc["workload"])
    assert {"engines", "slots"} <= set(doc["workload"])
    assert set(MACHINE) <= set(doc["machine"])


def figures(samples_per_s: float) -> Figures:
    return Figures(
        wall_s=10.0, rollout_s=8.0, samples_per_s=samples_per_s, tokens_per_s=100.0,
        effective_tokens_per_s=90.0, slot_utilization=0.5, bubble_frac=0.2, wasted_tokens=0,
        buffered_tokens=10, offpolicy_token_frac=0.1, staleness_mean=0.5, staleness_max=1, aborted=3,
        resumed=3,
    )  # fmt: skip


def test_bench_json_has_every_figure_and_speedups_over_sync() -> None:
    measured = with_speedups({"sync": figures(2.0), "april": figures(3.0), "async": figures(4.0)})
    doc = json.loads(json.dumps(bench_json(measured, {k: 1 for k in (*WORKLOAD, "engines", "slots")})))
    check_schema(doc, ["sync", "april", "async"])
    assert doc["speedup"] == {"sync": 1.0, "april": 1.5, "async": 2.0}
    assert "predicted" not in doc


def run_bench(out: Path, *args: str) -> dict[str, Any]:
    result = CliRunner().invoke(app, ["bench", "--engine", "sim", "--out", str(out), *args])
    assert result.exit_code == 0, result.output
    doc: dict[str, Any] = json.loads((out / "bench.json").read_text())
    return doc


# a small long-tailed workload: 2 engines x 16 slots, 4 x 4 samples a step, a round of a few seconds
SMALL = (
    "--workload", "lognormal:median=200,sigma=0.8,cap=2048", "--engines", "2", "--slots", "16",
    "--rollout-batch-size", "4", "--over-sampling-batch-size", "8", "--n-samples-per-prompt", "4",
    "--max-new-tokens", "2048", "--set", "learner.sim_step_s=2",
)  # fmt: skip


def test_bench_smoke_with_real_processes(tmp_path: Path) -> None:
    """`april bench --engine sim --steps 2`: three real runs, bench.json / bench.md / bench.png written."""
    doc = run_bench(tmp_path, "--steps", "2", "--target-s", "3", *SMALL)
    check_schema(doc, ["sync", "april", "async"])
    assert doc["workload"]["steps"] == 2 and doc["workload"]["engines"] == 2
    for mode, f in doc["modes"].items():
        assert f["wasted_tokens"] == 0, mode  # nothing generated is thrown away in any mode
        assert 0 < f["slot_utilization"] <= 1 and 0 <= f["bubble_frac"] <= 1, (mode, f)
    assert doc["modes"]["sync"]["aborted"] == 0 and doc["modes"]["sync"]["offpolicy_token_frac"] == 0.0
    # the sim engines report their re-prefill (a share of their model time) and stale-KV tokens: no
    # re-prefill in sync (nothing resumes). Under resume_kv recompute (the default) sync and april load
    # weights only while their engines are idle (between rounds), so no token attends to older KV; async
    # loads a version while sequences run and aborts them after, so a step or two of tokens may (a few)
    for mode, f in doc["modes"].items():
        assert 0 <= f["reprefill_frac"] < 1 and 0 <= f["stale_kv_token_frac"] < 0.05, (mode, f)
    for mode in ("sync", "april"):
        assert doc["modes"][mode]["stale_kv_token_frac"] == 0.0, (mode, doc["modes"][mode])
    assert doc["modes"]["sync"]["reprefill_frac"] == 0.0
    # the simulator's prediction of the same samples (virtual time, scaled to wall time) and its error
    # against the real processes are benchmark figures in bench.json, not a threshold: how close they come
    # depends on how busy the machine is
    assert set(doc["prediction_error"]) == set(doc["modes"]) == set(doc["predicted"])
    assert all(isinstance(e, float) and math.isfinite(e) for e in doc["prediction_error"].values())
    # `april simulate --per-sample-lengths` with the same settings is that prediction
    sim_args = [a.replace("--workload", "--lengths") for a in SMALL]
    result = CliRunner().invoke(
        app, ["simulate", *sim_args, "--steps", "2", "--per-sample-lengths", "--json"]
    )
    assert result.exit_code == 0, result.output
    simulated = json.loads(result.output)["modes"]
    for mode, predicted in doc["predicted"].items():
        assert simulated[mode]["samples_per_s"] == pytest.approx(predicted["samples_per_s"])
    md = (tmp_path / "bench.md").read_text()
    assert "| sync |" in md and "| april |" in md and "| async |" in md
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    for mode in ("sync", "april", "async"):
        assert (tmp_path / "runs" / mode / "metrics.jsonl").exists()


def test_bench_runs_simulated_episodes_in_real_processes(tmp_path: Path) -> None:
    """`april bench --episodes agentic`: the workers play the simulated episodes (env.name = "sim": the
    sim engine's turns, the simulated tools' latencies and answers), and `april simulate` predicts the
    same episodes."""
    args = ["--episodes", "agentic", "--engines", "1", "--slots", "8", "--rollout-batch-size", "2"]
    args += ["--over-sampling-batch-size", "4", "--n-samples-per-prompt", "2", "--max-new-tokens", "2048"]
    doc = run_bench(tmp_path, *args, "--modes", "sync,april", "--steps", "1", "--target-s", "3")
    assert doc["workload"]["episodes"] == "agentic"
    assert doc["workload"]["lengths"] == "lognormal:median=400,sigma=0.8,cap=4096"  # each turn's
    assert set(doc["predicted"]) == set(doc["modes"]) == {"sync", "april"}
    runs = tmp_path / "runs"
    config = (runs / "sync" / "config.toml").read_text()
    assert 'name = "sim"' in config and 'sim_turns = "uniform:min=2,max=10"' in config
    assert all(f["wasted_tokens"] == 0 for f in doc["modes"].values())


def setting_of(*modes: Mode, steps: int = 2, **fields: Any) -> BenchSetting:
    """A sim bench of `modes` on 2 engines x 4 slots, fixed:8 lengths, small batches; `fields`: more."""
    base = replace_fields(
        bench_base("sim"),
        {
            "run.steps": steps,
            "worker.slots": 4,
            "algo.rollout_batch_size": 2,
            "algo.over_sampling_batch_size": 4,
            "algo.n_samples_per_prompt": 2,
        },
    )
    return BenchSetting("sim", modes, base, "w", LengthSpec.parse("fixed:8"), 2, **fields)


def test_each_mode_gets_the_same_config_but_its_mode_and_the_sim_learner_unless_told_to_train() -> None:
    setting = setting_of(Mode.SYNC, Mode.ASYNC, steps=3, time_scale=0.5)
    sync, asyn = (config_to_dict(run_config(setting, r, "b")) for r in setting.runs())
    assert sync["run"].pop("mode") == "sync" and asyn["run"].pop("mode") == "async"
    assert sync == asyn
    assert sync["learner"]["backend"] == "sim" and sync["worker"]["sim_time_scale"] == 0.5
    assert sync["broker"]["min_workers"] == 2 and sync["worker"]["sim_lengths"] == "fixed:8"
    real = run_config(setting_of(Mode.SYNC, real_learner=True), BenchRun("sync", Mode.SYNC), "b")
    assert real.learner.backend == "deepspeed" and real.learner.model == real.worker.model == str(TINY_MODEL)
    assert real.data.synthetic_vocab_size == 320  # the tiny model's vocabulary: sim tokens it can train on


def test_a_bench_runs_the_config_file_given_with_the_benchs_own_fields_over_it(tmp_path: Path) -> None:
    """`april bench --config run.toml --set ...`: every run starts from the file (not the paper's setting),
    then --set and the options; the bench sets only what its runs need (mode, engine, learner, workers)."""
    run = tmp_path / "run.toml"
    run.write_text(
        '[algo]\nrollout_batch_size = 3\nover_sampling_batch_size = 6\n[worker]\nengine = "torch"\n'
    )
    base = resolve(run, ["algo.max_staleness=3"], bench_base("sim"), worker__slots=5)
    assert (base.algo.rollout_batch_size, base.algo.max_staleness, base.worker.slots) == (3, 3, 5)
    assert base.algo.max_new_tokens == 256  # the file's default, not the paper's 16k
    setting = BenchSetting("sim", (Mode.APRIL,), base, "w", LengthSpec.parse("fixed:8"), 2)
    (only,) = setting.runs()
    config = run_config(setting, only, "b")
    assert (config.run.mode, config.worker.engine, config.learner.backend) == (Mode.APRIL, "sim", "sim")
    assert config.algo == base.algo and config.broker.min_workers == 2


def test_several_staleness_bounds_run_async_once_each_against_one_sync_run() -> None:
    """`--max-staleness 1,2`: the ratios of both async runs are taken against the same sync run of the
    same bench; the runs differ only in mode and bound."""
    setting = setting_of(Mode.SYNC, Mode.APRIL, Mode.ASYNC, async_staleness=(1, 2))
    runs = setting.runs()
    configs = [run_config(setting, r, "b") for r in runs]
    assert [(r.label, c.run.mode, c.algo.max_staleness) for r, c in zip(runs, configs, strict=True)] == [
        ("sync", Mode.SYNC, 1),
        ("april", Mode.APRIL, 1),
        ("async-eta1", Mode.ASYNC, 1),
        ("async-eta2", Mode.ASYNC, 2),
    ]
    eta1, eta2 = (config_to_dict(c) for c in configs[2:])
    assert eta1["algo"].pop("max_staleness") == 1 and eta2["algo"].pop("max_staleness") == 2
    assert eta1 == eta2
    predicted = predict(setting)
    assert list(predicted) == ["sync", "april", "async-eta1", "async-eta2"]
    assert predicted["sync"].speedup == 1.0 and predicted["async-eta2"].speedup is not None
    assert setting.to_json()["async_staleness"] == [1, 2]


def test_a_sweep_runs_every_mode_but_sync_once_per_point_against_one_sync_run() -> None:
    """`april bench --sweep algo.prompt_order=issue,shortest_first --sweep algo.max_staleness=1,2`: the
    product of the points, each mode but sync once per point, each run differing only in mode and point."""
    base = setting_of(Mode.SYNC).config
    points = sweep_points(["algo.prompt_order=issue,shortest_first", "algo.max_staleness=1,2"], base)
    setting = setting_of(Mode.SYNC, Mode.APRIL, sweep=tuple(tuple(p.items()) for p in points))
    runs = setting.runs()
    assert [r.label for r in runs] == [
        "sync",
        "april-prompt_order=issue-max_staleness=1",
        "april-prompt_order=issue-max_staleness=2",
        "april-prompt_order=shortest_first-max_staleness=1",
        "april-prompt_order=shortest_first-max_staleness=2",
    ]
    configs = [config_to_dict(run_config(setting, r, "b")) for r in runs[1:]]
    assert [(c["algo"]["prompt_order"], c["algo"]["max_staleness"]) for c in configs] == [
        ("issue", 1),
        ("issue", 2),
        ("shortest_first", 1),
        ("shortest_first", 2),
    ]
    for c in configs:
        c["algo"].pop("prompt_order"), c["algo"].pop("max_staleness")
    assert all(c == configs[0] for c in configs)
    assert list(predict(setting)) == [r.label for r in runs]


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--sweep", "engines=1,2"], "--sweep: engines cannot be swept"),
        (["--sweep", "algo.colour=1,2"], "colour"),
        (["--sweep", "algo.max_staleness=1", "--max-staleness", "1,2"], "sweep algo.max_staleness instead"),
    ],
)
def test_a_bad_bench_sweep_is_one_line(args: list[str], expected: str, tmp_path: Path) -> None:
    got = CliRunner().invoke(app, ["bench", "--out", str(tmp_path), *args])
    assert got.exit_code == 2 and expected in got.output, got.output
    assert not any(tmp_path.iterdir())  # nothing ran


@pytest.mark.parametrize("text", ["", "x", "1,1", "-1", "1,,-2"])
def test_a_bad_staleness_list_is_one_error(text: str) -> None:
    base = bench_base("sim")
    with pytest.raises(ConfigError, match="max_staleness"):
        staleness_bounds(text, base)
    assert staleness_bounds("2", base) == (2,) and staleness_bounds("1, 2", base) == (1, 2)
    assert staleness_bounds(None, base) == ()


def test_a_variant_is_one_more_run_with_its_fields_set_and_predicted_alike() -> None:
    """`--variant LABEL:MODE:section.key=value,...`: the option reaches the run's config (every section)
    and the simulator's prediction of the same run (the very config it gets)."""
    base = setting_of(Mode.SYNC).config
    auto = parse_variant("april-auto:april:algo.over_sampling=auto, algo.over_sampling_batch_size=6", base)
    assert (auto.label, auto.mode) == ("april-auto", Mode.APRIL)
    lease = parse_variant("slow:sync:broker.abort_retries=9", base)
    setting = setting_of(Mode.SYNC, Mode.APRIL, variants=(auto, lease))
    setting = dataclasses.replace(
        setting,
        config=replace_fields(setting.config, {"data.synthetic_size": 32, "worker.sim_prompt_corr": 0.5}),
    )
    runs = setting.runs()
    assert [r.label for r in runs] == ["sync", "april", "april-auto", "slow"]
    plain, auto_cfg, slow = (config_to_dict(run_config(setting, r, "b")) for r in (runs[1], runs[2], runs[3]))
    assert auto_cfg["algo"].pop("over_sampling") == "auto" and plain["algo"].pop("over_sampling") == "fixed"
    assert auto_cfg["algo"].pop("over_sampling_batch_size") == 6
    plain["algo"].pop("over_sampling_batch_size")
    assert auto_cfg == plain
    assert slow["broker"]["abort_retries"] == 9 and slow["run"]["mode"] == "sync"
    assert plain["data"]["synthetic_size"] == 32 and plain["worker"]["sim_prompt_corr"] == 0.5
    assert list(predict(setting)) == ["sync", "april", "april-auto", "slow"]
    reuse = parse_variant("reuse:async:worker.resume_kv=reuse,algo.resume_affinity=true", base)
    simulated = sim_config(setting, reuse).config
    assert simulated.worker.resume_kv == ResumeKV.REUSE and simulated.algo.resume_affinity
    assert sim_config(setting, runs[1]).config.worker.resume_kv == ResumeKV.RECOMPUTE
    assert sim_config(setting, reuse).config == run_config(setting, reuse, "reuse")  # the run it predicts
    assert setting.to_json()["variants"]["april-auto"]["mode"] == "april"
    for bad, match in [
        ("x", "mode ''"),
        ("a b:april", "LABEL a word"),
        ("x:april:algo.nope=1", "nope"),
        ("x:april:algo.over_sampling=sometimes", "over_sampling"),
        ("x:april:algo.prompt_window", "section.key=value"),
    ]:
        with pytest.raises(ConfigError, match=match):
            parse_variant(bad, base)
    dup = setting_of(Mode.SYNC, variants=(parse_variant("sync:april", base),))
    with pytest.raises(ConfigError, match="exists already"):
        dup.runs()
