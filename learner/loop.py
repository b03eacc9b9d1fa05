"""The learner process: one loop, top to bottom, as in DESIGN.md section 2.

For each step: wait for the batch (exactly N samples in complete groups), train on it, publish weights
version v+1 (safetensors, atomic, sha256) and announce them, append the metrics line, checkpoint every
`checkpoint_every` steps, and ack the batch last (so a crash never leaves a batch acked but not in the
checkpoint when checkpointing every step). Under a launcher (torchrun, deepspeed) every rank runs the
loop; rank 0 alone talks to the broker and writes weights and metrics, and shares each batch.
`--resume` restarts from the latest checkpoint; the broker re-sends any batch it still holds, and
`last_batch_id` makes sure a trained batch is never trained again.
Composes the pieces; owns none of their logic.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from april import protocol
from april.config import AlgoConfig, Config
from april.keys import configured_client_keys
from learner import checkpoint, weights
from learner.batching import build_train_batch
from learner.client import BatchError, BrokerClient, check_batch
from learner.engine import TrainEngine, TrainSettings
from learner.losses import LossConfig
from learner.metrics import MetricsLog, ack_metrics, forget_steps_from, step_record, write_summary
from learner.ranks import share_batch
from learner.step import train_step

log = logging.getLogger("april.learner")


def loss_config(config: Config) -> LossConfig:
    lc = config.learner
    return LossConfig.from_algo(
        config.algo,
        eps_low=None if lc.eps_low < 0 else lc.eps_low,
        eps_high=None if lc.eps_high < 0 else lc.eps_high,
        kl_coef=lc.kl_coef,
        entropy_coef=lc.entropy_coef,
    )


def make_engine(config: Config) -> tuple[TrainEngine, Any]:
    """The training engine around the model in learner.model, and a frozen reference copy if KL is on."""
    from april.hf import load_model, set_torch_threads

    lc = config.learner
    if lc.backend == "torch" and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        raise ValueError("learner.backend = 'torch' runs one process; use 'deepspeed' for several ranks")
    set_torch_threads(lc.torch_threads)
    model = load_model(lc.model, device=lc.device, dtype="float32" if lc.device == "cpu" else "auto")
    reference = None
    if lc.kl_coef > 0:
        reference = load_model(lc.model, device=lc.device)
        reference.train(False)
        reference.requires_grad_(False)
    settings = TrainSettings(
        backend=lc.backend,  # type: ignore[arg-type]
        zero_stage=lc.zero_stage,
        micro_batch_size=1,
        grad_accum_steps=lc.micro_batches,
        lr=lc.lr,
        weight_decay=lc.weight_decay,
        betas=(lc.beta1, lc.beta2),
        eps=lc.adam_eps,
        grad_clip=lc.grad_clip,
        warmup_steps=lc.warmup_steps,
        device=lc.device,
    )
    return TrainEngine(model, settings), reference


def run_learner(config: Config, run_dir: Path, resume: bool, should_stop: Callable[[], bool]) -> None:
    """Train run.steps steps (or until stopped). Every rank runs this; only rank 0 talks to the broker,
    writes weights and metrics; the others get each batch from it (`learner.ranks.share_batch`)."""
    engine, reference = make_engine(config)
    cfg, algo, lc = loss_config(config), config.algo, config.learner
    leader = engine.rank == 0
    hf_model: Any = engine.module
    vocab = int(hf_model.get_input_embeddings().num_embeddings)
    meta = checkpoint.CheckpointMeta(step=0, version=0, last_batch_id=-1)
    if resume and (latest := checkpoint.latest(run_dir / "checkpoints")) is not None:
        meta = checkpoint.load(engine, latest)
        log.info("resumed from %s: step %d, version %d", latest, meta.step, meta.version)
    step, version = meta.step, meta.version
    curve = configured_client_keys(config.broker.curve_keys_dir) if leader else None  # rank 0 talks only
    client = BrokerClient(lc.broker, version, meta.last_batch_id, curve=curve) if leader else None
    metrics = None
    if leader:
        if resume:
            forget_steps_from(run_dir / "metrics.jsonl", step)
        metrics = MetricsLog(run_dir / "metrics.jsonl", run_dir / "tensorboard" if lc.tensorboard else None)
    saved, last_batch_id = step, meta.last_batch_id
    try:
        while step < config.run.steps:
            started = time.monotonic()
            batch = receive_batch(client, step, should_stop, algo, vocab) if client is not None else None
            batch = share_batch(batch, config.broker.max_message_bytes)
            if batch is None:
                break
            if batch.version > version:  # resumed from a checkpoint older than the last published weights
                log.warning(
                    "the broker is at v%d, this learner at v%d (resumed from step %d): the steps since that "
                    "checkpoint are lost; publishing from v%d on",
                    batch.version,
                    version,
                    step,
                    batch.version + 1,
                )
                version = batch.version
            waited = time.monotonic()
            train_batch = build_train_batch(
                batch.samples.to_samples(), n_samples_per_prompt=algo.n_samples_per_prompt
            )
            stats = train_step(
                engine,
                train_batch,
                cfg,
                version=version,
                temperature=algo.temperature,
                group_size=algo.n_samples_per_prompt,
                updates=lc.updates_per_batch,
                reference=reference,
            )
            computed = time.monotonic()
            state = engine.state_dict_for_publish()  # a collective under ZeRO-3: every rank calls it
            acked: dict[str, float] | None = None  # the figures the ack carries (rank 0)
            if client is not None and metrics is not None:
                path, sha = weights.publish(state, run_dir / "weights", version + 1, keep=lc.keep_weights)
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
                    train={**stats, "wait_s": waited - started},
                )
                acked = ack_metrics(record)
                metrics.append(record)
                log.info(
                    "step %d: loss %.4f, reward %.3f, accuracy %.3f, v%d published",
                    step + 1,
                    record["loss"],
                    record["reward_mean"],
                    record["accuracy"],
                    version + 1,
                )
            step, version, last_batch_id = step + 1, version + 1, batch.batch_id
            if lc.checkpoint_every and step % lc.checkpoint_every == 0:
                save_checkpoint(engine, config, run_dir, step, version, batch.batch_id)
                saved = step
            if client is not None and acked is not None:
                # acked last: a crash before this line trains the batch again from the last checkpoint (the
                # broker still holds it); one after it finds the step in the checkpoint and metrics.jsonl
                client.ack(batch.batch_id, acked)
        # stopped (or finished) between checkpoints: save one, so --resume loses nothing
        if lc.checkpoint_every and saved < step:
            save_checkpoint(engine, config, run_dir, step, version, last_batch_id)
    finally:
        if client is not None:
            client.close()
        if metrics is not None:
            metrics.close()
    if leader:
        write_summary(run_dir, run_dir / "metrics.jsonl")


def receive_batch(
    client: BrokerClient, step: int, should_stop: Callable[[], bool], algo: AlgoConfig, vocab_size: int
) -> protocol.Batch | None:
    """Rank 0: the next batch, checked against the exactly-N contract; None when stopping.

    A broken batch is reported and not trained: the other ranks are told to stop before the error
    propagates, so no rank waits forever for a batch that will not come.
    """
    if should_stop():
        return None
    batch = client.next_batch(step, should_stop)
    if batch is None:
        return None
    try:
        check_batch(batch, algo.samples_per_batch, algo.n_samples_per_prompt, vocab_size)
    except BatchError as exc:
        log.error("the broker broke the batch contract; not training it: %s", exc)
        share_batch(None, 0)
        raise
    return batch


def save_checkpoint(
    engine: TrainEngine, config: Config, run_dir: Path, step: int, version: int, batch_id: int
) -> None:
    checkpoint.save(
        engine,
        run_dir / "checkpoints",
        checkpoint.CheckpointMeta(
            step=step,
            version=version,
            last_batch_id=batch_id,
            world_size=engine.world_size,
            backend=config.learner.backend,
            zero_stage=config.learner.zero_stage,
        ),
        keep=config.learner.keep_checkpoints,
    )
