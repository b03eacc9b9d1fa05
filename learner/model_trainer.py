"""The trainer of a real model (`learner.backend = "torch"` or `"deepspeed"`): the `learner.trainer.Trainer`
the learner loop drives in a training run.

Loads `learner.model` (and a frozen reference copy when `kl_coef` > 0), wraps it in the training engine
(`learner.engine`), turns each batch into one `learner.step.train_step` (after DAPO's overlong shaping,
`learner.overlong`), publishes weights as safetensors (`learner.weights`) and saves/restores checkpoints
(`learner.checkpoint`: `checkpoints/step_*/`). Every
rank holds one; gathering weights and checkpointing are collectives, rank 0 alone writes the files.
Composes those pieces; owns none of their logic, and knows nothing of the broker.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from april import protocol
from april.config import Config
from learner import checkpoint, weights
from learner.losses import LossConfig
from learner.trainer import (
    BroadcastSend,
    PhaseReport,
    ResumePoint,
    SampleFigures,
    TrainResult,
    launched_rank,
    launched_world_size,
)

if TYPE_CHECKING:
    from learner.engine import TrainEngine, TrainSettings


def loss_config(config: Config) -> LossConfig:
    lc = config.learner
    return LossConfig.from_algo(
        config.algo,
        eps_low=None if lc.eps_low < 0 else lc.eps_low,
        eps_high=None if lc.eps_high < 0 else lc.eps_high,
        kl_coef=lc.kl_coef,
        entropy_coef=lc.entropy_coef,
        log_ratio_clamp=lc.log_ratio_clamp,
        clip_ratio_c=lc.clip_ratio_c,
        kl_estimator=lc.kl_estimator,
        kl_clamp=lc.kl_clamp,
    )


def engine_summary(settings: TrainSettings, world_size: int) -> str:
    """What `start` builds, for the phase report (the broker keeps it as the learner's engine):
    'DeepSpeed ZeRO-2 on cuda, torch fused AdamW, 2 ranks, GPUs 0,1' (the GPUs `april up` gave it)."""
    from april.devices import visible_gpus

    s = settings
    engine = f"DeepSpeed ZeRO-{s.zero_stage}" if s.backend == "deepspeed" else "torch"
    gpus = visible_gpus() if s.device.startswith("cuda") else ""
    ranks = f"{world_size} rank{'s' if world_size > 1 else ''}"
    return f"{engine} on {s.device}, {s.optimizer}, {ranks}" + (f", {gpus}" if gpus else "")


class ModelTrainer:
    def __init__(self, config: Config, run_dir: Path) -> None:
        lc = config.learner
        if lc.backend == "torch" and launched_world_size() > 1:
            raise ValueError("learner.backend = 'torch' runs one process; use 'deepspeed' for several ranks")
        self.config = config
        self.checkpoints = run_dir / "checkpoints"
        self.loss = loss_config(config)
        self._engine: TrainEngine | None = None
        self._reference: Any = None  # the frozen initial model when KL is on
        self._vocab = 0

    @property
    def engine(self) -> TrainEngine:
        if self._engine is None:
            raise RuntimeError("ModelTrainer.start() was not called")
        return self._engine

    @property
    def rank(self) -> int:
        return self._engine.rank if self._engine is not None else launched_rank()

    @property
    def world_size(self) -> int:
        return self.engine.world_size

    @property
    def vocab_size(self) -> int:
        return self._vocab

    @property
    def checkpoint_every(self) -> int:
        return self.config.learner.checkpoint_every

    def resume_point(self) -> ResumePoint | None:
        latest = checkpoint.latest(self.checkpoints)
        if latest is None:
            return None
        meta = checkpoint.read_meta(latest)
        lc = self.config.learner
        # refused here, before the model loads or rank 0 registers with the broker
        checkpoint.check_resumable(
            latest,
            meta,
            world_size=launched_world_size(),
            backend=lc.backend,
            zero_stage=lc.zero_stage,
            optimizer=self.settings().optimizer,
        )
        return ResumePoint(meta.step, meta.version, meta.last_batch_id, source=str(latest))

    def close(self) -> None:
        if self._engine is not None:
            self._engine.close()

    def settings(self) -> TrainSettings:
        """The training engine's settings from the learner's config, on the device it resolves to: under a
        launcher, every rank on CUDA takes its own GPU (`cuda:LOCAL_RANK`, as launchers mean it)."""
        from april.devices import resolve_device
        from learner.engine import TrainSettings

        lc = self.config.learner
        device = resolve_device(lc.device, "learner.device")
        if device.startswith("cuda") and launched_world_size() > 1:
            device = f"cuda:{os.environ.get('LOCAL_RANK', '0')}"
        return TrainSettings.of(lc, device)

    def start(self, report: PhaseReport) -> None:
        from april.devices import init_cuda
        from april.hf import enable_activation_checkpointing, load_model, set_torch_threads
        from learner.engine import TrainEngine
        from learner.logprob_head import check_supported

        lc = self.config.learner
        settings = self.settings()
        device = settings.device
        if device.startswith("cuda"):
            init_cuda(device, "learner")  # a GPU torch cannot use: one line now, not mid-load
        report(protocol.LearnerPhase.LOADING_MODEL, lc.model)
        set_torch_threads(lc.torch_threads)
        model = load_model(lc.model, device=device, dtype="float32" if device == "cpu" else "auto")
        if lc.logprob_chunk_tokens > 0:
            check_supported(model)  # at start, not at the first batch
        if lc.gradient_checkpointing:
            enable_activation_checkpointing(model)
        if lc.kl_coef > 0:
            self._reference = load_model(lc.model, device=device)
            self._reference.train(False)
            self._reference.requires_grad_(False)
        report(protocol.LearnerPhase.INITIALISING_ENGINE, engine_summary(settings, launched_world_size()))
        self._engine = TrainEngine(model, settings)
        hf_model: Any = self._engine.module
        self._vocab = int(hf_model.get_input_embeddings().num_embeddings)

    def restore(self, point: ResumePoint) -> None:
        checkpoint.load(self.engine, checkpoint.step_dir(self.checkpoints, point.step))

    def train(self, batch: protocol.Batch, version: int) -> TrainResult:
        from learner.batching import build_train_batch, row_keys
        from learner.overlong import apply_overlong, truncated_rows
        from learner.sample_stats import SampleStats
        from learner.step import Layout, train_step

        algo, lc = self.config.algo, self.config.learner
        samples = batch.samples.to_samples()
        built = build_train_batch(samples, n_samples_per_prompt=algo.n_samples_per_prompt)
        shaped, overlong = apply_overlong(built, truncated_rows(samples, built), algo)
        device = next(self.engine.module.parameters()).device
        per_sample = SampleStats(built.size, device, lc.log_ratio_clamp)
        metrics = train_step(
            self.engine,
            shaped,
            self.loss,
            version=version,
            temperature=algo.temperature,
            group_size=algo.n_samples_per_prompt,
            updates=lc.updates_per_batch,
            reference=self._reference,
            layout=Layout(
                micro_batches=lc.micro_batches,
                max_tokens=lc.max_tokens_per_micro_batch,
                chunk_tokens=lc.logprob_chunk_tokens,
                packed=lc.pack_sequences,
            ),
            per_sample=per_sample,
        )
        figures = SampleFigures(
            row_keys(samples), per_sample.advantage, per_sample.logprob_mean, per_sample.ratio_max
        )
        return TrainResult({**metrics, **overlong.metrics()}, figures if self.engine.rank == 0 else None)

    def publish(
        self, weights_dir: Path, version: int, broadcast: BroadcastSend | None = None
    ) -> tuple[Path, str] | None:
        state = self.engine.state_dict_for_publish()  # a collective under ZeRO-3: every rank calls it
        if self.engine.rank != 0:
            return None
        published = weights.publish(state, weights_dir, version, keep=self.config.learner.keep_weights)
        if broadcast is not None:  # after the file: a member that misses this version fetches it
            broadcast(state, version)
        return published

    def save(self, point: ResumePoint) -> None:
        lc = self.config.learner
        meta = checkpoint.CheckpointMeta(
            step=point.step,
            version=point.version,
            last_batch_id=point.last_batch_id,
            world_size=self.engine.world_size,
            backend=lc.backend,
            zero_stage=lc.zero_stage,
            optimizer=self.engine.settings.optimizer,
        )
        checkpoint.save(self.engine, self.checkpoints, meta, keep=lc.keep_checkpoints)
