"""What `april bench` runs: one setting, turned into the run config of each mode and the simulator's
prediction of the same runs.

Owns `BenchSetting` (workload, batch sizes, engines x slots, cost model, learner step, seed, steps),
`run_config` (the `Config` a mode's `april up` run gets: the same prompts, seed, engine settings and
number of steps in every mode; only `run.mode` differs) and, for `--engine sim`, `predict` (the same
setting in `broker.sim`'s virtual time, with each sample's length drawn exactly as the sim engine draws
it) and `choose_time_scale` (wall seconds per simulated second so the slowest mode takes about a target).
Starts nothing.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from actors.factory import model_vocab_size
from actors.lengths import LengthSpec
from april.config import (
    AlgoConfig,
    BrokerConfig,
    Config,
    ConfigError,
    DataConfig,
    LearnerConfig,
    Mode,
    ResumeKV,
    RunConfig,
    WorkerConfig,
    parse_override,
    replace_fields,
)
from april.engine_cost import EngineCost
from broker.sim.figures import Figures, with_speedups
from broker.sim.model import SimConfig, simulate

ENGINES = ("sim", "torch")


@dataclass(frozen=True, slots=True)
class BenchRun:
    """One run of a bench: its label in bench.json (the mode's name, async-etaN or a variant's), mode and
    settings; `overrides` ("section.key" -> value, as `--set` takes them) are applied to its config last."""

    label: str
    mode: Mode
    algo: AlgoConfig
    overrides: tuple[tuple[str, str], ...] = ()


def parse_variant(text: str, base: AlgoConfig) -> BenchRun:
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
    algo = replace_fields(Config(algo=base), dict(pairs)).algo  # checks every field now, in one line
    return BenchRun(label, mode, algo, pairs)


@dataclass(frozen=True, slots=True)
class BenchSetting:
    engine: str  # sim | torch
    modes: tuple[Mode, ...]
    steps: int
    workload: str  # what --workload named (a workload, spec or file; "task" for the built-in task)
    lengths: LengthSpec  # the response-length distribution (sim: drawn; torch: measured, for the figure)
    algo: AlgoConfig
    engines: int  # worker processes, one engine each
    slots: int
    seed: int = 0
    cost: EngineCost = dataclasses.field(default_factory=EngineCost)  # sim engine step cost
    learner_step_s: float = 20.0  # sim learner: simulated seconds per step
    prompt_len: int = 256  # sim: tokens of every prompt
    time_scale: float = 1.0  # sim: wall seconds per simulated second
    model: str = ""  # torch, or sim with real_learner: the model directory (workers and learner)
    real_learner: bool = False  # sim: train the model for real (DeepSpeed) instead of the simulated learner
    async_staleness: tuple[int, ...] = ()  # async once per bound (eta), labelled async-etaN; () = algo's
    variants: tuple[BenchRun, ...] = ()  # more runs after the modes' (--variant)
    dataset_size: int = 10000  # sim: prompts in the synthetic dataset (they recur every epoch)
    prompt_corr: float = 0.0  # sim: how much a length is its prompt's (april.sample_draw.LengthDraw)
    resume_kv: ResumeKV = ResumeKV.RECOMPUTE  # sim: the engines' prefix caches across a weight update

    def runs(self) -> list[BenchRun]:
        """The runs, in order: one per mode, and async once per bound of `async_staleness` when it names
        more than one (so every ratio to sync is taken in one bench, against one sync run)."""
        out = []
        for mode in self.modes:
            if mode is Mode.ASYNC and len(self.async_staleness) > 1:
                out += [
                    BenchRun(f"async-eta{eta}", mode, dataclasses.replace(self.algo, max_staleness=eta))
                    for eta in self.async_staleness
                ]
            else:
                eta = self.async_staleness[0] if self.async_staleness else self.algo.max_staleness
                out.append(BenchRun(mode.value, mode, dataclasses.replace(self.algo, max_staleness=eta)))
        labels = [r.label for r in out]
        for v in self.variants:
            if v.label in labels:
                raise ConfigError(f"--variant {v.label}: a run with this label exists already")
            labels.append(v.label)
        return out + list(self.variants)

    def __post_init__(self) -> None:
        if self.engine not in ENGINES:
            raise ValueError(f"--engine: got {self.engine!r}, expected one of {', '.join(ENGINES)}")

    def to_json(self) -> dict[str, object]:
        a = self.algo
        out: dict[str, object] = {
            "engine": self.engine,
            "workload": self.workload,
            "lengths": self.lengths.describe(),
            "rollout_batch_size": a.rollout_batch_size,
            "over_sampling_batch_size": a.over_sampling_batch_size,
            "n_samples_per_prompt": a.n_samples_per_prompt,
            "max_new_tokens": a.max_new_tokens,
            "max_staleness": a.max_staleness,
            "async_staleness": list(self.async_staleness) or [a.max_staleness],
            "steps": self.steps,
            "seed": self.seed,
            "engines": self.engines,
            "slots": self.slots,
        }
        if self.engine == "sim":
            out.update(
                decode_ms=self.cost.decode_ms,
                decode_ms_per_seq=self.cost.decode_ms_per_seq,
                prefill_ms_per_token=self.cost.prefill_ms_per_token,
                prefix_cache_tokens=self.cost.prefix_cache_tokens,
                resume_kv=self.resume_kv.value,
                resume_affinity=a.resume_affinity,
                learner_step_s=self.learner_step_s,
                prompt_len=self.prompt_len,
                time_scale=self.time_scale,
                dataset_size=self.dataset_size,
                prompt_corr=self.prompt_corr,
            )
            out["learner"] = "real" if self.real_learner else "sim"
        if self.engine == "torch" or self.real_learner:
            out["model"] = self.model
        if self.variants:
            out["variants"] = {v.label: {"mode": v.mode.value, **dict(v.overrides)} for v in self.variants}
        return out


def sim_config(setting: BenchSetting, run: BenchRun) -> SimConfig:
    return SimConfig(
        run.mode,
        run.algo,
        engines=setting.engines,
        slots=setting.slots,
        cost=setting.cost,
        learner_step_s=setting.learner_step_s,
        steps=setting.steps,
        prompt_len=setting.prompt_len,
        seed=setting.seed,
        per_sample_lengths=True,
        dataset_size=setting.dataset_size,
        prompt_corr=setting.prompt_corr,
        resume_kv=ResumeKV(dict(run.overrides).get("worker.resume_kv", setting.resume_kv)),
    )


def predict(setting: BenchSetting) -> dict[str, Figures]:
    """`april simulate`'s figures of the same runs, in simulated seconds (the same samples)."""
    by_mode = {r.label: simulate(sim_config(setting, r), setting.lengths).figures for r in setting.runs()}
    return with_speedups(by_mode)


