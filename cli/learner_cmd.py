"""`april learner`: run the learner (a real model, or simulated with learner.backend = "sim": the same loop
either way) until run.steps are trained or SIGINT/SIGTERM arrives. With `learner.gpus` > 1 and no launcher
around it, this process starts the ranks itself (`cli.rank_group`) and returns their exit code."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from april.config import Config, write_config
from april.devices import resolve_device
from april.hf import check_model_dir
from cli.process import setup_logging, stop_requested
from cli.rank_group import launched, run_ranks
from learner.wandb_sink import check_wandb


def run_learner_process(config: Config, run_dir: Path, resume: bool) -> int:
    # what can fail before anything starts, as one line: a missing wandb, an incomplete model directory, a
    # device torch does not see ("auto" becomes the device it picks: the run's config.learner.toml says it)
    check_wandb(config.learner)
    if config.learner.backend != "sim":
        check_model_dir(config.learner.model, tokenizer=False)  # the learner trains on ids: no tokenizer
        device = resolve_device(config.learner.device, "learner.device")
        config = dataclasses.replace(config, learner=dataclasses.replace(config.learner, device=device))
    if config.learner.gpus > 1 and not launched():
        return run_ranks(config.learner.gpus)  # each rank runs this command again, as one rank
    setup_logging()
    run_dir.mkdir(parents=True, exist_ok=True)
    write_config(config, run_dir / "config.learner.toml")
    from learner.loop import run_learner  # here: `april --help` does not load the learner

    run_learner(config, run_dir, resume, stop_requested())
    return 0
