"""The broker's rollout records: each evaluation's generations, one Parquet file per evaluation under
RUN_DIR/rollouts/eval/ (`vNNNNNN.parquet`, by the version it was issued at), written off the poll loop
(`april.rollout_writer`): every held-out prompt's sample, finished or failed (with its error).

Rows and columns are `april.rollouts`'; eval.jsonl (the summary line of each evaluation) is the server's.
"""

from __future__ import annotations

import logging
from pathlib import Path

from april import rollout_writer
from april.config import Config
from april.rollouts import Context, eval_dir, eval_file, eval_table, open_decoder
from broker.evaluation import EvalResult

log = logging.getLogger("april.broker")


def open_eval_records(config: Config, run_dir: Path) -> EvalRecords | None:
    """The evaluation records of this run; None when off, or when pyarrow is missing (said once)."""
    if not (config.run.rollout_records and config.run.eval_every > 0):
        return None
    if why := rollout_writer.unavailable():
        log.warning("%s", why)
        return None
    return EvalRecords(config, run_dir)


class EvalRecords:
    def __init__(self, config: Config, run_dir: Path) -> None:
        self.writer = rollout_writer.RolloutWriter(eval_dir(run_dir))
        self.decode = open_decoder(config.worker.model, config.learner.model)
        self.source = config.data.eval_source or config.data.source  # where the held-out prompts came from

    def submit(self, result: EvalResult) -> None:
        """Queue the file of this evaluation (not written again if a restarted broker repeats it)."""
        samples, version = result.samples, result.version
        context = Context(self.source, version, self.decode)
        self.writer.submit(eval_file(version), lambda: eval_table(version, samples, context))

    def close(self) -> None:
        self.writer.close()
