"""The one learner loop (`learner.loop`), driven in this process with the simulated trainer, against a real
broker (served from a thread here, so its books and its learner record can be read at any moment) and a
real sim-engine worker process.

From inside each trainer call the test checks what the broker sees at that moment: the phase the learner
reported (training, publishing, checkpointing, restoring) and that the batch is still unacked when the
state is saved (the loop acks last) and that every step's rollout records are on disk by then. Also:
resuming continues steps and versions, a crash before the ack writes that step's records once again (from
the same batch), a resume behind the broker's version never publishes a version twice, the simulated
learner imports no torch, the real trainer reports its start-up phases, and a restarted broker hears the
learner's phase again."""

from __future__ import annotations

import json
import logging
import subprocess
import sys
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest
from harness import Cluster, wait_for

from april import protocol
from april.config import Config, load_config
from april.protocol import LearnerPhase
from april.rollouts import train_steps
from broker.server import Broker
from learner.client import BrokerClient
from learner.loop import run_learner
from learner.phases import PhaseClock
from learner.sim_trainer import STATE_FILE, SimTrainer
from learner.trainer import BroadcastSend, ResumePoint, TrainResult

ROOT = Path(__file__).resolve().parents[1]
DEADLINE_S = 60  # "did not hang", never "was fast"
N = 4 * 2  # rollout_batch_size x n_samples_per_prompt of the harness's config


@dataclass
class Served:
    """A broker serving from a thread of this process."""

    broker: Broker
    stop: threading.Event
    thread: threading.Thread

    def close(self) -> None:
        self.stop.set()
        self.thread.join(10)
        self.broker.close()


def serve(config: Config, run_dir: Path) -> Served:
    broker = Broker(config, run_dir)
    broker.bind()
    stop = threading.Event()
    thread = threading.Thread(target=broker.serve, args=(stop.is_set,), daemon=True)
    thread.start()
    return Served(broker, stop, thread)


@pytest.fixture
def run(cluster: Callable[..., Cluster]) -> Iterator[tuple[Cluster, Served]]:
    """A broker in this process and one sim worker process; the learner is simulated, 0 s per step."""
    c = cluster(learner={"backend": "sim", "sim_step_s": 0.0, "tensorboard": False})
    served = serve(load_config(c.config_path), c.run_dir)
    c.start_worker("w0")
    try:
        yield c, served
    finally:
        c.close()
        served.close()


def learner_config(c: Cluster, steps: int) -> Config:
    return load_config(c.config_path, overrides={"run.steps": steps})


class Recording(SimTrainer):
    """The simulated trainer, noting each call and checking what the broker sees while it runs."""

    def __init__(self, config: Config, run_dir: Path, broker: Broker) -> None:
        super().__init__(config, run_dir)
        self.run_dir = run_dir
        self.broker = broker
        self.calls: list[tuple[Any, ...]] = []

    def reported(self, phase: LearnerPhase, detail: str) -> bool:
        learner = self.broker.learner
        return learner is not None and learner.phase == phase and learner.phase_detail == detail

    def restore(self, point: ResumePoint) -> None:
        wait_for(
            lambda: self.reported(LearnerPhase.RESTORING_CHECKPOINT, point.source), DEADLINE_S, "restoring"
        )
        self.calls.append(("restore", point.step, point.version, point.last_batch_id))

    def train(self, batch: protocol.Batch, version: int) -> TrainResult:
        detail = f"step {batch.step + 1}, {len(batch.samples)} samples"
        wait_for(lambda: self.reported(LearnerPhase.TRAINING, detail), DEADLINE_S, "the training phase")
        self.calls.append(("train", batch.batch_id, version, len(batch.samples)))
        return super().train(batch, version)

    def publish(
        self, weights_dir: Path, version: int, broadcast: BroadcastSend | None = None
    ) -> tuple[Path, str]:
        wait_for(
            lambda: self.reported(LearnerPhase.PUBLISHING_WEIGHTS, f"v{version}"), DEADLINE_S, "publishing"
        )
        assert broadcast is None  # the simulated learner serves nothing: no collective
        self.calls.append(("publish", version))
        return super().publish(weights_dir, version)

    def save(self, point: ResumePoint) -> None:
        detail = f"step {point.step}"
        wait_for(lambda: self.reported(LearnerPhase.CHECKPOINTING, detail), DEADLINE_S, "checkpointing")
        unacked = self.broker.core.state.batch
        # the ack comes after this returns: the broker still holds the batch being checkpointed
        assert unacked is not None and unacked.batch_id == point.last_batch_id, (unacked, point)
        self.calls.append(("save", point.step, point.version, point.last_batch_id))
        super().save(point)


