"""The broker core: every scheduling decision, once. Events in, with their time; decisions out.

`BrokerCore` holds the books (`broker.state`), the worker registry (`broker.peers`) with each worker's
liveness, the evaluations, the abort round, the learner's pending request and its last step's figures, the
slot-usage integrals and the sample errors (`broker.failures`, with the rule that stops a run whose
samples all fail alike), and has one method per event: a worker's hello, any message heard from it, its
credit, results, abort confirmation, engine health, weights loaded, usage report or departure; the
learner's hello, batch request, ack, weights or departure; a message the driver sent on its own; and the
tick. Each returns the list of decisions it took (`broker.decisions`): leases, messages to a worker or
the learner, refusals, settled samples, a batch handed out, a lost worker, a stopped run.

No sockets, no clock, no files: `broker.server` drives it from its sockets and the monotonic clock,
`broker.sim.model` from simulated engines and a simulated learner in virtual time, so the real broker
and the simulator make the same decisions for the same events. Liveness is the core's, as in zguide's
majordomo broker: each worker's last message heard and sent, and at each tick the workers silent past
the liveness window are lost and those sent nothing for an interval get a heartbeat (`liveness` False:
the driver models no silence, as `april simulate`). Durability is the driver's: a batch handed out leaves
once the driver has made it durable.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import Any

from april import protocol
from april.config import Config, ConfigError
from april.data import PromptRecord
from april.records import SETTLED, Sample
from april.status import EvalStatus
from april.weights_uri import WEIGHT_TRANSPORTS
from broker.decisions import (
    BatchFormed,
    Decision,
    EvalFinished,
    LeaseOut,
    Refuse,
    RunStopped,
    Send,
    Settled,
    ToLearner,
    WorkerLost,
)
from broker.dispatch import assign
from broker.evaluation import EvalResult, Evaluations
from broker.failures import FailureBook
from broker.peers import WorkerPeer, Workers
from broker.result_check import ResultRejected
from broker.state import BooksView, BrokerState, PendingBatch
from broker.usage import SlotUsage

log = logging.getLogger("april.broker")


@dataclass(slots=True)
class AbortRound:
    """An abort in progress: workers that still owe an AbortDone, with their deadline and attempts."""

    round_id: int
    started: float
    deadline: dict[str, float] = field(default_factory=dict)
    attempts: Counter[str] = field(default_factory=Counter)


@dataclass(frozen=True, slots=True)
class RoundView:
    """The round and the aborts, for the status."""

    round_id: int  # abort rounds started
    open: bool
    aborting: bool
    aborts_done: int


@dataclass(frozen=True, slots=True)
class CoreView:
    """What the core shows the status, at one moment (`BrokerCore.view`)."""

    uptime_s: float
    books: BooksView
    round: RoundView
    workers: Collection[WorkerPeer]  # in registration order
    liveness_window_s: float  # a worker heard from within it is alive
    learner_waiting: bool
    learner_metrics: dict[str, float]  # the learner's figures of its last acked step
    batches_acked: int
    eval: EvalStatus | None
    failures: FailureBook


class BrokerCore:
    """See the module docstring. `state`: fresh or restored from a snapshot (`restored`: its lease holders
    are registered as restored workers, and no baseline evaluation starts)."""

    def __init__(
        self,
        config: Config,
        state: BrokerState,
        held_out: Sequence[PromptRecord],
        now: float,
        *,
        restored: bool = False,
        liveness: bool = True,
    ) -> None:
        self.config = config
        self.cfg = config.broker
        batch_samples = config.algo.rollout_batch_size * config.algo.n_samples_per_prompt
        if self.cfg.max_buffered_samples < batch_samples:  # issuing would stop short of every batch
            raise ConfigError(
                f"broker.max_buffered_samples = {self.cfg.max_buffered_samples}: fewer samples than one "
                f"batch holds (algo.rollout_batch_size x algo.n_samples_per_prompt = {batch_samples}), "
                "so no batch could ever form"
            )
        self.state = state
        state.max_live_samples = self.cfg.max_buffered_samples
        run = config.run
        self.evals = Evaluations(
            held_out, run.eval_every, run.steps, config.algo.max_new_tokens, self._evaluated
        )
        self.workers = Workers(self.cfg.heartbeat_interval_s, self.cfg.liveness)
        self.liveness = liveness  # False: no worker is lost for silence, none is sent heartbeats
        self.abort: AbortRound | None = None
        self.learner_id = "learner"  # the learner session's id (refusals are counted under it)
        self.learner_waiting: int | None = None  # step of the learner's unanswered BatchRequest
        self.batches_acked = 0
        self.learner_metrics: dict[str, float] = {}  # the learner's figures of its last acked step
        self.started = now
        self.round_started = now  # the last ack (a batch's rollout_s counts from it)
        self.first_lease: float | None = None  # when generation started: batches' run_s count from it
        self.usage = SlotUsage(now)  # the workers' slot usage, per batch (rollout phases) and in total
        self.failures = FailureBook(self.cfg.stop_after_failures)  # sample errors; the stop rule
        self.last_step_totals: dict[str, Any] | None = None  # run_totals when the last step was acked
        self.behind_warned = 0  # the last version no worker with free slots served (warned once each)
        self.behind_since: float | None = None  # since when no worker with free slots may be leased work
        self._out: list[Decision] = []
        if restored:  # (a worker holding pinned partials is one too: lost if it never comes back)
            holders = {lease.worker_id for lease in state.leases.values()} | set(state.pinned.values())
            for worker_id in holders:
                self.workers.register(worker_id, now, restored=True)
        else:
            self.evals.on_version(0)  # a baseline: the starting weights on the held-out prompts

    def _take(self, now: float | None = None) -> list[Decision]:
        """The decisions taken; `now`: when they are carried out, so each message to a worker counts as
        sent to it then (its heartbeat is due an interval later)."""
        out, self._out = self._out, []
        if now is not None:
            for d in out:
                if isinstance(d, LeaseOut | Send) and (peer := self.workers.get(d.worker_id)) is not None:
                    self.workers.sent(peer, now)
        return out

    @property
    def round_id(self) -> int:
        """Abort rounds begun in the run (the books keep them: they survive a restart)."""
        return self.state.abort_rounds

    @property
    def aborts_done(self) -> int:
        return self.state.aborts_done

    # ------------------------------------------------------------------ workers

    def on_hello(self, hello: protocol.WorkerHello, now: float) -> list[Decision]:
        """A worker (re-)registers: leases it no longer holds are reclaimed, its credit is its free slots
        (as it says, or its slots less the leases it kept)."""
        held = set(hello.held_leases.tolist())
        old = self.workers.get(hello.worker_id)
        kept = 0
        for lease_id in self.leases_of(hello.worker_id):
            if lease_id in held:
                kept += 1
            else:
                self._reclaim(lease_id)
        if old is not None and not old.restored and (old.pid, old.host) != (hello.pid, hello.host):
            self._restart_pinned(hello.worker_id, "worker_restarted")  # a new process: its memory is new
        credit = hello.slots - kept if hello.credit < 0 else hello.credit
        peer = self.workers.register(
            hello.worker_id,
            now,
            engine=hello.engine,
            slots=hello.slots,
            credit=max(0, min(credit, hello.slots)),
            version=hello.version,
            pid=hello.pid,
            host=hello.host,
        )
        if peer is None:
            self._out.append(Refuse(hello.worker_id, "too_many_workers", "worker registry is full"))
            return self._take(now)
        log.info(
            "worker %s registered (%s, %d slots, v%d, kept %d leases)",
            hello.worker_id,
            hello.engine,
            hello.slots,
            hello.version,
            kept,
        )
        self._out.append(Send(hello.worker_id, self.welcome(hello.worker_id)))
        if self.abort is not None:  # a new session: it owes an AbortDone only for leases it kept
            if kept:
                self._send_abort(hello.worker_id, now)
            else:
                self.abort.deadline.pop(hello.worker_id, None)
        return self._take(now)

    def welcome(self, peer_id: str) -> protocol.Welcome:
        """The answer to a worker's or the learner's hello: the current weights and the sampling settings."""
        algo = self.config.algo
        return protocol.Welcome(
            peer_id=peer_id,
            mode=self.state.mode_policy.name,
            version=self.state.version,
            weights_uri=self.state.weights_uri,
            weights_sha256=self.state.weights_sha256,
            heartbeat_interval_s=self.cfg.heartbeat_interval_s,
            max_new_tokens=algo.max_new_tokens,
            temperature=algo.temperature,
            top_p=algo.top_p,
            top_k=algo.top_k,
        )

    def on_heard(self, worker_id: str, now: float) -> list[Decision]:
        """Any message from a registered worker: it is alive. A restored worker whose socket reconnected to
        this restarted broker by itself never finds it silent (it answers and sends heartbeats): it is
        asked, once an interval, for the hello that makes it leasable."""
        peer = self.workers.peers[worker_id]
        self.workers.heard(peer, now)
        peer.messages += 1
        if peer.restored and now - peer.hello_asked >= self.cfg.heartbeat_interval_s:
            peer.hello_asked = now
            self._out.append(Send(worker_id, protocol.Error("not_registered", "broker restarted: say hello")))
        return self._take(now)

    def on_sent(self, worker_id: str, now: float) -> list[Decision]:
        """The driver sent a worker a message of its own (a ResultAck): it counts as a heartbeat."""
        peer = self.workers.get(worker_id)
        if peer is not None:
            self.workers.sent(peer, now)
        return self._take()

    def on_credit(self, worker_id: str, credit: int) -> list[Decision]:
        """A worker grants `credit` free slots (LeaseRequest); the next tick leases them."""
        self._grant(self.workers.peers[worker_id], credit)
        return self._take()

    def _grant(self, peer: WorkerPeer, credit: int) -> None:
        # restored: slots unknown until it says hello, it finishes its leases and gets nothing new;
        # engine down: nothing until its EngineHealth says it serves again (then it grants its slots)
        if peer.leasable:
            self.workers.set_credit(peer, max(0, min(peer.credit + credit, peer.slots)))

    def on_result(self, worker_id: str, msg: protocol.SampleResult, now: float) -> list[Decision]:
        """A SampleResult as it came off the wire: `on_samples`, with the arrays checked at once where that
        is cheaper than one sample at a time (`BrokerState.vouch`: it passes only what the checks pass)."""
        lease_ids = msg.lease_ids.tolist()
        self.workers.peers[worker_id].samples_returned += len(msg.samples)
        vouched = self.state.vouch(worker_id, lease_ids, msg.samples)
        return self.on_samples(worker_id, lease_ids, msg.samples.to_samples(), msg.credit, now, vouched)

    def on_samples(
        self,
        worker_id: str,
        lease_ids: Sequence[int],
        samples: Sequence[Sample],
        credit: int,
        now: float,
        vouched: Sequence[bool] | None = None,
    ) -> list[Decision]:
        """Samples returned on their leases (finished, failed or interrupted), with `credit` freed slots;
        then the freed slots are leased at once (no training work once the round is complete).
        `vouched`: per sample, already checked against its lease (`on_result`); None: none was."""
        peer = self.workers.peers[worker_id]
        settled: list[tuple[int, int]] = []  # keys of the training samples that settled
        checked = [False] * len(samples) if vouched is None else vouched
        for lease_id, sample, ok in zip(lease_ids, samples, checked, strict=True):
            try:
                if self.evals.owns(lease_id):
                    accepted = self.evals.accept_result(worker_id, lease_id, sample, self.state.version)
                else:
                    accepted = self.state.accept_result(worker_id, lease_id, sample, vouched=ok)
                    if sample.status in SETTLED:  # for good: logged now, not in every snapshot after
                        settled.append(sample.key)
                if sample.status in SETTLED:
                    self.failures.settled(sample, now)
                peer.tokens_generated += accepted
            except ResultRejected as exc:
                if exc.reason == "duplicate":  # sent again: the books have it, nothing to answer
                    self._out.append(Refuse(worker_id, exc.reason, str(exc)[:500], reply=False))
                    continue
                log.warning("rejected sample from %s: %s", worker_id, exc)
                self._out.append(Refuse(worker_id, exc.reason, str(exc)[:500]))
                if exc.reason != "not_leased":  # garbage for a lease it holds: take the lease back
                    self._reclaim(lease_id)
        if settled:  # those of groups just dropped need no record
            groups = self.state.groups  # each as the books keep it (with the lease span they added)
            kept = [groups[g].samples[i] for g, i in settled if g in groups]
            self._out.append(Settled(kept, whole=len(kept) == len(samples)))
        self._grant(peer, credit)
        self._dispatch(now, train=not self.state.round_complete())
        return self._take(now)

    def on_abort_done(
        self, worker_id: str, round_id: int, credit: int, scoring: Collection[int], now: float
    ) -> list[Decision]:
        """A worker returned what it held (but the leases in `scoring`) and confirms abort `round_id`."""
        peer = self.workers.peers[worker_id]
        if peer.engine_ok:
            self.workers.set_credit(peer, min(credit, peer.slots) if peer.slots else credit)
        if self.abort is None or round_id != self.abort.round_id:
            return self._take(now)  # a late confirmation of an earlier round: credit reset is all it means
        unreturned = [lease_id for lease_id in self.leases_of(worker_id) if lease_id not in scoring]
        if unreturned:
            self._out.append(Refuse(worker_id, "abort_unreturned", f"{len(unreturned)} leases", reply=False))
            log.warning("worker %s confirmed abort but kept %d leases: reclaimed", worker_id, len(unreturned))
            for lease_id in unreturned:
                self._reclaim(lease_id)
        self.abort.deadline.pop(worker_id, None)
        return self._take(now)

    def on_engine_health(self, worker_id: str, msg: protocol.EngineHealth) -> list[Decision]:
        peer = self.workers.peers[worker_id]
        if msg.ok != peer.engine_ok:
            if msg.ok:
                came = "is up" if peer.engine_detail == protocol.ENGINE_STARTING else "serves again"
                log.info("worker %s: engine %s", worker_id, came)
            elif msg.detail == protocol.ENGINE_STARTING:  # every worker starts so: no news
                log.info("worker %s: engine starting, leasing it nothing until it is up", worker_id)
            else:
                log.warning("worker %s: engine down, leasing it nothing: %s", worker_id, msg.detail)
        peer.engine_ok, peer.engine_detail = msg.ok, msg.detail
        peer.failed_by_engine, peer.returned_by_engine = msg.failed_by_engine, msg.returned_by_engine
        peer.placement = msg.placement
        if not msg.ok:
            self.workers.set_credit(peer, 0)
        return self._take()

    def on_weights_loaded(self, worker_id: str, msg: protocol.WeightsLoaded) -> list[Decision]:
        peer = self.workers.peers[worker_id]
        if msg.ok and msg.version >= peer.version:  # a late report of an older version changes nothing
            peer.version = msg.version
            peer.weights_transport, peer.weights_sync_s = msg.transport, msg.sync_s
        elif not msg.ok:  # e.g. a sha256 mismatch: the worker keeps serving its old weights
            peer.failed_version = max(peer.failed_version, msg.version)
            self._out.append(Refuse(worker_id, "weights_not_loaded", msg.error, reply=False))
            log.warning("worker %s failed to load weights v%d: %s", worker_id, msg.version, msg.error)
        return self._take()

    def on_usage(self, worker_id: str, msg: protocol.EngineUsage, now: float) -> list[Decision]:
        self.usage.report(worker_id, msg, now)
        return self._take()

    def on_worker_lost(self, worker_id: str) -> list[Decision]:
        """A worker left (Disconnect): see `_lose`."""
        self._lose(worker_id)
        return self._take()

    def _lose(self, worker_id: str) -> None:
        """A worker left, fell silent or never confirmed an abort: its leases go back as they were leased."""
        for lease_id in self.leases_of(worker_id):
            self._reclaim(lease_id)
        self._restart_pinned(worker_id, "worker_lost")
        self.workers.remove(worker_id)
        if self.abort is not None:
            self.abort.deadline.pop(worker_id, None)
        self._out.append(WorkerLost(worker_id))

    def _restart_pinned(self, worker_id: str, cause: str) -> None:
        """The partials pinned to `worker_id` lost their environment state with its memory: each restarts
        from its prompt, its tokens dropped and counted under `cause`."""
        keys = self.state.pinned_of(worker_id)
        if keys:
            tokens = sum(self.state.restart(key, cause) for key in keys)
            log.warning(
                "worker %s (%s): %d pinned partials restarted from their prompt, %d tokens dropped",
                worker_id,
                cause.replace("_", " "),
                len(keys),
                tokens,
            )

    def leases_of(self, worker_id: str) -> list[int]:
        """Every lease the worker holds: training and evaluation."""
        return self.state.leases_of(worker_id) + self.evals.leases_of(worker_id)

    def _reclaim(self, lease_id: int) -> None:
        if self.evals.owns(lease_id):
            self.evals.reclaim(lease_id)
        else:
            self.state.reclaim(lease_id)

    def _evaluated(self, result: EvalResult) -> None:
        self._out.append(EvalFinished(result))

    # ------------------------------------------------------------------ dispatch

    def _dispatch(self, now: float, train: bool = True) -> None:
        """Lease work to every worker with credit, one Lease each (`broker.dispatch.assign`: who gets
        what); `train` False: evaluation samples only (the round is complete). Nothing once the run is
        stopped."""
        if self.abort is not None or len(self.workers) < self.cfg.min_workers or self.failures.stopped:
            return
        if not self.evals.queued and not (train and (self.state.leasable_samples() or self.state.pinned)):
            return  # nothing to lease: most results free a slot while admission holds new groups back
        peers = self.workers.with_credit()
        if not peers:
            return
        work, greedy, any_current = assign(self.state, self.evals, peers, train)
        self._note_behind(any_current, now)
        for peer, items, n_greedy in zip(peers, work, greedy, strict=True):
            if items:
                self.workers.set_credit(peer, peer.credit - len(items))
                if self.first_lease is None:
                    self.first_lease = now
                    self.usage.start(now)
                self._out.append(LeaseOut(peer.peer_id, items, n_greedy))

    def _note_behind(self, any_current: bool, now: float) -> None:
        """Warn, once per version, when for a liveness window no worker with free slots served it."""
        if any_current:
            self.behind_since = None
        elif self.behind_since is None:
            self.behind_since = now  # usual for a moment after each publish, while workers load it
        elif now - self.behind_since > self.workers.window and self.behind_warned < self.state.version:
            self.behind_warned = self.state.version  # once per version: the run waits on a load
            log.warning(
                "no worker with free slots serves weights v%d (or failed it within max_staleness): leasing "
                "nothing until one loads it (status: each worker's version)",
                self.state.version,
            )

    # ------------------------------------------------------------------ aborts

    def _start_abort(self, now: float) -> None:
        """Abort every worker holding a training lease, in registration order."""
        self.abort = AbortRound(self.state.begin_abort(), now)
        holders = {lease.worker_id for lease in self.state.leases.values()}
        log.info(
            "abort round %d: %d leased samples on %d workers",
            self.round_id,
            self.state.leased_samples,
            len(holders),
        )
        for worker_id in self.workers.peers:
            if worker_id in holders:
                self._send_abort(worker_id, now)

    def _send_abort(self, worker_id: str, now: float) -> None:
        assert self.abort is not None
        self.abort.deadline[worker_id] = now + self.cfg.abort_timeout_s
        self.abort.attempts[worker_id] += 1
        self._out.append(Send(worker_id, protocol.Abort(self.abort.round_id)))

    def _check_abort(self, abort: AbortRound, now: float) -> None:
        """Re-abort a worker past its deadline, or declare it dead past its retries; end a confirmed
        round (sync/april then park the queued samples for the next round)."""
        for worker_id, deadline in list(abort.deadline.items()):
            if now < deadline:
                continue
            if abort.attempts[worker_id] <= self.cfg.abort_retries:
                log.warning("worker %s has not confirmed abort %d: re-abort", worker_id, abort.round_id)
                self._send_abort(worker_id, now)
            else:
                log.error("worker %s never confirmed abort %d: declared dead", worker_id, abort.round_id)
                self._lose(worker_id)
        if not abort.deadline:
            log.info("abort round %d confirmed in %.3fs", abort.round_id, now - abort.started)
            self.abort = None
            self.state.end_abort()
            if self.state.mode_policy.round_based:
                self.state.park_queued_samples()

    # ------------------------------------------------------------------ the learner

    def on_learner_hello(self, learner_id: str) -> list[Decision]:
        """A learner session starts: a request of an earlier session is not this learner's."""
        self.learner_id = learner_id
        self.learner_waiting = None
        self._out.append(ToLearner(self.welcome(learner_id)))
        return self._take()

    def on_learner_gone(self) -> list[Decision]:
        self.learner_waiting = None
        return self._take()

    def on_batch_request(self, step: int, last_batch_id: int, now: float) -> list[Decision]:
        """The learner asks for step `step`, having trained `last_batch_id` (acked again if its ack was
        lost)."""
        batch = self.state.batch
        if batch is not None and batch.batch_id == last_batch_id:
            self._ack(last_batch_id, now)
        self.learner_waiting = step
        log.info("learner asks for step %d (last trained batch %d)", step, last_batch_id)
        return self._take()

    def on_ack(self, batch_id: int, now: float, metrics: dict[str, float] | None = None) -> list[Decision]:
        """The learner trained batch `batch_id` (`metrics`: its figures of that step); refused if no such
        batch is unacked."""
        if self._ack(batch_id, now):
            self.learner_metrics = dict(metrics or {})
        else:
            detail = f"no unacked batch {batch_id}"
            self._out.append(Refuse(self.learner_id, "stale_batch_ack", detail, reply=False))
            self._out.append(ToLearner(protocol.Error("stale_batch_ack", detail)))
        return self._take()

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
            self.last_step_totals = self.run_totals()
        return True

    def on_weights(self, version: int, uri: str, sha256: str, now: float) -> list[Decision]:
        """The learner published weights `version`: relayed to every worker; async aborts what is leased
        so that it resumes under them."""
        if not self.state.set_weights(version, uri, sha256):
            self._out.append(Refuse(self.learner_id, "stale_weights", f"v{version}", reply=False))
            return self._take()
        log.info("weights v%d published: relaying to %d workers", version, len(self.workers))
        relay = protocol.WeightsReady(version, uri, sha256)
        self._out += [Send(worker_id, relay) for worker_id in self.workers.peers]
        self.evals.on_version(version)
        if self.state.mode_policy.abort_on_new_version and self.state.leased_samples and self.abort is None:
            self._start_abort(now)
        return self._take(now)

    def batch_due(self) -> bool:
        """The learner waits, and its batch is formed or a batch worth of groups is complete."""
        if self.learner_waiting is None:
            return False
        return self.state.batch is not None or self.state.batch_worth_complete()

    def _hand_out_batch(self, now: float) -> None:
        """The waiting learner's batch: the unacked one again, or a new one if one can be formed; handed
        out at once (the driver sends it)."""
        if self.learner_waiting is None or self.failures.stopped:
            return
        batch = self.state.batch
        again = batch is not None
        if batch is None:
            batch = self._form_batch(self.learner_waiting, now)
            if batch is None:
                return
        batch.sends += 1
        log.info(
            "batch %d for step %d sent (%d samples)%s",
            batch.batch_id,
            batch.step,
            len(batch.samples),
            "" if batch.sends == 1 else f", {batch.sends} times: not acked before",
        )
        self.learner_waiting = None
        self._out.append(BatchFormed(batch, again))

    def _form_batch(self, step: int, now: float) -> PendingBatch | None:
        batch = self.state.form_batch(step)
        if batch is None:
            return None
        batch.stats["rollout_s"] = now - self.round_started
        batch.stats.update(self.evals.batch_stats())  # the latest evaluation, if any
        batch.stats.update(self.usage.take_window())
        batch.stats.update(self._weights_sync_stats(now))
        batch.stats.update(self.failures.take_window())  # the samples that settled with an error
        batch.stats["run_s"] = now - (self.first_lease if self.first_lease is not None else self.started)
        if self.state.mode_policy.round_based:
            self.usage.set_phase(now, False)  # the rollout phase ends with its batch
        self.state.check_ledger(f"after forming batch {batch.batch_id}")
        return batch

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

    # ------------------------------------------------------------------ the tick

    def tick(self, now: float) -> list[Decision]:
        """After every turn of the driver's loop: the workers silent past the liveness window are lost,
        abort deadlines, the end of a round (abort its holders, or park the queued samples at once), leases
        for free slots, the learner's batch, and a heartbeat to each worker sent nothing for an interval."""
        if self.liveness:
            self._purge_workers(now)
        if self.abort is not None:
            self._check_abort(self.abort, now)
        if self.state.close_round_if_complete():
            log.info("round complete: %d complete groups", len(self.state.complete))
            if self.state.leased_samples:
                self._start_abort(now)  # queued samples are parked once it is confirmed
            else:
                self.state.park_queued_samples()
        self._dispatch(now)
        self._hand_out_batch(now)
        if self.failures.stopped and self.learner_waiting is not None:  # told once each time it asks
            self._out.append(RunStopped(self.failures.stopped))
            self.learner_waiting = None
        out = self._take(now)
        if self.liveness:
            out += self._send_heartbeats(now)
        return out

    def _purge_workers(self, now: float) -> None:
        """Lose every worker silent for longer than the liveness window (any message counts)."""
        for worker_id in self.workers.dead(now):
            log.warning(
                "worker %s silent for %.1fs: dead, %d leases re-queued",
                worker_id,
                now - self.workers.peers[worker_id].last_seen,
                len(self.leases_of(worker_id)),
            )
            self._lose(worker_id)

    def _send_heartbeats(self, now: float) -> list[Decision]:
        """A Heartbeat to each worker sent nothing for a heartbeat interval (this tick's messages count)."""
        self._out += [Send(peer.peer_id, protocol.Heartbeat()) for peer in self.workers.due_heartbeat(now)]
        return self._take(now)

    # ------------------------------------------------------------------ what it shows

    def view(self, now: float) -> CoreView:
        """The core's part of the status."""
        return CoreView(
            uptime_s=now - self.started,
            books=self.state.view(self.evals.leases_by_worker()),
            round=RoundView(self.round_id, self.state.round_open, self.abort is not None, self.aborts_done),
            workers=list(self.workers.peers.values()),
            liveness_window_s=self.workers.window,
            learner_waiting=self.learner_waiting is not None,
            learner_metrics=self.learner_metrics,
            batches_acked=self.batches_acked,
            eval=self.evals.status(),
            failures=self.failures,
        )

    def run_totals(self) -> dict[str, Any]:
        """What the broker saw so far: taken when the run's last step is acked and when the broker stops,
        both written to RUN_DIR/broker_totals.json (for `april bench`): tokens generated and still held
        (`buffered_tokens`: partials, complete groups, an unacked batch), aborts and resumes, and the
        workers' slot integrals (broker.usage)."""
        state = self.state
        return {
            "tokens_generated": state.totals.tokens_generated,
            "buffered_tokens": state.buffered_tokens(),
            "trained_groups": state.trained,
            "aborted": state.totals.aborted,
            "resumed": state.totals.resumed,
            "restarted": state.totals.restarted,  # pinned partials restarted from their prompt
            "tokens_restarted": state.totals.tokens_restarted,
            "samples_finished": state.totals.samples_finished,
            "usage": self.usage.total.stats(),
            "ledger": state.ledger().to_json(),
        }
