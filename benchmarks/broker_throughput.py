"""Broker throughput: scripted workers stream finished samples through a real `april broker` process.

What runs (all on loopback, free ports picked at start):
- one `april broker` process, mode `async`; in the `steady` and `weights` scenarios `max_staleness` is so
  large that admission never blocks (see `scenario_settings` for the third, `bounded`);
- `--workers` scripted worker processes (this script with `--role worker`): each says WorkerHello with
  `--slots` slots, and answers every Lease at once with one SampleResult returning every leased sample
  FINISHED with `--tokens` response tokens (pre-built arrays, no model), credit = samples returned;
- a scripted learner in this process: BatchRequest(step) -> Batch -> BatchAck at once, and in the
  `weights` scenario a WeightsReady every `--weights-every` batches (in async mode that aborts leased work).
  With admission unbounded, a broker slower than its workers builds a backlog of complete groups; the
  report shows it (`backlog`), and `bounded` measures the steady state a real async run would reach.
  `floor`, `ceiling` and `flood-ceiling` run the workers against an echo broker instead (no learner):
  the machine's own latency and throughput, under what any broker can reach.

Measured over a fixed window (`--seconds`) after a warm-up (`--warmup`) that starts at the first Batch:
- samples/s trained: samples in the Batches the learner received in the window;
- MB/s: bytes of SampleResult frames the workers sent (in) and of Batch frames the learner got (out);
- message latency: per worker, from sending a SampleResult (which carries credit) to receiving the next
  Lease, a request-reply through the broker; in the streamed scenarios from when each sample's result is
  owed (it finished), so a gathering worker's hold counts; p50/p99 over all workers;
- broker CPU per sample: utime + stime of the broker process (all its threads: Python + ZeroMQ I/O)
  from /proc over the window, divided by samples trained; plus the workers' and learner's CPU share.

The broker runs as it does in production, including its snapshots: it writes `RUN_DIR/broker/state.snap`
(and fsyncs the log of complete groups, `complete.*.log`, which it appends to as groups complete),
whenever it forms a batch, whatever `snapshot_interval_s` says.
The learner does not decode the sample arrays (it reads the body map only), so that the harness takes as
little CPU from the broker as it can; workers decode Leases with the strict codec, as a real worker does.

`--repeat N` runs the scenarios N times round-robin and reports each one's median run (this shared
machine's figures move by a tenth or more from one run to the next), with every run's main figures.

Not a test: nothing is asserted. Prints a table and writes JSON (`--out`).
Usage: python benchmarks/broker_throughput.py [--workers 16 --tokens 2048 --seconds 10 --warmup 3]
       python benchmarks/broker_throughput.py --smoke     # every scenario at tiny sizes (the suite runs it)
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import heapq
import json
import math
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import zmq

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from actors.outbox import Outbox  # noqa: E402
from april import protocol  # noqa: E402
from april.codec import decode_header  # noqa: E402
from april.config import load_config  # noqa: E402
from april.files import write_json  # noqa: E402
from april.ports import free_ports  # noqa: E402
from april.records import FinishReason, Sample, SampleStatus, new_group_samples  # noqa: E402
from april.sources import open_source  # noqa: E402
from april.transport import dealer  # noqa: E402
from april.wire_records import SampleBatch  # noqa: E402
from cli.process import stop_requested  # noqa: E402

SCENARIOS = (
    "steady",
    "weights",
    "bounded",
    "streamed",
    "streamed-gathered",
    "flood",
    "flood-gathered",
    "flood-crowd",
    "floor",
    "ceiling",
    "flood-ceiling",
)
# steady and weights: a staleness bound so far off that admission never blocks and no group falls due
# within a run (admission would block after (bound + version + 1) x B groups accepted;
# `admission_headroom_groups` reports what was left). The broker's batch rule
# (broker.modes.asynchronous.keeps_staleness_bound) costs O(groups) whatever the bound, so the bound need
# not be small; 1024 was, when that rule cost O(max_staleness), and a quick machine used all 4,100 groups
# of the smoke run (B = 4) before its last batch.
ADMISSION_FREE_STALENESS = 1_000_000_000


@dataclass(frozen=True, slots=True)
class Scenario:
    name: str
    weights_every: int  # batches between WeightsReady; 0 = never
    max_staleness: int  # algo.max_staleness
    hold_ms: float  # how long a worker keeps a lease before returning it (streamed: the mean, per sample)
    stream: bool = False  # return each sample alone, after its own exponential hold (streamed)
    echo: bool = False  # the broker is `run_echo_broker`, not `april broker` (ECHO_OF)
    crowd: int = 0  # more workers, one slot each, busy for the whole run (`run_crowd`)
    result_hold_ms: float = 0.0  # streamed: each worker's outbox hold (worker.result_hold_ms)


def scenario_settings(args: argparse.Namespace, name: str) -> Scenario:
    """steady: no new weights, admission never blocks (the headline figure the issue asks for).
    weights: the same with a WeightsReady every `--weights-every` batches; workers hold each lease for
    `--weights-hold-ms` so that a new version finds leased work to abort (answered at once, every lease is
    back before the broker reads the learner's socket, and nothing is ever aborted).
    bounded: a WeightsReady after every batch and `--max-staleness`, as a real async run: the admission
    bound (max_staleness + version + 1) x B is then the only backpressure, so the backlog stays bounded.
    streamed: steady's broker, but workers return samples as engines do, one at a time as each finishes,
    and as the real worker sends them: the slot's credit (LeaseRequest), then the result
    (each sample held an exponential time of mean `--stream-hold-ms`, so results arrive as a Poisson
    stream of workers x slots / hold samples/s), below what the broker can take: its latency is then the
    broker's response time to one result, not the queue that a saturating closed loop builds (there, by
    Little's law, latency = results in flight / results per second whatever the broker does).
    floor: streamed's workers and load against `run_echo_broker`, which does the least any broker must:
    its latency is what the machine, the transport and the workers cost, the floor under streamed's.
    ceiling: steady's workers and load against the echo broker: the samples/s its workers return (gen/s)
    are what this machine, the transport and the workers can carry through one Python broker process
    that keeps no books, the ceiling over steady's.
    flood: streamed, but each sample held `--flood-hold-ms`, so far more is offered than one sample a
    message can carry: what the broker trains when engines return every sample alone and never wait.
    flood-ceiling: flood's workers and load against the echo broker, the ceiling over flood's.
    streamed-gathered, flood-gathered: streamed's and flood's workers and load, each worker holding what it
    owes (credit and results) for up to `--gather-hold-ms` in the real worker's outbox (actors/outbox.py,
    worker.result_hold_ms) and sending it as one SampleResult (GATHERED_OF): what gathering saves the
    broker, and what the hold costs in latency, when engines finish samples one at a time.
    flood-crowd: flood with `--crowd` more workers registered (1,008: 1,024 in all, a cluster's count),
    each holding a one-sample lease for the whole run and sending a heartbeat a second: a cluster whose
    other engines are busy. What the broker does per message must not grow with the workers it knows.
    """
    if name in ECHO_OF:
        return replace(scenario_settings(args, ECHO_OF[name]), name=name, echo=True)
    if name == "steady":
        return Scenario(name, 0, ADMISSION_FREE_STALENESS, args.hold_ms)
    if name == "weights":
        return Scenario(name, args.weights_every, ADMISSION_FREE_STALENESS, args.weights_hold_ms)
    if name == "streamed":
        return Scenario(name, 0, ADMISSION_FREE_STALENESS, args.stream_hold_ms, stream=True)
    if name == "flood":
        return Scenario(name, 0, ADMISSION_FREE_STALENESS, args.flood_hold_ms, stream=True)
    if name in GATHERED_OF:
        return replace(
            scenario_settings(args, GATHERED_OF[name]), name=name, result_hold_ms=args.gather_hold_ms
        )
    if name == "flood-crowd":
        return replace(scenario_settings(args, "flood"), name=name, crowd=args.crowd)
    return Scenario(name, 1, args.max_staleness, args.hold_ms)


# the scenarios run against the echo broker, each with the workers and load of the one it is paired with
ECHO_OF = {"floor": "streamed", "ceiling": "steady", "flood-ceiling": "flood"}
# the scenarios whose workers gather what they owe (`--gather-hold-ms`), each with the load of its pair
GATHERED_OF = {"streamed-gathered": "streamed", "flood-gathered": "flood"}


# run.steps: never reached, as in a run measured mid-way (past its last step the broker takes the run's
# totals at every ack, an O(samples held) sum that is no per-sample cost of a real run)
RUN_STEPS = 1_000_000_000
LEARNER_ID = "bench-learner"
BATCH_KIND = protocol.KIND_OF[protocol.Batch]
CLK_TCK = os.sysconf("SC_CLK_TCK")
START_TIMEOUT_S = 60.0  # broker bound + first batch received


# ------------------------------------------------------------------------------------------------ worker


class TokenPool:
    """Pre-built response tokens and log-probs; a result's arrays are slices of these (no per-call work)."""

    def __init__(self, tokens: int, slots: int, seed: int) -> None:
        rng = np.random.default_rng(seed)
        n = max(1, tokens * slots)
        self.ids = rng.integers(3, 32000, n, dtype=np.int32)
        self.logprobs = -rng.random(n, dtype=np.float32) * 4.0  # log-probs are <= 0

    def take(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        if n > self.ids.shape[0]:  # a lease larger than slots (never with a correct broker): grow once
            self.ids, self.logprobs = np.resize(self.ids, n), np.resize(self.logprobs, n)
        return self.ids[:n], self.logprobs[:n]


def finished_batch(lease: protocol.Lease, tokens: int, version: int, pool: TokenPool) -> SampleBatch:
    """Every leased sample FINISHED with `tokens` response tokens in all (or its budget), reward 1 or 0."""
    src = lease.samples
    if src.response_tokens:  # resumed partials (only after an Abort): through the records API
        return returned_batch(lease, pool, version, lambda s: tokens - s.response_len, FinishReason.STOP)
    n = len(src)
    lengths = np.minimum(lease.budgets.astype(np.int64), tokens)
    offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(lengths, out=offsets[1:])
    has = lengths > 0
    segments = np.stack([np.full(n, version, np.int64), np.zeros(n, np.int64), lengths], axis=1)[has]
    segment_offsets = np.zeros(n + 1, dtype=np.int64)
    np.cumsum(has, out=segment_offsets[1:])
    ids, lps = pool.take(int(offsets[-1]))
    return SampleBatch(
        group_id=src.group_id,
        index=src.index,
        status=np.full(n, SampleStatus.FINISHED, np.uint8),
        finish_reason=np.full(n, FinishReason.STOP, np.uint8),
        resumes=src.resumes,
        reward=(src.index % 2 == 0).astype(np.float64),
        prompt_offsets=src.prompt_offsets,
        prompt_ids=src.prompt_ids,
        response_offsets=offsets,
        response_ids=ids,
        response_logprobs=lps,
        segment_offsets=segment_offsets,
        segments=segments.reshape(-1),
        observation_offsets=np.zeros(n + 1, dtype=np.int64),  # single-turn samples: no observations
        observations=np.zeros(0, dtype=np.int64),
        prompt_text=src.prompt_text,
        metadata=src.metadata,
        error=src.error,
        episode=src.episode,
        # fresh leases came back with no lease spans; a worker returns them as leased
        lease_offsets=src.lease_offsets,
        lease_ends=src.lease_ends,
        lease_workers=src.lease_workers,
    )


def returned_batch(
    lease: protocol.Lease,
    pool: TokenPool,
    version: int,
    new_tokens: Callable[[Sample], int],
    reason: FinishReason,
) -> SampleBatch:
    """Leased samples extended by `new_tokens(sample)` tokens (within budget) via `Sample.extend`."""
    out = []
    for s, budget in zip(lease.samples.to_samples(), lease.budgets.tolist(), strict=True):
        ids, lps = pool.take(max(0, min(new_tokens(s), budget)))
        done = s.extend(ids, lps, version, reason)
        out.append(done.scored(float(s.index % 2 == 0)) if reason != FinishReason.ABORT else done)
    return SampleBatch.from_samples(out)


def send_counted(sock: zmq.Socket[bytes], msg: protocol.Message) -> int:
    """Send one message; return its size in bytes (all frames)."""
    frames = protocol.encode(msg)
    sock.send_multipart(frames, copy=len(frames) < 4)
    return sum(len(f) for f in frames)


class ScriptedWorker:
    """Answers each Lease with one SampleResult, at once or after `hold_s` (a stand-in for generation
    time, so that a new weight version finds leased work to abort). On Abort it returns what it holds
    INTERRUPTED, with the share of `tokens` its hold time allowed, then confirms with AbortDone.
    With `--stream` each leased sample finishes after its own exponential hold, and the worker owes what
    the real one owes when an engine finishes a sample: its slot's credit, then its scored result
    (`_on_outputs` and `_send_scored` in actors/worker.py), through the real worker's outbox: with
    `--result-hold-ms` 0 a LeaseRequest and a SampleResult of one sample, as a real worker sends them;
    with a hold, everything owed within it as one SampleResult carrying the credit."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.hold_s = args.hold_ms / 1e3
        self.pool = TokenPool(args.tokens, args.slots, seed=sum(args.worker_id.encode()))
        self.ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self.sock = dealer(self.ctx, args.broker, args.worker_id)
        self.version = 0
        self.held: list[tuple[float, protocol.Lease]] = []  # (time it is due back, lease), in due order
        self.last_sent = time.monotonic()
        self.pending_since = -1.0  # when our last SampleResult (with credit) left
        self.sends: list[tuple[float, int, int]] = []  # (time sent, samples, bytes) per SampleResult
        self.credit_sends: list[float] = []  # time sent of each LeaseRequest
        self.latencies: list[tuple[float, float]] = []  # (Lease arrival, seconds since our SampleResult)
        self.stream = args.stream
        self.rng = np.random.default_rng(sum(args.worker_id.encode()))
        self.streaming: list[tuple[float, int, int, int, Sample]] = []  # heap: (due, seq, lease, budget, s)
        self.awaiting: deque[float] = deque()  # streamed: when each credit not yet answered was owed
        self.outbox = Outbox(args.result_hold_ms / 1e3, max_samples=args.slots)
        self.other: dict[str, int] = {}
        self.seq = 0  # results sent, numbered as a real worker numbers them (the broker acknowledges them)

    def send(self, msg: protocol.Message) -> int:
        nbytes = send_counted(self.sock, msg)
        self.last_sent = time.monotonic()
        return nbytes

    def give_back(self, lease: protocol.Lease, samples: SampleBatch, credit: int) -> None:
        self.seq += 1
        nbytes = self.send(protocol.SampleResult(lease.lease_ids, samples, credit, self.seq))
        self.pending_since = self.last_sent
        self.sends.append((self.last_sent, len(samples), nbytes))

    def finish(self, lease: protocol.Lease) -> None:
        self.give_back(
            lease, finished_batch(lease, self.args.tokens, self.version, self.pool), len(lease.samples)
        )

    def abort(self, round_id: int, now: float) -> None:
        for due, lease in self.held:
            done = 1.0 - max(0.0, due - now) / self.hold_s  # share of the generation time that passed
            share = int(self.args.tokens * done)
            self.give_back(
                lease,
                returned_batch(
                    lease, self.pool, self.version, lambda s, k=share: k - s.response_len, FinishReason.ABORT
                ),
                0,
            )
        self.held.clear()
        for _, _, lease_id, budget, sample in self.streaming:  # half generated, whatever their hold
            ids, lps = self.pool.take(max(0, min(self.args.tokens // 2 - sample.response_len, budget)))
            done = sample.extend(ids, lps, self.version, FinishReason.ABORT)
            self.outbox.add([(lease_id, done)], 0, now)
        self.streaming.clear()
        self.send_outbox()  # nothing held may come after the AbortDone (as in actors/worker.py)
        self.send(protocol.AbortDone(round_id, self.args.slots, np.zeros(0, np.int64)))

    def take_streamed(self, lease: protocol.Lease, now: float) -> None:
        """Hold each leased sample alone, and count the latency of every result this Lease answers."""
        for _ in range(min(len(lease.samples), len(self.awaiting))):
            self.latencies.append((now, now - self.awaiting.popleft()))
        items = zip(lease.lease_ids.tolist(), lease.budgets.tolist(), lease.samples.to_samples(), strict=True)
        for lease_id, budget, sample in items:
            due = now + float(self.rng.exponential(self.hold_s))
            heapq.heappush(self.streaming, (due, lease_id, lease_id, budget, sample))

    def finish_streamed(self, lease_id: int, budget: int, sample: Sample, now: float) -> None:
        ids, lps = self.pool.take(max(0, min(self.args.tokens - sample.response_len, budget)))
        done = sample.extend(ids, lps, self.version, FinishReason.STOP).scored(float(sample.index % 2 == 0))
        for items, credit in (([], 1), ([(lease_id, done)], 0)):  # the slot is free, then the result scored
            self.outbox.add(items, credit, now)
            if self.outbox.due(now):
                self.send_outbox()
        self.awaiting.append(now)

    def send_outbox(self) -> None:
        msg = self.outbox.take()
        if isinstance(msg, protocol.SampleResult):
            self.seq += 1
            msg = replace(msg, seq=self.seq)
        if msg is not None:
            nbytes = self.send(msg)
            if isinstance(msg, protocol.SampleResult):
                self.sends.append((self.last_sent, len(msg.samples), nbytes))
            else:
                self.credit_sends.append(self.last_sent)

    def handle(self, msg: protocol.Message, now: float) -> None:
        match msg:
            case protocol.Lease() if self.stream:
                self.take_streamed(msg, now)
            case protocol.Lease():
                if self.pending_since >= 0:
                    self.latencies.append((now, now - self.pending_since))
                    self.pending_since = -1.0
                if self.hold_s > 0:
                    self.held.append((now + self.hold_s, msg))
                else:
                    self.finish(msg)
            case protocol.Welcome():
                self.version = msg.version
            case protocol.WeightsReady():
                self.version = msg.version
                self.send(protocol.WeightsLoaded(msg.version, True, ""))
            case protocol.Abort():
                self.abort(msg.round_id, now)
            case _:
                name = type(msg).__name__
                self.other[name] = self.other.get(name, 0) + 1

    def run(self, should_stop: Callable[[], bool]) -> None:
        hello = protocol.WorkerHello(
            worker_id=self.args.worker_id,
            engine="bench",
            slots=self.args.slots,
            version=0,
            pid=os.getpid(),
            host=platform.node(),
            held_leases=protocol.empty_lease_ids(),
        )
        self.send(hello)
        while not should_stop():
            now = time.monotonic()
            while self.held and self.held[0][0] <= now:
                self.finish(self.held.pop(0)[1])
            while self.streaming and self.streaming[0][0] <= now:
                self.finish_streamed(*heapq.heappop(self.streaming)[2:], now)
            if self.outbox.due(now):
                self.send_outbox()
            due = [q[0][0] for q in (self.held, self.streaming) if q]
            if (left := self.outbox.wait_s(now)) is not None:
                due.append(now + left)
            wait_ms = 100 if not due else max(1, math.ceil((min(due) - now) * 1e3))  # never a busy poll(0)
            if self.sock.poll(wait_ms, zmq.POLLIN):
                frames = self.sock.recv_multipart(copy=False)
                self.handle(protocol.decode([f.buffer for f in frames]), time.monotonic())
            elif time.monotonic() - self.last_sent >= 1.0:  # any message counts as a heartbeat
                self.send(protocol.Heartbeat())

    def close(self) -> None:
        with contextlib.suppress(zmq.ZMQError):
            self.send(protocol.Disconnect("benchmark over"))
        self.sock.close(linger=0)
        self.ctx.term()
        stats = {
            "sends": self.sends,
            "credit_sends": self.credit_sends,
            "latencies": self.latencies,
            "other": self.other,
        }
        Path(self.args.stats).write_text(json.dumps(stats))


def run_worker(args: argparse.Namespace) -> None:
    should_stop = stop_requested()  # SIGTERM/SIGINT end the loop, as they end a real worker's
    worker = ScriptedWorker(args)
    try:
        worker.run(should_stop)
    finally:
        worker.close()


def run_crowd(args: argparse.Namespace) -> None:
    """`--crowd` workers in one process (`crowd-0000`, ...), one slot each: each says hello, is leased one
    sample, and holds it until SIGTERM, sending a Heartbeat a second (staggered over the second) as an
    idle-looking busy worker must; what the broker sends them is read and dropped. Writes `--stats` once
    every hello is sent."""
    should_stop = stop_requested()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    ctx.set(zmq.MAX_SOCKETS, args.crowd + 64)  # libzmq's default is 1,023 sockets a context
    ids = [f"crowd-{i:04d}" for i in range(args.crowd)]
    socks = [dealer(ctx, args.broker, worker_id) for worker_id in ids]
    poller = zmq.Poller()
    for worker_id, sock in zip(ids, socks, strict=True):
        hello = protocol.WorkerHello(
            worker_id, "bench-crowd", 1, 0, os.getpid(), platform.node(), protocol.empty_lease_ids()
        )
        send_counted(sock, hello)
        poller.register(sock, zmq.POLLIN)
    Path(args.stats).write_text("ready\n")
    start = time.monotonic()
    beats = deque((start + (i + 1) / len(socks), sock) for i, sock in enumerate(socks))  # due time order
    while not should_stop():
        for sock, _ in poller.poll(50):
            with contextlib.suppress(zmq.Again):
                while True:
                    sock.recv_multipart(zmq.NOBLOCK, copy=False)
        now = time.monotonic()
        while beats and beats[0][0] <= now:
            due, sock = beats.popleft()
            send_counted(sock, protocol.Heartbeat())
            beats.append((due + 1.0, sock))
    for sock in socks:
        sock.close(linger=0)
    ctx.term()


# ------------------------------------------------------------------------------------------------ learner


@dataclass(frozen=True, slots=True)
class BatchSeen:
    """One Batch as the learner received it."""

    time: float
    samples: int
    tokens: int
    nbytes: int  # all frames
    version: int  # the broker's weights version when it formed the batch
    complete_waiting: int  # complete groups left in the broker (its ledger)
    issued: int  # groups issued so far (its ledger)


@dataclass(slots=True)
class LearnerLog:
    batches: list[BatchSeen] = field(default_factory=list)
    weights_published: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    workers_alive: int | None = None  # live workers in the broker's status (`ScriptedLearner.ask_status`)


class ScriptedLearner:
    """BatchRequest -> Batch -> BatchAck at once; optionally WeightsReady every `weights_every` batches."""

    def __init__(self, ctx: zmq.Context[zmq.Socket[bytes]], address: str, weights_every: int) -> None:
        self.sock = dealer(ctx, address, LEARNER_ID)
        self.weights_every = weights_every
        self.step = 0
        self.version = 0
        self.last_batch_id = -1
        self.log = LearnerLog()

    def start(self) -> None:
        send_counted(self.sock, protocol.LearnerHello(LEARNER_ID, 0, os.getpid()))
        send_counted(self.sock, protocol.BatchRequest(self.step, self.last_batch_id))

    def poll(self, timeout_ms: int) -> None:
        """Handle at most one message."""
        if not self.sock.poll(timeout_ms, zmq.POLLIN):
            return
        frames = [f.buffer for f in self.sock.recv_multipart(copy=False)]
        now = time.monotonic()
        if decode_header(frames, protocol.PROTOCOL_VERSION) != BATCH_KIND:
            msg = protocol.decode(frames)
            if isinstance(msg, protocol.Error):
                self.log.errors[msg.code] = self.log.errors.get(msg.code, 0) + 1
            elif isinstance(msg, protocol.StatusReply):
                self.log.workers_alive = sum(1 for w in msg.status.workers if w.alive)
            return
        # The body map only: batch id and array lengths (the arrays are the broker's cost, not ours).
        body = msgpack.unpackb(frames[1], raw=False)
        samples, tokens = body["samples"]["group_id"][2], body["samples"]["response_ids"][2]
        ledger = body["ledger"]
        self.log.batches.append(
            BatchSeen(
                now,
                samples,
                tokens,
                sum(len(f) for f in frames),
                body["version"],
                ledger["complete_waiting"],
                ledger["issued"],
            )
        )
        self.last_batch_id = body["batch_id"]
        send_counted(self.sock, protocol.BatchAck(self.last_batch_id, {}))
        self.step += 1
        if self.weights_every and self.step % self.weights_every == 0:
            self.version += 1
            sha = hashlib.sha256(f"bench weights v{self.version}".encode()).hexdigest()
            send_counted(self.sock, protocol.WeightsReady(self.version, f"bench://v{self.version}", sha))
            self.log.weights_published += 1
        send_counted(self.sock, protocol.BatchRequest(self.step, self.last_batch_id))

    def ask_status(self, timeout_s: float) -> None:
        """How many workers the broker counts alive (`log.workers_alive`), going on with batches meanwhile."""
        send_counted(self.sock, protocol.StatusRequest())
        deadline = time.monotonic() + timeout_s
        while self.log.workers_alive is None and time.monotonic() < deadline:
            self.poll(50)

    def close(self) -> None:
        with contextlib.suppress(zmq.ZMQError):
            send_counted(self.sock, protocol.Disconnect("benchmark over"))
        self.sock.close(linger=0)


# ------------------------------------------------------------------------------------- floor and ceiling


def run_echo_broker(args: argparse.Namespace) -> None:
    """The broker of `floor` and `ceiling`: the least a broker must do for the workers, to measure what
    is left when the broker costs (almost) nothing. It reads every message with the strict codec (a
    broker must, to answer bad input with an error, and a Lease only follows a result it has read),
    answers a WorkerHello with a Welcome and a Lease of `--slots` fresh samples, and a SampleResult or a
    LeaseRequest with a Lease of as many fresh samples as its credit. No books, batches or snapshots.
    Leases are encoded once per credit and sent again (workers only read them): the echo broker costs as
    little as it can. Its samples are the real broker's: the prompts (token ids, text and metadata) of
    the scenario's config (`--config`), so its workers read and return as much per sample as the real
    broker's do.
    Writes `--stats` once bound, and runs until SIGTERM."""
    should_stop = stop_requested()
    config = load_config(args.config)
    source = open_source(config.data, config.run.seed)
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(args.broker)
    next_group = 0

    def group(g: int) -> list[Sample]:
        prompt = source.get(g)
        return new_group_samples(
            g, args.n_samples_per_prompt, prompt.prompt_ids, prompt.text, prompt.metadata
        )

    def lease_frames(n: int) -> list[bytes]:
        nonlocal next_group
        groups = -(-n // args.n_samples_per_prompt)
        samples = [sample for g in range(next_group, next_group + groups) for sample in group(g)][:n]
        next_group += groups
        ids = np.arange(n, dtype=np.int64) + next_group * args.n_samples_per_prompt
        budgets = np.full(n, args.tokens, np.int32)
        lease = protocol.Lease(ids, budgets, np.zeros(n, np.uint8), SampleBatch.from_samples(samples))
        return protocol.encode(lease)

    made: dict[int, list[bytes]] = {}  # credit -> a Lease of as many samples, encoded once
    Path(args.stats).write_text("bound\n")
    while not should_stop():
        if not sock.poll(100, zmq.POLLIN):
            continue
        frames = sock.recv_multipart(copy=False)
        peer, msg = frames[0].bytes, protocol.decode([f.buffer for f in frames[1:]])
        match msg:
            case protocol.WorkerHello():
                welcome = protocol.Welcome(msg.worker_id, "async", 0, "", "", 5.0, args.tokens, 1.0, 1.0, 0)
                sock.send_multipart([peer, *protocol.encode(welcome)])
                sock.send_multipart([peer, *lease_frames(msg.slots)])
            case protocol.SampleResult() | protocol.LeaseRequest() if msg.credit:
                if msg.credit not in made:
                    made[msg.credit] = lease_frames(msg.credit)
                sock.send_multipart([peer, *made[msg.credit]])
    sock.close(linger=0)
    ctx.term()


# ------------------------------------------------------------------------------------------------ processes


def write_config(path: Path, args: argparse.Namespace, ports: Sequence[int], max_staleness: int) -> None:
    path.write_text(
        f"""[run]
mode = "async"
steps = {RUN_STEPS}

[algo]
rollout_batch_size = {args.rollout_batch_size}
over_sampling_batch_size = {args.rollout_batch_size}
n_samples_per_prompt = {args.n_samples_per_prompt}
max_new_tokens = {max(args.tokens, 1)}
max_staleness = {max_staleness}

[data]
source = "synthetic"
synthetic_prompt_len_min = 16
synthetic_prompt_len_max = 64

[broker]
bind_host = "127.0.0.1"
worker_port = {ports[0]}
learner_port = {ports[1]}
pub_port = {ports[2]}
snapshot_interval_s = 3600.0
"""
    )


def child_env() -> dict[str, str]:
    """The environment of the broker and worker processes: the april code of the tree this script lives in
    (PYTHONPATH), not whatever the interpreter's installed april points at."""
    path = os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH"))))
    return {**os.environ, "PYTHONPATH": path}


def echo_command(args: argparse.Namespace, port: int, bound: Path, config: Path) -> list[str]:
    return [
        sys.executable,
        __file__,
        "--role=echo",
        f"--broker=tcp://127.0.0.1:{port}",
        f"--tokens={args.tokens}",
        f"--n-samples-per-prompt={args.n_samples_per_prompt}",
        f"--stats={bound}",
        f"--config={config}",
    ]


def start_crowd(port: int, ready: Path, crowd: int, deadline: float) -> subprocess.Popen[bytes]:
    """The crowd process (`run_crowd`), once it has said every hello."""
    command = [sys.executable, __file__, "--role=crowd", f"--broker=tcp://127.0.0.1:{port}"]
    proc = subprocess.Popen([*command, f"--crowd={crowd}", f"--stats={ready}"], env=child_env())
    while not ready.exists():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"the crowd of {crowd} workers did not start (exit {proc.poll()})")
        time.sleep(0.05)
    return proc


def broker_command(run_dir: Path, profile: Path | None) -> list[str]:
    argv = ["broker", "--run-dir", str(run_dir), "--config", str(run_dir / "bench.toml")]
    if profile is None:
        return [sys.executable, "-c", "from cli.main import main; main()", *argv]
    code = (
        "import cProfile, sys, cli.main; "
        f"sys.argv = ['april', *{argv!r}]; "
        f"cProfile.run('cli.main.main()', {str(profile)!r})"
    )
    return [sys.executable, "-c", code]


@contextlib.contextmanager
def processes() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Every child started into the list is stopped on the way out: SIGTERM, then SIGKILL after 10 s."""
    procs: list[subprocess.Popen[bytes]] = []
    try:
        yield procs
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        deadline = time.monotonic() + 10.0
        for p in procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


def cpu_seconds(pid: int) -> float:
    """utime + stime of a whole process (all threads), from /proc/PID/stat."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / CLK_TCK


def bytes_written(pid: int) -> int:
    """`wchar` of /proc/PID/io: bytes written through write-like calls (files, also the sockets' few)."""
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    return 0


def peak_rss_mb(pid: int) -> float:
    """The process's peak resident memory (VmHWM of /proc/PID/status), in MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def thread_cpu_seconds(pid: int) -> dict[str, float]:
    """CPU seconds per thread name (e.g. the Python main thread vs ZeroMQ's I/O threads)."""
    out: dict[str, float] = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            name = (task / "comm").read_text().strip()
            fields = (task / "stat").read_text().rsplit(")", 1)[1].split()
            out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / CLK_TCK
    return out


@dataclass(slots=True)
class CpuSample:
    broker: float
    broker_threads: dict[str, float]
    broker_written: int  # bytes the broker handed to write(2) and writev(2) so far (snapshots, log)
    workers: float
    learner: float

    @classmethod
    def take(cls, broker_pid: int, worker_pids: Sequence[int]) -> CpuSample:
        t = os.times()
        return cls(
            broker=cpu_seconds(broker_pid),
            broker_threads=thread_cpu_seconds(broker_pid),
            broker_written=bytes_written(broker_pid),
            workers=sum(cpu_seconds(pid) for pid in worker_pids),
            learner=t.user + t.system,
        )


def py_spy_out(args: argparse.Namespace, scenario: str) -> Path:
    return Path(args.py_spy).with_suffix(f".{scenario}.txt")


def start_py_spy(pid: int, seconds: float, out: Path) -> subprocess.Popen[bytes]:
    """Sample the broker (collapsed stacks, 200 Hz) for the window; needs py-spy on PATH or in the venv."""
    exe = Path(sys.executable).with_name("py-spy")
    cmd = [str(exe) if exe.exists() else "py-spy", "record", "--pid", str(pid), "--rate", "200"]
    cmd += [
        "--duration",
        str(max(1, round(seconds))),
        "--format",
        "raw",
        "--output",
        str(out),
        "--nonblocking",
    ]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def print_py_spy(path: Path, top: int = 20) -> None:
    """Top functions by self and by total samples from py-spy's collapsed stacks (CPU only: py-spy
    leaves out idle time, so the shares are of the broker's busy time)."""
    own: dict[str, int] = {}
    total: dict[str, int] = {}
    count = 0
    for line in path.read_text().splitlines():
        stack, _, n = line.rpartition(" ")
        frames = [re.sub(r":\d+\)$", ")", f) for f in stack.split(";")]  # per function, not per line
        count += int(n)
        own[frames[-1]] = own.get(frames[-1], 0) + int(n)
        for f in set(frames):
            total[f] = total.get(f, 0) + int(n)
    for title, table in (("self", own), ("total", total)):
        print(f"\n--- py-spy {path.name}: top {top} by {title} ({count} samples) ---")
        for name, n in sorted(table.items(), key=lambda kv: -kv[1])[:top]:
            print(f"{n / count:7.1%}  {name}")


def tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


# ------------------------------------------------------------------------------------------------ one run


def run_scenario(args: argparse.Namespace, scenario: str, root: Path) -> dict[str, Any]:
    run_dir = root / scenario
    run_dir.mkdir(parents=True)
    ports = free_ports(3)
    settings = scenario_settings(args, scenario)
    write_config(run_dir / "bench.toml", args, ports, settings.max_staleness)
    profile = Path(args.profile_broker).with_suffix(f".{scenario}.prof") if args.profile_broker else None
    broker_log = run_dir / "broker.log"
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    # `april broker` writes config.toml once it has bound its ports, the echo broker its --stats file
    bound = run_dir / ("echo.bound" if settings.echo else "config.toml")
    with processes() as procs, open(broker_log, "wb") as log_file:
        broker = subprocess.Popen(
            echo_command(args, ports[0], bound, run_dir / "bench.toml")
            if settings.echo
            else broker_command(run_dir, profile),
            stdout=log_file,
            stderr=subprocess.STDOUT,
            env=child_env(),
        )
        procs.append(broker)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not bound.exists():
            if broker.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"broker did not start:\n{tail(broker_log)}")
            time.sleep(0.05)
        workers = [
            subprocess.Popen(
                [
                    sys.executable,
                    __file__,
                    "--role=worker",
                    f"--worker-id=bench-w{i:02d}",
                    f"--broker=tcp://127.0.0.1:{ports[0]}",
                    f"--tokens={args.tokens}",
                    f"--slots={args.slots}",
                    f"--hold-ms={settings.hold_ms}",
                    *(["--stream"] if settings.stream else []),
                    f"--result-hold-ms={settings.result_hold_ms}",
                    f"--stats={run_dir / f'worker{i:02d}.json'}",
                ],
                env=child_env(),
            )
            for i in range(args.workers)
        ]
        procs.extend(workers)
        if settings.crowd:
            procs.append(start_crowd(ports[0], run_dir / "crowd.ready", settings.crowd, deadline))
        learner = ScriptedLearner(ctx, f"tcp://127.0.0.1:{ports[1]}", settings.weights_every)
        try:
            if not settings.echo:  # the echo broker forms no batches: no learner
                learner.start()
            while not learner.log.batches and not settings.echo:
                if broker.poll() is not None:
                    raise RuntimeError(f"broker exited with {broker.returncode}:\n{tail(broker_log)}")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"no batch within {START_TIMEOUT_S:.0f}s:\n{tail(broker_log)}")
                learner.poll(100)
            window_start = (
                learner.log.batches[0].time if learner.log.batches else time.monotonic()
            ) + args.warmup
            window_end = window_start + args.seconds
            worker_pids = [w.pid for w in workers]
            cpu0: CpuSample | None = None
            spy: subprocess.Popen[bytes] | None = None
            while (now := time.monotonic()) < window_end:
                if cpu0 is None and now >= window_start:
                    cpu0 = CpuSample.take(broker.pid, worker_pids)
                    if args.py_spy:
                        spy = start_py_spy(broker.pid, args.seconds, py_spy_out(args, scenario))
                        procs.append(spy)
                if broker.poll() is not None:
                    raise RuntimeError(f"broker exited with {broker.returncode}:\n{tail(broker_log)}")
                learner.poll(5)
            cpu1 = CpuSample.take(broker.pid, worker_pids)
            broker_rss = peak_rss_mb(broker.pid)
            assert cpu0 is not None
            if not settings.echo:
                learner.ask_status(timeout_s=10.0)
            # state.snap (live groups) and the complete.*.log segments (complete groups, appended once each)
            snapshot_bytes = sum(f.stat().st_size for f in (run_dir / "broker").glob("*") if f.is_file())
        finally:
            learner.close()
            ctx.term()
        for w in workers:  # stop the workers first so they write their logs
            w.terminate()
        for w in workers:
            w.wait(timeout=10)
        if spy is not None:
            spy.wait(timeout=30)  # py-spy writes its file when its duration is over
    worker_logs = []
    for i in range(args.workers):
        path = run_dir / f"worker{i:02d}.json"
        if path.exists():
            worker_logs.append(json.loads(path.read_text()))
    result = summarize(args, scenario, learner.log, worker_logs, (window_start, window_end), cpu0, cpu1)
    result["snapshot_mb_at_end"] = snapshot_bytes / 1e6
    result["broker_peak_rss_mb"] = broker_rss
    result["workers_alive_at_end"] = learner.log.workers_alive  # the crowd's included (None: echo)
    log_text = broker_log.read_text(errors="replace")
    result["aborts"] = log_text.count("abort round") // 2  # each round logs its start and confirmation
    return result


