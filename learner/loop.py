"""The learner process: one loop, top to bottom, whatever trains (docs/learner.md).

For each step: wait for the batch (exactly N samples in complete groups), train on it, publish weights
version v+1 and announce them, append the metrics line and queue the step's rollout records, checkpoint
every `checkpoint_every` steps (once the records queued so far are on disk), and ack the batch last (so a
crash never leaves a batch acked but not in the checkpoint when checkpointing every step). What trains is
a `learner.trainer.Trainer`: a real model (`learner.model_trainer`) or the cost model of `april bench
--engine sim` (`learner.sim_trainer`), so both run this same loop.

Under a launcher (torchrun, deepspeed) every rank runs the loop; rank 0 alone talks to the broker and
writes weights and metrics, and shares each batch. Rank 0 connects before the model loads, so the broker
(and the dashboard) hear what the learner is doing while it starts (`learner.phases`).
`--resume` restarts from the latest saved point; the broker re-sends any batch it still holds, and
`last_batch_id` makes sure a trained batch is never trained again.
Weights reach workers by `weights.transport` (docs/design.md section 6): rank 0's `learner.handoff`
serves them (the weight service, and the broadcast hub with transport broadcast), says what each
version's announcement names, and after the last step keeps serving until the workers have it.
Composes the pieces; owns none of their logic. Imports no torch (the simulated learner runs without it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from april import protocol
from april.config import AlgoConfig, Config
from april.failures import RunFailed
from april.keys import configured_client_keys
from learner.client import BatchError, BrokerClient, check_batch
from learner.group_rewards import GroupRewards, group_rewards
from learner.handoff import WeightsHandOff
from learner.metrics import MetricsLog, ack_metrics, forget_steps_from, step_record, write_summary
from learner.phases import PhaseClock
from learner.ranks import share_batch
from learner.step_records import StepRecords, open_step_records
from learner.trainer import FRESH, ResumePoint, Trainer

log = logging.getLogger("april.learner")
Phase = protocol.LearnerPhase


def make_trainer(config: Config, run_dir: Path) -> Trainer:
    """The trainer `learner.backend` names; only the real one imports torch."""
    if config.learner.backend == "sim":
        from learner.sim_trainer import SimTrainer

        return SimTrainer(config, run_dir)
    from learner.model_trainer import ModelTrainer

    return ModelTrainer(config, run_dir)


def run_learner(
    config: Config,
    run_dir: Path,
    resume: bool,
    should_stop: Callable[[], bool],
    trainer: Trainer | None = None,
) -> None:
    """Train run.steps steps (or until stopped). Every rank runs this; only rank 0 talks to the broker,
    writes weights and metrics; the others get each batch from it (`learner.ranks.share_batch`)."""
    trainer = trainer if trainer is not None else make_trainer(config, run_dir)
    lc, algo = config.learner, config.algo
    leader = trainer.rank == 0
    saved_point = trainer.resume_point() if resume else None
    point = saved_point or FRESH
    handoff = WeightsHandOff.open(config, run_dir) if leader else None
    try:
        client = connect(config, point) if leader else None
    except BaseException:
        if handoff is not None:
            handoff.close()
        raise
    phases = PhaseClock(client.report_phase if client is not None else None)
    metrics: MetricsLog | None = None
    records: StepRecords | None = None
    rescoring: GroupRewards | None = None  # rank 0, an environment scoring whole groups
    try:
        trainer.start(phases.enter)
        if saved_point is not None:
            phases.enter(Phase.RESTORING_CHECKPOINT, point.source)
            trainer.restore(point)
            log.info("resumed from %s: step %d, version %d", point.source, point.step, point.version)
        if leader:
            if resume:
                forget_steps_from(run_dir / "metrics.jsonl", point.step)
            # the simulated learner writes no TensorBoard events: its writer would import torch
            events = run_dir / "tensorboard" if lc.tensorboard and lc.backend != "sim" else None
            metrics = MetricsLog(run_dir / "metrics.jsonl", events, config=config)
            records = open_step_records(config, run_dir, point.step, resume)
            rescoring = group_rewards(config)
        step, version, last_batch_id, saved = point.step, point.version, point.last_batch_id, point.step
        while step < config.run.steps:
            started = time.monotonic()
            phases.enter(Phase.WAITING_FOR_BATCH, f"step {step + 1}")
            batch = None
            if client is not None:
                batch = receive_batch(client, trainer, step, should_stop, algo)
                if batch is not None and rescoring is not None:
                    batch = rescoring.rescore(batch)
            if trainer.world_size > 1:
                batch = share_batch(batch, config.broker.max_message_bytes)
            if batch is None:
                break
            version = catch_up(version, batch.version, step)
            waited = time.monotonic()
            phases.enter(Phase.TRAINING, f"step {step + 1}, {len(batch.samples)} samples")
            trained = trainer.train(batch, version)
            computed = time.monotonic()
            phases.enter(Phase.PUBLISHING_WEIGHTS, f"v{version + 1}")
            broadcast = handoff.broadcast if handoff is not None else None
            published = trainer.publish(run_dir / "weights", version + 1, broadcast)
            acked: dict[str, float] | None = None  # the figures the ack carries (rank 0)
            if client is not None and metrics is not None and published is not None and handoff is not None:
                path, sha = published
                client.publish(version + 1, handoff.uri(path), sha)
                announced = time.monotonic()
                record = step_record(
                    step=step,
                    version=version + 1,
                    mode=config.run.mode.value,
                    batch=batch,
                    step_time_s=announced - started,
                    learner_time_s=computed - waited,
                    weight_sync_s=announced - computed,
                    train={
                        **trained.metrics,
                        **handoff.figures(),
                        **(rescoring.figures() if rescoring is not None else {}),
                        "wait_s": waited - started,
                    },
                    weights_transport=config.weights.transport.value,
                )
                acked = ack_metrics(record)
                shown = None
                if records is not None:
                    records.submit(step, version, batch, trained.samples)
                    if metrics.has_sinks:
                        shown = records.table(version, batch, trained.samples)
                metrics.append(record, shown)
                log_step(record)
            step, version, last_batch_id = step + 1, version + 1, batch.batch_id
            if trainer.checkpoint_every and step % trainer.checkpoint_every == 0:
                phases.enter(Phase.CHECKPOINTING, f"step {step}")
                if records is not None:  # a checkpointed step is never trained again: its records stay
                    records.flush()
                trainer.save(ResumePoint(step, version, batch.batch_id))
                saved = step
            if client is not None and acked is not None:
                # acked last: a crash before this line trains the batch again from the last checkpoint (the
                # broker still holds it); one after it finds the step in the checkpoint and metrics.jsonl
                client.ack(batch.batch_id, acked)
            phases.first_step_done()
        # stopped (or finished) between checkpoints: save one, so --resume loses nothing
        if trainer.checkpoint_every and saved < step:
            phases.enter(Phase.CHECKPOINTING, f"step {step}")
            if records is not None:
                records.flush()
            trainer.save(ResumePoint(step, version, last_batch_id))
        trainer.close()  # every rank got here: the last collective is behind them
        if client is not None and handoff is not None and step >= config.run.steps:
            handoff.serve_last(client, version)
    finally:
        if client is not None:
            client.close()
        if handoff is not None:
            handoff.close()
        if metrics is not None:
            metrics.close()
        if records is not None:
            records.close()  # what is queued is written: those steps' metrics lines are there
    if leader:
        write_summary(run_dir, run_dir / "metrics.jsonl")


def connect(config: Config, point: ResumePoint) -> BrokerClient:
    """Rank 0's connection to the broker, registered at the version and last batch of `point`."""
    curve = configured_client_keys(config.broker.curve_keys_dir)  # CurveZMQ keys when the broker needs them
    return BrokerClient(config.learner.broker, point.version, point.last_batch_id, curve=curve)


