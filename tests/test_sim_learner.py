"""The simulated learner (learner.backend = "sim") in a real run: broker, two sim workers and the learner as
processes (`april up`), checked through the run directory. Also checks that the workers' slot usage reaches
metrics.jsonl (slot_utilization and bubble_frac are numbers wherever a step had a rollout phase)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from april.files import sha256_file
from april.ports import free_ports
from cli.up_cmd import UpOptions, run_up

# a round of ~20-token samples at 15 ms a step (stated in the config below, not the default cost) takes
# ~0.3 s: several usage reports (every 0.1 s) each
STEP_S, TIME_SCALE, DECODE_MS = 0.2, 1.0, 15.0


def broker_ports() -> list[str]:
    names = ("worker_port", "learner_port", "pub_port")
    return [f"broker.{n}={p}" for n, p in zip(names, free_ports(3), strict=True)]


@pytest.mark.parametrize("mode", ["april", "async"])
def test_a_run_with_the_simulated_learner(tmp_path: Path, mode: str) -> None:
    cfg = tmp_path / "sim.toml"
    cfg.write_text(
        f'[run]\nmode = "{mode}"\nsteps = 3\n'
        "[algo]\nrollout_batch_size = 2\nover_sampling_batch_size = 4\nn_samples_per_prompt = 4\n"
        "max_new_tokens = 64\n[broker]\nmin_workers = 2\n"
        '[worker]\nengine = "sim"\nslots = 8\nsim_lengths = "lognormal:median=20,sigma=1.0,cap=64"\n'
        f"sim_time_scale = {TIME_SCALE}\nsim_decode_ms = {DECODE_MS}\n"
        f'[learner]\nbackend = "sim"\nsim_step_s = {STEP_S}\n'
    )
    run_dir = tmp_path / "run"
    opts = UpOptions(config=cfg, workers=2, run_dir=run_dir, headless=True, sets=tuple(broker_ports()))
    assert run_up(opts) == 0
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["version"] for x in lines] == [1, 2, 3]
    assert all(x["samples"] == 8 and x["loss"] == 0.0 for x in lines)
    for x in lines:
        assert x["learner_time_s"] >= STEP_S * TIME_SCALE * 0.95  # the cost model's step time, slept
        if x["phase_slot_s"] > 0:
            assert 0 <= x["slot_utilization"] <= 1, x["slot_utilization"]
        else:  # a batch formed at once from surplus complete groups: no rollout phase to measure
            assert math.isnan(x["slot_utilization"])
        if x["engine_s"] > 0:
            assert 0 <= x["bubble_frac"] <= 1, x["bubble_frac"]
        assert x["busy_phase_slot_s"] <= x["phase_slot_s"] and x["run_s"] > 0
    assert [x["run_s"] for x in lines] == sorted(x["run_s"] for x in lines)
    assert lines[0]["slot_utilization"] > 0 and lines[0]["engine_s"] > 0  # the first round is always measured
    # the published versions are real files whose sha256 the workers verified (no load failures logged)
    weights = sorted((run_dir / "weights").glob("v*.sim.json"))
    assert weights and weights[-1].name == "v000003.sim.json" and len(sha256_file(weights[-1])) == 64
    for log in (run_dir / "logs").glob("worker-*.log"):
        text = log.read_text()
        assert "weights v3 loaded" in text and "not loaded" not in text, text[-2000:]
    totals = json.loads((run_dir / "broker_totals.json").read_text())["at_stop"]
    trained = sum(x["tokens_trained"] for x in lines)
    assert totals["tokens_generated"] == trained + totals["buffered_tokens"]  # nothing generated was lost
    assert not math.isnan(totals["usage"]["slot_utilization"])
    assert json.loads((run_dir / "summary.json").read_text())["steps"] == 3


def test_the_simulated_learner_resumes_where_it_stopped(tmp_path: Path) -> None:
    """A second `april up --resume` continues the steps and versions (none trained twice, none skipped)."""
    cfg = tmp_path / "sim.toml"
    cfg.write_text(
        '[run]\nmode = "april"\nsteps = 2\n'
        "[algo]\nrollout_batch_size = 2\nover_sampling_batch_size = 4\nn_samples_per_prompt = 4\n"
        "max_new_tokens = 64\n"
        '[worker]\nengine = "sim"\nslots = 8\nsim_lengths = "lognormal:median=20,sigma=1.0,cap=64"\n'
        f'[learner]\nbackend = "sim"\nsim_step_s = {STEP_S}\n'
    )
    run_dir = tmp_path / "run"
    ports = tuple(broker_ports())
    assert run_up(UpOptions(config=cfg, workers=1, run_dir=run_dir, headless=True, sets=ports)) == 0
    state = json.loads((run_dir / "sim_learner.json").read_text())
    assert state["step"] == 2 and state["version"] == 2 and state["last_batch_id"] >= 0
    assert run_up(UpOptions(config=cfg, workers=1, resume=run_dir, steps=4, headless=True, sets=ports)) == 0
    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [0, 1, 2, 3]
    assert [x["version"] for x in lines] == [1, 2, 3, 4]
    assert json.loads((run_dir / "sim_learner.json").read_text())["step"] == 4