class Crashed(Exception):
    pass


class CrashingAtSave(Recording):
    """Checks, at each checkpoint, that the records of every step trained so far are on disk; and crashes
    while checkpointing after `crash_at` steps (its records written, its batch unacked)."""

    def __init__(self, config: Config, run_dir: Path, broker: Broker, crash_at: int) -> None:
        super().__init__(config, run_dir, broker)
        self.crash_at = crash_at

    def save(self, point: ResumePoint) -> None:
        assert list(train_steps(self.run_dir)) == list(range(point.step))
        if point.step == self.crash_at:
            raise Crashed(f"killed while checkpointing step {point.step}")
        super().save(point)


def train(
    c: Cluster,
    served: Served,
    steps: int,
    resume: bool = False,
    make: Callable[[Config, Path, Broker], Recording] = Recording,
) -> Recording:
    """Run the loop (in a thread: a hang fails the test instead of blocking it) for `steps` steps."""
    config = learner_config(c, steps)
    trainer = make(config, c.run_dir, served.broker)
    failed: list[BaseException] = []

    def learner() -> None:
        try:
            run_learner(config, c.run_dir, resume, lambda: False, trainer)
        except BaseException as exc:  # a failed check inside the trainer: re-raised below
            failed.append(exc)

    thread = threading.Thread(target=learner, daemon=True)
    thread.start()
    thread.join(DEADLINE_S * 3)
    assert not thread.is_alive(), f"the learner did not finish {steps} steps; calls so far {trainer.calls}"
    if failed:
        raise failed[0]
    return trainer


def metrics(c: Cluster) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (c.run_dir / "metrics.jsonl").read_text().splitlines()]


def test_each_step_trains_publishes_checkpoints_and_acks_last(run: tuple[Cluster, Served]) -> None:
    c, served = run
    trainer = train(c, served, steps=3)
    trains = [call for call in trainer.calls if call[0] == "train"]
    assert [v for _, _, v, _ in trains] == [0, 1, 2] and all(n == N for *_, n in trains)
    batch_ids = [b for _, b, _, _ in trains]
    assert len(set(batch_ids)) == 3
    expected: list[tuple[Any, ...]] = []
    for step, (_, batch_id, version, n) in enumerate(trains):
        expected += [
            ("train", batch_id, version, n),
            ("publish", version + 1),
            ("save", step + 1, version + 1, batch_id),
        ]
    assert trainer.calls == expected
    core = served.broker.core
    assert core.batches_acked == 3 and core.state.batch is None  # every batch acked
    assert [(x["step"], x["version"], x["samples"]) for x in metrics(c)] == [(0, 1, N), (1, 2, N), (2, 3, N)]
    assert json.loads((c.run_dir / "summary.json").read_text())["steps"] == 3
    state = json.loads((c.run_dir / STATE_FILE).read_text())
    assert state == {"step": 3, "version": 3, "last_batch_id": batch_ids[-1]}
    assert served.broker.core.state.version == 3


def test_a_resumed_loop_restores_the_saved_point_and_continues(run: tuple[Cluster, Served]) -> None:
    c, served = run
    first = train(c, served, steps=2)
    last_batch = [call for call in first.calls if call[0] == "train"][-1][1]
    second = train(c, served, steps=4, resume=True)
    assert second.calls[0] == ("restore", 2, 2, last_batch)
    trains = [call for call in second.calls if call[0] == "train"]
    assert [v for _, _, v, _ in trains] == [2, 3] and all(b > last_batch for _, b, _, _ in trains)
    assert [(x["step"], x["version"]) for x in metrics(c)] == [(0, 1), (1, 2), (2, 3), (3, 4)]


