"""The broker's status record (april/status.py): built from a live broker, it survives the wire and the
JSON of `april status --json` unchanged; decoding it is strict (a wrong field type is a ProtocolError naming
the field); the JSON keys are the ones docs/protocol.md documents; `StepFigures` reads the learner's
figures under either spelling."""

from __future__ import annotations

import json
import math
import re
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq
from harness import free_ports, wait_for
from test_codec import EXAMPLES

from april import protocol
from april.codec import ProtocolError
from april.config import load_config
from april.status import BrokerStatus, StepFigures
from april.transport import dealer, recv, send
from broker.server import Broker
from cli.status_cmd import fetch_status

DOCS = Path(__file__).resolve().parents[1] / "docs" / "protocol.md"


class LiveBroker:
    """An in-process broker serving on free loopback ports, with a worker and a learner talking to it."""

    def __init__(self, tmp_path: Path) -> None:
        ports = free_ports(3)
        config = load_config(
            overrides={
                "broker.worker_port": ports[0],
                "broker.learner_port": ports[1],
                "broker.pub_port": ports[2],
                "broker.heartbeat_interval_s": 0.2,
                "run.eval_every": 1,
                "data.eval_size": 4,
            }
        )
        self.broker = Broker(config, tmp_path / "run")
        self.broker.bind()
        self.worker_address, self.learner_address = (f"tcp://127.0.0.1:{p}" for p in ports[:2])
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.broker.serve, args=(self.stop.is_set,), daemon=True)
        self.thread.start()

    def halt(self) -> None:
        """Stop the poll loop: the books hold still from now on."""
        self.stop.set()
        self.thread.join(60)
        assert not self.thread.is_alive(), "the broker's loop did not stop"


@pytest.fixture
def live(tmp_path: Path) -> Iterator[LiveBroker]:
    b = LiveBroker(tmp_path)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    try:
        worker = dealer(ctx, b.worker_address, "w0")
        learner = dealer(ctx, b.learner_address, "learner-0")
        send(worker, protocol.WorkerHello("w0", "sim", 4, 0, 4242, "node-1", np.zeros(0, np.int64)))
        send(learner, protocol.LearnerHello("learner-0", 0, 77))
        assert isinstance(recv(learner, 60_000), protocol.Welcome)
        send(learner, protocol.BatchRequest(step=0, last_batch_id=-1))
        worker.send_multipart([b"not", b"a message"])  # counted in `rejected`
        wait_for(
            lambda: (
                (s := fetch_status(b.learner_address, 5)).workers
                and s.workers[0].leases == 4
                and s.learner is not None
                and s.learner.waiting_for_batch
                and s.rejected.total == 1
            ),
            60,
            "a leasing worker, a waiting learner and one rejection",
        )
        yield b
    finally:
        if b.thread.is_alive():
            b.halt()
        ctx.destroy(linger=0)
        b.broker.close()


def test_status_built_by_a_live_broker_round_trips_the_wire_and_json(live: LiveBroker) -> None:
    fetched = fetch_status(live.learner_address, 10)  # over the socket: decoded by the strict codec
    live.halt()
    built = live.broker.status(time.monotonic())
    assert built.workers[0].id == fetched.workers[0].id == "w0" and built.workers[0].leases == 4
    assert built.learner is not None and built.learner.waiting_for_batch
    assert built.eval is not None and built.eval.running is not None  # the v0 baseline evaluation
    assert built.rejected.total == 1 and built.ledger_balanced

    decoded = protocol.decode([bytes(f) for f in protocol.encode(protocol.StatusReply(built))])
    assert isinstance(decoded, protocol.StatusReply) and decoded.status == built

    printed = json.dumps(built.to_json())  # what `april status --json` prints
    assert BrokerStatus.from_json(json.loads(printed)) == built


def test_json_has_the_keys_docs_protocol_md_documents() -> None:
    section = DOCS.read_text().split("## 12. Status", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"^\| `(\w+)` \|", section, re.MULTILINE))
    status: BrokerStatus = EXAMPLES[protocol.StatusReply].status
    assert documented == set(status.to_json())


def _json_of_example() -> dict[str, Any]:
    out: dict[str, Any] = json.loads(json.dumps(EXAMPLES[protocol.StatusReply].status.to_json()))
    return out


