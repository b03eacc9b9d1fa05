"""One line of `metrics.jsonl` per learner step: the public contract of docs/design.md section 7.

`step_record` joins the three sources of a step's figures: the batch itself (rewards, lengths,
staleness, tokens), the broker's figures that came with it (`Batch.stats`, `Batch.ledger`, including the
latest evaluation on the held-out prompts) and the learner's own (loss and its statistics, timings).
`MetricsLog` appends the lines and is the only writer of the file; given a directory it also writes every
numeric field as a TensorBoard scalar, when `tensorboard` is installed, and given a config with
`learner.wandb_project` it logs them to wandb (`learner.wandb_sink`), each with the step's few samples
as a table when given one (`SamplesTable`, made by `learner.step_records`). The learner hands in plain
numbers; torch is imported only for TensorBoard's writer and wandb only for its run, inside `MetricsLog`.
`ack_metrics` (the figures relayed with a BatchAck) and `write_summary` (summary.json) serve both
learners, real and simulated.
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from april import protocol
from april.config import Config
from april.failures import STATS_PREFIX
from april.files import read_jsonl, write_json, write_text_atomic
from april.weights_uri import WORKER_SYNC_STATS
from learner.wandb_sink import WandbRun  # wandb itself is imported only when a WandbRun is opened

log = logging.getLogger("april.learner")

REQUIRED = (
    "step", "version", "mode", "time", "step_time_s", "samples", "groups", "tokens_generated",
    "tokens_trained", "samples_per_s", "tokens_per_s", "aborted", "resumed", "partial_buffer", "in_flight",
    "offpolicy_token_frac", "staleness_max", "staleness_mean", "reward_mean", "accuracy",
    "response_len_mean", "response_len_p99", "response_len_max", "slot_utilization", "learner_time_s",
    "weight_sync_s", "loss", "ledger", "errors", "eval_accuracy", "eval_version",
)  # fmt: skip

SAMPLES_TAG = "rollouts/samples"  # the step's few samples, on TensorBoard (text) and wandb (a table)

USAGE_INTEGRALS = (
    "busy_phase_slot_s", "phase_slot_s", "free_engine_s", "engine_s", "model_busy_s", "reprefill_s",
    "stale_kv_tokens",
)  # fmt: skip


@dataclass(frozen=True, slots=True)
class SamplesTable:
    """A few of a step's samples, for the trackers: column names and one list of values per sample."""

    columns: list[str]
    rows: list[list[Any]]

    def markdown(self) -> str:
        """The table as Markdown (TensorBoard's text tab renders it), cells on one line each."""

        def cell(value: Any) -> str:
            text = f"{value:.4g}" if isinstance(value, float) else str(value)
            return text.replace("|", "\\|").replace("\n", " ")

        lines = ["| " + " | ".join(self.columns) + " |", "|" + "---|" * len(self.columns)]
        lines += ["| " + " | ".join(cell(v) for v in row) + " |" for row in self.rows]
        return "\n".join(lines)


