"""The rollout worker process: leases samples from the broker, keeps its engine full, streams results.

One loop, top to bottom: read the broker's messages (leases, aborts, weights, heartbeats), advance the
engine one step, score what finished (rewards run in a killable child process and never block), send
what is ready, keep the connection alive. Speaks only `april.protocol` to the broker and only
`actors.engine.Engine` to the engine; knows nothing of scheduling policy.

Contracts it keeps (docs/protocol.md): a sample leased with its `greedy` flag set (an evaluation sample)
is decoded greedily; a sample that finished generating frees its engine slot at once
(LeaseRequest credit) and is streamed when scored; on Abort every unfinished sample goes back INTERRUPTED
with its tokens and log-probs, and AbortDone is sent only once the engine is idle, naming the samples
still being scored; weights are verified by sha256 before loading and a failed load keeps the old ones;
after every (re)connect and whenever the broker says it does not know this worker, the WorkerHello
names the leases still held. Heartbeats, liveness and reconnecting with backoff are `april.peer_link`'s.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import socket
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import numpy as np

from actors.engine import Engine, EngineError, GenerationOutput, GenerationRequest, SamplingParams
from actors.engines.sim_engine import SampleIdentity
from actors.reward_runner import RewardRunner
from actors.slot_meter import SlotMeter
from actors.tokenizer import Tokenizer
from april import protocol
from april.config import WorkerConfig
from april.files import sha256_file
from april.keys import ClientKeys
from april.peer_link import PeerLink
from april.records import FinishReason, Sample
from april.wire_records import SampleBatch

log = logging.getLogger("april.worker")
EngineFactory = Callable[[SamplingParams, int], Engine]  # (sampling, starting version) -> engine
MAX_MESSAGE_BYTES = 256 * 1024 * 1024


@dataclass(slots=True)
class Held:
    """A leased sample inside the engine: the sample as leased (prompt ids filled in)."""

    lease_id: int
    sample: Sample


def weights_path(uri: str) -> Path | None:
    """The local file of a weights URI (file:// or a plain path); None for sim:// (nothing to load)."""
    if uri.startswith("sim://"):
        return None
    parsed = urlparse(uri)
    return Path(parsed.path if parsed.scheme == "file" else uri)


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


class Worker:
    def __init__(
        self,
        cfg: WorkerConfig,
        tokenizer: Tokenizer,
        rewards: RewardRunner,
        make_engine: EngineFactory,
        seed: int,
        curve: ClientKeys | None = None,
    ) -> None:
        self.cfg = cfg
        self.worker_id = cfg.worker_id or f"{socket.gethostname()}-{os.getpid()}"
        self.tokenizer = tokenizer
        self.rewards = rewards
        self.make_engine = make_engine
        self.seed = seed
        self.engine: Engine | None = None
        self.meter: SlotMeter | None = None  # slot usage, reported as EngineUsage (from the engine's start)
        self.held: dict[int, Held] = {}  # lease id -> sample in the engine
        self.scoring: dict[int, Sample] = {}  # lease id -> finished sample waiting for its reward
        # the broker connection; `curve`: CurveZMQ client keys when the broker requires them
        self.link = PeerLink(cfg.broker, self.worker_id, self._hello, curve, MAX_MESSAGE_BYTES)

    # ------------------------------------------------------------------ the loop

    def run(self, should_stop: Callable[[], bool]) -> None:
        self.link.connect()
        while not should_stop():
            busy = self.engine is not None and self.engine.active > 0
            self._read_broker(0 if busy else 50)
            self._meter_usage()
            if busy and self.engine is not None:
                self._on_outputs(self.engine.step())
                self._meter_usage()
            self._send_scored()
            self.link.keep_alive()
        self._shutdown()

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
                self._on_lease(msg)
            case protocol.Abort(round_id=round_id):
                self._on_abort(round_id)
            case protocol.WeightsReady():
                self._on_weights(msg)
            case _:
                log.warning("unexpected %s from the broker", type(msg).__name__)

    # ------------------------------------------------------------------ broker messages

    def _on_welcome(self, msg: protocol.Welcome) -> None:
        if self.engine is None:
            sampling = SamplingParams(
                temperature=msg.temperature,
                top_p=msg.top_p,
                top_k=msg.top_k,
                stop_token_ids=self.tokenizer.eos_token_ids,
                seed=self.seed,
            )
            self.engine = self.make_engine(sampling, 0)
            self.meter = SlotMeter(self.engine.slots, time.monotonic())
            log.info(
                "worker %s: engine %s ready (%d slots)", self.worker_id, self.engine.name, self.engine.slots
            )
        if msg.version > self.engine.version and msg.weights_uri:
            self._load(msg.version, msg.weights_uri, msg.weights_sha256)

    def _on_lease(self, msg: protocol.Lease) -> None:
        assert self.engine is not None, "a Lease before Welcome"
        failed: list[tuple[int, Sample]] = []
        for lease_id, budget, greedy, sample in zip(
            msg.lease_ids.tolist(),
            msg.budgets.tolist(),
            msg.greedy.tolist(),
            msg.samples.to_samples(),
            strict=True,
        ):
            try:
                if sample.prompt_ids.shape[0] == 0:  # text-only prompt: tokenize once, resumes reuse the ids
                    ids = self.tokenizer.encode_prompt(sample.prompt_text, sample.metadata)
                    sample = dataclasses.replace(sample, prompt_ids=ids)
                self.held[lease_id] = Held(lease_id, sample)
                self.engine.add([GenerationRequest(lease_id, sample.resume_input(), budget, bool(greedy))])
            except (EngineError, ValueError) as exc:  # one bad request fails one sample, not the worker
                self.held.pop(lease_id, None)
                log.warning("sample %s cannot be generated: %s", sample.key, exc)
                failed.append((lease_id, sample.failed(f"engine rejected the request: {exc}"[:500])))
        if failed:
            self._send_results(failed, credit=len(failed))

    def _on_outputs(self, outputs: list[GenerationOutput]) -> None:
        """Finished samples leave the engine: free their slots now, score them, stream them when scored."""
        partials = [
            (o.request_id, apply_output(self.held.pop(o.request_id).sample, o))
            for o in outputs
            if o.finish_reason == FinishReason.ABORT
        ]
        if partials:  # aborted behind our back (a shared server): back to the broker as partials
            self._send_results(partials, credit=len(partials))
        outputs = [o for o in outputs if o.finish_reason != FinishReason.ABORT]
        for out in outputs:
            held = self.held.pop(out.request_id)
            sample = apply_output(held.sample, out)
            self.scoring[out.request_id] = sample
            text = self.tokenizer.decode(sample.response_ids)
            self.rewards.submit(out.request_id, text, sample.metadata.get("answer", ""), sample.metadata)
        if outputs:
            self._send(protocol.LeaseRequest(len(outputs)))

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
            self._send_results(done)

    def _send_results(self, items: list[tuple[int, Sample]], credit: int = 0) -> None:
        self._send(
            protocol.SampleResult(
                lease_ids=np.array([lease_id for lease_id, _ in items], dtype=np.int64),
                samples=SampleBatch.from_samples([s for _, s in items]),
                credit=credit,
            )
        )

    def _on_abort(self, round_id: int) -> None:
        """Return every unfinished sample as a partial; confirm once the engine is idle."""
        returned = self._drain_engine()
        scoring = np.array(sorted(self.scoring), dtype=np.int64)
        self._send(protocol.AbortDone(round_id, self.cfg.slots, scoring))
        log.info(
            "abort %d: engine idle, %d partials returned, %d still scoring",
            round_id,
            returned,
            scoring.shape[0],
        )

    def _drain_engine(self) -> int:
        """Abort the engine: finished samples go to scoring, partials back to the broker. Returns how
        many partials were sent."""
        if self.engine is None:
            return 0
        outputs = self.engine.abort()
        self._on_outputs([o for o in outputs if o.finish_reason != FinishReason.ABORT])
        items = [
            (o.request_id, apply_output(self.held.pop(o.request_id).sample, o))
            for o in outputs
            if o.finish_reason == FinishReason.ABORT
        ]
        if items:
            self._send_results(items)
        return len(items)

    def _on_weights(self, msg: protocol.WeightsReady) -> None:
        if self.engine is None or msg.version <= self.engine.version:
            return
        self._load(msg.version, msg.uri, msg.sha256)

    def _load(self, version: int, uri: str, sha256: str) -> None:
        """Verify and load between decode steps; on any failure keep serving the old version."""
        assert self.engine is not None
        started = time.monotonic()
        try:
            path = weights_path(uri)
            if path is not None:
                if not path.exists():
                    raise EngineError(f"weights file {path} does not exist")
                got = sha256_file(path)
                if got != sha256:
                    raise EngineError(f"sha256 of {path} is {got}, announced {sha256}")
            self.engine.load_weights(path or Path(uri), version)
        except (EngineError, OSError) as exc:
            log.error("weights v%d not loaded, still serving v%d: %s", version, self.engine.version, exc)
            self._send(protocol.WeightsLoaded(version, False, str(exc)[:500]))
            return
        log.info("weights v%d loaded in %.3fs", version, time.monotonic() - started)
        self._send(protocol.WeightsLoaded(version, True, ""))

    def _meter_usage(self) -> None:
        """Account slot usage up to now, and report it when due (cumulative: a lost report loses nothing)."""
        if self.engine is None or self.meter is None:
            return
        now = time.monotonic()
        self.meter.observe(now, self.engine.active)
        if self.meter.due(now, self.link.interval):
            self._send(self.meter.report(now))

    # ------------------------------------------------------------------ connection

    def _hello(self) -> list[protocol.Message]:
        """What introduces this worker to a broker that may have lost it: the leases it still holds."""
        held = np.array(sorted([*self.held, *self.scoring]), dtype=np.int64)
        version = self.engine.version if self.engine is not None else 0
        hello = protocol.WorkerHello(
            self.worker_id, self.cfg.engine, self.cfg.slots, version, os.getpid(), socket.gethostname(), held
        )
        return [hello]

    def _send(self, msg: protocol.Message) -> None:
        self.link.send(msg)

    def _shutdown(self) -> None:
        """Leave cleanly: partials back to the broker, scored samples sent if they come quickly."""
        self._drain_engine()
        deadline = time.monotonic() + min(self.cfg.reward_timeout_s, 5.0)
        while self.scoring and time.monotonic() < deadline:
            time.sleep(0.01)
            self._send_scored()
        self._send(protocol.Disconnect("shutdown"))
        self.rewards.close()
        if self.engine is not None:
            self.engine.close()
        self.link.close(linger_ms=1000)

    def identify(self, request: GenerationRequest) -> SampleIdentity:
        """Sample identity for the sim engine: stable across resumes and workers."""
        sample = self.held[request.request_id].sample
        return SampleIdentity.of_sample(sample.group_id, sample.index, int(sample.prompt_ids.shape[0]))