def choose_time_scale(predicted: dict[str, Figures], target_s: float) -> float:
    """Wall seconds per simulated second so that the slowest mode's run takes about `target_s`."""
    longest = max(f.wall_s for f in predicted.values())
    return target_s / longest if longest > 0 else 1.0


def run_config(setting: BenchSetting, bench_run: BenchRun, name: str) -> Config:
    """The `april up` config of one run (ports are the runner's)."""
    return replace_fields(_base_config(setting, bench_run, name), dict(bench_run.overrides))


def _base_config(setting: BenchSetting, bench_run: BenchRun, name: str) -> Config:
    run = RunConfig(name=name, seed=setting.seed, steps=setting.steps, mode=bench_run.mode)
    broker = BrokerConfig(min_workers=setting.engines)  # every engine starts together, as simulated
    learner = LearnerConfig(checkpoint_every=0, tensorboard=False)
    if setting.engine == "sim":
        data = DataConfig(
            source="synthetic",
            synthetic_prompt_len_min=setting.prompt_len,
            synthetic_prompt_len_max=setting.prompt_len,
            synthetic_size=setting.dataset_size,
            eval_size=0,
        )
        worker = WorkerConfig(
            engine="sim",
            slots=setting.slots,
            reward="exact",
            sim_lengths=setting.lengths.describe(),
            sim_time_scale=setting.time_scale,
            sim_decode_ms=setting.cost.decode_ms,
            sim_decode_ms_per_seq=setting.cost.decode_ms_per_seq,
            sim_prefill_ms_per_token=setting.cost.prefill_ms_per_token,
            sim_prompt_corr=setting.prompt_corr,
            sim_prefix_cache_tokens=setting.cost.prefix_cache_tokens,
            resume_kv=setting.resume_kv,
        )
        learner = dataclasses.replace(learner, backend="sim", sim_step_s=setting.learner_step_s)
        if setting.real_learner:  # sim tokens the model can train on: its vocabulary, its tokenizer
            vocab = model_vocab_size(setting.model)
            data = dataclasses.replace(data, synthetic_vocab_size=vocab)
            worker = dataclasses.replace(worker, model=setting.model)
            learner = dataclasses.replace(
                learner, model=setting.model, backend="deepspeed", lr=1e-4, torch_threads=2
            )
        return Config(run=run, algo=bench_run.algo, data=data, broker=broker, worker=worker, learner=learner)
    # torch: the built-in task on the model, everything real; one evaluation at the end (and the
    # broker's baseline at v0, the same work in every mode) gives accuracy_final
    run = dataclasses.replace(run, eval_every=setting.steps)
    data = DataConfig(source="task", eval_size=32)
    worker = WorkerConfig(
        engine="torch", slots=setting.slots, model=setting.model, reward="exact", torch_threads=1
    )
    learner = dataclasses.replace(learner, model=setting.model, backend="deepspeed", lr=1e-4, torch_threads=2)
    return Config(run=run, algo=bench_run.algo, data=data, broker=broker, worker=worker, learner=learner)