def test_a_crash_before_the_ack_writes_that_steps_records_once_again_from_its_batch(
    run: tuple[Cluster, Served],
) -> None:
    """Killed after a step's records were written but before its checkpoint and ack: the resumed loop
    removes that step's file, trains the same batch again (the broker re-sends it) and writes it once;
    every step's records are on disk before its checkpoint."""
    c, served = run
    with pytest.raises(Crashed):
        train(c, served, steps=3, make=lambda *args: CrashingAtSave(*args, crash_at=2))
    assert list(train_steps(c.run_dir)) == [0, 1]  # step 1's records were written before the crash
    crashed = pq.read_table(train_steps(c.run_dir)[1]).column("batch_id").to_pylist()
    train(c, served, steps=3, resume=True, make=lambda *args: CrashingAtSave(*args, crash_at=-1))
    files = train_steps(c.run_dir)
    assert list(files) == [0, 1, 2]
    rows = [pq.read_table(files[s]).to_pylist() for s in range(3)]
    assert [len(r) for r in rows] == [N, N, N]
    assert {x["batch_id"] for x in rows[1]} == set(crashed)  # the very batch, trained again
    keys = [(x["group_id"], x["sample_index"]) for r in rows for x in r]
    assert len(set(keys)) == len(keys)  # no sample twice
    lines = metrics(c)
    assert [x["step"] for x in lines] == [0, 1, 2]
    assert [sum(x["reward"] for x in r) / N for r in rows] == pytest.approx([x["reward_mean"] for x in lines])


def test_a_resume_behind_the_broker_never_publishes_a_version_twice(run: tuple[Cluster, Served]) -> None:
    """Resumed from a saved point older than the broker's weights (a crash between checkpoints), the loop
    trains from the broker's version and numbers on from it; the lost step is trained again."""
    c, served = run
    first = train(c, served, steps=2)
    first_batch = next(call for call in first.calls if call[0] == "train")[1]
    (c.run_dir / STATE_FILE).write_text(json.dumps({"step": 1, "version": 1, "last_batch_id": first_batch}))
    second = train(c, served, steps=3, resume=True)
    trains = [call for call in second.calls if call[0] == "train"]
    assert [v for _, _, v, _ in trains] == [2, 3]  # the broker was at v2
    assert [(x["step"], x["version"]) for x in metrics(c)] == [(0, 1), (1, 3), (2, 4)]
    assert served.broker.core.state.version == 4


def test_the_simulated_learner_imports_no_torch(tmp_path: Path) -> None:
    """The loop, the simulated trainer and its metrics log load no torch (april bench starts many)."""
    script = (
        "import json, sys\n"
        "from pathlib import Path\n"
        "from april.config import load_config\n"
        "from learner.loop import make_trainer, run_learner\n"
        "from learner.metrics import MetricsLog\n"
        "from learner.trainer import ResumePoint\n"
        f"run = Path({str(tmp_path)!r})\n"
        "t = make_trainer(load_config(overrides={'learner.backend': 'sim'}), run)\n"
        "t.publish(run / 'weights', 1)\n"
        "t.save(ResumePoint(1, 1, 0))\n"
        "MetricsLog(run / 'metrics.jsonl').close()\n"
        "print(json.dumps([type(t).__name__, t.resume_point().step, 'torch' in sys.modules]))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120, check=True
    )
    assert json.loads(out.stdout.strip().splitlines()[-1]) == ["SimTrainer", 1, False]


