"""How `april simulate` and `april bench` are configured: as every command is, plus a base layer and sweeps.

Both read the run's config the usual way (`--config FILE` < APRIL_* environment < `--set section.key=value`
< options, `cli.options.resolve_config`), so a user simulates or benchmarks the config file they train
with. Without `--config` the base layer is not the dataclass defaults but `paper_config`: the paper's
setting on a GPU-like simulated cluster (32 x 8 samples, over-sampling 64, 16k tokens, the sim engine's
cost `april.sim.engine_cost.DEFAULT_COST`, a 20 s learner step). The options below that name a config field
are that field, nothing more (the ones the documented commands use); `--sweep section.key=V1,V2,...`
runs every value of any field (several make a grid). The simulated cluster's size (`--engines`) is the one
setting no config field holds (`april up --workers`).
"""

from __future__ import annotations

import itertools
import tempfile
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated

import typer

from actors.lengths import EmpiricalLength, EpisodeFile, LengthSpec, LengthSpecError
from actors.sim_tools import episode_workload
from april.config import (
    AlgoConfig,
    Config,
    ConfigError,
    DataConfig,
    Mode,
    OverSampling,
    PromptOrder,
    ResumeKV,
    RunConfig,
    WorkerConfig,
    config_to_dict,
    replace_fields,
    write_config,
)
from april.sim.episode_plans import EpisodeWorkload
from cli.options import UserError, resolve_config

WORKLOADS = Path(__file__).resolve().parent.parent / "workloads"
PAPER_WORKLOAD = "math-long-tail"
MODES = "sync,april,async"
ENGINES = "engines"  # the sweep key of the simulated cluster's size (no config field)
PANEL = "Config fields (each the same as --set section.key=VALUE)"


def paper_config(steps: int = 20) -> Config:
    """The base layer without --config: the paper's setting (B = 32 groups of 8, over-sampling 64, 16k
    tokens), 64 slots an engine of the sim engine's default cost, synthetic 256-token prompts, a 20 s
    simulated learner step, no evaluations."""
    return Config(
        run=RunConfig(name="paper", steps=steps),
        algo=AlgoConfig(
            rollout_batch_size=32,
            over_sampling_batch_size=64,
            n_samples_per_prompt=8,
            max_new_tokens=16384,
            max_staleness=1,
        ),
        data=DataConfig(
            source="synthetic", synthetic_prompt_len_min=256, synthetic_prompt_len_max=256, eval_size=0
        ),
        worker=WorkerConfig(
            engine="sim", slots=64, reward="exact", sim_lengths=resolve_lengths(PAPER_WORKLOAD).describe()
        ),
    )


class LengthsError(UserError, ValueError):
    """A lengths option or field that names no workload, file or spec; one readable line."""


def resolve_lengths(value: str, workloads: Path = WORKLOADS, option: str = "--lengths") -> LengthSpec:
    """A workload name (workloads/NAME.toml|.txt|.jsonl), a file (.toml: a spec; any other: lengths, one
    integer or JSON object per line), or a spec string. Errors name `option`, what gave it."""
    for suffix in (".toml", ".txt", ".jsonl"):
        named = workloads / f"{value}{suffix}"
        if "/" not in value and named.is_file():
            return _load_file(named, option)
    path = Path(value)
    if ":" not in value and not path.is_file():
        names = sorted({p.stem for p in workloads.glob("*") if p.suffix in (".toml", ".txt", ".jsonl")})
        raise LengthsError(
            f"{option} {value!r}: no such workload or file (workloads: {', '.join(names) or 'none'}; "
            "or a spec like lognormal:median=64,sigma=1.0,cap=512)"
        )
    if path.is_file():
        return _load_file(path, option)
    try:
        return LengthSpec.parse(value)
    except LengthSpecError as exc:
        raise LengthsError(f"{option}: {exc}") from None


def _load_file(path: Path, option: str) -> LengthSpec:
    if path.suffix != ".toml":
        return EmpiricalLength.load(str(path))
    spec = _toml(path, option).get("lengths")
    if not isinstance(spec, str):
        raise LengthsError(f'{option} {path}: expected a string field "lengths" holding a length spec')
    return LengthSpec.parse(spec)


EpisodesOpt = Annotated[
    str | None,
    typer.Option(
        "--episodes",
        help="Multi-turn episodes: a workload (workloads/: agentic) or .toml setting worker.sim_lengths "
        "(each turn), sim_turns, sim_tool_ms, sim_observation_tokens; or a JSONL file of recorded "
        "episodes (worker.sim_episodes; format in docs/bench.md). --set changes any of them.",
    ),
]

