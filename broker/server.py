"""The broker process: one poll loop over three sockets, driving `BrokerState` from peers' messages.

Sockets: ROUTER for workers (5555), ROUTER for the learner and status clients (5556), PUB for status
snapshots (5557). Every poll has a timeout; every received message is decoded strictly, and a bad one is
dropped, counted (per peer, per reason) and answered with an Error: the broker never exits on a peer's
message. Orchestrates what needs clocks: liveness, the confirmed abort (re-abort on timeout, then declare
the worker dead), heartbeats, periodic snapshots and status publishing. Scheduling decisions are the
policy's (`broker.policy`), the books are `broker.state`'s, evaluations on the held-out prompts are
`broker.evaluation`'s and the Prometheus endpoint is `broker.prometheus`'s; this module only wires them to
the network.
"""

from __future__ import annotations

import gc
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import zmq

from april import protocol
from april.codec import ProtocolError
from april.config import Config, ConfigError
from april.data import PromptRecord, PromptSource, open_source
from april.keys import server_keys
from april.protocol import Message
from april.records import SETTLED, Sample
from april.status import BrokerStatus
from april.transport import configure
from april.weights_uri import WEIGHT_TRANSPORTS
from april.wire_records import SampleBatch
from broker import policy, snapshot
from broker.auth import CurveGate
from broker.evaluation import EvalResult, Evaluations
from broker.heldout import split_held_out
from broker.peers import LearnerPeer, Rejections, WorkerPeer, Workers
from broker.prometheus import PrometheusExporter
from broker.result_check import ResultRejected
from broker.snapshot_writer import SnapshotWriter
from broker.state import BrokerState, PendingBatch
from broker.status import build_status, run_totals
from broker.usage import SlotUsage

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
TOTALS = "broker_totals.json"  # the run's totals, written when the broker stops (april bench reads it)


@dataclass(slots=True)
class AbortRound:
    """An abort in progress: workers that still owe an AbortDone, with their deadline and attempts."""

    round_id: int
    started: float
    deadline: dict[str, float] = field(default_factory=dict)
    attempts: dict[str, int] = field(default_factory=dict)


def open_prompts(config: Config) -> tuple[PromptSource, tuple[PromptRecord, ...]]:
    """The run's training prompts and its held-out ones (none when it does not evaluate); a bad dataset
    or held-out size raises DatasetError / ConfigError (`april up` calls this before starting anything)."""
    source = open_source(config.data, config.run.seed)
    if config.run.eval_every > 0 and config.data.eval_size > 0:
        return split_held_out(source, config.data.eval_size)  # training never sees them
    return source, ()


