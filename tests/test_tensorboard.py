"""The learner's metrics line and its TensorBoard copy: `step_record` carries the broker's latest
evaluation (NaN / -1 before one), and `MetricsLog` with a TensorBoard directory writes every numeric field
as a scalar that TensorBoard's own reader finds, or skips quietly without the package."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from april import protocol
from april.ledger import Ledger
from april.records import FinishReason, Sample
from april.wire_records import SampleBatch
from learner.metrics import MetricsLog, scalars, step_record


def batch(stats: dict[str, float]) -> protocol.Batch:
    samples = [
        Sample(group_id=g, index=i, prompt_ids=np.array([5, 6], np.int32))
        .extend([7] * (2 + i), [-0.5] * (2 + i), 0, FinishReason.STOP)
        .scored(float(i))
        for g in range(2)
        for i in range(2)
    ]
    ledger = Ledger(issued=2, trained=0, complete_waiting=2, in_flight=0, partial=0, dropped={"failed": 0})
    return protocol.Batch(0, 0, 0, SampleBatch.from_samples(samples), stats, ledger)


def record(step: int, stats: dict[str, float]) -> dict[str, Any]:
    return step_record(
        step=step,
        version=step + 1,
        mode="april",
        batch=batch(stats),
        step_time_s=2.0,
        learner_time_s=1.0,
        weight_sync_s=0.1,
        train={"loss": 0.25, "clip_frac": 0.5},
    )


def test_step_record_carries_the_latest_evaluation() -> None:
    none_yet = record(0, {"aborted": 1.0})
    assert math.isnan(none_yet["eval_accuracy"]) and none_yet["eval_version"] == -1
    evaluated = record(3, {"eval_accuracy": 0.75, "eval_reward_mean": 0.5, "eval_version": 2.0})
    assert evaluated["eval_accuracy"] == 0.75 and evaluated["eval_version"] == 2
    assert evaluated["accuracy"] == 0.5  # the training figure beside it: reward > 0 on the batch


def test_scalars_flatten_nested_fields_and_skip_nan() -> None:
    tags = dict(scalars(record(1, {})))
    assert tags["learner/loss"] == 0.25 and tags["learner/clip_frac"] == 0.5  # no learner/learner/
    assert tags["learner/ledger/issued"] == 2 and tags["learner/ledger/dropped/failed"] == 0
    assert "learner/eval_accuracy" not in tags and tags["learner/eval_version"] == -1
    assert "learner/mode" not in tags and "learner/step" not in tags


def test_tensorboard_events_hold_every_numeric_field(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    pytest.importorskip("torch")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    log = MetricsLog(tmp_path / "metrics.jsonl", tensorboard_dir=tmp_path / "tensorboard")
    for step in range(3):
        log.append(record(step, {"eval_accuracy": 0.25 * step, "eval_version": float(step)}))
    events = list((tmp_path / "tensorboard").glob("events.out.tfevents.*"))
    assert len(events) == 1 and events[0].stat().st_size > 0  # flushed per step, before close
    log.close()
    reader = EventAccumulator(str(tmp_path / "tensorboard"))
    reader.Reload()
    tags = set(reader.Tags()["scalars"])
    assert {"learner/loss", "learner/eval_accuracy", "learner/accuracy", "learner/ledger/trained"} <= tags
    assert [(e.step, e.value) for e in reader.Scalars("learner/eval_accuracy")] == [
        (0, 0.0),
        (1, 0.25),
        (2, 0.5),
    ]
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["eval_version"] for line in lines] == [0, 1, 2]


def test_without_tensorboard_only_the_jsonl_is_written(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "torch.utils.tensorboard", None)  # import fails as if not installed
    log = MetricsLog(tmp_path / "metrics.jsonl", tensorboard_dir=tmp_path / "tensorboard")
    log.append(record(0, {}))
    log.close()
    assert not (tmp_path / "tensorboard").exists()
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["step"] == 0


def test_each_steps_few_samples_are_a_text_table_in_tensorboard(tmp_path: Path) -> None:
    pytest.importorskip("tensorboard")
    pytest.importorskip("torch")
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from learner.metrics import SAMPLES_TAG, SamplesTable

    log = MetricsLog(tmp_path / "metrics.jsonl", tensorboard_dir=tmp_path / "tensorboard")
    for step in range(2):
        log.append(record(step, {}), SamplesTable(["group", "response"], [[step, "a | b\nc"]]))
    log.close()
    reader = EventAccumulator(str(tmp_path / "tensorboard"), size_guidance={"tensors": 0})
    reader.Reload()
    tag = f"{SAMPLES_TAG}/text_summary"
    assert tag in reader.Tags()["tensors"]
    texts = [(e.step, e.tensor_proto.string_val[0].decode()) for e in reader.Tensors(tag)]
    assert texts == [(s, f"| group | response |\n|---|---|\n| {s} | a \\| b c |") for s in (0, 1)]
