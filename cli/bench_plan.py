"""What `april bench` runs: one setting, turned into the run config of each mode and the simulator's
prediction of the same runs.

Owns `BenchSetting` (the engine, the modes, the base config every run starts from, the workload, the
engines), `bench_base` (that config without `--config`: the paper's setting for the sim engine, the
built-in task on the tiny model for torch), `run_config` (the `Config` a run's `april up` gets: the base
with its mode and its fields, and what a benchmark run needs whatever the base says: the engine, the
simulated learner, every engine registered before the first lease) and, for `--engine sim`, `predict`
(each run's very config in `broker.sim`'s virtual time, each sample's length drawn exactly as the sim
engine draws it) and `choose_time_scale` (wall seconds per simulated second so the slowest mode takes
about a target). Starts nothing.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from actors.factory import model_vocab_size
from actors.lengths import LengthSpec
from april.config import (
    AlgoConfig,
    Config,
    ConfigError,
    DataConfig,
    LearnerConfig,
    Mode,
    RunConfig,
    WorkerConfig,
    parse_override,
    replace_fields,
)
from april.hf import TINY_MODEL
from broker.sim.figures import Figures, with_speedups
from broker.sim.model import SimConfig, simulate
from cli.sim_options import paper_config, resolve_episodes

ENGINES = ("sim", "torch")
TASK_WORKLOAD = "tiny-task"  # the built-in task's lengths on the tiny model (workloads/tiny-task.txt)
DEFAULT_WORKLOAD = {"sim": "math-long-tail", "torch": TASK_WORKLOAD}
Overrides = tuple[tuple[str, str], ...]  # ("section.key", value) as `--set` takes them


def bench_base(engine: str) -> Config:
    """The base config without --config. sim: the paper's setting (that of `april simulate`), 8 engines
    x 64 slots, 5 steps. torch: the built-in task on the tiny model, everything real (8 x 8 samples,
    over-sampling 16, 256 tokens, 32 slots, 10 steps, 32 held-out prompts)."""
    if engine == "sim":
        return paper_config(steps=5)
    model = str(TINY_MODEL)
    return Config(
        run=RunConfig(steps=10),
        algo=AlgoConfig(
            rollout_batch_size=8, over_sampling_batch_size=16, n_samples_per_prompt=8, max_new_tokens=256
        ),
        data=DataConfig(source="task", eval_size=32),
        worker=WorkerConfig(engine="torch", slots=32, model=model, reward="exact", torch_threads=1),
        learner=LearnerConfig(model=model, backend="deepspeed", lr=1e-4, torch_threads=2),
    )


@dataclass(frozen=True, slots=True)
class BenchRun:
    """One run of a bench: its label in bench.json (the mode's name, async-etaN or a variant's), mode and
    the fields set for it alone, applied to the base config last."""

    label: str
    mode: Mode
    overrides: Overrides = ()


def parse_variant(text: str, base: Config) -> BenchRun:
    """--variant LABEL:MODE[:section.key=value,...]: one more run, e.g. a mode with a policy option on."""
    label, _, rest = text.partition(":")
    mode_name, _, fields_ = rest.partition(":")
    label = label.strip()
    if not label or not label.replace("-", "").replace("_", "").isalnum():
        raise ConfigError(f"--variant {text!r}: expected LABEL:MODE[:section.key=value,...], LABEL a word")
    try:
        mode = Mode(mode_name.strip())
    except ValueError:
        raise ConfigError(
            f"--variant {text!r}: mode {mode_name.strip()!r}, expected sync, april or async"
        ) from None
    pairs = tuple(parse_override(f) for f in fields_.split(",") if f.strip())
    replace_fields(base, dict(pairs))  # checks every field now, in one line
    return BenchRun(label, mode, pairs)


def sweep_label(mode: Mode, point: tuple[tuple[str, str], ...]) -> str:
    """A swept run's label: its mode and each field's last name and value, e.g. april-prompt_order=issue."""
    return "-".join([mode.value, *(f"{key.rsplit('.', 1)[-1]}={value}" for key, value in point)])


@dataclass(frozen=True, slots=True)
class BenchSetting:
    engine: str  # sim | torch
    modes: tuple[Mode, ...]
    config: Config  # every run's config but its mode and fields (run.steps, algo, worker.slots, ...)
    workload: str  # what --workload named (a workload, spec or file)
    lengths: LengthSpec  # the response-length distribution (sim: drawn; torch: measured, for the figure)
    engines: int  # worker processes, one engine each
    time_scale: float = 1.0  # sim: wall seconds per simulated second
    real_learner: bool = False  # sim: train the model for real (DeepSpeed) instead of the simulated learner
    async_staleness: tuple[int, ...] = ()  # async once per bound (eta), labelled async-etaN; () = config's
    variants: tuple[BenchRun, ...] = ()  # more runs after the modes' (--variant)
    sweep: tuple[tuple[tuple[str, str], ...], ...] = ()  # --sweep points: each mode but sync once per point
    episodes: str = ""  # sim: what --episodes named ("": single-turn samples)

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ConfigError(f"--engine: got {self.engine!r}, expected one of {', '.join(ENGINES)}")

    @property
    def steps(self) -> int:
        return self.config.run.steps

    @property
    def model(self) -> str:
        """The model a real learner trains (torch, or sim with a real learner)."""
        return self.config.learner.model or str(TINY_MODEL)

    def runs(self) -> list[BenchRun]:
        """The runs, in order: one per mode, and async once per bound of `async_staleness` when it names
        more than one (so every ratio to sync is taken in one bench, against one sync run)."""
        out = []
        for mode in self.modes:
            if self.sweep and mode is not Mode.SYNC:
                out += [BenchRun(sweep_label(mode, point), mode, point) for point in self.sweep]
            elif mode is Mode.ASYNC and len(self.async_staleness) > 1:
                out += [
                    BenchRun(f"async-eta{eta}", mode, (("algo.max_staleness", str(eta)),))
                    for eta in self.async_staleness
                ]
            else:
                out.append(BenchRun(mode.value, mode))
        labels = [r.label for r in out]
        for v in self.variants:
            if v.label in labels:
                raise ConfigError(f"--variant {v.label}: a run with this label exists already")
            labels.append(v.label)
        return out + list(self.variants)

    def to_json(self) -> dict[str, object]:
        c = self.config
        a, w = c.algo, c.worker
        out: dict[str, object] = {
            "engine": self.engine,
            "workload": self.workload,
            **({"episodes": self.episodes} if self.episodes else {}),
            "lengths": self.lengths.describe(),
            "rollout_batch_size": a.rollout_batch_size,
            "over_sampling_batch_size": a.over_sampling_batch_size,
            "n_samples_per_prompt": a.n_samples_per_prompt,
            "max_new_tokens": a.max_new_tokens,
            "max_staleness": a.max_staleness,
            "async_staleness": list(self.async_staleness) or [a.max_staleness],
            "steps": c.run.steps,
            "seed": c.run.seed,
            "engines": self.engines,
            "slots": w.slots,
        }
        if self.engine == "sim":
            cost = w.sim_cost
            out.update(
                decode_ms=cost.decode_ms,
                decode_ms_per_seq=cost.decode_ms_per_seq,
                prefill_ms_per_token=cost.prefill_ms_per_token,
                prefix_cache_tokens=cost.prefix_cache_tokens,
                resume_kv=w.resume_kv.value,
                resume_affinity=a.resume_affinity,
                learner_step_s=c.learner.sim_step_s,
                prompt_len=c.data.synthetic_prompt_len_max,
                time_scale=self.time_scale,
                dataset_size=c.data.synthetic_size,
                prompt_corr=w.sim_prompt_corr,
            )
            out["learner"] = "real" if self.real_learner else "sim"
        if self.engine == "torch" or self.real_learner:
            out["model"] = self.model
        if self.variants:
            out["variants"] = {v.label: {"mode": v.mode.value, **dict(v.overrides)} for v in self.variants}
        return out


def run_config(setting: BenchSetting, bench_run: BenchRun, name: str) -> Config:
    """The `april up` config of one run (ports are the runner's): the base with the run's mode and fields,
    and what every benchmark run needs: every engine registered before the first lease (as simulated), no
    checkpoints, TensorBoard or rollout records (learner I/O the simulator does not model); sim: the sim
    engine with the workload and time scale, the simulated learner (or, with a real learner, the model on
    the sim engine's tokens); torch: one evaluation at the end (and the broker's baseline at v0, the same
    work in every mode) gives accuracy_final."""
    c = setting.config
    run = dataclasses.replace(c.run, name=name, mode=bench_run.mode, rollout_records=False)
    broker = dataclasses.replace(c.broker, min_workers=setting.engines)
    learner = dataclasses.replace(c.learner, checkpoint_every=0, tensorboard=False)
    worker, data = c.worker, c.data
    if setting.engine == "sim":
        worker = dataclasses.replace(
            worker, engine="sim", sim_lengths=setting.lengths.describe(), sim_time_scale=setting.time_scale
        )
        learner = dataclasses.replace(learner, backend="sim")
        if setting.real_learner:  # sim tokens the model can train on: its vocabulary, its tokenizer
            model = setting.model
            data = dataclasses.replace(data, synthetic_vocab_size=model_vocab_size(model))
            worker = dataclasses.replace(worker, model=model)
            learner = dataclasses.replace(learner, model=model, backend="deepspeed", lr=1e-4, torch_threads=2)
    else:
        worker = dataclasses.replace(worker, engine="torch")
        run = dataclasses.replace(run, eval_every=run.steps)
    config = dataclasses.replace(c, run=run, data=data, broker=broker, worker=worker, learner=learner)
    return replace_fields(config, dict(bench_run.overrides))


def sim_config(setting: BenchSetting, run: BenchRun) -> SimConfig:
    """The simulation of one run: the very config that run gets, on as many engines."""
    return SimConfig(run_config(setting, run, run.label), engines=setting.engines, per_sample_lengths=True)


def predict(setting: BenchSetting) -> dict[str, Figures]:
    """`april simulate`'s figures of the same runs, in simulated seconds (the same samples and episodes)."""
    by_mode = {}
    for r in setting.runs():
        cfg = sim_config(setting, r)
        by_mode[r.label] = simulate(
            cfg, setting.lengths, resolve_episodes(cfg.config, setting.lengths)
        ).figures
    return with_speedups(by_mode)


def choose_time_scale(predicted: dict[str, Figures], target_s: float) -> float:
    """Wall seconds per simulated second so that the slowest mode's run takes about `target_s`."""
    longest = max(f.wall_s for f in predicted.values())
    return target_s / longest if longest > 0 else 1.0
