"""`april worker`: run one rollout worker process until SIGINT/SIGTERM (returning its leases)."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path

from actors.engine import Engine, SamplingParams
from actors.engines.sim_engine import Identify
from actors.episode_driver import open_episode_driver
from actors.factory import check_worker, make_engine, make_tokenizer, on_device
from actors.reward_runner import RewardRunner
from actors.sim_tools import SimTools, episode_plans
from actors.worker import Worker
from april.config import Config, WeightsTransport, WorkerConfig
from april.keys import ClientKeys, configured_client_keys, weights_client_keys
from cli.process import setup_logging, stop_requested

# (worker settings, sampling, the worker's sample identity hook, starting version) -> engine
EngineBuilder = Callable[[WorkerConfig, SamplingParams, Identify, int], Engine]


def run_worker(config: Config, build_engine: EngineBuilder | None = None) -> None:
    """The worker process. `build_engine` is the configured engine's factory (default `make_engine`, with
    the episode plans of `env.name = "sim"`); tests give a scripted one so that a real worker process
    differs from `april worker` only in its engine."""
    setup_logging()
    cfg = config.worker
    curve = configured_client_keys(config.broker.curve_keys_dir)  # bad keys: one error line, before any load
    weights_keys = configured_weights_keys(config)
    check_worker(cfg)  # an unknown engine would only fail at the first lease
    cfg = on_device(cfg)  # "auto" resolved; a GPU torch sees and cannot use is one line, before connecting
    tokenizer = make_tokenizer(cfg)
    plans = episode_plans(config)  # env.name = "sim": the episodes the sim engine and tools play
    sim = None if plans is None else SimTools(plans, cfg.sim_time_scale, cfg.sim_tool_repeatable)
    # a bad env.name: one error line, exit 2
    episodes = open_episode_driver(config.env, tokenizer, cfg.slots, sim=sim)
    build = build_engine or functools.partial(make_engine, plans=plans)
    rewards = RewardRunner(cfg.reward, cfg.reward_timeout_s)
    worker: Worker

    def engine_factory(sampling: SamplingParams, version: int) -> Engine:
        return build(cfg, sampling, worker.identify, version)

    worker = Worker(
        cfg,
        tokenizer,
        rewards,
        engine_factory,
        seed=config.run.seed,
        curve=curve,
        weights=config.weights,
        weights_keys=weights_keys,
        episodes=episodes,
    )
    worker.run(stop_requested())


def configured_weights_keys(config: Config) -> ClientKeys | None:
    """CURVE keys for the learner's weight service (None: no CURVE, or transport file, which never
    fetches). A key directory without weights.key is one error line, before anything loads."""
    keys_dir = config.broker.curve_keys_dir
    if not keys_dir or config.weights.transport == WeightsTransport.FILE:
        return None
    return weights_client_keys(Path(keys_dir))
