"""`april bench`: the bench.json schema, a smoke run with real processes (`--engine sim --steps 2`), and
the agreement of `april bench --engine sim` with `april simulate` on the same setting (the test of the
simulator: the same samples, scheduling and cost model, once in virtual time, once as real processes)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from broker.sim.figures import Figures, with_speedups
from cli.bench_report import bench_json
from cli.main import app

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
    "--max-new-tokens", "2048", "--learner-step-s", "2",
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


def test_each_mode_gets_the_same_config_but_its_mode_and_the_sim_learner_unless_told_to_train() -> None:
    from actors.lengths import LengthSpec
    from april.config import AlgoConfig, Mode, config_to_dict
    from cli.bench_cmd import TINY_MODEL
    from cli.bench_plan import BenchRun, BenchSetting, run_config

    setting = BenchSetting(
        "sim",
        (Mode.SYNC, Mode.ASYNC),
        3,
        "w",
        LengthSpec.parse("fixed:8"),
        AlgoConfig(),
        2,
        4,
        time_scale=0.5,
    )
    sync, asyn = (config_to_dict(run_config(setting, r, "b")) for r in setting.runs())
    assert sync["run"].pop("mode") == "sync" and asyn["run"].pop("mode") == "async"
    assert sync == asyn
    assert sync["learner"]["backend"] == "sim" and sync["worker"]["sim_time_scale"] == 0.5
    assert sync["broker"]["min_workers"] == 2 and sync["worker"]["sim_lengths"] == "fixed:8"
    real = run_config(
        BenchSetting(
            "sim", (Mode.SYNC,), 3, "w", LengthSpec.parse("fixed:8"), AlgoConfig(), 2, 4,
            model=str(TINY_MODEL), real_learner=True,
        ),
        BenchRun("sync", Mode.SYNC, AlgoConfig()),
        "b",
    )  # fmt: skip
    assert real.learner.backend == "deepspeed" and real.learner.model == real.worker.model == str(TINY_MODEL)
    assert real.data.synthetic_vocab_size == 320  # the tiny model's vocabulary: sim tokens it can train on


def test_several_staleness_bounds_run_async_once_each_against_one_sync_run() -> None:
    """`--max-staleness 1,2`: the ratios of both async runs are taken against the same sync run of the
    same bench; the runs differ only in mode and bound."""
    from actors.lengths import LengthSpec
    from april.config import AlgoConfig, Mode, config_to_dict
    from cli.bench_plan import BenchSetting, predict, run_config

    setting = BenchSetting(
        "sim", (Mode.SYNC, Mode.APRIL, Mode.ASYNC), 2, "w", LengthSpec.parse("fixed:8"),
        AlgoConfig(rollout_batch_size=2, over_sampling_batch_size=4, n_samples_per_prompt=2), 2, 4,
        async_staleness=(1, 2),
    )  # fmt: skip
    runs = setting.runs()
    assert [(r.label, r.mode, r.algo.max_staleness) for r in runs] == [
        ("sync", Mode.SYNC, 1),
        ("april", Mode.APRIL, 1),
        ("async-eta1", Mode.ASYNC, 1),
        ("async-eta2", Mode.ASYNC, 2),
    ]
    eta1, eta2 = (config_to_dict(run_config(setting, r, "b")) for r in runs[2:])
    assert eta1["algo"].pop("max_staleness") == 1 and eta2["algo"].pop("max_staleness") == 2
    assert eta1 == eta2
    predicted = predict(setting)
    assert list(predicted) == ["sync", "april", "async-eta1", "async-eta2"]
    assert predicted["sync"].speedup == 1.0 and predicted["async-eta2"].speedup is not None
    assert setting.to_json()["async_staleness"] == [1, 2]


@pytest.mark.parametrize("text", ["", "x", "1,1", "-1", "1,,-2"])
def test_a_bad_staleness_list_is_one_error(text: str) -> None:
    from cli.bench_cmd import parse_staleness
    from cli.simulate_cmd import SimulateError

    with pytest.raises(SimulateError, match="--max-staleness"):
        parse_staleness(text)
    assert parse_staleness("2") == (2,) and parse_staleness("1, 2") == (1, 2)


def test_a_variant_is_one_more_run_with_its_fields_set_and_predicted_alike() -> None:
    """`--variant LABEL:MODE:section.key=value,...`: the option reaches the run's config (every section)
    and, for algo fields, the simulator's prediction of the same run."""
    from actors.lengths import LengthSpec
    from april.config import AlgoConfig, ConfigError, Mode, OverSampling, ResumeKV, config_to_dict
    from cli.bench_plan import BenchSetting, parse_variant, predict, run_config, sim_config

    base = AlgoConfig(rollout_batch_size=2, over_sampling_batch_size=4, n_samples_per_prompt=2)
    auto = parse_variant("april-auto:april:algo.over_sampling=auto, algo.over_sampling_batch_size=6", base)
    assert (auto.label, auto.mode, auto.algo.over_sampling, auto.algo.over_sampling_batch_size) == (
        "april-auto",
        Mode.APRIL,
        OverSampling.AUTO,
        6,
    )
    lease = parse_variant("slow:sync:broker.abort_retries=9", base)
    setting = BenchSetting(
        "sim", (Mode.SYNC, Mode.APRIL), 2, "w", LengthSpec.parse("fixed:8"), base, 2, 4,
        variants=(auto, lease), dataset_size=32, prompt_corr=0.5,
    )  # fmt: skip
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
    assert sim_config(setting, reuse).resume_kv == ResumeKV.REUSE and reuse.algo.resume_affinity
    assert sim_config(setting, runs[1]).resume_kv == ResumeKV.RECOMPUTE
    assert run_config(setting, reuse, "b").worker.resume_kv == ResumeKV.REUSE
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
    dup = BenchSetting(
        "sim", (Mode.SYNC,), 2, "w", LengthSpec.parse("fixed:8"), base, 2, 4,
        variants=(parse_variant("sync:april", base),),
    )  # fmt: skip
    with pytest.raises(ConfigError, match="exists already"):
        dup.runs()
