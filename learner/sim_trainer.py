"""The simulated trainer (`learner.backend = "sim"`): the `learner.trainer.Trainer` of `april bench --engine
sim`, so the learner loop runs for real (exactly-N check, versions, publish, metrics.jsonl, checkpoint,
ack last, summary.json) with no model.

A step spends a step time from a cost model instead of computing gradients; publishing writes a small
real file standing for the version (`weights/v{N:06d}.sim.json`) with its true sha256, which the workers
verify and the sim engine "loads". Its whole state is the resume point itself, saved every step (a
checkpoint is free here) as `sim_learner.json`: `--resume` (april up restarts a crashed learner with it)
continues from there, the broker re-sends an unacked batch, and one already trained is only acked again.

Cost model, in simulated seconds, scaled to wall time by `worker.sim_time_scale` (one clock for the whole
simulated run, as the sim engine's decode steps):
    step_s = learner.sim_step_s + learner.sim_step_s_per_token x trained response tokens
which is `april simulate --learner-step-s L` when the per-token part is 0 (`broker.sim.model`: the
learner takes L per batch, the weights are published at its end). One process; imports no torch.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import numpy as np

from april import protocol
from april.config import Config
from april.files import sha256_file, write_text_atomic
from learner.trainer import BroadcastSend, PhaseReport, ResumePoint, TrainResult

KEEP_WEIGHTS = 3  # simulated weight files kept (the announced one and its predecessors)
STATE_FILE = "sim_learner.json"  # the simulated learner's checkpoint: step, version, last_batch_id


def sim_step_s(config: Config, batch: protocol.Batch) -> float:
    """Wall seconds the simulated step of `batch` takes."""
    lc = config.learner
    tokens = int(np.diff(batch.samples.response_offsets).sum())
    return (lc.sim_step_s + lc.sim_step_s_per_token * tokens) * config.worker.sim_time_scale


class SimTrainer:
    rank = 0
    world_size = 1
    vocab_size = None  # no model: any token id goes
    checkpoint_every = 1  # its checkpoint is one small file: every step, so a resume never trains again

    def __init__(self, config: Config, run_dir: Path) -> None:
        self.config = config
        self.state_file = run_dir / STATE_FILE

    def resume_point(self) -> ResumePoint | None:
        if not self.state_file.exists():
            return None
        state = json.loads(self.state_file.read_text(encoding="utf-8"))
        step, version, last = int(state["step"]), int(state["version"]), int(state["last_batch_id"])
        return ResumePoint(step, version, last, source=str(self.state_file))

    def start(self, report: PhaseReport) -> None:
        """Nothing to load."""

    def restore(self, point: ResumePoint) -> None:
        """The resume point is the whole state."""

    def train(self, batch: protocol.Batch, version: int) -> TrainResult:
        time.sleep(sim_step_s(self.config, batch))
        return TrainResult({"loss": 0.0})  # no model: no sample has a learner log-prob or advantage

    def publish(
        self, weights_dir: Path, version: int, broadcast: BroadcastSend | None = None
    ) -> tuple[Path, str]:
        """A small real file standing for `version`: (path, sha256). Keeps the newest few. Nothing to
        broadcast: there is no model."""
        weights_dir.mkdir(parents=True, exist_ok=True)
        path = weights_dir / f"v{version:06d}.sim.json"
        write_text_atomic(path, json.dumps({"version": version, "simulated": True}) + "\n")
        for old in sorted(weights_dir.glob("v*.sim.json"))[:-KEEP_WEIGHTS]:
            old.unlink(missing_ok=True)
        return path, sha256_file(path)

    def close(self) -> None:
        pass  # one process, nothing shared

    def save(self, point: ResumePoint) -> None:
        state = {"step": point.step, "version": point.version, "last_batch_id": point.last_batch_id}
        write_text_atomic(self.state_file, json.dumps(state) + "\n")
