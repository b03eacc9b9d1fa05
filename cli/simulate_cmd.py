"""`april simulate`: what sync, april and async would give on a run's config and a cluster, in virtual time,
before spending GPU hours.

`simulate_command` is the typer command (`cli/main.py` registers it). It resolves the run's config as
every command does (`cli.sim_options`: --config, --set and the options that name config fields, over the
paper's setting without --config), expands `--sweep`, runs `broker.sim.model.simulate` per point and mode,
and prints a table or one JSON object. The model itself is `broker.sim`'s.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from actors.lengths import LengthSpec
from april.config import Mode, OverSampling, replace_fields
from april.sim.episode_plans import EpisodeWorkload
from broker.sim.figures import ARRIVAL_WINDOW_S, Figures, with_speedups
from broker.sim.model import SimConfig, simulate
from cli.options import ConfigOpt, SetOpt
from cli.sim_options import (
    MODES,
    PANEL,
    DatasetSize,
    Engines,
    EpisodesOpt,
    MaxNewTokens,
    Modes,
    OverSamplingBatchSize,
    OverSamplingOpt,
    PromptCorr,
    PromptOrderOpt,
    ResumeAffinity,
    ResumeKVOption,
    RolloutBatchSize,
    SamplesPerPrompt,
    Seed,
    Slots,
    Steps,
    episode_fields,
    paper_config,
    parse_modes,
    point_config,
    point_values,
    resolve,
    resolve_episodes,
    resolve_lengths,
    sweep_points,
)

MIN_WIDTH = 150
Values = dict[str, object]  # a sweep point's values: "section.key" (or "engines") -> the value it runs


@dataclass(frozen=True, slots=True)
class Point:
    """One sweep point: its swept values, its run and its workload (resolved before any point runs)."""

    values: Values
    cfg: SimConfig
    lengths: LengthSpec  # each response's (single-turn) or each turn's length
    episodes: EpisodeWorkload | None

    @staticmethod
    def of(values: Values, cfg: SimConfig) -> Point:
        lengths = resolve_lengths(cfg.config.worker.sim_lengths, option="worker.sim_lengths")
        return Point(values, cfg, lengths, resolve_episodes(cfg.config, lengths))


def run_point(point: Point, modes: list[Mode]) -> tuple[dict[str, Figures], Waits]:
    """Each mode at one sweep point: its figures (speedups over sync) and why its learner waited."""
    cfg = point.cfg
    results = {}
    for m in modes:
        run = SimConfig(
            replace_fields(cfg.config, {"run.mode": m.value}), cfg.engines, cfg.per_sample_lengths
        )
        results[m.value] = simulate(run, point.lengths, point.episodes)
    return with_speedups({m: r.figures for m, r in results.items()}), {m: r.waits for m, r in results.items()}


Waits = dict[str, dict[str, float]]  # mode -> cause -> simulated seconds the learner waited


def wait_lines(results: list[tuple[Values, dict[str, Figures], Waits]], steps: int) -> list[str]:
    """One line per (sweep point, mode): the learner's wait per step, by cause (broker.sim.model)."""
    out = []
    for point, _, waits in results:
        at = "".join(f"{k}={v} " for k, v in point.items())
        for mode, causes in waits.items():
            total = sum(causes.values())
            shares = ", ".join(f"{c} {100 * w / total:.0f}%" for c, w in causes.items() if w > 0)
            out.append(f"  {at}{mode}: {total / steps:,.1f} s per step ({shares or 'never waited'})")
    return out


