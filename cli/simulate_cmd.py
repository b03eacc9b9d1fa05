"""`april simulate`: what sync, april and async would give on a length distribution and a cluster, in
virtual time, before spending GPU hours.

`simulate_command` is the typer command (`cli/main.py` registers it). The plain functions here resolve
`--lengths` (a workload name, a spec, or a file), expand `--sweep`, run `broker.sim.model.simulate` per
point and mode, and print a table or one JSON object. The model itself is `broker.sim`'s.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import time
import tomllib
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from actors.lengths import EmpiricalLength, LengthSpec
from april.config import AlgoConfig, Mode, OverSampling, PromptOrder, ResumeKV
from april.engine_cost import EngineCost
from broker.sim.figures import ARRIVAL_WINDOW_S, Figures, with_speedups
from broker.sim.model import SimConfig, simulate
from cli.options import UserError
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
    MaxStaleness,
    Modes,
    OverSamplingOpt,
    PrefillMsPerToken,
    PrefixCacheTokens,
    PromptCorr,
    PromptLen,
    PromptOrderOpt,
    PromptWindow,
    ResumeAffinity,
    ResumeKVOption,
    SamplesPerPrompt,
)

WORKLOADS = Path(__file__).resolve().parent.parent / "workloads"
DEFAULT_LENGTHS = "math-long-tail"
MIN_WIDTH = 150
# --sweep KEY -> its column in the table
SWEEP_KEYS = {
    "over-sampling-ratio": "os ratio",
    "over-sampling-batch-size": "os groups",
    "max-staleness": "eta",
    "engines": "engines",
    "slots": "slots",
    "learner-step-s": "L s",
}


class SimulateError(UserError, ValueError):
    """A bad --lengths, --modes or --sweep value; one readable line."""


def resolve_lengths(value: str, workloads: Path = WORKLOADS, option: str = "--lengths") -> LengthSpec:
    """A workload name (workloads/NAME.toml|.txt|.jsonl), a file (.toml: a spec; any other: lengths, one
    integer or JSON object per line), or a spec string. Errors name `option`, the flag that gave it."""
    for suffix in (".toml", ".txt", ".jsonl"):
        named = workloads / f"{value}{suffix}"
        if "/" not in value and named.is_file():
            return _load_file(named, option)
    path = Path(value)
    if ":" not in value and not path.is_file():
        names = sorted({p.stem for p in workloads.glob("*") if p.suffix in (".toml", ".txt", ".jsonl")})
        raise SimulateError(
            f"{option} {value!r}: no such workload or file (workloads: {', '.join(names) or 'none'}; "
            "or a spec like lognormal:median=64,sigma=1.0,cap=512)"
        )
    return _load_file(path, option) if path.is_file() else LengthSpec.parse(value)


def _load_file(path: Path, option: str) -> LengthSpec:
    if path.suffix != ".toml":
        return EmpiricalLength.load(str(path))
    try:
        doc = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise SimulateError(f"{option} {path}: cannot read the workload ({exc})") from None
    spec = doc.get("lengths")
    if not isinstance(spec, str):
        raise SimulateError(f'{option} {path}: expected a string field "lengths" holding a length spec')
    return LengthSpec.parse(spec)


def parse_modes(text: str) -> list[Mode]:
    modes: list[Mode] = []
    for name in (m.strip().lower() for m in text.split(",") if m.strip()):
        try:
            mode = Mode(name)
        except ValueError:
            raise SimulateError(
                f"--modes: got {name!r}, expected a comma list of sync, april, async"
            ) from None
        if mode not in modes:
            modes.append(mode)
    if not modes:
        raise SimulateError("--modes: empty, expected a comma list of sync, april, async")
    return modes


def sweep_points(specs: list[str]) -> list[dict[str, float]]:
    """`KEY=V1,V2,...` per --sweep; several give their cartesian product. [{}] when none."""
    axes: list[list[tuple[str, float]]] = []
    for spec in specs:
        key, eq, values = spec.partition("=")
        key = key.strip().lstrip("-").replace("_", "-").lower()
        if not eq or key not in SWEEP_KEYS:
            raise SimulateError(
                f"--sweep {spec!r}: expected KEY=V1,V2,... with KEY one of {', '.join(SWEEP_KEYS)}"
            )
        axis = [(key, _sweep_value(spec, key, v)) for v in values.split(",") if v.strip()]
        if not axis:
            raise SimulateError(f"--sweep {spec!r}: no values")
        axes.append(axis)
    return [dict(point) for point in itertools.product(*axes)]


def _sweep_value(spec: str, key: str, text: str) -> float:
    """A number; a whole one (an int) for keys that count something."""
    try:
        value = float(text)
    except ValueError:
        raise SimulateError(f"--sweep {spec!r}: got {text.strip()!r}, expected a number") from None
    if key in ("over-sampling-ratio", "learner-step-s"):
        return value
    if not value.is_integer():
        raise SimulateError(f"--sweep {spec!r}: got {text.strip()!r}, expected a whole number")
    return int(value)


def apply_point(base: SimConfig, point: dict[str, float]) -> SimConfig:
    """The setting at one sweep point."""
    cfg, algo = base, base.algo
    for key, value in point.items():
        if key == "over-sampling-ratio":
            algo = dataclasses.replace(algo, over_sampling_batch_size=round(value * algo.rollout_batch_size))
        elif key == "over-sampling-batch-size":
            algo = dataclasses.replace(algo, over_sampling_batch_size=int(value))
        elif key == "max-staleness":
            algo = dataclasses.replace(algo, max_staleness=int(value))
        elif key == "engines":
            cfg = dataclasses.replace(cfg, engines=int(value))
        elif key == "slots":
            cfg = dataclasses.replace(cfg, slots=int(value))
        else:
            cfg = dataclasses.replace(cfg, learner_step_s=value)
    return dataclasses.replace(cfg, algo=algo)


Waits = dict[str, dict[str, float]]  # mode -> cause -> simulated seconds the learner waited


def run_point(cfg: SimConfig, lengths: LengthSpec, modes: list[Mode]) -> tuple[dict[str, Figures], Waits]:
    """Each mode at one sweep point: its figures (speedups over sync) and why its learner waited."""
    results = {m.value: simulate(dataclasses.replace(cfg, mode=m), lengths) for m in modes}
    return with_speedups({m: r.figures for m, r in results.items()}), {m: r.waits for m, r in results.items()}


def wait_lines(results: list[tuple[dict[str, float], dict[str, Figures], Waits]], steps: int) -> list[str]:
    """One line per (sweep point, mode): the learner's wait per step, by cause (broker.sim.model)."""
    out = []
    for point, _, waits in results:
        at = "".join(f"{k}={v:g} " for k, v in point.items())
        for mode, causes in waits.items():
            total = sum(causes.values())
            shares = ", ".join(f"{c} {100 * w / total:.0f}%" for c, w in causes.items() if w > 0)
            out.append(f"  {at}{mode}: {total / steps:,.1f} s per step ({shares or 'never waited'})")
    return out


