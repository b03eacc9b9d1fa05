"""The simulated learner (`learner.backend = "sim"`): the real learner's protocol and files, no model.

For `april bench --engine sim`: it takes batches from the real broker exactly as `learner.loop` does
(exactly-N check included), spends a step time from a cost model instead of computing gradients,
publishes weights version v+1 as a small real file with its true sha256 (the workers verify it and the
sim engine "loads" it), acks the batch and writes the same metrics.jsonl lines and summary.json.

Cost model, in simulated seconds, scaled to wall time by `worker.sim_time_scale` (one clock for the whole
simulated run, as the sim engine's decode steps):
    step_s = learner.sim_step_s + learner.sim_step_s_per_token x trained response tokens
which is `april simulate --learner-step-s L` when the per-token part is 0 (`broker.sim.model`: the
learner takes L per batch, the weights are published at its end). Imports no torch.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from april import protocol
from april.config import Config
from april.files import sha256_file
from april.keys import configured_client_keys
from learner.client import BrokerClient, check_batch
from learner.metrics import MetricsLog, ack_metrics, step_record, write_summary

log = logging.getLogger("april.learner")
KEEP_WEIGHTS = 3  # simulated weight files kept (the announced one and its predecessors)


def sim_step_s(config: Config, batch: protocol.Batch) -> float:
    """Wall seconds the simulated step of `batch` takes."""
    lc = config.learner
    tokens = int(np.diff(batch.samples.response_offsets).sum())
    return (lc.sim_step_s + lc.sim_step_s_per_token * tokens) * config.worker.sim_time_scale


def publish_sim_weights(weights_dir: Path, version: int) -> tuple[Path, str]:
    """A small real file standing for version `version`: (path, sha256). Keeps the newest few."""
    weights_dir.mkdir(parents=True, exist_ok=True)
    path = weights_dir / f"v{version:06d}.sim.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"version": version, "simulated": True}) + "\n", encoding="utf-8")
    tmp.replace(path)
    for old in sorted(weights_dir.glob("v*.sim.json"))[:-KEEP_WEIGHTS]:
        old.unlink(missing_ok=True)
    return path, sha256_file(path)


def run_sim_learner(config: Config, run_dir: Path, should_stop: Callable[[], bool]) -> None:
    """Train run.steps simulated steps (or until stopped); always from step 0 (nothing to resume)."""
    algo = config.algo
    curve = configured_client_keys(config.broker.curve_keys_dir)  # CurveZMQ keys when the broker needs them
    client = BrokerClient(config.learner.broker, 0, curve=curve)
    metrics = MetricsLog(run_dir / "metrics.jsonl")
    step = version = 0
    try:
        while step < config.run.steps and not should_stop():
            started = time.monotonic()
            batch = client.next_batch(step, should_stop)
            if batch is None:
                break
            check_batch(batch, algo.samples_per_batch, algo.n_samples_per_prompt)
            version = max(version, batch.version)
            waited = time.monotonic()
            time.sleep(sim_step_s(config, batch))
            computed = time.monotonic()
            path, sha = publish_sim_weights(run_dir / "weights", version + 1)
            client.publish(version + 1, path.resolve().as_uri(), sha)
            published = time.monotonic()
            record = step_record(
                step=step,
                version=version + 1,
                mode=config.run.mode.value,
                batch=batch,
                step_time_s=published - started,
                learner_time_s=computed - waited,
                weight_sync_s=published - computed,
                train={"loss": 0.0, "wait_s": waited - started},
            )
            client.ack(batch.batch_id, ack_metrics(record))
            metrics.append(record)
            log.info(
                "step %d (simulated): %d samples, v%d published", step + 1, len(batch.samples), version + 1
            )
            step, version = step + 1, version + 1
    finally:
        client.close()
        metrics.close()
    write_summary(run_dir, run_dir / "metrics.jsonl")