# --episodes: a workload TOML's keys and the config fields they set
EPISODE_KEYS = {
    "lengths": "worker.sim_lengths",
    "turns": "worker.sim_turns",
    "tool_ms": "worker.sim_tool_ms",
    "observation_tokens": "worker.sim_observation_tokens",
}


def episode_fields(value: str, workloads: Path = WORKLOADS) -> dict[str, str]:
    """--episodes VALUE as the config fields it sets: a workload name (workloads/NAME.toml) or a .toml file
    whose keys are `EPISODE_KEYS` ("turns" required; each a length spec, "tool_ms" may be empty: none),
    or any other file: recorded episodes (`actors.lengths.EpisodeFile`, worker.sim_episodes)."""
    named = workloads / f"{value}.toml"
    path = named if "/" not in value and named.is_file() else Path(value)
    if not path.is_file():
        names = sorted(p.stem for p in workloads.glob("*.toml") if "turns" in _toml(p, "--episodes"))
        raise LengthsError(
            f"--episodes {value!r}: no such workload or file (episode workloads: "
            f"{', '.join(names) or 'none'}; or a JSONL file of recorded episodes)"
        )
    if path.suffix != ".toml":
        return {"worker.sim_episodes": EpisodeFile.load(str(path.resolve())).describe()}
    doc = _toml(path, "--episodes")
    if not isinstance(doc.get("turns"), str):
        raise LengthsError(f'--episodes {path}: expected a string field "turns" holding a length spec')
    fields = {}
    for key, name in EPISODE_KEYS.items():
        spec = doc.get(key)
        if key == "tool_ms" and spec == "":
            fields[name] = ""
        elif isinstance(spec, str):
            fields[name] = resolve_lengths(spec, workloads, f"--episodes {path}: {key}").describe()
        elif spec is not None:
            raise LengthsError(f"--episodes {path}: {key} = {spec!r}, expected a length spec string")
    return fields


def resolve_episodes(config: Config, lengths: LengthSpec) -> EpisodeWorkload | None:
    """The episodes `config` simulates (worker.sim_turns or worker.sim_episodes; each turn's tokens from
    `lengths`), or None: single-turn samples. Specs may name workloads; errors name the field."""
    return episode_workload(config.worker, lengths, lambda spec, field: resolve_lengths(spec, option=field))


def _toml(path: Path, option: str) -> dict[str, object]:
    try:
        return tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise LengthsError(f"{option} {path}: cannot read the workload ({exc})") from None


def parse_modes(text: str) -> list[Mode]:
    modes: list[Mode] = []
    for name in (m.strip().lower() for m in text.split(",") if m.strip()):
        try:
            mode = Mode(name)
        except ValueError:
            raise ConfigError(f"--modes: got {name!r}, expected a comma list of sync, april, async") from None
        if mode not in modes:
            modes.append(mode)
    if not modes:
        raise ConfigError("--modes: empty, expected a comma list of sync, april, async")
    return modes


def resolve(config_file: Path | None, sets: list[str] | None, base: Config, **flags: object) -> Config:
    """The config from `config_file` (or `base` without one), the environment, --set and `flags`
    ("section__key" -> value or None), in that order of precedence; checked as simulated engines run it."""
    if config_file is not None:
        config = resolve_config(config_file, sets, **flags)
    else:
        with tempfile.TemporaryDirectory(prefix="april-sim-") as tmp:
            path = Path(tmp) / "base.toml"
            write_config(base, path)
            config = resolve_config(path, sets, **flags)
    check_simulated(config)
    return config


def check_simulated(config: Config) -> None:
    """What simulated engines cannot run, as one ConfigError line: they score every sample 0, so dynamic
    sampling would drop every group and no batch would ever form."""
    if config.algo.dynamic_sampling:
        raise ConfigError(
            "algo.dynamic_sampling = true: simulated engines score every sample 0, so every group would be "
            "dropped and no batch would form; expected false here (--set algo.dynamic_sampling=false)"
        )