def summarize(
    args: argparse.Namespace,
    scenario: str,
    learner: LearnerLog,
    worker_logs: list[dict[str, Any]],
    window: tuple[float, float],
    cpu0: CpuSample,
    cpu1: CpuSample,
) -> dict[str, Any]:
    lo, hi = window
    secs = hi - lo
    batches = [b for b in learner.batches if lo <= b.time < hi]
    samples = sum(b.samples for b in batches)
    tokens = sum(b.tokens for b in batches)
    out_bytes = sum(b.nbytes for b in batches)
    sends = [s for log in worker_logs for s in log["sends"] if lo <= s[0] < hi]
    credit_sends = [t for log in worker_logs for t in log["credit_sends"] if lo <= t < hi]
    in_bytes = sum(s[2] for s in sends)
    lat = np.array([x[1] for log in worker_logs for x in log["latencies"] if lo <= x[0] < hi])
    broker_cpu = cpu1.broker - cpu0.broker
    threads = {k: round(v - cpu0.broker_threads.get(k, 0.0), 3) for k, v in cpu1.broker_threads.items()}
    worker_other: dict[str, int] = {}
    for log in worker_logs:
        for k, v in log["other"].items():
            worker_other[k] = worker_other.get(k, 0) + v
    before = [b.complete_waiting for b in learner.batches if b.time < lo]
    settings = scenario_settings(args, scenario)
    last = learner.batches[-1] if learner.batches else BatchSeen(0.0, 0, 0, 0, 0, 0, 0)
    # async admission: at most (max_staleness + version + 1) x B groups accepted at version v
    # (broker.modes.asynchronous.admission_limit); no headroom left means admission held the workers back
    limit = (settings.max_staleness + last.version + 1) * args.rollout_batch_size
    return {
        "scenario": scenario,
        **{k: v for k, v in asdict(settings).items() if k != "name"},
        "window_s": round(secs, 3),
        "batches": len(batches),
        "samples": samples,
        "samples_per_s": samples / secs,
        "tokens_per_s": tokens / secs,
        "mb_per_s_in": in_bytes / secs / 1e6,  # SampleResult frames sent by workers
        "mb_per_s_out": out_bytes / secs / 1e6,  # Batch frames received by the learner
        "generated_per_s": sum(s[1] for s in sends) / secs,  # samples returned by workers
        # complete groups waiting in the broker (ledger of the last Batch before / in the window): the
        # backlog grows when workers return samples faster than the broker turns them into batches
        "backlog_groups_start": before[-1] if before else None,
        "backlog_groups_end": batches[-1].complete_waiting if batches else None,
        "batches_total": len(learner.batches),  # warm-up and window
        "issued_groups_at_end": last.issued,
        "admission_headroom_groups": limit - last.issued,
        "sample_results": len(sends),
        "samples_per_result": (sum(s[1] for s in sends) / len(sends)) if sends else 0.0,
        "lease_requests": len(credit_sends),
        # messages the workers sent per sample they returned (SampleResults and LeaseRequests; heartbeats
        # are none: any message counts as one, and the loaded workers always have something to send)
        "messages_per_sample": (len(sends) + len(credit_sends)) / max(1, sum(s[1] for s in sends)),
        "latency_ms_p50": float(np.percentile(lat, 50) * 1e3) if lat.size else None,
        "latency_ms_p99": float(np.percentile(lat, 99) * 1e3) if lat.size else None,
        "latency_ms_max": float(lat.max() * 1e3) if lat.size else None,
        "latency_count": int(lat.size),
        "broker_cpu_s": broker_cpu,
        "broker_cpu_us_per_sample": broker_cpu / samples * 1e6 if samples else None,
        "broker_cpu_util": broker_cpu / secs,  # 1.0 = one core busy
        "broker_threads_cpu_s": threads,
        # snapshots and the log of settled samples, mostly (ZeroMQ's I/O thread sends with sendmsg)
        "broker_write_mb_per_s": (cpu1.broker_written - cpu0.broker_written) / secs / 1e6,
        "workers_cpu_util": (cpu1.workers - cpu0.workers) / secs,
        "learner_cpu_util": (cpu1.learner - cpu0.learner) / secs,
        "weights_published": learner.weights_published,
        "learner_errors": learner.errors,
        "worker_other_messages": worker_other,
        "worker_logs": len(worker_logs),
    }


