"""examples/tour.py, the first read, runs as written: a broker core, a worker on the torch engine and one
learner step in one process. Loaded from its file, as a reader runs it; if an API it shows changes, this
fails and the tour is brought up to date."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("transformers")

TOUR = Path(__file__).resolve().parent.parent / "examples" / "tour.py"


def test_the_tour_forms_a_batch_trains_on_it_and_the_worker_serves_the_new_weights(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("tour", TOUR)
    assert spec is not None and spec.loader is not None
    tour = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tour)
    figures = tour.tour(tmp_path)
    groups, group_size = tour.SETTINGS["algo.rollout_batch_size"], tour.SETTINGS["algo.n_samples_per_prompt"]
    assert figures["batch_samples"] == groups * group_size
    assert figures["updates"] == 1 and figures["tokens_trained"] > 0
    assert figures["rewards_distinct"] > 1 and figures["grad_norm"] > 0  # the step had something to learn
    assert figures["worker_version"] == 1  # published, relayed by the core, checked and loaded
    assert (tmp_path / "weights").is_dir()
