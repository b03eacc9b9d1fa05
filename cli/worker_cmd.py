"""`april worker`: run one rollout worker process until SIGINT/SIGTERM (returning its leases)."""

from __future__ import annotations

from collections.abc import Callable

from actors.engine import Engine, SamplingParams
from actors.engines.sim_engine import Identify
from actors.factory import check_worker, make_engine, make_tokenizer
from actors.reward_runner import RewardRunner
from actors.worker import Worker
from april.config import Config, WorkerConfig
from april.keys import configured_client_keys
from cli.process import setup_logging, stop_requested

# (worker settings, sampling, the worker's sample identity hook, starting version) -> engine
EngineBuilder = Callable[[WorkerConfig, SamplingParams, Identify, int], Engine]


def run_worker(config: Config, build_engine: EngineBuilder = make_engine) -> None:
    """The worker process. `build_engine` is the configured engine's factory; tests give a scripted one
    so that a real worker process differs from `april worker` only in its engine."""
    setup_logging()
    cfg = config.worker
    curve = configured_client_keys(config.broker.curve_keys_dir)  # bad keys: one error line, before any load
    check_worker(cfg)  # an unknown engine would only fail at the first lease
    tokenizer = make_tokenizer(cfg)
    rewards = RewardRunner(cfg.reward, cfg.reward_timeout_s)
    worker: Worker

    def engine_factory(sampling: SamplingParams, version: int) -> Engine:
        return build_engine(cfg, sampling, worker.identify, version)

    worker = Worker(cfg, tokenizer, rewards, engine_factory, seed=config.run.seed, curve=curve)
    worker.run(stop_requested())