def step_record(
    *,
    step: int,
    version: int,
    mode: str,
    batch: protocol.Batch,
    step_time_s: float,
    learner_time_s: float,
    weight_sync_s: float,
    train: dict[str, float],
    weights_transport: str = "",
) -> dict[str, Any]:
    """The metrics line of one step. `train` holds the learner's figures (loss, clip_frac, ...)."""
    samples = batch.samples
    lengths = np.diff(samples.response_offsets)
    rewards = samples.reward
    stats = batch.stats
    tokens_trained = samples.model_tokens  # an episode's observations are context, not trained on
    tokens_generated = int(stats.get("tokens_generated", tokens_trained))
    record: dict[str, Any] = {
        "step": step,
        "version": version,
        "mode": mode,
        "time": time.time(),
        "step_time_s": step_time_s,
        "samples": len(samples),
        "groups": len(set(samples.group_id.tolist())),
        "tokens_generated": tokens_generated,
        "tokens_trained": tokens_trained,
        "samples_per_s": len(samples) / step_time_s if step_time_s > 0 else 0.0,
        "tokens_per_s": tokens_generated / step_time_s if step_time_s > 0 else 0.0,
        "aborted": int(stats.get("aborted", 0)),
        "resumed": int(stats.get("resumed", 0)),
        "partial_buffer": int(stats.get("partial_buffer", 0)),
        "in_flight": int(stats.get("in_flight", 0)),
        "offpolicy_token_frac": float(stats.get("offpolicy_token_frac", 0.0)),
        "staleness_max": float(stats.get("staleness_max", 0.0)),
        "staleness_mean": float(stats.get("staleness_mean", 0.0)),
        "reward_mean": float(rewards.mean()) if len(samples) else 0.0,
        "accuracy": float((rewards > 0).mean()) if len(samples) else 0.0,  # binary-reward tasks: reward > 0
        "response_len_mean": float(lengths.mean()) if len(samples) else 0.0,
        "response_len_p99": float(np.percentile(lengths, 99)) if len(samples) else 0.0,
        "response_len_max": int(lengths.max()) if len(samples) else 0,
        "slot_utilization": float(stats.get("slot_utilization", float("nan"))),
        "bubble_frac": float(stats.get("bubble_frac", float("nan"))),
        # the workers' slot integrals behind the two ratios (seconds; broker.usage), summable over steps
        **{k: float(stats.get(k, 0.0)) for k in USAGE_INTEGRALS},
        "run_s": float(stats.get("run_s", float("nan"))),  # batch formed, seconds after the first lease
        "rollout_s": float(stats.get("rollout_s", 0.0)),
        "learner_time_s": learner_time_s,
        "weight_sync_s": weight_sync_s,
        "weights_transport": weights_transport,  # weights.transport: how versions were offered (section 6)
        # the workers serving the version this batch's round ran on, how their weights came, the slowest
        # one's seconds from hearing of the version to serving it (the broker's WeightsLoaded reports)
        **{k: float(stats.get(k, 0.0)) for k in WORKER_SYNC_STATS},
        "loss": float(train.get("loss", float("nan"))),
        "ledger": batch.ledger.to_json(),
        # samples that settled with an error since the previous batch, by reason (april.failures)
        "errors": {
            k.removeprefix(STATS_PREFIX): int(v) for k, v in stats.items() if k.startswith(STATS_PREFIX)
        },
        # the broker's latest evaluation on the held-out prompts (greedy, at eval_version); none yet: NaN, -1
        "eval_accuracy": float(stats.get("eval_accuracy", float("nan"))),
        "eval_reward_mean": float(stats.get("eval_reward_mean", float("nan"))),
        "eval_version": int(stats.get("eval_version", -1)),
    }
    record.update({f"learner/{k}": v for k, v in train.items() if k != "loss"})
    return record


class MetricsLog:
    """Appends one JSON object per line to RUN_DIR/metrics.jsonl (flushed and fsynced per line, so a
    crash never leaves a torn line that a resumed run would append after), and mirrors each line to the
    optional sinks. With `tensorboard_dir` (the learner passes RUN_DIR/tensorboard), every numeric field of
    a line is also a TensorBoard scalar `learner/<name>` at global step `step` (nested fields as
    `learner/ledger/issued`, NaN skipped); without the `tensorboard` package that part is skipped, said
    once in the log. With a `config` whose `learner.wandb_project` is set, the same fields go to the run
    directory's wandb run under their metrics.jsonl names (`learner.wandb_sink`); wandb is imported only
    then, and its absence is a one-line ConfigError here, before the first step."""

    def __init__(self, path: Path, tensorboard_dir: Path | None = None, config: Config | None = None) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        self._tensorboard: Any = None  # torch.utils.tensorboard.SummaryWriter
        self._wandb: WandbRun | None = None
        if tensorboard_dir is not None:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as exc:
                log.info("no TensorBoard events: %s (pip install tensorboard)", exc)
            else:
                self._tensorboard = SummaryWriter(log_dir=str(tensorboard_dir))
        if config is not None and config.learner.wandb_project:
            last = self.last_step()
            self._wandb = WandbRun(path.parent, config, next_step=0 if last is None else last + 1)

    @property
    def has_sinks(self) -> bool:
        """Whether anything but metrics.jsonl takes the lines (TensorBoard, wandb)."""
        return self._tensorboard is not None or self._wandb is not None

    def append(self, record: dict[str, Any], samples: SamplesTable | None = None) -> None:
        """Append `record`'s line and mirror it to the sinks, with `samples` as the table `rollouts/samples`
        at the same step."""
        missing = [k for k in REQUIRED if k not in record]
        if missing:
            raise ValueError(f"metrics record lacks {missing}")
        line = json.dumps(record, allow_nan=True) + "\n"
        with open(self.path, "a") as f:
            f.write(line)
            f.flush()
            os.fsync(f.fileno())
        step = int(record["step"])
        if self._tensorboard is not None:
            for name, value in scalars(record):
                self._tensorboard.add_scalar(name, value, step)
            if samples is not None and samples.rows:
                self._tensorboard.add_text(SAMPLES_TAG, samples.markdown(), step)
            self._tensorboard.flush()  # a step's events are on disk with its line
        if self._wandb is not None:
            tables = {SAMPLES_TAG: samples} if samples is not None and samples.rows else {}
            self._wandb.log(step, dict(numeric_fields(record)), tables)

    def close(self) -> None:
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None
        if self._wandb is not None:
            self._wandb.close()
            self._wandb = None

    def last_step(self) -> int | None:
        """The step of the last complete line (resume appends after it)."""
        if not self.path.exists():
            return None
        last = None
        for line in self.path.read_text().splitlines():
            try:
                last = int(json.loads(line)["step"])
            except (ValueError, KeyError):
                break
        return last


