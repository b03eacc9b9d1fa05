"""`april learner`: run the learner (a real model, or simulated with learner.backend = "sim": the same loop
either way) until run.steps are trained or SIGINT/SIGTERM arrives."""

from __future__ import annotations

from pathlib import Path

from april.config import Config, write_config
from april.hf import check_model_dir
from cli.process import setup_logging, stop_requested
from learner.wandb_sink import check_wandb


def run_learner_process(config: Config, run_dir: Path, resume: bool) -> None:
    # what can fail before anything starts, as one line: a missing wandb, an incomplete model directory
    check_wandb(config.learner)
    if config.learner.backend != "sim":
        check_model_dir(config.learner.model, tokenizer=False)  # the learner trains on ids: no tokenizer
    setup_logging()
    run_dir.mkdir(parents=True, exist_ok=True)
    write_config(config, run_dir / "config.learner.toml")
    from learner.loop import run_learner  # here: `april --help` does not load the learner

    run_learner(config, run_dir, resume, stop_requested())
