"""The simulated learner (`learner.backend = "sim"`): the real learner's protocol and files, no model.

For `april bench --engine sim`: it takes batches from the real broker exactly as `learner.loop` does
(exactly-N check included), spends a step time from a cost model instead of computing gradients,
publishes weights version v+1 as a small real file with its true sha256 (the workers verify it and the
sim engine "loads" it), writes the same metrics.jsonl lines and summary.json, and acks the batch last.
Its whole state (step, version, last batch id) is `sim_learner.json`, written before each ack as the real
learner checkpoints before it: `--resume` (april up restarts a crashed learner with it) continues from
there, the broker re-sends an unacked batch, and one already trained is only acked again.

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
from april.files import sha256_file, write_text_atomic
from april.keys import configured_client_keys
from learner.client import BrokerClient, check_batch
from learner.metrics import MetricsLog, ack_metrics, forget_steps_from, step_record, write_summary

log = logging.getLogger("april.learner")
KEEP_WEIGHTS = 3  # simulated weight files kept (the announced one and its predecessors)
STATE_FILE = "sim_learner.json"  # the simulated learner's checkpoint: step, version, last_batch_id


def sim_step_s(config: Config, batch: protocol.Batch) -> float:
    """Wall seconds the simulated step of `batch` takes."""
    lc = config.learner
    tokens = int(np.diff(batch.samples.response_offsets).sum())
    return (lc.sim_step_s + lc.sim_step_s_per_token * tokens) * config.worker.sim_time_scale


def publish_sim_weights(weights_dir: Path, version: int) -> tuple[Path, str]:
    """A small real file standing for version `version`: (path, sha256). Keeps the newest few."""
    weights_dir.mkdir(parents=True, exist_ok=True)
    path = weights_dir / f"v{version:06d}.sim.json"
    write_text_atomic(path, json.dumps({"version": version, "simulated": True}) + "\n")
    for old in sorted(weights_dir.glob("v*.sim.json"))[:-KEEP_WEIGHTS]:
        old.unlink(missing_ok=True)
    return path, sha256_file(path)


def load_state(run_dir: Path) -> tuple[int, int, int]:
    """(step, version, last_batch_id) saved by the last acked-or-about-to-be-acked step; zeros if none."""
    path = run_dir / STATE_FILE
    if not path.exists():
        return 0, 0, -1
    state = json.loads(path.read_text(encoding="utf-8"))
    return int(state["step"]), int(state["version"]), int(state["last_batch_id"])


def save_state(run_dir: Path, step: int, version: int, last_batch_id: int) -> None:
    state = {"step": step, "version": version, "last_batch_id": last_batch_id}
    write_text_atomic(run_dir / STATE_FILE, json.dumps(state) + "\n")


def run_sim_learner(config: Config, run_dir: Path, resume: bool, should_stop: Callable[[], bool]) -> None:
    """Train run.steps simulated steps (or until stopped), from the saved state when resuming."""
    algo = config.algo
    step, version, last_batch_id = load_state(run_dir) if resume else (0, 0, -1)
    if resume:
        log.info("resumed: step %d, version %d", step, version)
        forget_steps_from(run_dir / "metrics.jsonl", step)
    curve = configured_client_keys(config.broker.curve_keys_dir)  # CurveZMQ keys when the broker needs them
    client = BrokerClient(config.learner.broker, version, last_batch_id, curve=curve)
    metrics = MetricsLog(run_dir / "metrics.jsonl")
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
            metrics.append(record)
            step, version = step + 1, version + 1
            save_state(run_dir, step, version, batch.batch_id)
            client.ack(batch.batch_id, ack_metrics(record))  # last, as the real learner (learner.loop)
            log.info("step %d (simulated): %d samples, v%d published", step, len(batch.samples), version)
    finally:
        client.close()
        metrics.close()
    write_summary(run_dir, run_dir / "metrics.jsonl")