def setting_json(cfg: SimConfig, lengths: LengthSpec) -> dict[str, Any]:
    a = cfg.algo
    return {
        "lengths": lengths.describe(),
        "rollout_batch_size": a.rollout_batch_size,
        "over_sampling_batch_size": a.over_sampling_batch_size,
        "n_samples_per_prompt": a.n_samples_per_prompt,
        "max_new_tokens": a.max_new_tokens,
        "max_staleness": a.max_staleness,
        "engines": cfg.engines,
        "slots": cfg.slots,
        "decode_ms": cfg.cost.decode_ms,
        "decode_ms_per_seq": cfg.cost.decode_ms_per_seq,
        "prefill_ms_per_token": cfg.cost.prefill_ms_per_token,
        "prefix_cache_tokens": cfg.cost.prefix_cache_tokens,
        "resume_affinity": a.resume_affinity,
        "resume_kv": cfg.resume_kv.value,
        "learner_step_s": cfg.learner_step_s,
        "steps": cfg.steps,
        "prompt_len": cfg.prompt_len,
        "seed": cfg.seed,
        "dataset_size": cfg.dataset_size,
        "prompt_corr": cfg.prompt_corr,
        "over_sampling": a.over_sampling.value,
        "prompt_order": a.prompt_order.value,
        "prompt_window": a.prompt_window,
    }


