"""`april worker`: run one rollout worker process until SIGINT/SIGTERM (returning its leases)."""

from __future__ import annotations

import logging
import signal
import sys
from types import FrameType

from actors.factory import make_engine, make_tokenizer
from actors.reward_runner import RewardRunner
from actors.worker import Worker
from april.config import Config


def run_worker(config: Config) -> None:
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    cfg = config.worker
    tokenizer = make_tokenizer(cfg)
    rewards = RewardRunner(cfg.reward, cfg.reward_timeout_s)
    worker: Worker

    def engine_factory(sampling, version):  # type: ignore[no-untyped-def]
        return make_engine(cfg, sampling, worker.identify, version)

    worker = Worker(cfg, tokenizer, rewards, engine_factory, seed=config.run.seed)
    stopping = False

    def stop(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    worker.run(lambda: stopping)
