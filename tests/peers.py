"""Scripted protocol peers for broker integration tests, run as separate processes.

`python tests/peers.py worker '<json>'` / `python tests/peers.py learner '<json>'` (JSON, not pickle).
A scripted worker is a fake engine on purpose: these tests are about the broker. It "decodes" one token
per sample per step with deterministic, long-tailed target lengths, streams finished samples, returns
partials on Abort, follows WeightsReady, and reconnects (re-hello with its held leases) when the broker
goes silent. The scripted learner requests batches, checks they hold exactly N samples in complete groups,
publishes a version per step and acks; it can crash before acking. Both append JSON lines describing
what they saw to `events` files that the tests read.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import zmq

from april import protocol
from april.codec import ProtocolError
from april.records import FinishReason, Sample, SampleStatus
from april.transport import dealer, recv, send
from april.wire_records import SampleBatch

FAKE_SHA = "0" * 64
SCRIPTED_SYNC_S = 0.125  # a scripted worker reports version v loaded by "network" in v x this many seconds


def target_length(group_id: int, index: int, max_new_tokens: int, tail_every: int) -> int:
    """Deterministic long tail: most responses short, every `tail_every`-th group very long."""
    rng = np.random.default_rng(group_id * 1009 + index)
    if tail_every and group_id % tail_every == tail_every - 1:
        return max_new_tokens + 10  # runs into the budget: finishes with reason length
    return int(rng.integers(2, max(3, max_new_tokens // 6)))


class Events:
    def __init__(self, path: str) -> None:
        self.f = open(path, "a", buffering=1)  # noqa: SIM115 - lives as long as the process

    def write(self, **event: Any) -> None:
        self.f.write(json.dumps({"t": time.time(), **event}) + "\n")


@dataclass
class Running:
    lease_id: int
    sample: Sample
    target: int
    budget: int
    generated: int = 0


@dataclass
class WorkerScript:
    address: str
    worker_id: str
    events: str
    slots: int = 4
    step_s: float = 0.005
    tail_every: int = 0
    retire_after_aborts: int = 0  # send Disconnect after confirming this many aborts (0 = never)
    ignore_abort: bool = False
    heartbeat_s: float = 0.2
    liveness: int = 3
    running: dict[int, Running] = field(default_factory=dict)


def run_worker(cfg: WorkerScript) -> None:
    ev = Events(cfg.events)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = hello(ctx, cfg, ev)
    version, max_new = 0, 16
    last_heard, last_sent, aborts = time.monotonic(), 0.0, 0
    while True:
        try:
            msg = recv(sock, int(cfg.step_s * 1000) or 1)
        except ProtocolError as exc:
            ev.write(kind="protocol_error", error=str(exc))
            msg = None
        now = time.monotonic()
        if msg is not None:
            last_heard = now
        match msg:
            case protocol.Welcome():
                if msg.weights_uri:  # (re)loads the run's weights, as a worker does after every hello
                    send(sock, protocol.WeightsLoaded(msg.version, True, "", "network", SCRIPTED_SYNC_S))
                version, max_new = msg.version, msg.max_new_tokens
                ev.write(kind="welcome", version=version)
            case protocol.Lease():
                for lid, budget, greedy, s in zip(
                    msg.lease_ids.tolist(),
                    msg.budgets.tolist(),
                    msg.greedy.tolist(),
                    msg.samples.to_samples(),
                    strict=True,
                ):
                    ev.write(
                        kind="lease",
                        lease=lid,
                        g=s.group_id,
                        i=s.index,
                        len=s.response_len,
                        resumes=s.resumes,
                        greedy=bool(greedy),
                        prompt=s.metadata.get("prompt_index", ""),
                        version=version,
                    )
                    if s.prompt_ids.shape[0] == 0:  # text-only prompt: "tokenize" it
                        s = Sample(**{**_fields(s), "prompt_ids": np.array([1, 2, 3], dtype=np.int32)})
                    cfg.running[lid] = Running(
                        lid, s, target_length(s.group_id, s.index, max_new, cfg.tail_every), budget
                    )
            case protocol.Abort(round_id=round_id):
                ev.write(kind="abort", round=round_id, held=len(cfg.running))
                if cfg.ignore_abort:
                    continue
                return_partials(sock, cfg, version, ev)
                send(sock, protocol.AbortDone(round_id, cfg.slots, np.zeros(0, np.int64)))
                aborts += 1
                if cfg.retire_after_aborts and aborts >= cfg.retire_after_aborts:
                    send(sock, protocol.Disconnect("retiring"))
                    ev.write(kind="retired")
                    time.sleep(0.2)
                    return
            case protocol.WeightsReady(version=v):
                version = v
                # a known transport and a sync time the broker must relay as reported (status, batch stats)
                send(sock, protocol.WeightsLoaded(v, True, "", "network", SCRIPTED_SYNC_S * v))
                ev.write(kind="weights", version=v)
            case protocol.Error(code=code, detail=detail):
                ev.write(kind="error", code=code, detail=detail)
                if code == "not_registered":
                    sock.close(linger=0)
                    sock = hello(ctx, cfg, ev)
                elif code == "not_leased":
                    drop_unknown_leases(cfg, detail)
        if cfg.running and decode_step(sock, cfg, version, ev):
            last_sent = now
        if now - last_sent > cfg.heartbeat_s:
            send(sock, protocol.Heartbeat())
            last_sent = now
        if now - last_heard > cfg.liveness * cfg.heartbeat_s * 2:
            ev.write(kind="reconnect", held=len(cfg.running))
            sock.close(linger=0)
            sock = hello(ctx, cfg, ev)
            last_heard = now


def _fields(s: Sample) -> dict[str, Any]:
    return {name: getattr(s, name) for name in Sample.__dataclass_fields__}


def hello(ctx: zmq.Context[zmq.Socket[bytes]], cfg: WorkerScript, ev: Events) -> zmq.Socket[bytes]:
    sock = dealer(ctx, cfg.address, cfg.worker_id)
    held = np.array(sorted(cfg.running), dtype=np.int64)
    send(sock, protocol.WorkerHello(cfg.worker_id, "scripted", cfg.slots, 0, os.getpid(), "localhost", held))
    ev.write(kind="hello", held=len(held))
    return sock


def drop_unknown_leases(cfg: WorkerScript, detail: str) -> None:
    for word in detail.split():
        if word.isdigit() and int(word) in cfg.running:
            del cfg.running[int(word)]


def decode_step(sock: zmq.Socket[bytes], cfg: WorkerScript, version: int, ev: Events) -> bool:
    """One token for every running sample; stream the finished ones. True if something was sent."""
    time.sleep(cfg.step_s)
    done: list[Running] = []
    for r in cfg.running.values():
        if r.generated < r.budget and r.sample.response_len < r.target:
            r.generated += 1
            r.sample = r.sample.extend([5 + r.generated % 50], [-0.5], version, FinishReason.NONE)
        if r.sample.response_len >= r.target or r.generated >= r.budget:  # budget 0: finished at once
            reason = FinishReason.STOP if r.sample.response_len >= r.target else FinishReason.LENGTH
            reward = float((r.sample.group_id + r.sample.index) % 2)
            r.sample = r.sample.extend([], [], version, reason).scored(reward)
            done.append(r)
    if done:
        finish(sock, cfg, done, ev)
    return bool(done)


def finish(sock: zmq.Socket[bytes], cfg: WorkerScript, done: list[Running], ev: Events) -> None:
    for r in done:
        del cfg.running[r.lease_id]
        ev.write(
            kind="result",
            lease=r.lease_id,
            g=r.sample.group_id,
            i=r.sample.index,
            status=r.sample.status.name,
            len=r.sample.response_len,
        )
    send(
        sock,
        protocol.SampleResult(
            lease_ids=np.array([r.lease_id for r in done], dtype=np.int64),
            samples=SampleBatch.from_samples([r.sample for r in done]),
            credit=len(done),
        ),
    )


def return_partials(sock: zmq.Socket[bytes], cfg: WorkerScript, version: int, ev: Events) -> None:
    if not cfg.running:
        return
    for r in cfg.running.values():
        if r.sample.status == SampleStatus.RUNNING or r.sample.status == SampleStatus.PENDING:
            r.sample = r.sample.extend([], [], version, FinishReason.ABORT)
    done = list(cfg.running.values())
    finish(sock, cfg, done, ev)


# ---------------------------------------------------------------------------------------------------


@dataclass
class LearnerScript:
    address: str
    events: str
    steps: int
    samples_per_batch: int
    group_size: int
    train_s: float = 0.05
    crash_before_ack_at_step: int = -1
    weights_file: str = ""  # publish this file (with its real sha256) instead of sim:// URIs
    bad_sha_at_step: int = -1  # announce a wrong sha256 for this step's weights
    start_step: int = 0
    heartbeat_s: float = 0.2
    liveness: int = 3
    learner_id: str = field(default_factory=lambda: f"learner-{uuid.uuid4().hex[:8]}")


def run_learner(cfg: LearnerScript) -> None:
    ev = Events(cfg.events)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    version = cfg.start_step
    step = cfg.start_step
    last_batch = -1  # the last batch trained: sent with every request so a lost ack is never lost for good
    sock = learner_hello(ctx, cfg, version)
    send(sock, protocol.BatchRequest(step, last_batch))
    last_heard = last_sent = last_hello = time.monotonic()
    while step < cfg.steps:
        try:
            msg = recv(sock, 50)
        except ProtocolError as exc:
            ev.write(kind="protocol_error", error=str(exc))
            continue
        now = time.monotonic()
        if msg is not None:
            last_heard = now
        if isinstance(msg, protocol.Batch) and msg.batch_id == last_batch:
            send(sock, protocol.BatchAck(msg.batch_id, {}))  # trained already: only the ack was lost
        elif isinstance(msg, protocol.Batch):
            check_batch(msg, cfg, ev)
            if step == cfg.crash_before_ack_at_step:
                ev.write(kind="crash", batch=msg.batch_id)
                os._exit(3)
            time.sleep(cfg.train_s)
            version += 1
            send(sock, weights_message(cfg, version, bad=step == cfg.bad_sha_at_step))
            send(sock, protocol.BatchAck(msg.batch_id, {}))
            last_batch = msg.batch_id
            step += 1
            if step < cfg.steps:
                send(sock, protocol.BatchRequest(step, last_batch))
            last_sent = now
        elif isinstance(msg, protocol.Error):
            ev.write(kind="error", code=msg.code, detail=msg.detail)
        if now - last_sent > cfg.heartbeat_s:
            send(sock, protocol.Heartbeat())
            last_sent = now
        # a broker gone (silent), or one that restarted and does not know us (it answers every message
        # with not_registered, so it is never silent: april.peer_link's rule): hello again, ask again
        unknown = isinstance(msg, protocol.Error) and msg.code == "not_registered"
        if unknown and now - last_hello < cfg.heartbeat_s:
            unknown = False  # at most one hello an interval: a burst of answers asks for one
        if unknown or now - last_heard > cfg.liveness * cfg.heartbeat_s * 2:
            ev.write(kind="reconnect", step=step)
            last_hello = now
            sock.close(linger=0)
            sock = learner_hello(ctx, cfg, version)
            if version > cfg.start_step:  # the broker may have lost the announcement with its state
                send(sock, weights_message(cfg, version))
            send(sock, protocol.BatchRequest(step, last_batch))
            last_heard = now
    ev.write(kind="done", steps=step)
    send(sock, protocol.Disconnect("done"))
    time.sleep(0.1)


def weights_message(cfg: LearnerScript, version: int, bad: bool = False) -> protocol.WeightsReady:
    if not cfg.weights_file:
        return protocol.WeightsReady(version, f"sim://weights/v{version}", FAKE_SHA)
    sha = hashlib.sha256(open(cfg.weights_file, "rb").read()).hexdigest()  # noqa: SIM115
    return protocol.WeightsReady(version, f"file://{cfg.weights_file}", FAKE_SHA if bad else sha)


def learner_hello(ctx: zmq.Context[zmq.Socket[bytes]], cfg: LearnerScript, version: int) -> zmq.Socket[bytes]:
    sock = dealer(ctx, cfg.address, cfg.learner_id)
    send(sock, protocol.LearnerHello(cfg.learner_id, version, os.getpid()))
    return sock


def check_batch(msg: protocol.Batch, cfg: LearnerScript, ev: Events) -> None:
    samples = msg.samples.to_samples()
    groups: dict[int, list[int]] = {}
    for s in samples:
        groups.setdefault(s.group_id, []).append(s.index)
    ok = (
        len(samples) == cfg.samples_per_batch
        and all(sorted(ix) == list(range(cfg.group_size)) for ix in groups.values())
        and all(s.status == SampleStatus.FINISHED for s in samples)
    )
    ev.write(
        kind="batch",
        batch=msg.batch_id,
        step=msg.step,
        version=msg.version,
        ok=ok,
        samples=len(samples),
        keys=[[s.group_id, s.index] for s in samples],
        staleness=[s.staleness(msg.version) for s in samples],
        segments=[[list(map(int, (g.version, g.start, g.end))) for g in s.segments] for s in samples],
        observations=[[[int(o.start), int(o.end)] for o in s.observations] for s in samples],
        responses=[s.response_ids.tolist() for s in samples],
        rewards=[s.reward for s in samples],
        resumes=[s.resumes for s in samples],
        episodes=[s.episode.decode() for s in samples],
        stats=msg.stats,
        ledger=msg.ledger.to_json(),
        balanced=msg.ledger.balanced,
    )


def main() -> None:
    role, args = sys.argv[1], json.loads(sys.argv[2])
    if role == "worker":
        run_worker(WorkerScript(**args))
    elif role == "learner":
        run_learner(LearnerScript(**args))
    else:
        raise SystemExit(f"unknown role {role}")


if __name__ == "__main__":
    main()