def sweep_points(specs: list[str], config: Config) -> list[dict[str, str]]:
    """`section.key=V1,V2,...` per --sweep (or `engines=...`); several give their cartesian product, in
    order. Each value is checked now, as --set checks it (a ConfigError names the field). [{}] when none."""
    axes: list[list[tuple[str, str]]] = []
    for spec in specs:
        key, eq, values = spec.partition("=")
        key = key.strip()
        axis = [(key, v.strip()) for v in values.split(",") if v.strip()]
        if not eq or ("." not in key and key != ENGINES) or not axis:
            raise ConfigError(
                f"--sweep {spec!r}: expected section.key=V1,V2,... (any config field, or {ENGINES}=...)"
            )
        if key == "run.mode":
            raise ConfigError(f"--sweep {spec!r}: the modes are --modes (run.mode of each run)")
        if any(k == key for k, _ in itertools.chain(*axes)):
            raise ConfigError(f"--sweep {spec!r}: {key} is swept twice")
        for _, value in axis:
            point_config(config, {key: value})
        axes.append(axis)
    return [dict(point) for point in itertools.product(*axes)]


def point_config(config: Config, point: Mapping[str, str]) -> tuple[Config, int | None]:
    """`config` at one sweep point, and the engines it sets (None: not swept)."""
    fields = {k: v for k, v in point.items() if k != ENGINES}
    engines = None
    if ENGINES in point:
        try:
            engines = int(point[ENGINES])
        except ValueError:
            engines = 0
        if engines < 1:
            raise ConfigError(f"--sweep {ENGINES}={point[ENGINES]}: expected a whole number >= 1")
    return replace_fields(config, fields), engines


def point_values(config: Config, engines: int, point: Mapping[str, str]) -> dict[str, object]:
    """The swept fields' values as the config holds them (typed; enums by value), for tables and JSON."""
    values = config_to_dict(config)
    out: dict[str, object] = {}
    for key in point:
        if key == ENGINES:
            out[key] = engines
        else:
            section, _, name = key.partition(".")
            out[key] = values[section][name]
    return out


# ------------------------------------------------------------------ options

Modes = Annotated[str, typer.Option(help="Comma list of modes, run in this order (run.mode of each run).")]
Engines = Annotated[int, typer.Option(help="Simulated engines (worker processes), worker.slots each.", min=1)]
RolloutBatchSize = Annotated[
    int | None, typer.Option(help="algo.rollout_batch_size: groups per step.", min=1, rich_help_panel=PANEL)
]
OverSamplingBatchSize = Annotated[
    int | None,
    typer.Option(
        help="algo.over_sampling_batch_size: groups in flight per april round.", min=1, rich_help_panel=PANEL
    ),
]
SamplesPerPrompt = Annotated[
    int | None,
    typer.Option(help="algo.n_samples_per_prompt: samples per group.", min=1, rich_help_panel=PANEL),
]
MaxNewTokens = Annotated[
    int | None, typer.Option(help="algo.max_new_tokens: the response budget.", min=1, rich_help_panel=PANEL)
]
OverSamplingOpt = Annotated[
    OverSampling | None,
    typer.Option(help="algo.over_sampling: fixed, or auto (planned per round).", rich_help_panel=PANEL),
]
PromptOrderOpt = Annotated[
    PromptOrder | None,
    typer.Option(help="algo.prompt_order: which drawn prompt is issued next.", rich_help_panel=PANEL),
]
ResumeAffinity = Annotated[
    bool | None,
    typer.Option(
        "--resume-affinity/--no-resume-affinity",
        help="algo.resume_affinity: a partial goes back to the engine it left.",
        rich_help_panel=PANEL,
    ),
]
ResumeKVOption = Annotated[
    ResumeKV | None,
    typer.Option(
        help="worker.resume_kv: prefix caches across a weight update.",
        case_sensitive=False,
        rich_help_panel=PANEL,
    ),
]
Slots = Annotated[
    int | None, typer.Option(help="worker.slots: sequences per engine.", min=1, rich_help_panel=PANEL)
]
PromptCorr = Annotated[
    float | None,
    typer.Option(
        help="worker.sim_prompt_corr: how much a length is its prompt's.",
        min=0,
        max=0.999,
        rich_help_panel=PANEL,
    ),
]
DatasetSize = Annotated[
    int | None,
    typer.Option(help="data.synthetic_size: prompts, recurring every epoch.", min=1, rich_help_panel=PANEL),
]
Steps = Annotated[
    int | None, typer.Option(help="run.steps: learner steps per run.", min=1, rich_help_panel=PANEL)
]
Seed = Annotated[int | None, typer.Option(help="run.seed: prompts and drawn lengths.", rich_help_panel=PANEL)]
