"""The rollout worker process: leases samples from the broker, keeps its engine full, streams results.

One loop, top to bottom: read the broker's messages (leases, aborts, weights, heartbeats), advance the
engine one step, score what finished (rewards run in a killable child process and never block), send
what is ready (at once, or gathered for up to `worker.result_hold_ms` into one message: `actors.outbox`,
whose results no later message overtakes and whose leases a hello names), keep the connection alive.
Speaks only `april.protocol` to the broker and only `actors.engine.Engine` to the engine; knows nothing
of scheduling policy.

Contracts it keeps (docs/protocol.md): a sample leased with its `greedy` flag set (an evaluation sample)
is decoded greedily; a sample that finished generating frees its engine slot at once
(LeaseRequest credit) and is streamed when scored; on Abort every unfinished sample goes back INTERRUPTED
with its tokens and log-probs, and AbortDone is sent only once the engine is idle, naming the samples
still being scored; weights are verified by sha256 before loading and a failed load keeps the old ones;
weights reach the worker by the transport the learner announced (`actors.weight_sync`: the learner's file
where this host sees it, else fetched from the learner's weight service on a background thread), so the
loop never waits on the network: a version is loaded between engine steps once its bytes are local and
verified, each WeightsLoaded says how the bytes came (`transport`) and the seconds from first hearing of
the version to the engine serving it (`sync_s`), a version that cannot be had is answered
WeightsLoaded(ok=False) once, and a worker that missed versions gets only the newest; every result is
numbered (`seq`) and kept until the broker acknowledges it (Lease.acked, ResultAck: what it took is on
its disk); after every (re)connect and whenever the broker says it does not know this worker, the
WorkerHello names the leases still held (those of unacknowledged results too) and its free slots, and
the unacknowledged results follow it again, in order and without credit, so a broker that restarted or
lost them takes them once. Heartbeats, liveness and reconnecting with backoff are `april.peer_link`'s.

The engine may fail (actors/engine.py says how) and the worker outlives it. A request the engine failed
fails its sample (with the reason) or, when the failure was transient, returns it as a partial; either
frees its slot and is counted. An engine that cannot serve at all (EngineUnavailable from any call, or an
EngineError no request was blamed for) is down: every sample it held goes back as a partial, the broker
hears EngineHealth(ok=False) and leases nothing more, and the engine is probed with the peer link's
backoff (on a helper thread, so that heartbeats go on while a probe waits on a hung server) until it
serves; then the worker says so, loads the newest weights version it has ready (again: a restarted server
holds its launch weights; a newer one still being fetched follows when it is ready), and grants its slots
again. Samples being scored are not the engine's and are
unaffected. `actors.engine_health` keeps the schedule and the counts.

Which lease goes where is the worker core's (`april.worker_core`, the rules `april simulate`'s workers
follow too): the loop feeds it the leases, the turns that ended and, after each engine step, the steps
that answered, then lets it fill free slots and grant credit; it carries out the core's decisions. With
`env.name` set every lease is an episode whose resets and steps `actors.episode_driver` runs.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import os
import socket
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import numpy as np

from actors.engine import (
    BroadcastReceiving,
    Engine,
    EngineError,
    EngineUnavailable,
    GenerationOutput,
    GenerationRequest,
    SamplingParams,
    TensorLoading,
    WeightsLost,
)
from actors.engine_health import EngineHealth, one_line
from actors.engines.sim_engine import SampleIdentity
from actors.episode_driver import EpisodeDriver
from actors.outbox import Outbox
from actors.reward_runner import RewardRunner
from actors.slot_meter import SlotMeter
from actors.tokenizer import Tokenizer
from actors.weight_sync import BROADCAST, Offered, Ready, Unavailable, WeightSync
from april import protocol
from april.config import WeightsConfig, WorkerConfig
from april.devices import visible_gpus
from april.episode import EpisodeError
from april.failures import Reason, failure
from april.files import sha256_file
from april.keys import ClientKeys
from april.peer_link import PeerLink
from april.records import FinishReason, Sample
from april.sim.sample_draw import prompt_key
from april.worker_core import Begin, Decision, Phase, RunStep, Settle, StartTurn, WorkerCore

log = logging.getLogger("april.worker")
EngineFactory = Callable[[SamplingParams, int], Engine]  # (sampling, starting version) -> engine
MAX_MESSAGE_BYTES = 256 * 1024 * 1024


def apply_output(sample: Sample, out: GenerationOutput) -> Sample:
    """The sample extended by an engine output: one segment per run of equal versions, then its status."""
    s = sample
    if out.token_ids.shape[0]:
        cuts = np.flatnonzero(np.diff(out.versions)) + 1
        for ids, lps, vs in zip(
            np.split(out.token_ids, cuts),
            np.split(out.logprobs, cuts),
            np.split(out.versions, cuts),
            strict=True,
        ):
            s = s.extend(ids, lps, int(vs[0]), FinishReason.NONE)
    return s.ended(out.finish_reason)


def interrupted(sample: Sample, out: GenerationOutput | None) -> Sample:
    """The sample going back unfinished (INTERRUPTED): with the tokens `out` brings, or as leased."""
    if out is None:
        return apply_output(sample, GenerationOutput.of(0, [], [], [], FinishReason.ABORT))
    return apply_output(sample, dataclasses.replace(out, finish_reason=FinishReason.ABORT))


def failed_by_engine(sample: Sample, error: str) -> Sample:
    """The sample FAILED because the engine failed its request (the request itself was at fault)."""
    return sample.failed(failure(Reason.ENGINE_FAILED, f"engine failed the request: {one_line(error)}"))


class Worker:
    def __init__(
        self,
        cfg: WorkerConfig,
        tokenizer: Tokenizer,
        rewards: RewardRunner,
        make_engine: EngineFactory,
        seed: int,
        curve: ClientKeys | None = None,
        weights: WeightsConfig | None = None,
        weights_keys: ClientKeys | None = None,
        episodes: EpisodeDriver | None = None,
    ) -> None:
        self.cfg = cfg
        self.episodes = episodes  # multi-turn samples (`env.name` set): every lease is an episode
        self.worker_id = cfg.worker_id or f"{socket.gethostname()}-{os.getpid()}"
        self.tokenizer = tokenizer
        self.rewards = rewards
        self.make_engine = make_engine
        self.seed = seed
        self.engine: Engine | None = None
        self.meter: SlotMeter | None = None  # slot usage, reported as EngineUsage (from the engine's start)
        # every lease held, and the rules of where each goes (the episode driver's core when episodic)
        self.core = episodes.core if episodes is not None else WorkerCore(cfg.slots, episodic=False)
        self.scoring: dict[int, Sample] = {}  # lease id -> finished sample waiting for its reward
        # results and credit owed to the broker, held up to result_hold_ms and sent as one message
        self.outbox = Outbox(cfg.result_hold_ms / 1e3, max_samples=cfg.slots)
        self.seq = 0  # SampleResults sent (each numbered)
        self.unacked: dict[int, protocol.SampleResult] = {}  # by seq: sent, not yet acknowledged
        # the engine is built on a thread after the first Welcome (a vLLM or SGLang start can outlast the
        # broker's liveness window): until then it is "starting", and the broker leases it nothing
        self.health = EngineHealth(down=True, detail=protocol.ENGINE_STARTING)
        # how announced versions become local files (`weights_keys`: CURVE keys for the weight service)
        self.sync = WeightSync(weights or WeightsConfig(), self.worker_id, weights_keys)
        self.ready: Ready | None = None  # the newest version ready to load (loaded again after a restart)
        self.tried = -1  # the newest version a load was tried of (a failed one is not tried again)
        self.weights_lost = False  # the engine is down until a version is loaded into it again (WeightsLost)
        self.prober: ThreadPoolExecutor | None = None  # runs Engine.probe while the engine is down
        self.probing: Future[Engine | None] | None = None
        self.sampling: SamplingParams | None = None  # from the first Welcome: how engines are built
        # the broker connection; `curve`: CurveZMQ client keys when the broker requires them
        self.link = PeerLink(cfg.broker, self.worker_id, self._hello, curve, MAX_MESSAGE_BYTES)

    # ------------------------------------------------------------------ the loop

    def run(self, should_stop: Callable[[], bool]) -> None:
        self.link.connect()
        try:
            while not should_stop():
                busy = self.engine is not None and not self.health.down and self.engine.active > 0
                self._read_broker(0 if busy else self._idle_wait_ms())
                self._sync_weights()
                self._meter_usage()
                if self.health.down:
                    self._probe(time.monotonic())
                elif busy:
                    self._step()
                    self._meter_usage()
                self._drive()
                self._send_scored()
                self._send_outbox_if_due()
                self._report_health()
                self.link.keep_alive()
            self._shutdown()
        finally:
            # A worker that dies of an error must still close its socket: one left to the garbage collector
            # can be finalised after its context, whose term() then waits on it forever.
            self.link.close(linger_ms=0)

    def _read_broker(self, timeout_ms: int) -> None:
        """Handle what the broker sent, waiting at most `timeout_ms` for the first message."""
        msg = self.link.recv(timeout_ms)
        while msg is not None:
            self._handle(msg)
            msg = self.link.recv(0)

    def _handle(self, msg: protocol.Message) -> None:
        match msg:
            case protocol.Welcome():
                self._on_welcome(msg)
            case protocol.Lease():
                self._on_acked(msg.acked)
                self._on_lease(msg)
            case protocol.ResultAck(acked=acked):
                self._on_acked(acked)
            case protocol.Abort(round_id=round_id):
                self._on_abort(round_id)
            case protocol.WeightsReady():
                self._on_weights(msg)
            case _:
                log.warning("unexpected %s from the broker", type(msg).__name__)

    # ------------------------------------------------------------------ broker messages

    def _on_acked(self, acked: int) -> None:
        """The broker has what it took of results up to `acked` on its disk: forget them."""
        while self.unacked and next(iter(self.unacked)) <= acked:
            del self.unacked[next(iter(self.unacked))]

    def _on_welcome(self, msg: protocol.Welcome) -> None:
        if self.sampling is None:  # the first Welcome: the run's sampling settings; build the engine now
            self.sampling = SamplingParams(
                temperature=msg.temperature,
                top_p=msg.top_p,
                top_k=msg.top_k,
                stop_token_ids=self.tokenizer.eos_token_ids,
                seed=self.seed,
            )
            self.health.next_probe = time.monotonic()
        if msg.weights_uri:
            self._on_weights(protocol.WeightsReady(msg.version, msg.weights_uri, msg.weights_sha256))

    def _engine_built(self, engine: Engine) -> None:
        self.engine = engine
        gpus = visible_gpus() if engine.name == "sglang" or self.cfg.device.startswith("cuda") else ""
        placement = f"{engine.placement}, {gpus}" if gpus else engine.placement
        self.health.placement = one_line(placement, protocol.MAX_PLACEMENT)  # told with its coming up
        if isinstance(engine, TensorLoading):  # it can take the learner's broadcast, when one is announced
            self.sync.accept_broadcast(self.cfg.device)
        elif isinstance(engine, BroadcastReceiving):  # its servers can, as ranks of the learner's group
            self.sync.accept_server_broadcast(engine.broadcast_servers)
        self.meter = SlotMeter(engine.slots, time.monotonic(), self.cfg.usage_report_s)
        log.info(
            "worker %s: engine %s ready (%d slots, %s)",
            self.worker_id,
            engine.name,
            engine.slots,
            self.health.placement,
        )

    def _on_lease(self, msg: protocol.Lease) -> None:
        leased = list(
            zip(
                msg.lease_ids.tolist(),
                msg.budgets.tolist(),
                msg.greedy.tolist(),
                msg.samples.to_samples(),
                strict=True,
            )
        )
        self.core.leased(len(leased))
        if self.health.down or self.engine is None:  # leased before the broker heard: back, as leased
            self._return_unstarted([(lease_id, s) for lease_id, _, _, s in leased])
            return
        for lease_id, budget, greedy, sample in leased:
            try:
                if self.episodes is not None:
                    decisions = self.episodes.lease(lease_id, budget, bool(greedy), sample)
                else:
                    # a text prompt: tokenized once, resumes reuse the ids
                    if sample.prompt_ids.shape[0] == 0:
                        ids = self.tokenizer.encode_prompt(sample.prompt_text, sample.metadata)
                        sample = dataclasses.replace(sample, prompt_ids=ids)
                    decisions = self.core.lease(lease_id, budget, bool(greedy), sample, Begin.TURN)
            except EpisodeError as exc:  # a state this worker cannot read: the sample, not the worker, fails
                log.warning("sample %s cannot be resumed: %s", sample.key, exc)
                decisions = [
                    Settle(lease_id, sample.failed(failure(Reason.EPISODE_STATE, f"episode: {exc}")))
                ]
            except ValueError as exc:  # the tokenizer's: one bad prompt fails one sample
                log.warning("sample %s cannot be generated: %s", sample.key, exc)
                rejected = failure(Reason.ENGINE_REJECTED, f"engine rejected the request: {exc}")
                decisions = [Settle(lease_id, sample.failed(rejected))]
            self._carry_out(decisions, grant=False)  # (granted once every lease is in)
        self._drive()

    def _step(self) -> None:
        """One engine step. An EngineError no request was blamed for leaves the engine in a state the
        worker cannot know: it takes back what it can (abort) and treats the engine as down."""
        assert self.engine is not None
        try:
            outputs = self.engine.step()
        except EngineUnavailable as exc:
            self._engine_down(exc, exc.partials)
            return
        except EngineError as exc:
            log.error("engine step failed, no request blamed: treating the engine as down: %s", exc)
            try:
                partials = self.engine.abort()
            except EngineError as again:
                partials = again.partials if isinstance(again, EngineUnavailable) else []
            self._engine_down(exc, partials)
            return
        self._on_outputs(outputs, asked=False)

    def _on_outputs(self, outputs: Sequence[GenerationOutput], asked: bool) -> None:
        """Samples leave the engine, each freeing its slot: a turn that ended goes to the core (scored when
        single-turn; an episode's step runs); ABORT ones go back as partials (an engine error, or an abort
        behind our back on a shared server, when not `asked` by an Abort); failed requests fail their
        sample. What they owe is sent with the credit `_drive` grants once the freed slots are filled (an
        abort's AbortDone sets the credit instead)."""
        decisions: list[Decision] = []
        for out in outputs:
            held = self.core.held.get(out.request_id)
            if held is None or held.phase is not Phase.ENGINE:  # a request of a lease already returned
                log.warning("engine returned request %d, which this worker no longer holds", out.request_id)
                continue
            if out.finish_reason == FinishReason.ABORT:
                decisions.append(Settle(out.request_id, apply_output(held.sample, out)))
                if out.error or not asked:  # not the broker's Abort: the engine's doing
                    self.health.returned += 1
                    log.warning("sample %s back as a partial: %s", held.sample.key, out.error or "aborted")
            elif out.error:
                log.warning("sample %s failed by the engine: %s", held.sample.key, out.error)
                decisions.append(
                    Settle(out.request_id, failed_by_engine(apply_output(held.sample, out), out.error))
                )
                self.health.failed += 1
            else:
                decisions += self._turn_ended(held.sample, out)
        self._carry_out(decisions, grant=False)  # (granted once the freed slots are filled: `_drive`)

    def _turn_ended(self, sample: Sample, out: GenerationOutput) -> list[Decision]:
        """A turn ended (STOP or LENGTH): the core says what follows."""
        turn = apply_output(sample, dataclasses.replace(out, finish_reason=FinishReason.NONE))
        return self.core.turn_ended(out.request_id, turn, out.finish_reason)

    def _score(self, lease_id: int, sample: Sample) -> None:
        self.scoring[lease_id] = sample
        text = self.tokenizer.decode(sample.response_ids)
        self.rewards.submit(lease_id, text, sample.metadata.get("answer", ""), sample.metadata)

    def _send_scored(self) -> None:
        done: list[tuple[int, Sample]] = []
        for result in self.rewards.poll():
            sample = self.scoring.pop(result.key, None)
            if sample is None:
                continue
            if result.reward is not None:
                done.append((result.key, sample.scored(result.reward)))
            else:
                log.warning("sample %s failed its reward: %s", sample.key, result.error)
                done.append((result.key, sample.failed(result.error)))
        if done:
            self._owe(done)

    def _carry_out(self, decisions: Sequence[Decision], grant: bool = True) -> None:
        """The core's decisions: turns into the engine, steps run, samples scored or owed to the broker
        (with the credit the core grants now, unless `grant` is off: an abort's AbortDone sets it)."""
        settled: list[tuple[int, Sample]] = []
        for d in decisions:
            match d:
                case StartTurn():
                    self._start_turn(d)
                case RunStep():
                    assert self.episodes is not None
                    self.episodes.run_steps([d])
                case Settle(to_score=True):
                    self._score(d.lease_id, d.sample)
                case Settle():
                    settled.append((d.lease_id, d.sample))
        self._owe(settled, grant)

    def _owe(self, items: list[tuple[int, Sample]], grant: bool = True) -> None:
        """Results for the broker into the outbox; with `grant`, the free slots the core grants too, and
        the outbox sent once it is due (at once with result_hold_ms 0). Without, they wait for the next
        grant (or for the next message the worker sends: nothing overtakes them)."""
        for lease_id, _ in items:
            self.core.forget(lease_id)
        if self.episodes is not None:
            self.episodes.forget(items)
        granted = self.core.grant() if grant and not self.health.down else 0  # a down engine grants none
        self.outbox.add(items, granted, time.monotonic())
        if grant:
            self._send_outbox_if_due()

    def _send_outbox_if_due(self) -> None:
        if self.outbox.due(time.monotonic()):
            self._send_outbox()

    def _send_outbox(self) -> None:
        msg = self.outbox.take()
        if isinstance(msg, protocol.SampleResult):  # kept until acknowledged
            self.seq += 1
            msg = dataclasses.replace(msg, seq=self.seq)
            self.unacked[self.seq] = msg
        if msg is not None:
            self.link.send(msg)

    # ------------------------------------------------------------------ turns and episodes

    def _drive(self) -> None:
        """After the engine's step (its turns that ended), as `april simulate`'s engines at a step
        boundary: the steps and resets that answered, then free slots to waiting turns, then the credit
        the core grants, sent with what settled."""
        if self.episodes is not None:
            self._carry_out(self.episodes.poll(), grant=False)
        self._fill_slots()

    def _fill_slots(self) -> None:
        """Start waiting turns in free engine slots (the core's order). While the engine is down they go
        back as partials."""
        if self.engine is None:
            return
        if self.health.down:
            back = self.core.return_waiting()
            self.health.returned += len(back)
            self._carry_out(back)
            return
        self._carry_out(self.core.fill())

    def _start_turn(self, d: StartTurn) -> None:
        """Add a turn to the engine; a request it rejects fails its sample (one bad request, not the
        worker); an engine that cannot serve takes it back with the others."""
        assert self.engine is not None
        held = self.core.held.get(d.lease_id)
        if held is None or held.phase is not Phase.ENGINE:  # the engine went down since: it went back
            return
        try:
            self.engine.add([GenerationRequest(d.lease_id, d.sample.resume_input(), d.budget, d.greedy)])
        except EngineUnavailable as exc:
            self._engine_down(exc, exc.partials)
        except EngineError as exc:
            self.core.forget(d.lease_id)
            self.health.failed += 1
            log.warning("sample %s cannot be generated: %s", d.sample.key, exc)
            rejected = failure(Reason.ENGINE_REJECTED, f"engine rejected the request: {exc}")
            self._owe([(d.lease_id, d.sample.failed(rejected))])

    def _idle_wait_ms(self) -> int:
        """How long an idle loop may block on the broker socket. A fetch finishing or a step answering does
        not wake it, so it looks every 5 ms while one is on its way (a version loads promptly, sync_s is
        honest), or at the moment a simulated step answers; and no longer than the outbox may hold."""
        wait_s = 0.05
        if self.sync.busy or (self.episodes is not None and self.episodes.busy):
            wait_s = 0.005
        answer_s = self.episodes.next_answer_s() if self.episodes is not None else None
        if answer_s is not None:
            wait_s = min(wait_s, answer_s)
        held_s = self.outbox.wait_s(time.monotonic())
        if held_s is not None:
            wait_s = min(wait_s, held_s)
        return math.ceil(wait_s * 1e3)

    def _on_abort(self, round_id: int) -> None:
        """Return every unfinished sample as a partial; confirm once the engine is idle (a down engine
        is: it holds nothing, and grants no credit)."""
        returned = self._drain_engine()
        # what waits for a slot goes back as it is; episodes in a step: back, or waited for (named as
        # scoring is)
        back, waited = self.episodes.abort() if self.episodes is not None else self.core.abort({})
        self._carry_out(back, grant=False)
        returned += sum(1 for d in back if isinstance(d, Settle))
        scoring = np.array(sorted([*self.scoring, *waited]), dtype=np.int64)
        credit = 0 if self.health.down else self.cfg.slots
        self.core.set_credit(credit)
        self._send(protocol.AbortDone(round_id, credit, scoring))
        log.info(
            "abort %d: engine idle, %d partials returned, %d still scoring",
            round_id,
            returned,
            scoring.shape[0],
        )

    def _drain_engine(self) -> int:
        """Abort the engine: finished samples go to scoring, partials back to the broker. Returns how
        many samples went back."""
        if self.engine is None or self.health.down:
            return 0
        held = self.core.active
        try:
            outputs = self.engine.abort()
        except EngineError as exc:  # the samples still go back, as far as the engine told us
            self._engine_down(exc, exc.partials if isinstance(exc, EngineUnavailable) else [])
            return held
        self._on_outputs(outputs, asked=True)
        return sum(1 for o in outputs if o.finish_reason == FinishReason.ABORT)

    def _on_weights(self, msg: protocol.WeightsReady) -> None:
        if self.engine is not None and msg.version <= self.engine.version:
            self.sync.remember(msg)  # e.g. its servers took it from the broadcast before it was announced
            return
        self.sync.announce(msg)  # fetched (or found) in the background, loaded by _sync_weights when ready

    def _sync_weights(self) -> None:
        """Versions whose bytes became local: keep the newest, load it when the engine serves; answer
        versions that could not be had. A down or starting engine loads it once it serves again."""
        for result in self.sync.poll():
            if isinstance(result, Offered):
                self._load_offer(result)
            elif isinstance(result, Unavailable):
                sync_s = time.monotonic() - result.heard_at
                log.error(
                    "weights v%d cannot be had (%s): %s", result.version, result.transport, result.error
                )
                self._send(
                    protocol.WeightsLoaded(
                        result.version, False, result.error[:500], result.transport, sync_s
                    )
                )
            elif self.ready is None or result.version > self.ready.version:
                self.ready = result
        ready = self.ready
        if ready is None or ready.version <= self.tried or self.engine is None:
            return
        lost = self.weights_lost and ready.version >= self.engine.version  # loaded while down: it answers
        if lost or (not self.health.down and ready.version > self.engine.version):
            self._load(ready)

    def _load(self, ready: Ready) -> None:
        """Verify (unless verified as it came) and load between decode steps; on any failure keep serving
        the old version."""
        assert self.engine is not None
        version = ready.version
        self.tried = max(self.tried, version)
        started = time.monotonic()
        try:
            path = ready.path
            if path is not None and not ready.verified:
                if not path.exists():
                    raise EngineError(f"weights file {path} does not exist")
                got = sha256_file(path)
                if got != ready.sha256:
                    raise EngineError(f"sha256 of {path} is {got}, announced {ready.sha256}")
            if ready.tensors is not None:  # broadcast: the version itself, for an engine that takes tensors
                assert isinstance(self.engine, TensorLoading)
                self.engine.load_tensors(ready.tensors, version)
                self.ready = None  # the engine holds it now: free the received copy (an in-process engine)
            else:
                self.engine.load_weights(path or Path(ready.source), version)
        except (EngineError, OSError) as exc:
            log.error("weights v%d not loaded, still serving v%d: %s", version, self.engine.version, exc)
            sync_s = time.monotonic() - ready.heard_at
            self._send(protocol.WeightsLoaded(version, False, str(exc)[:500], ready.transport, sync_s))
            if isinstance(exc, EngineUnavailable):
                self._engine_down(exc, exc.partials)
            return
        now = time.monotonic()
        self.sync.loaded(version)
        self.weights_lost = False
        log.info(
            "weights v%d loaded in %.3fs (%s, %.3fs since announced)",
            version,
            now - started,
            ready.transport or "nothing to load",
            now - ready.heard_at,
        )
        self._send(protocol.WeightsLoaded(version, True, "", ready.transport, now - ready.heard_at))

    def _load_offer(self, offered: Offered) -> None:
        """The learner is broadcasting a version to the engine's servers now: park, receive, check, resume
        (`BroadcastReceiving.load_broadcast`), before the version is announced. A failure is answered
        WeightsLoaded(ok=False) and the version comes by the network once announced."""
        offer, engine = offered.offer, self.engine
        if engine is None or self.health.down or not isinstance(engine, BroadcastReceiving):
            log.warning("weights v%d: not taken from the broadcast: the engine is down", offer.version)
            return
        try:
            engine.load_broadcast(offer)
        except EngineError as exc:
            log.error(
                "weights v%d: broadcast not loaded (v%d serves): %s", offer.version, engine.version, exc
            )
            sync_s = time.monotonic() - offer.started_at
            self._send(protocol.WeightsLoaded(offer.version, False, str(exc)[:500], BROADCAST, sync_s))
            if isinstance(exc, EngineUnavailable):
                self._engine_down(exc, exc.partials)
            return
        self.tried = max(self.tried, offer.version)
        if self.ready is not None and self.ready.version <= offer.version:
            self.ready = None  # older than what the engine serves now
        self.sync.loaded(offer.version)
        sync_s = time.monotonic() - offer.started_at
        log.info("weights v%d loaded in %.3fs (broadcast, checked on the servers)", offer.version, sync_s)
        self._send(protocol.WeightsLoaded(offer.version, True, "", BROADCAST, sync_s))

    def _meter_usage(self) -> None:
        """Account slot usage up to now, and report it when due (cumulative: a lost report loses nothing)."""
        if self.engine is None or self.meter is None:
            return
        now = time.monotonic()
        self.meter.observe(now, 0 if self.health.down else self.engine.active)
        if self.meter.due(now, self.link.interval):
            # straight to the broker, not after the outbox: a cumulative report commutes with results, and
            # sent every usage_report_s while generating it would cut every longer hold short
            self.link.send(self.meter.report(now, self.engine))

    # ------------------------------------------------------------------ engine down and back

    def _engine_down(self, exc: EngineError, partials: Sequence[GenerationOutput]) -> None:
        """The engine cannot serve: the broker hears it first (so that it leases nothing more when the
        samples come back), then every sample the engine held goes back, with the tokens `partials`
        bring (a turn that ended goes on: a single-turn sample is scored, an episode's step runs), and
        probing starts."""
        outputs = {o.request_id: o for o in partials}
        decisions: list[Decision] = []
        back = failed = 0
        for lease_id in self.core.in_phase(Phase.ENGINE):
            sample, out = self.core.held[lease_id].sample, outputs.get(lease_id)
            if out is not None and out.error and out.finish_reason == FinishReason.NONE:
                # refused before the engine went down: the request is at fault, a retry would fail again
                decisions.append(Settle(lease_id, failed_by_engine(sample, out.error)))
                failed += 1
            elif (
                out is not None
                and not out.error
                and out.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
            ):
                decisions += self._turn_ended(sample, out)
            else:
                decisions.append(Settle(lease_id, interrupted(sample, out)))
                back += 1
        was_down = self.health.down
        self.sync.rejoin_broadcast()  # its servers leave the learner's group until they serve again
        if isinstance(exc, WeightsLost):
            self._weights_lost(exc)
        self.health.returned += back
        self.health.failed += failed
        self.health.go_down(str(exc), time.monotonic())
        self.core.set_credit(0)  # the broker's, once it hears: nothing more until the engine serves
        self._report_health()
        self._carry_out(decisions)
        if not was_down:
            log.error(
                "engine down (%s): %d samples returned, leasing nothing until it serves again",
                self.health.detail,
                back,
            )

    def _weights_lost(self, exc: WeightsLost) -> None:
        """The engine answers but holds no whole version (a server restarted, or a broadcast failed, and
        its version came by broadcast): get that version, or the newest announced, from a file or the
        network again and load it while the engine is down; the probe then finds it serving."""
        if not self.weights_lost:
            log.warning("engine holds no whole version (%s): getting v%d again", exc, exc.version)
        self.weights_lost = True
        self.tried = min(self.tried, exc.version - 1)
        if self.ready is None or self.ready.version < exc.version:
            self.sync.refetch(exc.version)

    def _return_unstarted(self, items: list[tuple[int, Sample]]) -> None:
        """Leases that reached a down engine's worker: back as leased, no credit."""
        self._owe([(lease_id, interrupted(sample, None)) for lease_id, sample in items])
        self.health.returned += len(items)

    def _probe(self, now: float) -> None:
        """While down (or starting): start a probe when due, which builds the engine if there is none yet;
        when one ends, come up, or wait longer. An engine that cannot be built at all (not merely not yet
        reachable) stops the worker with its reason, as a bad configuration should."""
        if self.probing is None:
            if self.health.probe_due(now):
                if self.prober is None:
                    self.prober = ThreadPoolExecutor(1, thread_name_prefix="engine-probe")
                self.probing = self.prober.submit(self._probe_engine)
            return
        if not self.probing.done():
            return
        probe, self.probing = self.probing, None
        try:
            built = probe.result()  # anything but an EngineError is a bug in the engine: it surfaces here
            if built is not None:
                self._engine_built(built)
            self._recover()
        except EngineError as exc:
            if self.engine is None and not isinstance(exc, EngineUnavailable):
                raise
            if isinstance(exc, WeightsLost):
                self._weights_lost(exc)
            self.health.probe_failed(str(exc), now)
            log.warning(
                "engine still down (probe %d): %s; next probe in %.0fs",
                self.health.probes_failed,
                self.health.detail,
                self.health.wait_s,
            )

    def _probe_engine(self) -> Engine | None:
        """On the probe thread: the engine answers (None), or a first engine is built (it)."""
        if self.engine is not None:
            self.engine.probe()
            return None
        assert self.sampling is not None, "probing before Welcome"
        return self.make_engine(self.sampling, 0)

    def _recover(self) -> None:
        """The engine answers again: drop requests of leases already returned, say so, load the newest
        weights announced, and grant the free slots. Raises EngineError when it fails again.

        The weights are loaded even when the engine reports that version already: what answers may be a
        restarted server holding its launch weights, which the engine object cannot always tell, and a
        token tagged with a version that did not make it would be trained as on-policy when it is not."""
        assert self.engine is not None
        if self.engine.active:  # left behind by a failure that was not EngineUnavailable
            self._on_outputs(self.engine.abort(), asked=True)
        self.health.come_up()
        log.info("engine serves again: leasing resumes")
        self._report_health()
        self.sync.rejoin_broadcast()  # a restarted server joins the learner's group with the others
        if self.ready is not None and self.ready.version >= self.engine.version:
            self._load(self.ready)
        if not self.health.down:
            self._send(protocol.LeaseRequest(self.core.grant()))

    def _report_health(self) -> None:
        report = self.health.unsent()
        if report is not None:
            self._send(report)

    # ------------------------------------------------------------------ connection

    def _hello(self) -> list[protocol.Message]:
        """What introduces this worker to a broker that may have lost it: the leases it still holds (its
        unacknowledged results' too) and its free slots, its engine's health when that is not the broker's
        default (up, nothing lost), then its unacknowledged results again, in order, without credit (the
        hello's counts the slots they freed)."""
        resent = [i for r in self.unacked.values() for i in r.lease_ids.tolist()]
        held = np.array(
            sorted({*self.core.held, *self.scoring, *self.outbox.lease_ids(), *resent}), dtype=np.int64
        )
        version = self.engine.version if self.engine is not None else 0
        free = 0 if self.engine is None or self.health.down else self.core.free()
        self.core.set_credit(free)  # what the broker holds once it read the hello
        self.outbox.drop_credit()
        hello = protocol.WorkerHello(
            self.worker_id,
            self.cfg.engine,
            self.cfg.slots,
            version,
            os.getpid(),
            socket.gethostname(),
            held,
            free,
        )
        self.health.sent = self.health.report()  # what the broker knows once it read the hello
        intro: list[protocol.Message] = [hello] if self.health.pristine else [hello, self.health.sent]
        return intro + [dataclasses.replace(r, credit=0) for r in self.unacked.values()]

    def _send(self, msg: protocol.Message) -> None:
        """Send `msg` after everything the outbox holds, so that no held result is overtaken (only the
        usage report, which commutes with results, goes straight to the link: `_meter_usage`)."""
        self._send_outbox()
        self.link.send(msg)

    def _shutdown(self) -> None:
        """Leave cleanly: partials back to the broker, scored samples sent if they come quickly."""
        self._drain_engine()
        back, _ = self.episodes.abort() if self.episodes is not None else self.core.abort({})
        self._carry_out(back, grant=False)
        wait_s = min(self.cfg.reward_timeout_s, 5.0)
        if self.episodes is not None:  # a step an abort cannot kill runs once: its result is waited for
            wait_s = max(wait_s, self.episodes.runner.wait_s())
        deadline = time.monotonic() + wait_s
        while (self.scoring or self.core.held) and time.monotonic() < deadline:
            time.sleep(0.01)
            self._send_scored()
            self._drive()
        self._send(protocol.Disconnect("shutdown"))
        self.rewards.close()
        if self.episodes is not None:
            self.episodes.close()
        self.sync.close()
        if self.prober is not None:
            self.prober.shutdown(wait=False, cancel_futures=True)
        if self.engine is not None:
            try:
                self.engine.close()
            except EngineError as exc:  # a server that is gone: nothing left to release
                log.warning("engine close failed: %s", exc)
        self.link.close(linger_ms=1000)

    def identify(self, request: GenerationRequest) -> SampleIdentity:
        """Sample identity for the sim engine: stable across resumes and workers."""
        s = self.core.held[request.request_id].sample
        ids = s.prompt_ids
        identity = SampleIdentity.of_sample(s.group_id, s.index, int(ids.shape[0]), prompt_key(ids))
        if self.episodes is None:
            return identity
        unseen = s.response_len - (s.segments[-1].end if s.segments else 0)  # an answer appended since
        return dataclasses.replace(
            identity, model_tokens=s.model_tokens, calls=len(s.observations), unseen=unseen
        )
