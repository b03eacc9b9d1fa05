"""The learner's rollout records: the samples each step trained, one Parquet file per step under
RUN_DIR/rollouts/train/, written off the loop (`april.rollout_writer`); and the few of them each step
shows on wandb and TensorBoard.

Owns which samples of a batch are recorded (all, or `run.rollout_records_groups` whole groups drawn per
step from the run's seed, so a step trained again draws the same), the step files across a resume (those
of the steps a resumed learner trains again are removed first, as their metrics.jsonl lines are: a
step's file always holds the batch its metrics line describes) and the step's few samples for the
trackers (`samples_table`). Rows and columns are `april.rollouts`'; rank 0 alone holds a `StepRecords`.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from april import protocol
from april.config import Config
from april.records import Sample
from april.rollout_writer import RolloutWriter, unavailable
from april.rollouts import (
    STEP_FILE,
    Context,
    abort_cuts,
    numbered,
    open_decoder,
    step_file,
    train_dir,
    train_table,
)
from learner.metrics import SamplesTable
from learner.trainer import SampleFigures

log = logging.getLogger("april.learner")

TABLE_SAMPLES = 4  # samples per step on wandb and TensorBoard: the best, worst, longest and most aborted
TABLE_TEXT = 400  # characters of a prompt or response in that table (the records hold them whole)


def forget_steps_from(directory: Path, step: int) -> None:
    """Remove the records of steps >= `step`: a resumed learner trains them again."""
    gone = [path for number, path in numbered(directory, STEP_FILE).items() if number >= step]
    for path in gone:
        path.unlink()
    if gone:
        log.info("rollout records: %d step file(s) from step %d removed (trained again)", len(gone), step)


def open_step_records(config: Config, run_dir: Path, step: int, resume: bool) -> StepRecords | None:
    """Rank 0's step records; None when off, or when pyarrow is missing (said once: the learner trains)."""
    if not config.run.rollout_records:
        return None
    if why := unavailable():
        log.warning("%s", why)
        return None
    return StepRecords(config, run_dir, step, resume)


class StepRecords:
    """Rank 0's writer of the step files; `first_step` is the step the learner trains next."""

    def __init__(self, config: Config, run_dir: Path, first_step: int, resume: bool) -> None:
        directory = train_dir(run_dir)
        if resume:
            forget_steps_from(directory, first_step)
        self.writer = RolloutWriter(directory)
        self.decode = open_decoder(config.worker.model, config.learner.model)
        self.source = config.data.source
        self.groups = config.run.rollout_records_groups
        self.seed = config.run.seed

    def chosen(self, step: int, samples: Sequence[Sample]) -> list[Sample]:
        """The samples recorded at `step`: all, or `groups` whole groups drawn from (seed, step)."""
        ids = list(dict.fromkeys(s.group_id for s in samples))
        if not self.groups or self.groups >= len(ids):
            return list(samples)
        rng = np.random.default_rng((self.seed, step))
        kept = {ids[i] for i in rng.choice(len(ids), size=self.groups, replace=False).tolist()}
        return [s for s in samples if s.group_id in kept]

    def submit(self, step: int, version: int, batch: protocol.Batch, figures: SampleFigures | None) -> None:
        """Queue the file of `step` (trained from weights `version`)."""
        samples = self.chosen(step, batch.samples.to_samples())
        context = Context(self.source, version, self.decode)
        by_key = figures.of() if figures is not None else None
        self.writer.submit(
            step_file(step), lambda: train_table(step, version, batch.batch_id, samples, context, by_key)
        )

    def table(self, version: int, batch: protocol.Batch, figures: SampleFigures | None) -> SamplesTable:
        """The step's few samples for the trackers, now (a few decodes)."""
        context = Context(self.source, version, self.decode)
        return samples_table(
            batch.samples.to_samples(), context, figures.of() if figures is not None else None
        )

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


def samples_table(
    samples: Sequence[Sample],
    context: Context,
    figures: dict[tuple[int, int], tuple[float, float, float]] | None,
) -> SamplesTable:
    """The step's best, worst, longest and most aborted samples (distinct, at most `TABLE_SAMPLES`), their
    prompt and response shortened."""
    picks: list[Sample] = []
    for key in (
        lambda s: -s.reward,
        lambda s: s.reward,
        lambda s: -s.response_len,
        lambda s: -len(abort_cuts(s)),
    ):
        taken = {s.key for s in picks}
        best = min((s for s in samples if s.key not in taken), key=key, default=None)
        if best is not None and len(picks) < TABLE_SAMPLES:
            picks.append(best)
    texts = (
        context.decode([ids for s in picks for ids in (s.prompt_ids, s.response_ids)])
        if context.decode
        else []
    )
    columns = ["group", "index", "reward", "advantage", "tokens", "aborts", "prompt", "response"]
    rows = []
    for i, s in enumerate(picks):
        prompt = texts[2 * i] if texts else s.prompt_text
        response = texts[2 * i + 1] if texts else ""
        advantage = (figures or {}).get(s.key, (float("nan"),))[0]
        rows.append(
            [s.group_id, s.index, s.reward, advantage, s.response_len, len(abort_cuts(s)),
             prompt[-TABLE_TEXT:], response[:TABLE_TEXT]]
        )  # fmt: skip
    return SamplesTable(columns, rows)