def numeric_fields(record: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, int | float]]:
    """(name, value) for every finite number in a metrics record but `step` (the x axis) and `time` (the
    loggers keep their own wall clock), nested dicts flattened with "/" (`ledger/dropped/failed`); names
    and values as in metrics.jsonl. Bools, strings and NaN (no evaluation yet) are left out."""
    for key, value in record.items():
        if not prefix and key in ("step", "time"):
            continue
        if isinstance(value, dict):
            yield from numeric_fields(value, f"{prefix}{key}/")
        elif isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
            yield prefix + key, value


def scalars(record: dict[str, Any]) -> Iterator[tuple[str, float]]:
    """(TensorBoard tag, value) for each of `numeric_fields`, under `learner/`. Keys already namespaced by
    the learner (`learner/clip_frac`) keep their name."""
    for name, value in numeric_fields(record):
        yield (name if name.startswith("learner/") else "learner/" + name), float(value)


def ack_metrics(record: dict[str, Any]) -> dict[str, float]:
    """The numeric figures of a metrics line, for the broker's status feed (bounded in count)."""
    numeric = {
        k: float(v)
        for k, v in record.items()
        if isinstance(v, int | float) and not isinstance(v, bool) and len(k) <= 64
    }
    return dict(list(numeric.items())[: protocol.MAX_ACK_METRICS])


def write_summary(run_dir: Path, metrics_path: Path) -> None:
    """summary.json: totals and throughput over the run's metrics lines, and the last line's ledger (taken
    as its batch was formed: that batch's groups are still complete_waiting)."""
    lines = read_jsonl(metrics_path)
    if not lines:
        return
    wall = sum(x["step_time_s"] for x in lines)
    summary = {
        "steps": len(lines),
        "final_version": lines[-1]["version"],
        "ledger": lines[-1]["ledger"],
        "samples_trained": sum(x["samples"] for x in lines),
        "tokens_trained": sum(x["tokens_trained"] for x in lines),
        "tokens_generated": sum(x["tokens_generated"] for x in lines),
        "wall_s": wall,
        "samples_per_s": sum(x["samples"] for x in lines) / wall if wall else 0.0,
        "reward_mean_first": lines[0]["reward_mean"],
        "reward_mean_last": lines[-1]["reward_mean"],
    }
    write_json(run_dir / "summary.json", summary)


def forget_steps_from(path: Path, step: int) -> None:
    """Drop the metrics lines of steps >= `step`: a resumed learner trains them again (atomic rewrite)."""
    if not path.exists():
        return
    lines = path.read_text(encoding="utf-8").splitlines(keepends=True)
    kept = [x for x in lines if x.strip() and json.loads(x)["step"] < step]
    if len(kept) == len(lines):
        return
    log.info("metrics.jsonl: %d lines of steps >= %d dropped (trained again)", len(lines) - len(kept), step)
    write_text_atomic(path, "".join(kept))