# ------------------------------------------------------------------------------------------------ report


def main_figure(result: dict[str, Any]) -> str:
    """A scenario's figure: samples/s trained, or returned against an echo broker (which trains none)."""
    return "generated_per_s" if result["echo"] else "samples_per_s"


def median_run(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The run with the median `main_figure`, whole, so that its fields stay one run's; `repeats` lists
    every run's main figures, in the order they ran."""
    key = main_figure(runs[0])
    chosen = sorted(runs, key=lambda r: r[key])[(len(runs) - 1) // 2]
    figures = ("samples_per_s", "generated_per_s", "broker_cpu_us_per_sample", "latency_ms_p99")
    return {**chosen, "repeats": [{k: r[k] for k in figures} for r in runs]}


def print_table(results: list[dict[str, Any]]) -> None:
    def fmt(v: Any, spec: str) -> str:
        return "-" if v is None else format(v, spec)

    head = (
        f"{'scenario':<10}{'samples/s':>11}{'gen/s':>8}{'MB/s in':>9}{'MB/s out':>10}"
        f"{'p50 ms':>8}{'p99 ms':>8}"
        f"{'broker us/sample':>18}{'broker cpu':>12}{'workers cpu':>13}{'smp/result':>12}"
    )
    print(head)
    print("-" * len(head))
    for r in results:
        print(
            f"{r['scenario']:<10}{r['samples_per_s']:>11.0f}{r['generated_per_s']:>8.0f}{r['mb_per_s_in']:>9.1f}{r['mb_per_s_out']:>10.1f}"
            f"{fmt(r['latency_ms_p50'], '.2f'):>8}{fmt(r['latency_ms_p99'], '.2f'):>8}"
            f"{fmt(r['broker_cpu_us_per_sample'], '.1f'):>18}{r['broker_cpu_util']:>11.0%} "
            f"{r['workers_cpu_util']:>12.0%} {r['samples_per_result']:>11.1f}"
        )
    for r in results:
        extra = f", {r['weights_published']} weight versions" if r["weights_every"] else ""
        print(
            f"  {r['scenario']}: {r['batches']} batches, {r['samples']} samples in {r['window_s']:.1f}s"
            f"{extra}, {r['aborts']} aborts; backlog {r['backlog_groups_start']} -> {r['backlog_groups_end']}"
            f" complete groups; snapshot {r['snapshot_mb_at_end']:.0f} MB, written "
            f"{r['broker_write_mb_per_s']:.1f} MB/s; broker threads cpu-s "
            f"{r['broker_threads_cpu_s']}"
        )
    print(
        "(samples/s = trained (in Batches), gen/s = returned by workers; cpu: 100% = one core busy; "
        "MB/s in = SampleResult frames from workers, out = Batch frames)"
    )
    if len(results[0]["repeats"]) > 1:
        print(f"the median of {len(results[0]['repeats'])} runs each; samples/s (gen/s) of every run:")
        for r in results:
            print(f"  {r['scenario']}: " + ", ".join(f"{x[main_figure(r)]:,.0f}" for x in r["repeats"]))


def machine_info() -> dict[str, Any]:
    model = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    return {
        "cpu_count": os.cpu_count(),
        "cpu_model": model,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "numpy": np.__version__,
        "pyzmq": zmq.__version__,
        "libzmq": zmq.zmq_version(),
        "msgpack": ".".join(map(str, msgpack.version)),
    }


# --smoke: every scenario, the same processes and messages, at a size that runs in a few seconds each
SMOKE: dict[str, Any] = {
    "workers": 2,
    "slots": 8,
    "tokens": 64,
    "seconds": 1.5,
    "warmup": 0.5,
    "rollout_batch_size": 4,
    "n_samples_per_prompt": 4,
    "weights_every": 2,
    "stream_hold_ms": 100.0,  # 2 workers x 8 slots: 160 samples/s offered, a batch of 16 every 0.1 s
    "flood_hold_ms": 10.0,  # 1,600 samples/s offered
    "crowd": 30,
    "out": "bench-out/broker_throughput-smoke.json",
}


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workers", type=int, default=16, help="scripted worker processes")
    p.add_argument("--tokens", type=int, default=2048, help="response tokens per returned sample")
    p.add_argument("--slots", type=int, default=64, help="slots (credit) per worker")
    p.add_argument("--seconds", type=float, default=10.0, help="measurement window")
    p.add_argument("--warmup", type=float, default=3.0, help="seconds after the first batch, not measured")
    p.add_argument("--rollout-batch-size", type=int, default=64, help="groups per batch (algo.*)")
    p.add_argument("--n-samples-per-prompt", type=int, default=8, help="samples per group (algo.*)")
    p.add_argument("--weights-every", type=int, default=10, help="batches between WeightsReady (weights)")
    p.add_argument("--hold-ms", type=float, default=0.0, help="lease hold time of steady and bounded")
    p.add_argument("--weights-hold-ms", type=float, default=20.0, help="lease hold time of weights")
    p.add_argument(
        "--stream-hold-ms", type=float, default=2000.0, help="mean hold time of each sample in streamed"
    )
    p.add_argument("--flood-hold-ms", type=float, default=50.0, help="mean hold time of each sample in flood")
    p.add_argument(
        "--gather-hold-ms", type=float, default=10.0, help="each worker's outbox hold in flood-gathered"
    )
    p.add_argument("--max-staleness", type=int, default=1, help="algo.max_staleness of `bounded`")
    p.add_argument("--crowd", type=int, default=1008, help="busy one-slot workers added in flood-crowd")
    p.add_argument("--scenarios", default=",".join(SCENARIOS), help=f"comma-separated, from {SCENARIOS}")
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="runs of each scenario (round-robin); the median run is reported",
    )
    p.add_argument("--out", default="bench-out/broker_throughput.json", help="JSON results file")
    p.add_argument("--run-root", default="", help="parent of the run directories (default: a temp dir)")
    p.add_argument("--keep", action="store_true", help="keep the run directories (broker logs, snapshots)")
    p.add_argument("--profile-broker", default="", help="run the broker under cProfile, stats to PATH.*.prof")
    p.add_argument("--py-spy", default="", help="sample the broker with py-spy in the window, to PATH.*.txt")
    p.add_argument(
        "--smoke", action="store_true", help="a few seconds a scenario: tiny sizes (options given win)"
    )
    # worker role (started by this script)
    p.add_argument(
        "--role", choices=("bench", "worker", "echo", "crowd"), default="bench", help=argparse.SUPPRESS
    )
    p.add_argument("--stream", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--result-hold-ms", type=float, default=0.0, help=argparse.SUPPRESS)
    p.add_argument("--worker-id", default="", help=argparse.SUPPRESS)
    p.add_argument("--broker", default="", help=argparse.SUPPRESS)
    p.add_argument("--stats", default="", help=argparse.SUPPRESS)
    p.add_argument("--config", default="", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.smoke:  # the smoke sizes become the defaults, so options given on the command line still win
        p.set_defaults(**SMOKE)
        args = p.parse_args(argv)
    if args.repeat < 1:
        p.error(f"--repeat: {args.repeat}, must be >= 1")
    unknown = set(args.scenarios.split(",")) - set(SCENARIOS)
    if unknown:
        p.error(f"--scenarios: unknown {sorted(unknown)}, expected some of {SCENARIOS}")
    return args


def print_profile(path: Path, top: int = 25) -> None:
    import pstats

    for key in ("cumulative", "tottime"):
        print(f"\n--- broker profile {path.name}, top {top} by {key} ---")
        pstats.Stats(str(path)).sort_stats(key).print_stats(top)


def main(argv: Sequence[str] | None = None) -> None:
    args = parse_args(argv)
    if args.role == "worker":
        run_worker(args)
        return
    if args.role == "echo":
        run_echo_broker(args)
        return
    if args.role == "crowd":
        run_crowd(args)
        return
    load_start = os.getloadavg()
    root = Path(tempfile.mkdtemp(prefix="april-bench-", dir=args.run_root or None))
    scenarios = args.scenarios.split(",")
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in scenarios}
    try:
        for rep in range(args.repeat):  # round-robin, so that a slow spell of the machine hits them all
            for scenario in scenarios:
                print(
                    f"running {scenario} ({rep + 1}/{args.repeat}): {args.workers} workers x {args.slots} "
                    f"slots, {args.tokens} tokens, {args.warmup:.0f}s warm-up + {args.seconds:.0f}s",
                    flush=True,
                )
                runs[scenario].append(run_scenario(args, scenario, root / f"{rep}"))
    finally:
        if args.keep:
            print(f"run directories kept in {root}")
        else:
            shutil.rmtree(root, ignore_errors=True)
    results = [median_run(runs[name]) for name in scenarios]
    print()
    print_table(results)
    load_end = os.getloadavg()
    start, end = (" ".join(f"{x:.2f}" for x in load) for load in (load_start, load_end))
    print(f"load average (1, 5, 15 min): {start} at the start, {end} at the end, {os.cpu_count()} CPUs")
    report = {
        "benchmark": "broker_throughput",
        "machine": machine_info(),
        "params": {k: v for k, v in vars(args).items() if k not in ("role", "worker_id", "broker", "stats")},
        "load_average": {"start": load_start, "end": load_end},  # the machine may be shared
        "notes": "broker snapshots (fsynced) at every batch formed, as in production",
        "results": results,
    }
    write_json(Path(args.out), report)
    print(f"wrote {args.out}")
    for scenario in args.scenarios.split(","):
        if args.profile_broker:
            print_profile(Path(args.profile_broker).with_suffix(f".{scenario}.prof"))
        if args.py_spy and py_spy_out(args, scenario).exists():
            print_py_spy(py_spy_out(args, scenario))


if __name__ == "__main__":
    main()
