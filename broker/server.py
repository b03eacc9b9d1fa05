"""The broker process: one poll loop over three sockets, driving the broker core from peers' messages.

Sockets: ROUTER for workers (5555), ROUTER for the learner and status clients (5556), PUB for status
snapshots (5557). Every poll has a timeout; every received message is decoded strictly, and a bad one is
dropped, counted (per peer, per reason) and answered with an Error: the broker never exits on a peer's
message. Owns the transport and the clock: which peer is alive (silence past the liveness window),
heartbeats, the learner's session, snapshots (a formed batch leaves only once its snapshot is durable),
the log of settled samples and the journal of the books' changes (`broker.journal`, handed to the
snapshot writer after each turn of the loop), result acknowledgements (a worker's result is acknowledged
once the journal holding it is durable: in the next Lease it is sent, else a ResultAck), eval.jsonl and
the evaluations' rollout records, the status feed and the Prometheus endpoint. Every scheduling decision,
and the workers' liveness (who is lost, who is due a heartbeat), is `broker.core.BrokerCore`'s: the loop
hands it each event with the time, carries out the decisions it returns, and reads its status view.
"""

from __future__ import annotations

import gc
import json
import logging
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import zmq

from april import protocol
from april.codec import ProtocolError
from april.config import Config, ConfigError
from april.failures import RUN_FAILED
from april.files import write_json
from april.keys import server_keys
from april.protocol import Message, WeightsReady
from april.records import Sample
from april.status import BrokerStatus
from april.transport import configure
from april.wire_records import SampleBatch
from broker import decisions, snapshot
from broker.auth import CurveGate
from broker.core import BrokerCore
from broker.eval_records import open_eval_records
from broker.heldout import open_prompts
from broker.journal import Journal
from broker.peers import LearnerPeer, Rejections
from broker.prometheus import PrometheusExporter
from broker.snapshot_writer import SnapshotWriter
from broker.state import BrokerState, PendingBatch
from broker.status import StatusView, build_status

log = logging.getLogger("april.broker")
DRAIN_LIMIT = 256  # messages handled per socket before the loop ticks again ...
# ... or this many of the workers' once a batch is due (`_batch_due`), so the tick forms it, or sends it once
# durable: under a stream of one-sample results, 256 messages held a batch back 100-200 ms at each
DRAIN_LIMIT_BATCH_DUE = 16
STATUS_PERIOD_S = 1.0
# a result of at least this many samples, all accepted and settled, is logged as the worker sent it (one
# record, no per-sample gathering); smaller ones are gathered with others, a record each would cost more
LOG_AS_RECEIVED_MIN = 16
# The cyclic garbage collector, as the poll loop runs. The loop builds a few objects per sample, and they die
# by reference count (a full collection after 13 s of `steady`, 150,000 samples, found 317 objects in
# cycles), but by default a young collection ran every 700 net allocations and a full one, over every
# object of the books, every 70,000: in `steady` (2,048 complete groups waiting) that was the p99 latency
# (150-175 ms, against about 60) and a fifth of the throughput. So what start-up built (config, prompts,
# restored books) is frozen out of every collection, and young collections wait for this many net
# allocations; a full one stays possible for what cyclic garbage there is.
GC_THRESHOLDS = (100_000, 50, 20)
EVAL_LOG = "eval.jsonl"  # one line per finished evaluation, in the run directory
ACK_TICKS = 1  # a result's acknowledgement no Lease carried this many ticks after it came goes alone
TOTALS = "broker_totals.json"  # the run's totals, written when the broker stops (april bench reads it)


@dataclass(slots=True)
class ResultAcks:
    """A worker's results not yet acknowledged to it: (the log write that makes each durable, its seq, when
    it came), oldest first; and the highest seq acknowledged."""

    pending: deque[tuple[int, int, float]] = field(default_factory=deque)
    acked: int = 0