def setting_json(cfg: SimConfig, lengths: LengthSpec, episodes: EpisodeWorkload | None) -> dict[str, Any]:
    c = cfg.config
    a, w, cost = c.algo, c.worker, c.worker.sim_cost
    extra = {} if episodes is None else {"episodes": episodes_json(cfg)}
    return {
        "lengths": lengths.describe(),
        "rollout_batch_size": a.rollout_batch_size,
        "over_sampling_batch_size": a.over_sampling_batch_size,
        "n_samples_per_prompt": a.n_samples_per_prompt,
        "max_new_tokens": a.max_new_tokens,
        "max_staleness": a.max_staleness,
        "engines": cfg.engines,
        "slots": w.slots,
        "decode_ms": cost.decode_ms,
        "decode_ms_per_seq": cost.decode_ms_per_seq,
        "prefill_ms_per_token": cost.prefill_ms_per_token,
        "prefix_cache_tokens": cost.prefix_cache_tokens,
        "resume_affinity": a.resume_affinity,
        "resume_kv": w.resume_kv.value,
        "learner_step_s": c.learner.sim_step_s,
        "steps": c.run.steps,
        "prompt_len": c.data.synthetic_prompt_len_max,
        "seed": c.run.seed,
        "dataset_size": c.data.synthetic_size,
        "prompt_corr": w.sim_prompt_corr,
        "over_sampling": a.over_sampling.value,
        "prompt_order": a.prompt_order.value,
        "prompt_window": a.prompt_window,
        "prompts": c.data.source,
        "max_buffered_samples": c.broker.max_buffered_samples,
        **extra,
    }


def episodes_json(cfg: SimConfig) -> dict[str, Any]:
    """The episode settings of a run that simulates episodes (`lengths` is then each turn's)."""
    w, env = cfg.config.worker, cfg.config.env
    drawn = {"turns": w.sim_turns, "tool_ms": w.sim_tool_ms or None}
    return {
        **({"recorded": w.sim_episodes} if w.sim_episodes else drawn),
        "observation_tokens": w.sim_observation_tokens,
        "tool_repeatable": w.sim_tool_repeatable,
        "max_turns": env.max_turns,
        "max_turn_tokens": env.max_turn_tokens,
    }


def header(cfg: SimConfig, lengths: LengthSpec, episodes: EpisodeWorkload | None) -> str:
    c = cfg.config
    a, w, cost = c.algo, c.worker, c.worker.sim_cost
    synthetic = c.data.source == "synthetic"
    prompts = f"{c.data.synthetic_size} prompts" if synthetic else f"the prompts of {c.data.source}"
    return (
        f"{'each turn: ' if episodes else ''}lengths {lengths.describe()}\n"
        f"{episodes_line(cfg) if episodes else ''}"
        f"{a.rollout_batch_size} x {a.n_samples_per_prompt} samples a step (over-sampling "
        f"{a.over_sampling_batch_size}{' auto' if a.over_sampling == OverSampling.AUTO else ''}, "
        f"prompts {a.prompt_order.value}), {prompts} (length correlation {w.sim_prompt_corr:g}), "
        f"{a.max_new_tokens} tokens max, {cfg.engines} engines x {w.slots} "
        f"slots, step {cost.decode_ms:g} + {cost.decode_ms_per_seq:g} ms/seq, prefill "
        f"{cost.prefill_ms_per_token:g} ms/token, learner {c.learner.sim_step_s:g} s, eta {a.max_staleness}, "
        f"{c.run.steps} steps\n"
        f"prefix cache {cost.prefix_cache_tokens:,} tokens an engine, resume_kv {w.resume_kv.value}, resume "
        f"affinity {'on' if a.resume_affinity else 'off'}"
    )


def episodes_line(cfg: SimConfig) -> str:
    w, env = cfg.config.worker, cfg.config.env
    what = (
        f"recorded episodes {w.sim_episodes}"
        if w.sim_episodes
        else f"episodes of {w.sim_turns} turns, tool calls of {w.sim_tool_ms or 'no'} ms"
    )
    kind = "repeatable (killed by an abort)" if w.sim_tool_repeatable else "waited for by an abort"
    return (
        f"{what}, {kind}, answers of {w.sim_observation_tokens} tokens; at most {env.max_turns} turns of "
        f"{env.max_turn_tokens} tokens\n"
    )


