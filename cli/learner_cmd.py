"""`april learner`: run the learner until run.steps are trained or SIGINT/SIGTERM arrives."""

from __future__ import annotations

from pathlib import Path

from april.config import Config, write_config
from cli.process import setup_logging, stop_requested


def run_learner_process(config: Config, run_dir: Path, resume: bool) -> None:
    from learner.loop import run_learner

    setup_logging()
    run_dir.mkdir(parents=True, exist_ok=True)
    write_config(config, run_dir / "config.learner.toml")
    run_learner(config, run_dir, resume, stop_requested())