def header(cfg: SimConfig, lengths: LengthSpec) -> str:
    a, c = cfg.algo, cfg.cost
    return (
        f"lengths {lengths.describe()}\n"
        f"{a.rollout_batch_size} x {a.n_samples_per_prompt} samples a step (over-sampling "
        f"{a.over_sampling_batch_size}{' auto' if a.over_sampling == OverSampling.AUTO else ''}, "
        f"prompts {a.prompt_order.value}), {cfg.dataset_size} prompts (length correlation "
        f"{cfg.prompt_corr:g}), "
        f"{a.max_new_tokens} tokens max, {cfg.engines} engines x {cfg.slots} "
        f"slots, step {c.decode_ms:g} + {c.decode_ms_per_seq:g} ms/seq, prefill {c.prefill_ms_per_token:g} "
        f"ms/token, learner {cfg.learner_step_s:g} s, eta {a.max_staleness}, {cfg.steps} steps\n"
        f"prefix cache {c.prefix_cache_tokens:,} tokens an engine, resume_kv {cfg.resume_kv.value}, resume "
        f"affinity {'on' if a.resume_affinity else 'off'}"
    )


def render(results: list[tuple[dict[str, float], dict[str, Figures], Waits]]) -> Table:
    """One row per (sweep point, mode)."""
    keys = list(results[0][0]) if results else []
    table = Table(box=None, pad_edge=False)
    for key in keys:
        table.add_column(SWEEP_KEYS[key], justify="right", no_wrap=True)
    heads = ("mode", "samples/s", "speedup", "tok/s", "eff tok/s", "util", "bubble", "offpol", "stale")
    for head in (*heads, "reprefill", "stale KV", "aborted", "resumed", "wasted", "wall s"):
        table.add_column(head, justify="left" if head == "mode" else "right")
    for point, by_mode, _ in results:
        for mode, f in by_mode.items():
            table.add_row(
                *(f"{point[k]:g}" for k in keys),
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


def broker_load(results: list[tuple[dict[str, float], dict[str, Figures], Waits]]) -> str:
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
    lengths: Annotated[
        str,
        typer.Option(
            "--lengths",
            help="Response lengths: a workload name (workloads/: math-long-tail, short-answer), a spec "
            "(fixed:N, lognormal:median=M,sigma=S[,cap=C], mixture:W*SPEC+..., file:PATH) or a FILE of "
            "lengths (one integer per line, or JSONL with response_len) from a real run.",
        ),
    ] = DEFAULT_LENGTHS,
    rollout_batch_size: Annotated[int, typer.Option(help="Groups per training step (B).", min=1)] = 32,
    over_sampling_batch_size: Annotated[
        int, typer.Option(help="Groups in flight per april round.", min=1)
    ] = 64,
    n_samples_per_prompt: SamplesPerPrompt = 8,
    max_new_tokens: Annotated[
        int, typer.Option(help="Response budget; longer ones are truncated.", min=1)
    ] = 16384,
    engines: Annotated[int, typer.Option(help="Inference engines (one GPU or TP group each).", min=1)] = 8,
    slots: Annotated[int, typer.Option(help="Concurrent sequences per engine.", min=1)] = 64,
    decode_ms: DecodeMs = COST.decode_ms,
    decode_ms_per_seq: DecodeMsPerSeq = COST.decode_ms_per_seq,
    prefill_ms_per_token: PrefillMsPerToken = COST.prefill_ms_per_token,
    prefix_cache_tokens: PrefixCacheTokens = COST.prefix_cache_tokens,
    learner_step_s: LearnerStepS = LEARNER_STEP_S,
    max_staleness: MaxStaleness = 1,
    resume_affinity: ResumeAffinity = False,
    resume_kv: ResumeKVOption = ResumeKV.RECOMPUTE,
    steps: Annotated[int, typer.Option(help="Learner steps simulated per mode.", min=1)] = 20,
    prompt_len: PromptLen = PROMPT_LEN,
    seed: Annotated[
        int, typer.Option(help="Seed of the drawn lengths (the same samples in every mode).")
    ] = 0,
    per_sample_lengths: Annotated[
        bool,
        typer.Option(
            "--per-sample-lengths",
            help="Draw each sample's length from (seed, group, index) as the sim engine does: the very "
            "samples `april bench --engine sim --seed SEED` runs.",
        ),
    ] = False,
    prompt_corr: PromptCorr = 0.0,
    dataset_size: DatasetSize = DATASET_SIZE,
    over_sampling: OverSamplingOpt = OverSampling.FIXED,
    prompt_order: PromptOrderOpt = PromptOrder.ISSUE,
    prompt_window: PromptWindow = 64,
    modes: Modes = MODES,
    sweep: Annotated[
        list[str] | None,
        typer.Option(
            help="KEY=V1,V2,... (repeat for a grid); KEY: over-sampling-ratio, over-sampling-batch-size, "
            "max-staleness, engines, slots, learner-step-s."
        ),
    ] = None,
    as_json: Annotated[
        bool, typer.Option("--json", help="One JSON object: per mode the bench.json figures.")
    ] = False,
) -> None:
    """Predict what april / async give over sync on a length distribution, in virtual time.

    A discrete-event model drives the broker's own books and scheduling policy (BrokerState, broker.policy)
    with simulated engines and learner. Decode step = A + B x active sequences (+ C per prefilled token),
    the sim engine's cost model (april/engine_cost.py: `april up --engine sim` starts from the same
    defaults); defaults are GPU-like for a 4B model on one H100-class GPU per engine (A 6 ms, B 0.1 ms,
    C 0.02 ms: ~12 ms a step at 64 sequences, ~50k prefill tokens/s), a 20 s learner step, and the
    paper's setting (32 x 8 samples, over-sampling 64, 16k tokens, 8 engines).
    """
    spec = resolve_lengths(lengths)
    chosen = parse_modes(modes)
    points = sweep_points(sweep or [])
    algo = AlgoConfig(
        rollout_batch_size=rollout_batch_size,
        over_sampling_batch_size=over_sampling_batch_size,
        n_samples_per_prompt=n_samples_per_prompt,
        max_new_tokens=max_new_tokens,
        max_staleness=max_staleness,
        over_sampling=over_sampling,
        prompt_order=prompt_order,
        prompt_window=prompt_window,
        resume_affinity=resume_affinity,
    )
    base = SimConfig(
        Mode.SYNC,
        algo,
        engines=engines,
        slots=slots,
        cost=EngineCost(decode_ms, decode_ms_per_seq, prefill_ms_per_token, prefix_cache_tokens),
        learner_step_s=learner_step_s,
        steps=steps,
        prompt_len=prompt_len,
        seed=seed,
        per_sample_lengths=per_sample_lengths,
        dataset_size=dataset_size,
        prompt_corr=prompt_corr,
        resume_kv=resume_kv,
    )
    started = time.perf_counter()
    results = [(p, *run_point(apply_point(base, p), spec, chosen)) for p in points]
    elapsed = time.perf_counter() - started
    if as_json:
        out: dict[str, Any] = {"setting": setting_json(base, spec)}
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
    console.print(header(base, spec))
    console.print(render(results))
    console.print(
        "learner waiting for its batch, by what held it (admission bound / generation / staleness rule):"
    )
    for line in wait_lines(results, base.steps):
        console.print(line, highlight=False)
    console.print(f"simulated in {elapsed:.1f} s (virtual time; speedup = samples/s over sync)")
    console.print(broker_load(results))
