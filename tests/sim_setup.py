"""A simulated run's config for tests, by the few fields a test sets (the rest are the config's defaults).

`april simulate` reads a whole run config (`broker.sim.model.SimConfig.config`); tests name only what they
are about: the mode and algo, the cluster (engines x slots), the engines' cost, the learner's step, the
prompts and the run's length.
"""

from __future__ import annotations

from april.config import (
    AlgoConfig,
    Config,
    DataConfig,
    LearnerConfig,
    Mode,
    ResumeKV,
    RunConfig,
    WorkerConfig,
)
from april.sim.engine_cost import DEFAULT_COST, EngineCost
from broker.sim.model import SimConfig


def sim_config(
    mode: Mode,
    algo: AlgoConfig,
    *,
    engines: int = 8,
    slots: int = 64,
    cost: EngineCost = DEFAULT_COST,
    learner_step_s: float = 20.0,
    steps: int = 20,
    prompt_len: int = 256,
    seed: int = 0,
    dataset_size: int = 10000,
    prompt_corr: float = 0.0,
    resume_kv: ResumeKV = ResumeKV.RECOMPUTE,
    per_sample_lengths: bool = False,
    check_ledger_every_event: bool = False,
) -> SimConfig:
    config = Config(
        run=RunConfig(mode=mode, steps=steps, seed=seed),
        algo=algo,
        data=DataConfig(
            synthetic_prompt_len_min=prompt_len,
            synthetic_prompt_len_max=prompt_len,
            synthetic_size=dataset_size,
            eval_size=0,
        ),
        worker=WorkerConfig(
            engine="sim",
            slots=slots,
            sim_decode_ms=cost.decode_ms,
            sim_decode_ms_per_seq=cost.decode_ms_per_seq,
            sim_prefill_ms_per_token=cost.prefill_ms_per_token,
            sim_prefix_cache_tokens=cost.prefix_cache_tokens,
            sim_prompt_corr=prompt_corr,
            resume_kv=resume_kv,
        ),
        learner=LearnerConfig(backend="sim", sim_step_s=learner_step_s),
    )
    return SimConfig(config, engines, per_sample_lengths, check_ledger_every_event)