class Broker:
    def __init__(self, config: Config, run_dir: Path, *, resume: bool = False) -> None:
        self.config = config
        self.cfg = config.broker
        self.run_dir = run_dir
        keys = server_keys(Path(self.cfg.curve_keys_dir)) if self.cfg.curve_keys_dir else None  # fail first
        source, held_out = open_prompts(config)
        self.evals = Evaluations(
            held_out, config.run.eval_every, config.run.steps, config.algo.max_new_tokens, self._record_eval
        )
        self.exporter = PrometheusExporter(self.cfg.metrics_port) if self.cfg.metrics_port > 0 else None
        self.workers = Workers(self.cfg.heartbeat_interval_s, self.cfg.liveness)
        self.behind_warned = 0  # the last version no worker with free slots served (warned once each)
        self.behind_since: float | None = None  # since when no worker with free slots may be leased work
        now = time.monotonic()
        if resume and not snapshot.exists(run_dir / "broker"):
            # Killed before its first snapshot: nothing was persisted, and no batch was handed out (a batch
            # leaves only once a snapshot holding it is durable), so starting the books afresh loses nothing;
            # refusing would make `april up`'s restart with --resume fail for good.
            log.warning("--resume: no snapshot in %s yet; starting the books afresh", run_dir / "broker")
            resume = False
        trusted: set[int] = set()  # complete groups whose log records the books were restored from
        if resume:
            snap = snapshot.read(run_dir / "broker")
            self.state = snapshot.restore(snap, config.run.mode, config.algo, source)
            for worker_id in {lease.worker_id for lease in self.state.leases.values()}:
                self.workers.register(worker_id, now, restored=True)
            trusted = snapshot.restored_groups(self.state)
            # persist the new epoch at once: a second crash must not reuse this epoch's lease ids
            snapshot.write(snapshot.capture(self.state), run_dir / "broker", trusted)
        else:
            self.state = BrokerState(config.run.mode, config.algo, source)
            self.evals.on_version(0)  # a baseline: the starting weights on the held-out prompts
        self.state.max_live_samples = self.cfg.max_buffered_samples
        self.snapshots = SnapshotWriter(run_dir / "broker", trusted)
        self.batch_snapshot_seq = 0  # the formed batch is sent once this snapshot is durable
        self.learner: LearnerPeer | None = None
        self.learner_identity = b""
        self.learner_waiting: int | None = None  # step of an unanswered BatchRequest
        self.learner_metrics: dict[str, float] = {}  # the learner's figures of its last acked step
        self.rejections = Rejections()
        self.batches_acked = 0
        self.abort: AbortRound | None = None
        self.round_id = 0
        self.aborts_done = 0
        self.started = now
        self.round_started = now
        self.usage = SlotUsage(now)  # the workers' slot usage, per batch (rollout phases) and in total
        self.first_lease: float | None = None  # when generation started: batches' run_s count from it
        self.last_step_totals: dict[str, object] | None = None  # run_totals when the last step was acked
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
            self.state.mode.value,
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

    def _batch_due(self) -> bool:
        """The learner waits, and its batch is formed (a tick sends it once durable) or a batch worth of
        groups is complete (a tick may form it)."""
        if self.learner_waiting is None:
            return False
        return self.state.batch is not None or len(self.state.complete) >= self.state.algo.rollout_batch_size

    def close(self) -> None:
        if self.exporter is not None:
            self.exporter.close()
        self.save_snapshot()
        self.snapshots.close()
        totals = {"at_last_step": self.last_step_totals, "at_stop": run_totals(self)}
        (self.run_dir / TOTALS).write_text(json.dumps(totals, indent=2) + "\n", encoding="utf-8")
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
        return self.snapshots.submit(snapshot.capture_refs(self.state))

    # ------------------------------------------------------------------ receiving

    def _drain(
        self,
        sock: zmq.Socket[bytes],
        handle: Callable[[bytes, Message, float], None],
        batch_first: bool = False,
    ) -> None:
        """Handle the socket's waiting messages, up to DRAIN_LIMIT; `batch_first`: DRAIN_LIMIT_BATCH_DUE
        once a batch is due, and at least that many, so the loop goes on whatever the batch waits for."""
        for handled in range(DRAIN_LIMIT):
            if batch_first and handled >= DRAIN_LIMIT_BATCH_DUE and self._batch_due():
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
                self.state.check_ledger(f"after {type(msg).__name__} from {identity!r}")

    def _reject(self, sock: zmq.Socket[bytes], identity: bytes, reason: str, detail: str) -> None:
        peer = identity.decode("utf-8", "replace")[:64]
        self.rejections.count(peer, reason)
        log.debug("rejected message from %r: %s", peer, detail)
        self._send(sock, identity, protocol.Error(reason, detail[:500]))

    def _send(self, sock: zmq.Socket[bytes], identity: bytes, msg: Message) -> None:
        frames = protocol.encode(msg)
        sock.send_multipart([identity, *frames], copy=len(frames) < 4)

    def _send_worker(self, worker_id: str, msg: Message, now: float) -> None:
        self._send(self.worker_sock, worker_id.encode(), msg)
        peer = self.workers.get(worker_id)
        if peer is not None:
            self.workers.sent(peer, now)

    # ------------------------------------------------------------------ workers

    def _on_worker(self, identity: bytes, msg: Message, now: float) -> None:
        worker_id = identity.decode("utf-8", "replace")
        if isinstance(msg, protocol.WorkerHello):
            self._on_hello(identity, msg, now)
            return
        peer = self.workers.get(worker_id)
        if peer is None:
            self._reject(self.worker_sock, identity, "not_registered", "send WorkerHello first")
            return
        self.workers.heard(peer, now)
        peer.messages += 1
        if peer.restored and now - peer.hello_asked >= self.cfg.heartbeat_interval_s:
            # a worker whose socket reconnected to this restarted broker by itself never finds it silent
            # (it answers and sends heartbeats): only this asks it for the hello that makes it leasable
            peer.hello_asked = now
            self._send_worker(worker_id, protocol.Error("not_registered", "broker restarted: say hello"), now)
        match msg:
            case protocol.Heartbeat():
                pass
            case protocol.LeaseRequest(credit=credit):
                self._grant(worker_id, credit)
            case protocol.SampleResult():
                peer.samples_returned += len(msg.samples)
                self._on_results(worker_id, msg)
                # refill at once (the slot is idle until then), spreading as every dispatch does; no
                # training work once the round is complete
                self._dispatch(now, train=not self.state.round_complete())
            case protocol.AbortDone():
                self._on_abort_done(worker_id, msg, now)
            case protocol.EngineUsage():
                self.usage.report(worker_id, msg, now)
            case protocol.EngineHealth():
                self._on_engine_health(peer, msg)
            case protocol.WeightsLoaded(version=version, ok=ok, error=error):
                if ok and version >= peer.version:  # a late report of an older version changes nothing
                    peer.version = version
                    peer.weights_transport, peer.weights_sync_s = msg.transport, msg.sync_s
                elif not ok:  # e.g. a sha256 mismatch: the worker keeps serving its old weights
                    peer.failed_version = max(peer.failed_version, version)
                    self.rejections.count(worker_id, "weights_not_loaded")
                    log.warning("worker %s failed to load weights v%d: %s", worker_id, version, error)
            case protocol.Disconnect(reason=reason):
                log.info("worker %s disconnected: %s", worker_id, reason)
                self._drop_worker(worker_id)
            case _:
                self._reject(self.worker_sock, identity, "unexpected_message", type(msg).__name__)

    def _on_hello(self, identity: bytes, msg: protocol.WorkerHello, now: float) -> None:
        if identity != msg.worker_id.encode():
            self._reject(
                self.worker_sock, identity, "identity_mismatch", "worker_id must equal the socket identity"
            )
            return
        held = set(msg.held_leases.tolist())
        kept = 0
        for lease_id in self._leases_of(msg.worker_id):
            if lease_id in held:
                kept += 1
            else:
                self._reclaim(lease_id)
        peer = self.workers.register(
            msg.worker_id,
            now,
            engine=msg.engine,
            slots=msg.slots,
            credit=max(0, msg.slots - kept),
            version=msg.version,
            pid=msg.pid,
            host=msg.host,
        )
        if peer is None:
            self._reject(self.worker_sock, identity, "too_many_workers", "worker registry is full")
            return
        log.info(
            "worker %s registered (%s, %d slots, v%d, kept %d leases)",
            msg.worker_id,
            msg.engine,
            msg.slots,
            msg.version,
            kept,
        )
        self._send_worker(msg.worker_id, self._welcome(msg.worker_id), now)
        if self.abort is not None:  # a new session: it owes an AbortDone only for leases it kept
            if kept:
                self._send_abort(msg.worker_id, now)
            else:
                self.abort.deadline.pop(msg.worker_id, None)

    def _welcome(self, peer_id: str) -> protocol.Welcome:
        algo = self.config.algo
        return protocol.Welcome(
            peer_id=peer_id,
            mode=self.state.mode.value,
            version=self.state.version,
            weights_uri=self.state.weights_uri,
            weights_sha256=self.state.weights_sha256,
            heartbeat_interval_s=self.cfg.heartbeat_interval_s,
            max_new_tokens=algo.max_new_tokens,
            temperature=algo.temperature,
            top_p=algo.top_p,
            top_k=algo.top_k,
        )

    def _grant(self, worker_id: str, credit: int) -> None:
        peer = self.workers.peers[worker_id]
        # restored: slots unknown until it says hello, it finishes its leases and gets nothing new;
        # engine down: nothing until its EngineHealth says it serves again (then it grants its slots)
        if not peer.leasable:
            return
        self.workers.set_credit(peer, max(0, min(peer.credit + credit, peer.slots)))

    def _on_engine_health(self, peer: WorkerPeer, msg: protocol.EngineHealth) -> None:
        if msg.ok != peer.engine_ok:
            if msg.ok:
                log.info("worker %s: engine serves again", peer.peer_id)
            else:
                log.warning("worker %s: engine down, leasing it nothing: %s", peer.peer_id, msg.detail)
        peer.engine_ok, peer.engine_detail = msg.ok, msg.detail
        peer.failed_by_engine, peer.returned_by_engine = msg.failed_by_engine, msg.returned_by_engine
        if not msg.ok:
            self.workers.set_credit(peer, 0)

    def _on_results(self, worker_id: str, msg: protocol.SampleResult) -> None:
        peer = self.workers.peers[worker_id]
        settled: list[Sample] = []
        lease_ids = msg.lease_ids.tolist()
        vouched = self.state.vouch(worker_id, lease_ids, msg.samples)
        for lease_id, sample, ok in zip(lease_ids, msg.samples.to_samples(), vouched, strict=True):
            try:
                if self.evals.owns(lease_id):
                    accepted = self.evals.accept_result(worker_id, lease_id, sample, self.state.version)
                else:
                    accepted = self.state.accept_result(worker_id, lease_id, sample, vouched=ok)
                    if sample.status in SETTLED:  # for good: logged now, not in every snapshot after
                        settled.append(sample)
                peer.tokens_generated += accepted
            except ResultRejected as exc:
                self.rejections.count(worker_id, exc.reason)
                log.warning("rejected sample from %s: %s", worker_id, exc)
                self._send(self.worker_sock, worker_id.encode(), protocol.Error(exc.reason, str(exc)[:500]))
                if exc.reason != "not_leased":  # garbage for a lease it holds: take the lease back
                    self._reclaim(lease_id)
        if len(settled) == len(msg.samples) >= LOG_AS_RECEIVED_MIN:
            self.snapshots.log_received(msg.samples)  # the arrays as they came, in one record
        elif settled:  # those of groups just dropped need no record
            self.snapshots.log_groups([(s.group_id, [s]) for s in settled if s.group_id in self.state.groups])
        self._grant(worker_id, msg.credit)

    def _leases_of(self, worker_id: str) -> list[int]:
        """Every lease the worker holds: training and evaluation."""
        return self.state.leases_of(worker_id) + self.evals.leases_of(worker_id)

    def _reclaim(self, lease_id: int) -> None:
        if self.evals.owns(lease_id):
            self.evals.reclaim(lease_id)
        else:
            self.state.reclaim(lease_id)

    def _drop_worker(self, worker_id: str) -> None:
        for lease_id in self._leases_of(worker_id):
            self._reclaim(lease_id)
        self.workers.remove(worker_id)
        if self.abort is not None:
            self.abort.deadline.pop(worker_id, None)

    def _dispatch(self, now: float, train: bool = True) -> None:
        """Lease work to every worker with credit, one Lease each: evaluation samples first, up to each
        worker's credit in registration order (they are few and the evaluation waits for its slowest),
        then training samples spread over the workers by free slots relative to size
        (`policy.spread_leases`), so no engine runs more sequences than its share while another idles.
        Samples leave the dispatch queue in its order whoever gets them.

        Only workers on current weights get work (`policy.serves_current_weights`): one still syncing the
        newest version (a network fetch takes a while) would generate every token under an older policy
        than the learner's. Its spread share is kept for it (the first worker to load a version does not
        take a whole round) and it is leased work once its WeightsLoaded says it serves the version (or
        that it cannot load it: then it works on within the staleness bound)."""
        if self.abort is not None or len(self.workers) < self.cfg.min_workers:
            return
        peers = self.workers.with_credit()
        if not peers:
            return
        current = [
            policy.serves_current_weights(p.version, p.failed_version, self.state.version, self.state.algo)
            for p in peers
        ]
        work = [
            self.evals.take_work(p.peer_id, p.credit, self.state.new_lease_id) if ok else []
            for p, ok in zip(peers, current, strict=True)
        ]
        greedy = [len(w) for w in work]
        if any(current):
            self.behind_since = None
        elif self.behind_since is None:
            self.behind_since = now  # usual for a moment after each publish, while workers load it
        elif now - self.behind_since > self.workers.window and (self.behind_warned < self.state.version):
            self.behind_warned = self.state.version  # once per version: the run waits on a load
            log.warning(
                "no worker with free slots serves weights v%d (or failed it within max_staleness): leasing "
                "nothing until one loads it (status: each worker's version)",
                self.state.version,
            )
        if train and self.state.dispatch_allowed():
            self._lease_training(peers, work, current)
        for peer, items, n_greedy in zip(peers, work, greedy, strict=True):
            if items:
                self._send_lease(peer, items, n_greedy, now)

    def _lease_training(
        self, peers: list[WorkerPeer], work: list[list[tuple[int, int, Sample]]], current: list[bool]
    ) -> None:
        """Add each `current` worker's spread share of training samples to `work` (the others' shares stay
        queued for them). A worker on older weights than a partial's last segment gets fewer (take_work
        leaves that partial queued): what it left goes to the current workers with credit left, most free
        first. With `algo.resume_affinity` partials first go back to the worker they left, if it has room
        (`BrokerState.take_held_partials`)."""
        free = [p.credit - len(w) for p, w in zip(peers, work, strict=True)]
        if self.state.algo.resume_affinity:
            room = [f if ok else 0 for f, ok in zip(free, current, strict=True)]
            held = self.state.take_held_partials([p.peer_id for p in peers], room, [p.version for p in peers])
            for i, items in enumerate(held):
                work[i] += items
                free[i] -= len(items)
        shares = policy.spread_leases(self.state.leasable_samples(), free, [p.slots for p in peers])
        short = False
        for peer, items, share, ok in zip(peers, work, shares, current, strict=True):
            if share and ok:
                got = self.state.take_work(peer.peer_id, share, peer.version)
                items += got
                short = short or len(got) < share
        if not short:
            return
        order = sorted(range(len(peers)), key=lambda i: -(peers[i].credit - len(work[i])) / peers[i].slots)
        for i in order:
            left = peers[i].credit - len(work[i])
            if current[i] and left > 0 and self.state.leasable_samples():
                work[i] += self.state.take_work(peers[i].peer_id, left, peers[i].version)

    def _send_lease(
        self, peer: WorkerPeer, work: list[tuple[int, int, Sample]], greedy: int, now: float
    ) -> None:
        """One Lease message: the first `greedy` items are evaluation samples (decoded greedily)."""
        self.workers.set_credit(peer, peer.credit - len(work))
        if self.first_lease is None:
            self.first_lease = now
            self.usage.start(now)
        lease_ids, budgets, samples = zip(*work, strict=True)
        lease = protocol.Lease(
            lease_ids=np.array(lease_ids, dtype=np.int64),
            budgets=np.array(budgets, dtype=np.int32),
            greedy=(np.arange(len(work)) < greedy).astype(np.uint8),
            samples=SampleBatch.from_samples(samples),
        )
        self._send_worker(peer.peer_id, lease, now)

    # ------------------------------------------------------------------ aborts

    def _start_abort(self, now: float) -> None:
        self.round_id += 1
        self.abort = AbortRound(self.round_id, now)
        holders = {lease.worker_id for lease in self.state.leases.values()}
        log.info(
            "abort round %d: %d leased samples on %d workers",
            self.round_id,
            self.state.leased_samples,
            len(holders),
        )
        for worker_id in holders:
            self._send_abort(worker_id, now)

    def _send_abort(self, worker_id: str, now: float) -> None:
        assert self.abort is not None
        self.abort.deadline[worker_id] = now + self.cfg.abort_timeout_s
        self.abort.attempts[worker_id] = self.abort.attempts.get(worker_id, 0) + 1
        self._send_worker(worker_id, protocol.Abort(self.abort.round_id), now)

    def _on_abort_done(self, worker_id: str, msg: protocol.AbortDone, now: float) -> None:
        peer = self.workers.peers[worker_id]
        if peer.engine_ok:
            self.workers.set_credit(peer, min(msg.credit, peer.slots) if peer.slots else msg.credit)
        if self.abort is None or msg.round_id != self.abort.round_id:
            return  # a late confirmation of an earlier round: credit reset is all it means
        scoring = set(msg.scoring.tolist())
        unreturned = [lease_id for lease_id in self._leases_of(worker_id) if lease_id not in scoring]
        if unreturned:
            self.rejections.count(worker_id, "abort_unreturned")
            log.warning("worker %s confirmed abort but kept %d leases: reclaimed", worker_id, len(unreturned))
            for lease_id in unreturned:
                self._reclaim(lease_id)
        self.abort.deadline.pop(worker_id, None)

    def _check_abort(self, now: float) -> None:
        assert self.abort is not None
        for worker_id, deadline in list(self.abort.deadline.items()):
            if now < deadline:
                continue
            if self.abort.attempts[worker_id] <= self.cfg.abort_retries:
                log.warning("worker %s has not confirmed abort %d: re-abort", worker_id, self.abort.round_id)
                self._send_abort(worker_id, now)
            else:
                log.error("worker %s never confirmed abort %d: declared dead", worker_id, self.abort.round_id)
                self._drop_worker(worker_id)
        if not self.abort.deadline:
            log.info("abort round %d confirmed in %.3fs", self.abort.round_id, now - self.abort.started)
            self.abort = None
            self.aborts_done += 1
            if policy.is_round_based(self.state.mode):
                self.state.park_queued_samples()

    # ------------------------------------------------------------------ learner and status clients

    def _on_learner(self, identity: bytes, msg: Message, now: float) -> None:
        if isinstance(msg, protocol.StatusRequest):
            self._send(self.learner_sock, identity, protocol.StatusReply(self.status(now)))
            return
        if isinstance(msg, protocol.LearnerHello):
            self.learner = LearnerPeer(msg.learner_id, last_seen=now, last_sent=now)
            self.learner_waiting = None  # a request of an earlier session is not this learner's
            self.learner_identity = identity
            log.info("learner %s registered (v%d)", msg.learner_id, msg.version)
            self._send(self.learner_sock, identity, self._welcome(msg.learner_id))
            return
        if self.learner is None or identity != self.learner_identity:
            self._reject(self.learner_sock, identity, "not_registered", "send LearnerHello first")
            return
        self.learner.last_seen = now
        match msg:
            case protocol.Heartbeat():
                pass
            case protocol.BatchRequest(step=step, last_batch_id=last):
                if self.state.batch is not None and self.state.batch.batch_id == last:
                    self._ack(last, now)  # the learner trained it; its BatchAck was lost
                self.learner_waiting = step
                log.info("learner asks for step %d (last trained batch %d)", step, last)
            case protocol.BatchAck(batch_id=batch_id, metrics=metrics):
                if self._ack(batch_id, now):
                    self.learner_metrics = dict(metrics)
                else:
                    self._reject(
                        self.learner_sock, identity, "stale_batch_ack", f"no unacked batch {batch_id}"
                    )
            case protocol.WeightsReady():
                self._on_weights(msg, now)
            case protocol.LearnerPhaseReport(phase=phase, detail=detail):
                self.learner.enter(phase, detail, now)
            case protocol.Disconnect():
                self.learner = None
                self.learner_waiting = None
            case _:
                self._reject(self.learner_sock, identity, "unexpected_message", type(msg).__name__)

    def _ack(self, batch_id: int, now: float) -> bool:
        if not self.state.ack_batch(batch_id, slots=sum(p.slots for p in self.workers.peers.values())):
            return False
        # No snapshot here: if the broker dies before the next one, the restored broker still holds this
        # batch, and the learner's next BatchRequest (last_batch_id) acks it again.
        self.state.check_ledger(f"after acking batch {batch_id}")
        self.batches_acked += 1
        self.round_started = now
        self.usage.set_phase(now, True)  # a new round opens (async: the phase never closed)
        if self.batches_acked >= self.config.run.steps:
            self.usage.stop(now)  # the run's last step: its figures end here
            self.last_step_totals = run_totals(self)
        return True

    def _on_weights(self, msg: protocol.WeightsReady, now: float) -> None:
        if not self.state.set_weights(msg.version, msg.uri, msg.sha256):
            self.rejections.count(self.learner.peer_id if self.learner else "learner", "stale_weights")
            return
        log.info("weights v%d published: relaying to %d workers", msg.version, len(self.workers))
        for worker_id in list(self.workers.peers):
            self._send_worker(worker_id, msg, now)
        self.evals.on_version(msg.version)
        if policy.abort_on_new_version(self.state.mode) and self.state.leased_samples and self.abort is None:
            self._start_abort(now)

    def _weights_sync_stats(self, now: float) -> dict[str, float]:
        """For metrics.jsonl: how many live workers serve the broker's version, and the slowest one's sync
        seconds for it (from hearing of the version to serving it; 0 when none reported one yet)."""
        current = [
            p
            for p in self.workers.peers.values()
            if p.version == self.state.version and self.workers.alive(p, now) and not p.restored
        ]
        by_transport = {
            f"workers_synced_{t}": float(sum(1 for p in current if p.weights_transport == t))
            for t in WEIGHT_TRANSPORTS
        }
        return {
            "workers_synced": float(len(current)),
            "worker_sync_s_max": max((p.weights_sync_s for p in current), default=0.0),
            **by_transport,
        }

    def _try_send_batch(self, now: float) -> None:
        if self.learner_waiting is None or self.learner is None:
            return
        fresh = self.state.batch is None
        batch = self.state.form_batch(self.learner_waiting)
        if batch is None:
            return
        if fresh:
            batch.stats["rollout_s"] = now - self.round_started
            batch.stats.update(self.evals.batch_stats())  # the latest evaluation, if any
            batch.stats.update(self.usage.take_window())
            batch.stats.update(self._weights_sync_stats(now))
            batch.stats["run_s"] = now - (self.first_lease if self.first_lease is not None else self.started)
            if policy.is_round_based(self.state.mode):
                self.usage.set_phase(now, False)  # the rollout phase ends with its batch
            self.state.check_ledger(f"after forming batch {batch.batch_id}")
            self.batch_snapshot_seq = self.save_snapshot()
        if self.snapshots.durable_seq < self.batch_snapshot_seq:
            return  # not on disk yet: a crash now must not forget a batch the learner may train
        self._send(self.learner_sock, self.learner_identity, self._batch_message(batch))
        batch.sends += 1
        log.info(
            "batch %d for step %d sent (%d samples)%s",
            batch.batch_id,
            batch.step,
            len(batch.samples),
            "" if batch.sends == 1 else f", {batch.sends} times: not acked before",
        )
        self.learner.last_sent = now
        self.learner_waiting = None

    def _batch_message(self, batch: PendingBatch) -> protocol.Batch:
        columns = self.snapshots.batch_columns(batch.batch_id)  # gathered off the loop with its snapshot
        return protocol.Batch(
            batch_id=batch.batch_id,
            step=batch.step,
            version=batch.version,
            samples=SampleBatch.from_samples(batch.samples) if columns is None else columns,
            stats=dict(batch.stats),
            ledger=self.state.ledger(),
        )

    # ------------------------------------------------------------------ the tick

    def tick(self, now: float) -> None:
        if self.snapshots.error is not None:
            raise snapshot.SnapshotError(f"cannot write snapshots: {self.snapshots.error}")
        for worker_id in self.workers.dead(now):
            log.warning(
                "worker %s silent for %.1fs: dead, %d leases re-queued",
                worker_id,
                now - self.workers.peers[worker_id].last_seen,
                len(self._leases_of(worker_id)),
            )
            self._drop_worker(worker_id)
        if self.abort is not None:
            self._check_abort(now)
        if self.state.close_round_if_complete():
            log.info("round complete: %d complete groups", len(self.state.complete))
            if self.state.leased_samples:
                self._start_abort(now)  # queued samples are parked once it is confirmed
            else:
                self.state.park_queued_samples()
        self._dispatch(now)
        self._try_send_batch(now)
        for peer in self.workers.due_heartbeat(now):
            self._send_worker(peer.peer_id, protocol.Heartbeat(), now)
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
        if self.cfg.debug_ledger:
            self.state.check_ledger("in debug tick")

    def _record_eval(self, result: EvalResult) -> None:
        """Append a finished evaluation to RUN_DIR/eval.jsonl (the final one lands after the last step)."""
        line = json.dumps({"time": time.time(), **result.to_json()})
        with open(self.run_dir / EVAL_LOG, "a", encoding="utf-8") as f:
            f.write(line + "\n")

    def status(self, now: float) -> BrokerStatus:
        return build_status(self, now)