def render(results: list[tuple[Values, dict[str, Figures], Waits]]) -> Table:
    """One row per (sweep point, mode)."""
    keys = list(results[0][0]) if results else []
    table = Table(box=None, pad_edge=False)
    for key in keys:
        table.add_column(key, justify="right", no_wrap=True)
    heads = ("mode", "samples/s", "speedup", "tok/s", "eff tok/s", "util", "bubble", "offpol", "stale")
    for head in (*heads, "reprefill", "stale KV", "aborted", "resumed", "wasted", "wall s"):
        table.add_column(head, justify="left" if head == "mode" else "right")
    for point, by_mode, _ in results:
        for mode, f in by_mode.items():
            table.add_row(
                *(str(point[k]) for k in keys),
                mode,
                f"{f.samples_per_s:.3f}",
                "-" if f.speedup is None else f"{f.speedup:.2f}x",
                f"{f.tokens_per_s:,.0f}",
                f"{f.effective_tokens_per_s:,.0f}",
                f"{f.slot_utilization:.3f}",
                f"{f.bubble_frac:.3f}",
                f"{f.offpolicy_token_frac:.3f}",
                f"{f.staleness_mean:.2f}/{f.staleness_max}",
                "-" if f.reprefill_frac is None else f"{f.reprefill_frac:.4f}",
                "-" if f.stale_kv_token_frac is None else f"{f.stale_kv_token_frac:.3f}",
                str(f.aborted),
                str(f.resumed),
                str(f.wasted_tokens),
                f"{f.wall_s:,.0f}",
            )
    return table


def broker_load(results: list[tuple[Values, dict[str, Figures], Waits]]) -> str:
    """The samples per second the simulated engines return to the broker, the highest of every point and
    mode: to hold against the capacity benchmarks/broker_throughput.py measures on the broker's host."""
    figs = [f for _, by_mode, _ in results for f in by_mode.values()]
    mean = max((f.broker_arrivals_per_s_mean or 0.0 for f in figs), default=0.0)
    peak = max((f.broker_arrivals_per_s_peak or 0.0 for f in figs), default=0.0)
    return (
        f"broker load: up to {mean:,.0f} samples/s returned by the engines on average, {peak:,.0f} in the "
        f"busiest {ARRIVAL_WINDOW_S:g} s (virtual time); the broker keeps up if the samples/s "
        "benchmarks/broker_throughput.py measures on its host is higher"
    )