def test_the_model_trainer_reports_its_start_up_phases(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    from april.hf import make_tiny_model
    from learner.model_trainer import ModelTrainer

    model = make_tiny_model(tmp_path / "tiny", seed=0)
    config = load_config(overrides={"learner.model": str(model), "learner.backend": "torch"})
    trainer = ModelTrainer(config, tmp_path / "run")
    reported: list[tuple[LearnerPhase, str]] = []
    trainer.start(lambda phase, detail: reported.append((phase, detail)))
    assert reported == [
        (LearnerPhase.LOADING_MODEL, str(model)),
        (LearnerPhase.INITIALISING_ENGINE, "torch on cpu, torch AdamW, 1 rank"),  # learner.device auto
    ]
    assert trainer.rank == 0 and trainer.world_size == 1 and trainer.vocab_size == 320
    assert trainer.resume_point() is None  # nothing saved yet


def test_the_phase_clock_sums_up_start_up_once_and_sends_each_phase(
    caplog: pytest.LogCaptureFixture,
) -> None:
    now = [100.0]
    sent: list[tuple[LearnerPhase, str]] = []
    clock = PhaseClock(lambda phase, detail: sent.append((phase, detail)), clock=lambda: now[0])
    for phase, seconds in [
        (LearnerPhase.LOADING_MODEL, 4.0),
        (LearnerPhase.INITIALISING_ENGINE, 0.5),
        (LearnerPhase.WAITING_FOR_BATCH, 3.0),
        (LearnerPhase.TRAINING, 1.25),
    ]:
        clock.enter(phase, phase.name)
        now[0] += seconds
    with caplog.at_level(logging.INFO, logger="april.learner"):
        clock.first_step_done()
        clock.enter(LearnerPhase.WAITING_FOR_BATCH, "step 2")
        now[0] += 7.0
        clock.first_step_done()
    summaries = [r.getMessage() for r in caplog.records if r.getMessage().startswith("first step")]
    assert summaries == [
        "first step done 8.8s after the learner started: loading_model 4.0s, initialising_engine 0.5s, "
        "waiting_for_batch 3.0s, training 1.2s"
    ]
    assert [p for p, _ in sent][-1] == LearnerPhase.WAITING_FOR_BATCH and len(sent) == 5
    assert clock.durations[LearnerPhase.WAITING_FOR_BATCH] == 3.0  # later phases are not start-up


def test_a_restarted_broker_hears_the_learner_phase_again(cluster: Callable[..., Cluster]) -> None:
    """The client re-announces its latest phase after every new hello, as it does its latest weights."""
    c = cluster()
    config = load_config(c.config_path)
    first = serve(config, c.run_dir)
    client = BrokerClient(c.learner_address, version=0)
    try:
        client.report_phase(LearnerPhase.LOADING_MODEL, "models/tiny")
        wait_for(lambda: first.broker.learner and first.broker.learner.phase, DEADLINE_S, "the first broker")
        assert first.broker.learner is not None
        assert (first.broker.learner.phase, first.broker.learner.phase_detail) == (
            LearnerPhase.LOADING_MODEL,
            "models/tiny",
        )
        first.close()
        second = serve(config, c.tmp / "second")  # knows no learner: it answers not_registered
        try:

            def heard() -> bool:
                learner = second.broker.learner
                return learner is not None and learner.phase == LearnerPhase.LOADING_MODEL

            client.next_batch(0, heard)  # asks, is refused, says hello again, stops once heard
            assert heard()
            assert second.broker.learner is not None and second.broker.learner.phase_detail == "models/tiny"
        finally:
            second.close()
    finally:
        client.close()


def test_a_restarted_broker_hears_the_learners_engine_again(cluster: Callable[..., Cluster]) -> None:
    """The broker shows the engine the learner initialised after the phase moved on, and a broker that
    lost the learner hears it again with the hello (before the latest phase, which stays the latest)."""
    c = cluster()
    config = load_config(c.config_path)
    first = serve(config, c.run_dir)
    client = BrokerClient(c.learner_address, version=0)
    engine = "DeepSpeed ZeRO-0 on cpu, torch AdamW, 1 rank"
    try:
        client.report_phase(LearnerPhase.INITIALISING_ENGINE, engine)
        client.report_phase(LearnerPhase.WAITING_FOR_BATCH, "step 1")
        wait_for(
            lambda: first.broker.learner and first.broker.learner.phase == LearnerPhase.WAITING_FOR_BATCH,
            DEADLINE_S,
            "the first broker",
        )
        assert first.broker.learner is not None and first.broker.learner.engine == engine
        first.close()
        second = serve(config, c.tmp / "second")
        try:

            def heard() -> bool:
                learner = second.broker.learner
                return learner is not None and learner.phase == LearnerPhase.WAITING_FOR_BATCH

            client.next_batch(0, heard)
            assert second.broker.learner is not None and second.broker.learner.engine == engine
        finally:
            second.close()
    finally:
        client.close()