class Broker:
    def __init__(self, config: Config, run_dir: Path, *, resume: bool = False) -> None:
        self.config = config
        self.cfg = config.broker
        self.run_dir = run_dir
        keys = server_keys(Path(self.cfg.curve_keys_dir)) if self.cfg.curve_keys_dir else None  # fail first
        source, held_out = open_prompts(config)
        self.exporter = PrometheusExporter(self.cfg.metrics_port) if self.cfg.metrics_port > 0 else None
        now = time.monotonic()
        if resume and not snapshot.exists(run_dir / "broker"):
            # Killed before its first state file was written (at its start, below): nothing was leased yet,
            # so starting the books afresh loses nothing; refusing would make `april up`'s restart with
            # --resume fail for good.
            log.warning("--resume: no snapshot in %s yet; starting the books afresh", run_dir / "broker")
            resume = False
        trusted: set[int] = set()  # complete groups whose log records the books were restored from
        if resume:  # the last durable state file, and the journal of the changes after it
            state = snapshot.resume(run_dir / "broker", config.run.mode, config.algo, source)
            trusted = snapshot.restored_groups(state)
        else:
            state = BrokerState(config.run.mode, config.algo, source)
        # a state file at once, which the journal follows: a resumed broker's (a second crash must not
        # reuse this epoch's lease ids), and a new one's (a crash before its first snapshot keeps what
        # was acknowledged meanwhile)
        snapshot.write(snapshot.capture(state), run_dir / "broker", trusted)
        self.core = BrokerCore(config, state, held_out, now, restored=resume)
        self.journal = state.journal = Journal()  # every change of the books from now on
        self.snapshots = SnapshotWriter(run_dir / "broker", trusted)
        self.acks: dict[str, ResultAcks] = {}  # workers with results not yet acknowledged to them
        # (worker, seq, when it came) of results whose journal is not queued yet
        self._unlogged: list[tuple[str, int, float]] = []
        self.eval_records = open_eval_records(config, run_dir)
        self.batch_snapshot_seq = 0  # the formed batch is sent once this snapshot is durable
        self.held_batch: PendingBatch | None = None  # handed out by the core, sent once durable
        self.learner: LearnerPeer | None = None
        self.learner_identity = b""
        self.rejections = Rejections()
        self.last_status = 0.0
        self.last_snapshot = now
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.gate = CurveGate(self.ctx, keys, self.rejections) if keys is not None else None
        self.worker_sock = configure(self.ctx.socket(zmq.ROUTER), self.cfg.max_message_bytes)
        self.learner_sock = configure(self.ctx.socket(zmq.ROUTER), self.cfg.max_message_bytes)
        self.pub_sock = configure(self.ctx.socket(zmq.PUB), self.cfg.max_message_bytes)
        if self.gate is not None:  # CurveZMQ: every handshake is checked (and refusals counted) by the gate
            for sock in (self.worker_sock, self.learner_sock, self.pub_sock):
                self.gate.secure(sock)
        for sock in (self.worker_sock, self.learner_sock):
            sock.setsockopt(zmq.ROUTER_MANDATORY, 0)  # a reply to a vanished peer is dropped, never raises
            sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a peer reconnecting under its id replaces the old pipe

    # ------------------------------------------------------------------ lifecycle

    def bind(self) -> None:
        host = self.cfg.bind_host
        self.worker_sock.bind(f"tcp://{host}:{self.cfg.worker_port}")
        self.learner_sock.bind(f"tcp://{host}:{self.cfg.learner_port}")
        self.pub_sock.bind(f"tcp://{host}:{self.cfg.pub_port}")
        log.info(
            "broker %s mode=%s on %s ports %d/%d/%d",
            self.run_dir,
            self.config.run.mode.value,
            host,
            self.cfg.worker_port,
            self.cfg.learner_port,
            self.cfg.pub_port,
        )
        if self.exporter is not None:
            try:
                self.exporter.start(host)
            except OSError as exc:
                self.close()
                raise ConfigError(
                    f"broker.metrics_port = {self.cfg.metrics_port}: cannot serve Prometheus metrics on "
                    f"{host} ({exc.strerror or exc})"
                ) from None
            log.info("Prometheus metrics on http://%s:%d/metrics", host, self.cfg.metrics_port)

    def serve(self, should_stop: Callable[[], bool]) -> None:
        poller = zmq.Poller()
        poller.register(self.worker_sock, zmq.POLLIN)
        poller.register(self.learner_sock, zmq.POLLIN)
        for sock in self.gate.sockets if self.gate is not None else []:
            poller.register(sock, zmq.POLLIN)
        timeout_ms = max(1, int(self.cfg.heartbeat_interval_s * 250))
        gc.freeze()
        gc.set_threshold(*GC_THRESHOLDS)
        while not should_stop():
            waiting_for_disk = self.snapshots.durable_seq < self.batch_snapshot_seq
            events = dict(poller.poll(1 if waiting_for_disk else timeout_ms))
            if self.gate is not None:
                self.gate.drain()
            if self.learner_sock in events:  # first: the learner's requests are what a step waits for
                self._drain(self.learner_sock, self._on_learner)
            if self.worker_sock in events:
                self._drain(self.worker_sock, self._on_worker, batch_first=True)
            self.tick(time.monotonic())

    def close(self) -> None:
        if self.exporter is not None:
            self.exporter.close()
        self.save_snapshot()
        self.snapshots.close()
        if self.eval_records is not None:
            self.eval_records.close()
        totals = {"at_last_step": self.core.last_step_totals, "at_stop": self.core.run_totals()}
        write_json(self.run_dir / TOTALS, totals)
        for sock in (self.worker_sock, self.learner_sock, self.pub_sock):
            sock.close(linger=0)
        if self.gate is not None:
            self.gate.close()
        self.ctx.term()

    def save_snapshot(self) -> int:
        """Queue a snapshot of the books now; returns its sequence number (see SnapshotWriter)."""
        if self.snapshots.error is not None:
            raise snapshot.SnapshotError(f"cannot write snapshots: {self.snapshots.error}")
        self.last_snapshot = time.monotonic()
        self._log_journal()  # the state file goes after the changes it holds, before any it does not
        return self.snapshots.submit(snapshot.capture_refs(self.core.state))

    def _log_journal(self) -> None:
        """Queue the books' changes since the last call; the results handled meanwhile are acknowledged
        once those writes are durable."""
        if len(self.journal):
            self.snapshots.log_journal(self.journal.take())
        if self._unlogged:
            log_seq = self.snapshots.log_seq
            for worker_id, seq, came in self._unlogged:
                self.acks.setdefault(worker_id, ResultAcks()).pending.append((log_seq, seq, came))
            self._unlogged.clear()

    def _acked(self, worker_id: str) -> int:
        """The highest seq of `worker_id`'s results that is durable (0: none yet), about to be sent to it:
        those results are no longer pending."""
        acks = self.acks.get(worker_id)
        if acks is None:
            return 0
        durable = self.snapshots.durable_log
        while acks.pending and acks.pending[0][0] <= durable:
            acks.acked = max(acks.acked, acks.pending.popleft()[1])
        if not acks.pending:
            del self.acks[worker_id]
        return acks.acked

    def _send_acks(self, now: float) -> None:
        """A ResultAck to each worker with a durable result that came ACK_TICKS ticks ago or more and that
        no Lease has acknowledged since (whatever else was sent to it)."""
        durable = self.snapshots.durable_log
        due = now - ACK_TICKS * self.cfg.heartbeat_interval_s / 4
        for worker_id, acks in list(self.acks.items()):
            if worker_id not in self.core.workers:
                del self.acks[worker_id]
            elif acks.pending[0][0] <= durable and acks.pending[0][2] <= due:
                self._send_worker(worker_id, protocol.ResultAck(self._acked(worker_id)))
                self.core.on_sent(worker_id, now)

    # ------------------------------------------------------------------ receiving and sending

    def _drain(
        self,
        sock: zmq.Socket[bytes],
        handle: Callable[[bytes, Message, float], None],
        batch_first: bool = False,
    ) -> None:
        """Handle the socket's waiting messages, up to DRAIN_LIMIT; `batch_first`: DRAIN_LIMIT_BATCH_DUE
        once a batch is due (`BrokerCore.batch_due`), and at least that many, so the loop goes on whatever
        the batch waits for."""
        for handled in range(DRAIN_LIMIT):
            if batch_first and handled >= DRAIN_LIMIT_BATCH_DUE and self.batch_due():
                return
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            identity = frames[0].bytes
            now = time.monotonic()
            try:
                msg = protocol.decode([f.buffer for f in frames[1:]], self.cfg.max_message_bytes)
            except ProtocolError as exc:
                self._reject(sock, identity, exc.reason, str(exc))
                continue
            handle(identity, msg, now)
            if self.cfg.debug_ledger:  # debug builds: the books balance after every state change
                self.core.state.check_ledger(f"after {type(msg).__name__} from {identity!r}")

    def _reject(self, sock: zmq.Socket[bytes], identity: bytes, reason: str, detail: str) -> None:
        peer = identity.decode("utf-8", "replace")[:64]
        self.rejections.count(peer, reason)
        log.debug("rejected message from %r: %s", peer, detail)
        self._send(sock, identity, protocol.Error(reason, detail[:500]))

    def _send(self, sock: zmq.Socket[bytes], identity: bytes, msg: Message) -> None:
        frames = protocol.encode(msg)
        sock.send_multipart([identity, *frames], copy=len(frames) < 4)

    def _send_worker(self, worker_id: str, msg: Message) -> None:
        self._send(self.worker_sock, worker_id.encode(), msg)

    def _send_learner(self, msg: Message) -> None:
        self._send(self.learner_sock, self.learner_identity, msg)

    def batch_due(self) -> bool:
        """The learner waits for a batch that can be formed, or a batch handed out waits for its snapshot."""
        return self.held_batch is not None or self.core.batch_due()

    def _carry_out(
        self, todo: list[decisions.Decision], now: float, result: SampleBatch | None = None
    ) -> None:
        """Do what the core decided, in its order; `result`: the SampleResult's samples the decisions
        answer (a whole result of settled samples is logged as it came)."""
        for d in todo:
            match d:
                case decisions.LeaseOut(worker_id=worker_id, work=work, greedy=greedy):
                    self._send_worker(worker_id, lease_message(work, greedy, self._acked(worker_id)))
                case decisions.Send(worker_id=worker_id, message=message):
                    self._send_worker(worker_id, message)
                case decisions.ToLearner(message=message) if self.learner is not None:
                    self._send_learner(message)
                case decisions.Settled(samples=samples, whole=whole):
                    if whole and result is not None and len(result) >= LOG_AS_RECEIVED_MIN:
                        # the arrays as they came, in one record, with the lease spans the books added
                        self.snapshots.log_received(result.with_leases(samples))
                    elif samples:
                        self.snapshots.log_groups([(s.group_id, [s]) for s in samples])
                case decisions.Refuse(peer_id=peer_id, reason=reason, detail=detail, reply=reply):
                    self.rejections.count(peer_id, reason)
                    if reply:
                        self._send(self.worker_sock, peer_id.encode(), protocol.Error(reason, detail))
                case decisions.BatchFormed(batch=batch, again=again):
                    if not again:  # a new batch leaves once the snapshot holding it is durable
                        self.batch_snapshot_seq = self.save_snapshot()
                    self.held_batch = batch
                    self._send_batch(now)
                case decisions.WorkerLost(worker_id=worker_id):
                    self.acks.pop(worker_id, None)
                case decisions.EvalFinished(result=finished):
                    line = json.dumps({"time": time.time(), **finished.to_json()})
                    with open(self.run_dir / EVAL_LOG, "a", encoding="utf-8") as f:
                        f.write(line + "\n")  # the final one lands after the last step
                    if self.eval_records is not None:
                        self.eval_records.submit(finished)
                case decisions.RunStopped(line=line) if self.learner is not None:  # it exits with the line
                    self._send_learner(protocol.Error(RUN_FAILED, line[:500]))

    # ------------------------------------------------------------------ workers

    def _on_worker(self, identity: bytes, msg: Message, now: float) -> None:
        worker_id = identity.decode("utf-8", "replace")
        core = self.core
        if isinstance(msg, protocol.WorkerHello):
            if identity != msg.worker_id.encode():
                self._reject(
                    self.worker_sock,
                    identity,
                    "identity_mismatch",
                    "worker_id must equal the socket identity",
                )
                return
            self.acks.pop(msg.worker_id, None)  # a new session: its results are sent again and acknowledged
            self._unlogged = [item for item in self._unlogged if item[0] != msg.worker_id]
            self._carry_out(core.on_hello(msg, now), now)
            return
        if worker_id not in core.workers:
            self._reject(self.worker_sock, identity, "not_registered", "send WorkerHello first")
            return
        self._carry_out(core.on_heard(worker_id, now), now)
        match msg:
            case protocol.Heartbeat():
                pass
            case protocol.LeaseRequest(credit=credit):
                self._carry_out(core.on_credit(worker_id, credit), now)
            case protocol.SampleResult():
                self._carry_out(core.on_result(worker_id, msg, now), now, msg.samples)
                if msg.seq:  # acknowledged once its journal is durable
                    self._unlogged.append((worker_id, msg.seq, now))
            case protocol.AbortDone():
                self._carry_out(
                    core.on_abort_done(worker_id, msg.round_id, msg.credit, set(msg.scoring.tolist()), now),
                    now,
                )
            case protocol.EngineUsage():
                self._carry_out(core.on_usage(worker_id, msg, now), now)
            case protocol.EngineHealth():
                self._carry_out(core.on_engine_health(worker_id, msg), now)
            case protocol.WeightsLoaded():
                self._carry_out(core.on_weights_loaded(worker_id, msg), now)
            case protocol.Disconnect(reason=reason):
                log.info("worker %s disconnected: %s", worker_id, reason)
                self._carry_out(core.on_worker_lost(worker_id), now)
            case _:
                self._reject(self.worker_sock, identity, "unexpected_message", type(msg).__name__)

    # ------------------------------------------------------------------ learner and status clients

    def _on_learner(self, identity: bytes, msg: Message, now: float) -> None:
        core = self.core
        if isinstance(msg, protocol.StatusRequest):
            self._send(self.learner_sock, identity, protocol.StatusReply(self.status(now)))
            return
        if isinstance(msg, protocol.LearnerHello):
            self.learner = LearnerPeer(msg.learner_id, last_seen=now, last_sent=now)
            self.learner_identity = identity
            self.held_batch = None  # a batch handed to an earlier session goes again when this one asks
            log.info("learner %s registered (v%d)", msg.learner_id, msg.version)
            self._carry_out(core.on_learner_hello(msg.learner_id), now)
            return
        if self.learner is None or identity != self.learner_identity:
            self._reject(self.learner_sock, identity, "not_registered", "send LearnerHello first")
            return
        self.learner.last_seen = now
        match msg:
            case protocol.Heartbeat():
                pass
            case protocol.BatchRequest(step=step, last_batch_id=last):
                self._carry_out(core.on_batch_request(step, last, now), now)
            case protocol.BatchAck(batch_id=batch_id, metrics=metrics):
                self._carry_out(core.on_ack(batch_id, now, dict(metrics)), now)
            case protocol.WeightsReady(version=version, uri=uri, sha256=sha256):
                todo = core.on_weights(version, uri, sha256, now)
                if any(isinstance(d, decisions.Send) and isinstance(d.message, WeightsReady) for d in todo):
                    # the version is durable before any worker hears of it: a restarted broker must not
                    # refuse the tokens of a version its workers generated with (future_version)
                    self._log_journal()
                    self.snapshots.wait_log(self.snapshots.log_seq, timeout=60.0)
                self._carry_out(todo, now)
            case protocol.LearnerPhaseReport(phase=phase, detail=detail):
                self.learner.enter(phase, detail, now)
            case protocol.Disconnect():
                self.learner = None
                self.held_batch = None
                self._carry_out(core.on_learner_gone(), now)
            case _:
                self._reject(self.learner_sock, identity, "unexpected_message", type(msg).__name__)

    def _send_batch(self, now: float) -> None:
        """Send the batch the core handed out once its snapshot is durable: a crash must never forget a
        batch the learner may have trained."""
        batch = self.held_batch
        if batch is None or self.learner is None or self.snapshots.durable_seq < self.batch_snapshot_seq:
            return
        columns = self.snapshots.batch_columns(batch.batch_id)  # gathered off the loop with its snapshot
        message = protocol.Batch(
            batch_id=batch.batch_id,
            step=batch.step,
            version=batch.version,
            samples=SampleBatch.from_samples(batch.samples) if columns is None else columns,
            stats=dict(batch.stats),
            ledger=self.core.state.ledger(),
        )
        self._send_learner(message)
        self.held_batch = None
        self.learner.last_sent = now

    # ------------------------------------------------------------------ the tick

    def tick(self, now: float) -> None:
        if self.snapshots.error is not None:
            raise snapshot.SnapshotError(f"cannot write snapshots: {self.snapshots.error}")
        core = self.core
        self._carry_out(core.tick(now), now)
        self._send_batch(now)
        if self.acks:
            self._send_acks(now)
        if self.learner is not None and now - self.learner.last_sent >= self.cfg.heartbeat_interval_s:
            self._send(self.learner_sock, self.learner_identity, protocol.Heartbeat())
            self.learner.last_sent = now
        if now - self.last_status >= STATUS_PERIOD_S:
            self.last_status = now
            status = self.status(now)
            self.pub_sock.send_multipart([b"status", *protocol.encode(protocol.StatusReply(status))])
            if self.exporter is not None:
                self.exporter.update(status)
        if now - self.last_snapshot >= self.cfg.snapshot_interval_s:
            self.save_snapshot()
        self._log_journal()
        if self.cfg.debug_ledger:
            core.state.check_ledger("in debug tick")

    def status(self, now: float) -> BrokerStatus:
        view = StatusView(
            run=self.config.run.name,
            steps=self.config.run.steps,
            core=self.core.view(now),
            learner=self.learner,
            batch_held=self.held_batch is not None,
            rejections=self.rejections,
        )
        return build_status(view, now)


def lease_message(work: list[tuple[int, int, Sample]], greedy: int, acked: int = 0) -> protocol.Lease:
    """One Lease message: the first `greedy` items are evaluation samples (decoded greedily); `acked`: the
    worker's results acknowledged so far."""
    lease_ids, budgets, samples = zip(*work, strict=True)
    return protocol.Lease(
        lease_ids=np.array(lease_ids, dtype=np.int64),
        budgets=np.array(budgets, dtype=np.int32),
        greedy=(np.arange(len(work)) < greedy).astype(np.uint8),
        samples=SampleBatch.from_samples(samples),
        acked=acked,
    )
