"""The broker's rollout records: each evaluation's generations, one Parquet file per evaluation under
RUN_DIR/rollouts/eval/ (`vNNNNNN.parquet`, by the version it was issued at), written off the poll loop
(`april.rollout_writer`): every held-out prompt's sample, finished or failed (with its error).

Rows and columns are `april.rollouts`'; eval.jsonl (the summary line of each evaluation) is the server's.
"""

from __future__ import annotations

from pathlib import Path

from april.config import Config
from april.rollout_writer import RolloutWriter
from april.rollouts import Context, eval_dir, eval_file, eval_table, open_decoder
from broker.evaluation import EvalResult


class EvalRecords:
    def __init__(self, config: Config, run_dir: Path) -> None:
        self.writer = RolloutWriter(eval_dir(run_dir))
        self.decode = open_decoder(config.worker.model, config.learner.model)
        self.source = config.data.eval_source or config.data.source  # where the held-out prompts came from

    def submit(self, result: EvalResult) -> None:
        """Queue the file of this evaluation (not written again if a restarted broker repeats it)."""
        samples, version = result.samples, result.version
        context = Context(self.source, version, self.decode)
        self.writer.submit(eval_file(version), lambda: eval_table(version, samples, context))

    def close(self) -> None:
        self.writer.close()
