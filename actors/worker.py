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

With `env.name` set every lease is an episode: `actors.episode_driver` holds it between turns (resets,
tool steps, waiting for a slot); the worker adds its turns to the engine and sends what settles.
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
from dataclasses import dataclass
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

log = logging.getLogger("april.worker")
EngineFactory = Callable[[SamplingParams, int], Engine]  # (sampling, starting version) -> engine
MAX_MESSAGE_BYTES = 256 * 1024 * 1024


@dataclass(slots=True)
class Held:
    """A leased sample inside the engine: the sample as leased (prompt ids filled in)."""

    lease_id: int
    sample: Sample


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
    last_version = s.segments[-1].version if s.segments else 0
    return s.extend([], [], last_version, out.finish_reason)


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
        self.held: dict[int, Held] = {}  # lease id -> sample in the engine
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
                # idle, the loop waits on the broker socket; a fetch finishing (or a tool step) does not
                # wake it, so it looks every 5 ms while one is on its way (a version loads promptly, sync_s
                # is honest), and no longer than what the outbox holds may wait
                stepping = self.episodes is not None and self.episodes.busy
                self._read_broker(0 if busy else self._idle_wait_ms(5 if self.sync.busy or stepping else 50))
                self._sync_weights()
                self._drive_episodes()
                self._meter_usage()
                if self.health.down:
                    self._probe(time.monotonic())
                elif busy:
                    self._step()
                    self._meter_usage()
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
        if self.episodes is not None and not self.health.down and self.engine is not None:
            for lease_id, budget, greedy, sample in leased:
                self._lease_episode(lease_id, budget, bool(greedy), sample)
            self._fill_slots()
            return
        failed: list[tuple[int, Sample]] = []
        for i, (lease_id, budget, greedy, sample) in enumerate(leased):
            if self.health.down or self.engine is None:  # leased before the broker heard: back, as leased
                self._return_unstarted([(lid, s) for lid, _, _, s in leased[i:]])
                break
            try:
                if sample.prompt_ids.shape[0] == 0:  # text-only prompt: tokenize once, resumes reuse the ids
                    ids = self.tokenizer.encode_prompt(sample.prompt_text, sample.metadata)
                    sample = dataclasses.replace(sample, prompt_ids=ids)
                self.held[lease_id] = Held(lease_id, sample)
                self.engine.add([GenerationRequest(lease_id, sample.resume_input(), budget, bool(greedy))])
            except EngineUnavailable as exc:  # this sample is held: it goes back with the others
                self._engine_down(exc, exc.partials)
            except (EngineError, ValueError) as exc:  # one bad request fails one sample, not the worker
                self.held.pop(lease_id, None)
                log.warning("sample %s cannot be generated: %s", sample.key, exc)
                if isinstance(exc, EngineError):  # (a ValueError is the tokenizer's)
                    self.health.failed += 1
                failed.append(
                    (
                        lease_id,
                        sample.failed(failure(Reason.ENGINE_REJECTED, f"engine rejected the request: {exc}")),
                    )
                )
        if failed:
            self._owe(failed, credit=0 if self.health.down else len(failed))

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
        """Samples leave the engine, each freeing its slot: finished ones are scored (and streamed when
        scored); ABORT ones go back as partials (an engine error, or an abort behind our back on a shared
        server, when not `asked` by an Abort); failed requests fail their sample."""
        done: list[tuple[int, Sample]] = []
        finished = 0
        settled: list[tuple[int, Sample]] = []  # episodes ended by a turn (their reward is set)
        for out in outputs:
            held = self.held.pop(out.request_id, None)
            if held is None:  # a request of a lease already returned (after an engine failure)
                log.warning("engine returned request %d, which this worker no longer holds", out.request_id)
                continue
            if out.finish_reason == FinishReason.ABORT:
                done.append((out.request_id, apply_output(held.sample, out)))
                if out.error or not asked:  # not the broker's Abort: the engine's doing
                    self.health.returned += 1
                    log.warning("sample %s back as a partial: %s", held.sample.key, out.error or "aborted")
            elif out.error:
                log.warning("sample %s failed by the engine: %s", held.sample.key, out.error)
                done.append((out.request_id, failed_by_engine(apply_output(held.sample, out), out.error)))
                self.health.failed += 1
            elif self.episodes is not None:
                settled += self._turn_ended(out.request_id, held.sample, out)
                finished += 1
            else:
                self._score(out.request_id, apply_output(held.sample, out))
                finished += 1
        if self.episodes is not None and not asked:  # a freed slot goes to an episode waiting, else credit
            finished = max(0, finished - self._fill_slots())
        if done:
            self._owe(done, credit=0 if asked else len(done))
        if finished or settled:
            self._owe(settled, finished)

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

    def _owe(self, items: list[tuple[int, Sample]], credit: int = 0) -> None:
        """Results and freed slots for the broker: into the outbox, sent once it is due (at once with
        result_hold_ms 0)."""
        if self.episodes is not None:
            self.episodes.forget(items)
        self.outbox.add(items, credit, time.monotonic())
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

    # ------------------------------------------------------------------ episodes

    def _lease_episode(self, lease_id: int, budget: int, greedy: bool, sample: Sample) -> None:
        assert self.episodes is not None
        try:
            self.episodes.lease(lease_id, budget, greedy, sample)
        except EpisodeError as exc:  # a state this worker cannot read: the sample, not the worker, fails
            log.warning("sample %s cannot be resumed: %s", sample.key, exc)
            self._owe([(lease_id, sample.failed(failure(Reason.EPISODE_STATE, f"episode: {exc}")))], credit=1)

    def _turn_ended(self, lease_id: int, sample: Sample, out: GenerationOutput) -> list[tuple[int, Sample]]:
        """An episode's turn finished (STOP or LENGTH): its step starts, or it settles (returned)."""
        assert self.episodes is not None
        turn = apply_output(sample, dataclasses.replace(out, finish_reason=FinishReason.NONE))
        ended = self.episodes.turn_ended(lease_id, turn, out.finish_reason)
        return [] if ended is None else [(ended.lease_id, ended.sample)]

    def _drive_episodes(self) -> None:
        """Steps and resets that answered: settled episodes to the broker, the rest into free slots."""
        if self.episodes is None:
            return
        settled = self.episodes.poll()
        if settled:
            credit = 0 if self.health.down else sum(e.credit for e in settled)
            self._owe([(e.lease_id, e.sample) for e in settled], credit)
        if self.episodes.ready:
            self._fill_slots()

    def _fill_slots(self) -> int:
        """Start episodes' next turns in free engine slots, answered episodes before unstarted leases
        (those wait when an answered episode took the slot their credit was for). While the engine is
        down they go back as partials. Returns how many started."""
        assert self.episodes is not None
        started = 0
        while self.episodes.ready and self.engine is not None:
            if self.health.down:
                back = []
                while (nxt := self.episodes.next_request()) is not None:
                    back.append((nxt[0].request_id, interrupted(nxt[1], None)))
                self.health.returned += len(back)
                self._owe(back)
                break
            if self.engine.active >= self.engine.slots:
                break
            nxt = self.episodes.next_request()
            assert nxt is not None
            request, sample = nxt
            self.held[request.request_id] = Held(request.request_id, sample)
            try:
                self.engine.add([request])
                started += 1
            except EngineUnavailable as exc:
                self._engine_down(exc, exc.partials)
            except EngineError as exc:
                self.held.pop(request.request_id, None)
                self.health.failed += 1
                log.warning("sample %s cannot be generated: %s", sample.key, exc)
                failed = sample.failed(failure(Reason.ENGINE_REJECTED, f"engine rejected the request: {exc}"))
                self._owe([(request.request_id, failed)], credit=1)
        return started

    def _episodes_held(self) -> bool:
        return self.episodes is not None and bool(self.episodes.episodes)

    def _idle_wait_ms(self, wait_ms: int) -> int:
        """How long an idle loop may block on the broker socket: `wait_ms`, or until the outbox is due."""
        left = self.outbox.wait_s(time.monotonic())
        return wait_ms if left is None else min(wait_ms, math.ceil(left * 1e3))

    def _on_abort(self, round_id: int) -> None:
        """Return every unfinished sample as a partial; confirm once the engine is idle (a down engine
        is: it holds nothing, and grants no credit)."""
        returned = self._drain_engine()
        waited: list[int] = []
        if self.episodes is not None:  # episodes between turns: back, or waited for (named as scoring is)
            back, waited = self.episodes.abort()
            self._owe([(e.lease_id, e.sample) for e in back])
            returned += len(back)
        scoring = np.array(sorted([*self.scoring, *waited]), dtype=np.int64)
        self._send(protocol.AbortDone(round_id, 0 if self.health.down else self.cfg.slots, scoring))
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
        held = len(self.held)
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
        bring (one that finished is scored), and probing starts."""
        outputs = {o.request_id: o for o in partials}
        back: list[tuple[int, Sample]] = []
        failed: list[tuple[int, Sample]] = []
        settled: list[tuple[int, Sample]] = []  # episodes a finished turn ended
        for lease_id, held in self.held.items():
            out = outputs.get(lease_id)
            if out is not None and out.error and out.finish_reason == FinishReason.NONE:
                # refused before the engine went down: the request is at fault, a retry would fail again
                failed.append((lease_id, failed_by_engine(held.sample, out.error)))
            elif (
                out is not None
                and not out.error
                and out.finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
            ):
                if self.episodes is None:
                    self._score(lease_id, apply_output(held.sample, out))
                    continue
                settled += self._turn_ended(lease_id, held.sample, out)
            else:
                back.append((lease_id, interrupted(held.sample, out)))
        self.held.clear()
        was_down = self.health.down
        self.sync.rejoin_broadcast()  # its servers leave the learner's group until they serve again
        if isinstance(exc, WeightsLost):
            self._weights_lost(exc)
        self.health.returned += len(back)
        self.health.failed += len(failed)
        self.health.go_down(str(exc), time.monotonic())
        self._report_health()
        if back or failed or settled:
            self._owe(settled + failed + back)  # credit 0: nothing more until the engine serves
        if not was_down:
            log.error(
                "engine down (%s): %d samples returned, leasing nothing until it serves again",
                self.health.detail,
                len(back),
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
            self._send(protocol.LeaseRequest(max(0, self.cfg.slots - len(self.held))))

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
        episodes = self.episodes.lease_ids() if self.episodes is not None else []
        resent = [i for r in self.unacked.values() for i in r.lease_ids.tolist()]
        held = np.array(
            sorted({*self.held, *self.scoring, *self.outbox.lease_ids(), *episodes, *resent}), dtype=np.int64
        )
        version = self.engine.version if self.engine is not None else 0
        free = 0 if self.health.down or self.engine is None else max(0, self.cfg.slots - len(self.held))
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
        if self.episodes is not None:
            back, _ = self.episodes.abort()
            self._owe([(e.lease_id, e.sample) for e in back])
        wait_s = min(self.cfg.reward_timeout_s, 5.0)
        if self.episodes is not None:  # a step an abort cannot kill runs once: its result is waited for
            wait_s = max(wait_s, self.episodes.runner.wait_s())
        deadline = time.monotonic() + wait_s
        while (self.scoring or self._episodes_held()) and time.monotonic() < deadline:
            time.sleep(0.01)
            self._send_scored()
            self._drive_episodes()
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
        sample = self.held[request.request_id].sample
        ids = sample.prompt_ids
        return SampleIdentity.of_sample(sample.group_id, sample.index, int(ids.shape[0]), prompt_key(ids))