def test_from_json_rejects_a_wrong_field_type_naming_the_field() -> None:
    cases: list[tuple[str, Any, str]] = [
        ("version", "3", "status.version: expected int, got str"),
        ("workers", {"w0": {}}, "status.workers: expected a list, got dict"),
        (
            "learner",
            {"id": 7, "last_seen_s": 0.5, "waiting_for_batch": True},
            "status.learner.id: expected str",
        ),
        ("uptime_s", True, "status.uptime_s: expected float, got bool"),
        ("partial_staleness", {"0": 1.5}, "status.partial_staleness['0']: expected int, got float"),
    ]
    for key, value, message in cases:
        obj = _json_of_example()
        obj[key] = value
        with pytest.raises(ProtocolError, match=re.escape(message)) as info:
            BrokerStatus.from_json(obj)
        assert info.value.reason == "wrong_type"
    obj = _json_of_example()
    del obj["ledger"]
    with pytest.raises(ProtocolError, match="status: missing field\\(s\\) ledger"):
        BrokerStatus.from_json(obj)
    with pytest.raises(ProtocolError, match="expected a map, got list"):
        BrokerStatus.from_json([1, 2])


def test_from_json_reads_the_derived_keys_back_as_properties() -> None:
    obj = _json_of_example()
    assert obj["ledger_balanced"] is True and obj["rejected"]["total"] == 2
    status = BrokerStatus.from_json(obj)
    assert status.ledger_balanced and status.rejected.total == 2
    assert math.isnan(status.learner_metrics["eval_accuracy"])  # NaN survives as Python's json NaN


def test_step_figures_read_flat_and_namespaced_names_and_nan_for_the_rest() -> None:
    figures = StepFigures.read(
        {"step": 4.0, "version": 5, "loss": 0.25, "learner/clip_frac": 0.125, "accuracy": True, "mode": "x"}
    )
    assert figures.step == 4 and figures.version == 5
    assert figures.loss == 0.25 and figures.clip_frac == 0.125
    assert math.isnan(figures.accuracy)  # a bool is not a figure
    assert math.isnan(figures.entropy)  # not sent
    assert StepFigures.read({"step": math.nan}).step is None


def test_the_status_says_where_each_worker_and_the_learner_run(tmp_path: Path) -> None:
    """A worker's engine placement comes with its EngineHealth, the learner's engine with its
    INITIALISING_ENGINE report; both stay in the status (and its JSON) after the learner moves on, and
    a new hello forgets them until they are said again (the worker's and learner's clients re-send them)."""
    b = LiveBroker(tmp_path)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    engine = "DeepSpeed ZeRO-0 on cuda, torch fused AdamW, 1 rank"
    try:
        worker, learner = dealer(ctx, b.worker_address, "w0"), dealer(ctx, b.learner_address, "learner-0")
        send(worker, protocol.WorkerHello("w0", "torch", 4, 0, 4242, "node-1", np.zeros(0, np.int64)))
        send(worker, protocol.EngineHealth(True, "", 0, 0, placement="cuda:0, cuda graphs"))
        send(learner, protocol.LearnerHello("learner-0", 0, 77))
        send(learner, protocol.LearnerPhaseReport(protocol.LearnerPhase.INITIALISING_ENGINE, engine))
        send(learner, protocol.LearnerPhaseReport(protocol.LearnerPhase.WAITING_FOR_BATCH, "step 1"))

        def said() -> bool:
            s = fetch_status(b.learner_address, 5)
            return bool(s.workers) and s.workers[0].placement != "" and s.learner is not None

        wait_for(said, 60, "the worker's placement and the learner's engine")
        status = fetch_status(b.learner_address, 5)
        assert status.workers[0].placement == "cuda:0, cuda graphs"
        assert status.workers[0].engine_label == "torch · cuda:0, cuda graphs"
        assert status.learner is not None and status.learner.phase == "waiting for batch"
        assert status.learner.engine == engine
        printed = json.loads(json.dumps(status.to_json()))
        assert printed["workers"][0]["placement"] == "cuda:0, cuda graphs"
        assert printed["learner"]["engine"] == engine

        send(learner, protocol.LearnerHello("learner-0", 0, 77))  # a new session: said again, or unknown
        send(worker, protocol.WorkerHello("w0", "torch", 4, 0, 4242, "node-1", np.zeros(0, np.int64)))
        wait_for(
            lambda: (
                (s := fetch_status(b.learner_address, 5)).learner is not None
                and s.learner.engine == ""
                and s.workers[0].placement == ""
            ),
            60,
            "the hellos forgetting what the sessions before them said",
        )
    finally:
        b.halt()
        ctx.destroy(linger=0)
        b.broker.close()


def test_an_older_status_without_placements_reads_as_unknown() -> None:
    """The fields are evolvable additions: a status from a broker before them reads with "" for both."""
    obj = _json_of_example()
    for w in obj["workers"]:
        w.pop("placement", None)
    obj["learner"].pop("engine", None)
    status = BrokerStatus.from_json(obj)
    assert all(w.placement == "" and w.engine_label == w.engine for w in status.workers)
    assert status.learner is not None and status.learner.engine == ""