def simulate_command(
    config: ConfigOpt = None,
    set_: SetOpt = None,
    sweep: Annotated[
        list[str] | None,
        typer.Option(
            help="section.key=V1,V2,... (repeat for a grid): every value of any config field, or "
            "engines=N1,N2,... (the cluster's size)."
        ),
    ] = None,
    modes: Modes = MODES,
    engines: Engines = 8,
    lengths: Annotated[
        str | None,
        typer.Option(
            "--lengths",
            help="worker.sim_lengths: response lengths: a workload name (workloads/: math-long-tail, "
            "short-answer), a spec (fixed:N, lognormal:median=M,sigma=S[,cap=C], mixture:W*SPEC+..., "
            "file:PATH) or a FILE of lengths (one integer per line, or JSONL with response_len) from a run.",
        ),
    ] = None,
    episodes: EpisodesOpt = None,
    per_sample_lengths: Annotated[
        bool,
        typer.Option(
            "--per-sample-lengths",
            help="Draw each sample's length from (seed, group, index) as the sim engine does: the very "
            "samples `april bench --engine sim --seed SEED` runs.",
        ),
    ] = False,
    as_json: Annotated[
        bool, typer.Option("--json", help="One JSON object: per mode the bench.json figures.")
    ] = False,
    rollout_batch_size: RolloutBatchSize = None,
    over_sampling_batch_size: OverSamplingBatchSize = None,
    n_samples_per_prompt: SamplesPerPrompt = None,
    max_new_tokens: MaxNewTokens = None,
    max_staleness: Annotated[
        int | None,
        typer.Option(help="algo.max_staleness: versions a sample may lag (eta).", rich_help_panel=PANEL),
    ] = None,
    over_sampling: OverSamplingOpt = None,
    prompt_order: PromptOrderOpt = None,
    resume_affinity: ResumeAffinity = None,
    resume_kv: ResumeKVOption = None,
    slots: Slots = None,
    prompt_corr: PromptCorr = None,
    dataset_size: DatasetSize = None,
    steps: Steps = None,
    seed: Seed = None,
) -> None:
    """Predict what april / async give over sync on a run's config, in virtual time.

    A discrete-event model drives the broker's own core (broker/core.py: the books, the scheduling policy)
    with simulated engines and learner. Decode step = A + B x active sequences (+ C per prefilled token),
    the sim engine's cost model (worker.sim_decode_ms, sim_decode_ms_per_seq, sim_prefill_ms_per_token).
    Without --config: the paper's setting (32 x 8 samples, over-sampling 64, 16k tokens, 8 engines x 64
    slots, math-long-tail, GPU-like cost A 6 ms, B 0.1 ms, C 0.02 ms, a 20 s learner step).
    """
    chosen = parse_modes(modes)
    # --episodes' fields are set first, so that --set can change any of them
    workload = [f"{k}={v}" for k, v in episode_fields(episodes).items()] if episodes else []
    base = resolve(
        config,
        [*workload, *(set_ or [])],
        paper_config(),
        worker__sim_lengths=None if lengths is None else resolve_lengths(lengths).describe(),
        algo__rollout_batch_size=rollout_batch_size,
        algo__over_sampling_batch_size=over_sampling_batch_size,
        algo__n_samples_per_prompt=n_samples_per_prompt,
        algo__max_new_tokens=max_new_tokens,
        algo__max_staleness=max_staleness,
        algo__over_sampling=over_sampling,
        algo__prompt_order=prompt_order,
        algo__resume_affinity=resume_affinity,
        worker__resume_kv=resume_kv,
        worker__slots=slots,
        worker__sim_prompt_corr=prompt_corr,
        data__synthetic_size=dataset_size,
        run__steps=steps,
        run__seed=seed,
    )
    runs: list[Point] = []
    for p in sweep_points(sweep or [], base):
        at, swept = point_config(base, p)
        cfg = SimConfig(at, swept or engines, per_sample_lengths)
        runs.append(Point.of(point_values(at, cfg.engines, p), cfg))
    started = time.perf_counter()
    results = [(run.values, *run_point(run, chosen)) for run in runs]
    elapsed = time.perf_counter() - started
    first = runs[0].cfg
    if as_json:
        out: dict[str, Any] = {"setting": setting_json(first, runs[0].lengths, runs[0].episodes)}
        modes_json = [
            {m: {**f.to_json(), "learner_wait_s": waits[m]} for m, f in by_mode.items()}
            for _, by_mode, waits in results
        ]
        if sweep:
            out["sweep"] = [{"point": r[0], "modes": mj} for r, mj in zip(results, modes_json, strict=True)]
        else:
            out["modes"] = modes_json[0]
        print(json.dumps(out, indent=2))
        return
    console = Console(width=max(MIN_WIDTH, Console().width))  # a narrower table would elide figures
    console.print(header(first, runs[0].lengths, runs[0].episodes))
    console.print(render(results))
    console.print(
        "learner waiting for its batch, by what held it (admission bound / generation / staleness rule):"
    )
    for line in wait_lines(results, first.steps):
        console.print(line, highlight=False)
    console.print(f"simulated in {elapsed:.1f} s (virtual time; speedup = samples/s over sync)")
    console.print(broker_load(results))