def receive_batch(
    client: BrokerClient, trainer: Trainer, step: int, should_stop: Callable[[], bool], algo: AlgoConfig
) -> protocol.Batch | None:
    """Rank 0: the next batch, checked against the exactly-N contract; None when stopping.

    A broken batch is reported and not trained, and a run the broker stopped (`RunFailed`: its samples
    all failed alike) ends here: either way the other ranks are told to stop before the error propagates,
    so no rank waits forever for a batch that will not come.
    """
    if should_stop():
        return None
    try:
        batch = client.next_batch(step, should_stop)
        if batch is None:
            return None
        check_batch(batch, algo.samples_per_batch, algo.n_samples_per_prompt, trainer.vocab_size)
    except (BatchError, RunFailed) as exc:
        if isinstance(exc, BatchError):
            log.error("the broker broke the batch contract; not training it: %s", exc)
        if trainer.world_size > 1:
            share_batch(None, 0)
        raise
    return batch


def catch_up(version: int, broker_version: int, step: int) -> int:
    """The version this step trains from: the broker's when it is ahead (resumed from a checkpoint older
    than the last published weights), so published versions never go back."""
    if broker_version <= version:
        return version
    log.warning(
        "the broker is at v%d, this learner at v%d (resumed from step %d): the steps since that checkpoint "
        "are lost; publishing from v%d on",
        broker_version,
        version,
        step,
        broker_version + 1,
    )
    return broker_version


def log_step(record: dict[str, Any]) -> None:
    log.info(
        "step %d: loss %.4f, reward %.3f, accuracy %.3f, v%d published",
        record["step"] + 1,
        record["loss"],
        record["reward_mean"],
        record["accuracy"],
        record["version"],
    )
