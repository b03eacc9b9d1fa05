"""`april bench`: the same workload once per mode with the real broker, workers and learner processes,
one mode after another; writes OUT/bench.json, OUT/bench.md and OUT/bench.png.

`bench_command` is the typer command (`cli/main.py` registers it): it resolves the runs' base config as
every command does (--config, --set and the options that name config fields, over `cli.bench_plan.bench_base`
without --config), turns it into a `cli.bench_plan.BenchSetting`, runs each mode (`cli.bench_run`), and
writes the reports (`cli.bench_report`). With `--engine sim` the learner is simulated too
(`learner.backend = "sim"`), the simulator predicts the same runs first (`april simulate`, with the same
samples) and the time scale is chosen from that prediction so the slowest mode takes about `--target-s`
wall seconds; with `--engine torch` everything is real: the model on this machine.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import typer

from actors.lengths import EmpiricalLength, LengthSpec
from actors.sim_tools import SIM_ENV
from april.config import Config, ConfigError, replace_fields
from april.files import write_json
from april.hf import check_model_dir
from broker.sim.figures import Figures, with_speedups
from cli.bench_plan import (
    DEFAULT_WORKLOAD,
    ENGINES,
    BenchSetting,
    bench_base,
    choose_time_scale,
    parse_variant,
    predict,
)
from cli.bench_report import bench_json, bench_markdown, bench_png
from cli.options import ConfigOpt, SetOpt
from cli.sim_options import ENGINES as ENGINES_KEY
from cli.sim_options import (
    MODES,
    PANEL,
    DatasetSize,
    EpisodesOpt,
    MaxNewTokens,
    Modes,
    OverSamplingBatchSize,
    PromptCorr,
    ResumeAffinity,
    ResumeKVOption,
    RolloutBatchSize,
    SamplesPerPrompt,
    Seed,
    Slots,
    Steps,
    episode_fields,
    parse_modes,
    resolve,
    resolve_lengths,
    sweep_points,
)

DEFAULT_ENGINES = {"sim": 8, "torch": 2}


def _absolute(spec: LengthSpec) -> LengthSpec:
    """A lengths file named by an absolute path: the workers may run elsewhere than here."""
    if isinstance(spec, EmpiricalLength):
        return EmpiricalLength.load(str(Path(spec.path).resolve()))
    return spec


def staleness_bounds(text: str | None, base: Config) -> tuple[int, ...]:
    """--max-staleness: one bound, or a comma list of distinct bounds (async once per bound), each checked
    as algo.max_staleness is."""
    if text is None:
        return ()
    values = [v.strip() for v in text.split(",")]
    if not text.strip() or "" in values:
        raise ConfigError(f"--max-staleness: got {text!r}, expected algo.max_staleness values, e.g. 1 or 1,2")
    bounds = tuple(replace_fields(base, {"algo.max_staleness": v}).algo.max_staleness for v in values)
    if len(set(bounds)) != len(bounds):
        raise ConfigError(f"--max-staleness (algo.max_staleness): got {text!r}, expected distinct values")
    return bounds


def bench_command(
    engine: Annotated[
        str, typer.Option(help="sim (cost model, simulated learner) or torch (all real).")
    ] = "sim",
    config: ConfigOpt = None,
    set_: SetOpt = None,
    modes: Modes = MODES,
    workload: Annotated[
        str | None,
        typer.Option(
            help="Response lengths (sim: drawn per sample, worker.sim_lengths): a workloads/ name, a spec or "
            "a file, as for `april simulate --lengths`. Default: math-long-tail (sim), tiny-task (torch: "
            "only its histogram; the model decides the lengths)."
        ),
    ] = None,
    episodes: EpisodesOpt = None,
    out: Annotated[
        Path, typer.Option(help="Output directory (bench.json, bench.md, bench.png, runs/).")
    ] = Path("runs/bench"),
    engines: Annotated[
        int | None, typer.Option(help="Worker processes, one engine each (sim 8, torch 2).", min=1)
    ] = None,
    max_staleness: Annotated[
        str | None,
        typer.Option(
            help="algo.max_staleness: versions a sample may lag (eta). A comma list (1,2) runs async once "
            "per value (async-eta1, async-eta2), each against the same sync run; the first is every other "
            "run's.",
            rich_help_panel=PANEL,
        ),
    ] = None,
    target_s: Annotated[
        float,
        typer.Option(help="sim: wall seconds the slowest mode's run should take (sets the time scale)."),
    ] = 60.0,
    time_scale: Annotated[
        float | None, typer.Option(help="sim: wall seconds per simulated second (overrides --target-s).")
    ] = None,
    variant: Annotated[
        list[str] | None,
        typer.Option(
            help="LABEL:MODE[:section.key=value,...] (repeat): one more run after the modes', e.g. "
            "april-auto:april:algo.over_sampling=auto,algo.over_sampling_batch_size=128; compared with the "
            "same sync run."
        ),
    ] = None,
    sweep: Annotated[
        list[str] | None,
        typer.Option(
            help="section.key=V1,V2,... (repeat: the product): every mode but sync once per point, labelled "
            "MODE-key=V, each compared with the one sync run; as `april simulate --sweep`.",
        ),
    ] = None,
    real_learner: Annotated[
        bool,
        typer.Option(
            "--real-learner",
            help="sim: train learner.model (default the tiny model) for real (DeepSpeed, gradients) on the "
            "sim engine's tokens instead of the simulated learner (its own speed, not "
            "learner.sim_step_s, then sets the step time).",
        ),
    ] = False,
    model: Annotated[
        str | None,
        typer.Option(
            help="worker.model and learner.model: the model directory (torch; sim --real-learner).",
            rich_help_panel=PANEL,
        ),
    ] = None,
    steps: Steps = None,
    slots: Slots = None,
    rollout_batch_size: RolloutBatchSize = None,
    over_sampling_batch_size: OverSamplingBatchSize = None,
    n_samples_per_prompt: SamplesPerPrompt = None,
    max_new_tokens: MaxNewTokens = None,
    resume_affinity: ResumeAffinity = None,
    resume_kv: ResumeKVOption = None,
    prompt_corr: PromptCorr = None,
    dataset_size: DatasetSize = None,
    seed: Seed = None,
) -> None:
    """Run the same workload in each mode with real processes; write bench.json, bench.md, bench.png."""
    if engine not in ENGINES:
        raise ConfigError(f"--engine: got {engine!r}, expected sim or torch")
    chosen = tuple(parse_modes(modes))
    model_dir = None if model is None else str(Path(model).resolve())
    if episodes and engine != "sim":
        raise ConfigError("--episodes: simulated episodes run on the sim engine (--engine sim)")
    # --episodes' fields are set first, so that --set can change any of them; the workers play them
    # with the simulated tools (env.name = "sim")
    played = {**episode_fields(episodes), "env.name": SIM_ENV} if episodes else {}
    base = resolve(
        config,
        [*(f"{k}={v}" for k, v in played.items()), *(set_ or [])],
        bench_base(engine),
        run__steps=steps,
        run__seed=seed,
        algo__rollout_batch_size=rollout_batch_size,
        algo__over_sampling_batch_size=over_sampling_batch_size,
        algo__n_samples_per_prompt=n_samples_per_prompt,
        algo__max_new_tokens=max_new_tokens,
        algo__resume_affinity=resume_affinity,
        worker__slots=slots,
        worker__resume_kv=resume_kv,
        worker__sim_prompt_corr=prompt_corr,
        worker__model=model_dir,
        learner__model=model_dir,
        data__synthetic_size=dataset_size,
    )
    points = sweep_points(sweep or [], base)
    if any(ENGINES_KEY in point for point in points):
        raise ConfigError("--sweep: engines cannot be swept in a bench (one set of workers); use --engines")
    if sweep and max_staleness and "," in max_staleness:
        raise ConfigError("--sweep and a --max-staleness list: sweep algo.max_staleness instead")
    staleness = staleness_bounds(max_staleness, base)
    if staleness:
        base = replace_fields(base, {"algo.max_staleness": staleness[0]})
    name = workload or (base.worker.sim_lengths if episodes else DEFAULT_WORKLOAD[engine])
    setting = BenchSetting(
        engine=engine,
        modes=chosen,
        config=base,
        workload=name,
        lengths=_absolute(resolve_lengths(name, option="--workload")),
        episodes=episodes or "",
        engines=engines or DEFAULT_ENGINES[engine],
        real_learner=real_learner,
        async_staleness=staleness,
        variants=tuple(parse_variant(v, base) for v in variant or []),
        sweep=tuple(tuple(point.items()) for point in points if point),
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
    write_json(out / "bench.json", doc)
    (out / "bench.md").write_text(bench_markdown(doc, measured, predicted), encoding="utf-8")
    slots = setting.config.worker.slots
    title = f"april bench, {setting.engine} engine, {setting.workload}: {setting.engines} x {slots} slots"
    bench_png(out / "bench.png", measured, setting.lengths, title)
    print(f"april bench: wrote {out / 'bench.json'}, bench.md, bench.png", file=sys.stderr)
    return doc
