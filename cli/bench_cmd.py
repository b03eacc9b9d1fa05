"""`april bench`: the same workload once per mode with the real broker, workers and learner processes,
one mode after another; writes OUT/bench.json, OUT/bench.md and OUT/bench.png.

`bench_command` is the typer command (`cli/main.py` registers it): it turns options into a
`cli.bench_plan.BenchSetting`, runs each mode (`cli.bench_run`), and writes the reports
(`cli.bench_report`). With `--engine sim` the learner is simulated too (`learner.backend = "sim"`), the
simulator predicts the same runs first (`april simulate`, with the same samples) and the time scale is
chosen from that prediction so the slowest mode takes about `--target-s` wall seconds; with
`--engine torch` everything is real: the model on this machine.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from actors.lengths import EmpiricalLength, LengthSpec
from april.config import AlgoConfig, ResumeKV
from april.engine_cost import EngineCost
from april.hf import check_model_dir
from broker.sim.figures import Figures, with_speedups
from cli.bench_plan import BenchSetting, choose_time_scale, parse_variant, predict
from cli.bench_report import bench_json, bench_markdown, bench_png
from cli.sim_options import (
    COST,
    DATASET_SIZE,
    LEARNER_STEP_S,
    MODES,
    PROMPT_LEN,
    DatasetSize,
    DecodeMs,
    DecodeMsPerSeq,
    LearnerStepS,
    Modes,
    PrefillMsPerToken,
    PrefixCacheTokens,
    PromptCorr,
    PromptLen,
    ResumeAffinity,
    ResumeKVOption,
    SamplesPerPrompt,
)
from cli.simulate_cmd import SimulateError, parse_modes, resolve_lengths

REPO = Path(__file__).resolve().parents[1]
TINY_MODEL = REPO / "models" / "tiny"
TASK_WORKLOAD = "tiny-task"  # the built-in task's lengths on the tiny model (workloads/tiny-task.txt)
# engine -> defaults of the options that differ (sim: the paper-like setting of `april simulate`)
DEFAULTS: dict[str, dict[str, int | str]] = {
    "sim": {"workload": "math-long-tail", "steps": 5, "engines": 8, "slots": 64, "rollout_batch_size": 32,
            "over_sampling_batch_size": 64, "max_new_tokens": 16384},
    "torch": {"workload": TASK_WORKLOAD, "steps": 10, "engines": 2, "slots": 32, "rollout_batch_size": 8,
              "over_sampling_batch_size": 16, "max_new_tokens": 256},
}  # fmt: skip


def _absolute(spec: LengthSpec) -> LengthSpec:
    """A lengths file named by an absolute path: the workers may run elsewhere than here."""
    if isinstance(spec, EmpiricalLength):
        return EmpiricalLength.load(str(Path(spec.path).resolve()))
    return spec


def parse_staleness(text: str) -> tuple[int, ...]:
    """--max-staleness: one bound, or a comma list of distinct bounds >= 0."""
    try:
        values = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise SimulateError(f"--max-staleness: got {text!r}, expected integers >= 0, e.g. 1 or 1,2") from None
    if not values or min(values) < 0 or len(set(values)) != len(values):
        raise SimulateError(f"--max-staleness: got {text!r}, expected distinct integers >= 0, e.g. 1 or 1,2")
    return values


def bench_command(
    engine: Annotated[
        str, typer.Option(help="sim (cost model, simulated learner) or torch (all real).")
    ] = "sim",
    modes: Modes = MODES,
    steps: Annotated[
        int | None, typer.Option(help="Learner steps per mode (sim 5, torch 10).", min=1)
    ] = None,
    workload: Annotated[
        str | None,
        typer.Option(
            help="Response lengths (sim: drawn per sample): a workloads/ name, a spec or a file, as for "
            "`april simulate --lengths`. Default: math-long-tail (sim), tiny-task (torch: only its "
            "histogram; the model decides the lengths)."
        ),
    ] = None,
    out: Annotated[
        Path, typer.Option(help="Output directory (bench.json, bench.md, bench.png, runs/).")
    ] = Path("runs/bench"),
    engines: Annotated[
        int | None, typer.Option(help="Worker processes, one engine each (sim 8, torch 2).")
    ] = None,
    slots: Annotated[
        int | None, typer.Option(help="Concurrent sequences per engine (sim 64, torch 32).")
    ] = None,
    rollout_batch_size: Annotated[int | None, typer.Option(help="Groups per step (sim 32, torch 8).")] = None,
    over_sampling_batch_size: Annotated[
        int | None, typer.Option(help="Groups in flight per april round (sim 64, torch 16).")
    ] = None,
    n_samples_per_prompt: SamplesPerPrompt = 8,
    max_new_tokens: Annotated[
        int | None, typer.Option(help="Response budget (sim 16384, torch 256).")
    ] = None,
    max_staleness: Annotated[
        str,
        typer.Option(
            help="async: versions a sample may lag (eta). A comma list (1,2) runs async once per value "
            "(async-eta1, async-eta2), each against the same sync run."
        ),
    ] = "1",
    decode_ms: DecodeMs = COST.decode_ms,
    decode_ms_per_seq: DecodeMsPerSeq = COST.decode_ms_per_seq,
    prefill_ms_per_token: PrefillMsPerToken = COST.prefill_ms_per_token,
    prefix_cache_tokens: PrefixCacheTokens = COST.prefix_cache_tokens,
    learner_step_s: LearnerStepS = LEARNER_STEP_S,
    prompt_len: PromptLen = PROMPT_LEN,
    resume_affinity: ResumeAffinity = False,
    resume_kv: ResumeKVOption = ResumeKV.RECOMPUTE,
    target_s: Annotated[
        float,
        typer.Option(help="sim: wall seconds the slowest mode's run should take (sets the time scale)."),
    ] = 60.0,
    time_scale: Annotated[
        float | None, typer.Option(help="sim: wall seconds per simulated second (overrides --target-s).")
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed of prompts, sampling and drawn lengths (every mode).")] = 0,
    model: Annotated[
        Path, typer.Option(help="torch, or sim with --real-learner: the model directory.")
    ] = TINY_MODEL,
    prompt_corr: PromptCorr = 0.0,
    dataset_size: DatasetSize = DATASET_SIZE,
    variant: Annotated[
        list[str] | None,
        typer.Option(
            help="LABEL:MODE[:section.key=value,...] (repeat): one more run after the modes', e.g. "
            "april-auto:april:algo.over_sampling=auto,algo.over_sampling_batch_size=128; compared with the "
            "same sync run."
        ),
    ] = None,
    real_learner: Annotated[
        bool,
        typer.Option(
            "--real-learner",
            help="sim: train --model for real (DeepSpeed, gradients) on the sim engine's tokens instead of "
            "the simulated learner (its own speed, not --learner-step-s, then sets the step time).",
        ),
    ] = False,
) -> None:
    """Run the same workload in each mode with real processes; write bench.json, bench.md, bench.png."""
    if engine not in DEFAULTS:
        raise SimulateError(f"--engine: got {engine!r}, expected sim or torch")
    d = DEFAULTS[engine]
    staleness = parse_staleness(max_staleness)
    algo = AlgoConfig(
        rollout_batch_size=rollout_batch_size or int(d["rollout_batch_size"]),
        over_sampling_batch_size=over_sampling_batch_size or int(d["over_sampling_batch_size"]),
        n_samples_per_prompt=n_samples_per_prompt,
        max_new_tokens=max_new_tokens or int(d["max_new_tokens"]),
        max_staleness=staleness[0],
        resume_affinity=resume_affinity,
    )
    name = workload or str(d["workload"])
    setting = BenchSetting(
        engine=engine,
        modes=tuple(parse_modes(modes)),
        steps=steps or int(d["steps"]),
        workload=name,
        lengths=_absolute(resolve_lengths(name, option="--workload")),
        algo=algo,
        engines=engines or int(d["engines"]),
        slots=slots or int(d["slots"]),
        seed=seed,
        cost=EngineCost(decode_ms, decode_ms_per_seq, prefill_ms_per_token, prefix_cache_tokens),
        learner_step_s=learner_step_s,
        prompt_len=prompt_len,
        model=str(model.resolve()),
        real_learner=real_learner,
        async_staleness=staleness,
        variants=tuple(parse_variant(v, algo) for v in variant or []),
        dataset_size=dataset_size,
        prompt_corr=prompt_corr,
        resume_kv=resume_kv,
    )
    run_bench(setting, out, target_s, time_scale)


def run_bench(
    setting: BenchSetting, out: Path, target_s: float, time_scale: float | None
) -> dict[str, object]:
    """Every mode, then the reports; returns bench.json's object."""
    import dataclasses

    from cli.bench_run import run_mode  # april up's machinery: imported when a bench runs, not for --help

    if setting.engine == "torch" or setting.real_learner:  # before any process starts: one ModelError line
        check_model_dir(setting.model)
    predicted: dict[str, Figures] | None = None
    if setting.engine == "sim":
        predicted = predict(setting)
        scale = time_scale if time_scale is not None else choose_time_scale(predicted, target_s)
        setting = dataclasses.replace(setting, time_scale=scale)
    out.mkdir(parents=True, exist_ok=True)
    measured: dict[str, Figures] = {}
    for bench_run in setting.runs():
        figures, took = run_mode(setting, bench_run, out)
        measured[bench_run.label] = figures
        print(
            f"april bench: {bench_run.label}: {figures.samples_per_s:.3f} samples/s, slot utilisation "
            f"{figures.slot_utilization:.3f} ({took:.0f} s with start-up)",
            file=sys.stderr,
        )
    measured = with_speedups(measured)
    doc = bench_json(measured, setting.to_json(), predicted, setting.time_scale)
    (out / "bench.json").write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    (out / "bench.md").write_text(bench_markdown(doc, measured, predicted), encoding="utf-8")
    title = (
        f"april bench, {setting.engine} engine, {setting.workload}: {setting.engines} x {setting.slots} slots"
    )
    bench_png(out / "bench.png", measured, setting.lengths, title)
    print(f"april bench: wrote {out / 'bench.json'}, bench.md, bench.png", file=sys.stderr)
    return doc
