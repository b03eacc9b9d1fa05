"""`april simulate`'s discrete-event model: the real broker books and policy, simulated engines and learner.

Owns the event loop in virtual time and the broker's side of it. The books are a real
`broker.state.BrokerState` (so every scheduling decision is `broker.policy`'s, through the same calls the
broker makes); engines are `broker.sim.engines.EngineModel`; the learner takes `learner_step_s` per batch.
Events: an engine reaching a step boundary where a sequence finishes or a message waits (leases, aborts
and weights are read there, so an abort round-trip lasts until each holder's current step ends), and
the learner finishing a step (weights v+1 published, batch acked, next batch requested).

`broker/server.py` holds the glue between messages and `BrokerState` next to its sockets and clocks, so
this module mirrors it, handler by handler (names in brackets):
  - SampleResult: accept each sample, grant the finished samples' slots back, then dispatch unless the
    round is complete [_on_worker, _on_results, _dispatch(train=...)]. Scoring is instant, so the
    worker's LeaseRequest and SampleResult arrive together.
  - AbortDone: the worker's credit is reset to its slots; the abort round ends in the next tick once
    every holder confirmed, and sync/april then park queued samples [_on_abort_done, _check_abort].
  - tick, after every event: end a confirmed abort; close a complete round (abort the holders, or park
    at once); dispatch: the leasable samples spread over the workers with credit by free slots relative
    to size (`policy.spread_leases`), one Lease each; form and hand out the batch if the learner waits
    [tick, _dispatch, _try_send_batch].
  - WeightsReady: set_weights, relay to every worker, in async abort when samples are leased and no abort
    is running [_on_weights]. BatchAck: ack_batch, then the ledger check [_ack].
  - the learner (learner/loop.py): request, train, publish v+1, ack, request the next step.
Not modelled: network latency, reward scoring time, weight loading time, evaluations, failures,
heartbeats and snapshots. Two shortcuts skip calls that provably return nothing (no lease when
`take_work` could lease nothing to anyone; no `form_batch` with fewer than a batch of complete groups).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np

from april.config import AlgoConfig, ConfigError, Mode, ResumeKV
from april.data import SyntheticPromptSource
from april.engine_cost import EngineCost
from april.ledger import Ledger
from april.records import Sample
from april.sample_draw import LengthDraw, LengthSampler, prompt_key, sample_key
from broker import policy
from broker.sim.engines import Abort, EngineModel, Lease, Output, ToEngine, Weights
from broker.sim.figures import ArrivalMeter, Figures, Meter, Tally, compute_figures
from broker.state import BrokerState

LENGTH_CHUNK_GROUPS = 512  # groups whose lengths are drawn at once


class SimulationError(RuntimeError):
    """The simulated run cannot go on (nothing left to happen before the last step): a bug or a
    configuration that can never fill a batch. One readable line."""


@dataclass(frozen=True, slots=True)
class SimConfig:
    mode: Mode
    algo: AlgoConfig
    engines: int = 8
    slots: int = 64  # concurrent sequences per engine
    cost: EngineCost = field(default_factory=EngineCost)
    learner_step_s: float = 20.0  # one optimizer step + weights publish, per batch
    steps: int = 20  # learner steps simulated
    prompt_len: int = 256  # tokens of every prompt (prefilled with each fresh or resumed sample)
    # the prompts: `april.data.SyntheticPromptSource` of this size (an epoch), seeded by `seed`, as
    # `april bench --engine sim` configures its runs; prompts recur every `dataset_size` groups
    dataset_size: int = 10000
    prompt_corr: float = 0.0  # how much a response's length is its prompt's (april.sample_draw.LengthDraw)
    seed: int = 0  # response lengths are drawn per sample from this seed: the same in every mode
    # True: each sample's length drawn from (seed, group, index) exactly as the sim engine draws it
    # (april.sample_draw), so `april bench --engine sim` runs the very same samples; False: one seeded stream
    per_sample_lengths: bool = False
    check_ledger_every_event: bool = False  # debug: the books balance after every event (slow)
    resume_kv: ResumeKV = ResumeKV.RECOMPUTE  # the engines' prefix caches across a weight update

    def __post_init__(self) -> None:
        for name in ("engines", "slots", "steps", "prompt_len", "dataset_size"):
            if getattr(self, name) < 1:
                raise ConfigError(f"simulate: {name} = {getattr(self, name)}, expected >= 1")
        if not 0 <= self.prompt_corr < 1:
            raise ConfigError(f"simulate: prompt_corr = {self.prompt_corr}, expected a number in [0, 1)")
        if not self.learner_step_s >= 0:
            raise ConfigError(f"simulate: learner_step_s = {self.learner_step_s}, expected >= 0")
        c = self.cost
        if c.step_ms(1) <= 0:  # virtual time must advance, or the event loop would never end
            raise ConfigError(
                f"simulate: step cost A={c.decode_ms:g}, B={c.decode_ms_per_seq:g}, "
                f"C={c.prefill_ms_per_token:g} ms: expected A + B > 0 (a step takes time)"
            )


@dataclass(frozen=True, slots=True)
class StepRecord:
    """One learner step as simulated."""

    batch_id: int
    version: int  # the weights version the batch was formed at
    handed_out_s: float  # when the batch reached the learner
    trained_s: float  # when its step ended (weights v+1 published)
    staleness_max: int
    groups: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class SimResult:
    figures: Figures
    ledger: Ledger
    steps: tuple[StepRecord, ...]
    abort_rounds: int
    events: int
    # simulated seconds the learner waited for a batch, by what held it (see `WAIT_CAUSES`)
    waits: dict[str, float] = field(default_factory=dict)


# Why a batch could not be formed while the learner waited for one, checked in this order:
WAIT_CAUSES = (
    "admission",  # async: fewer than a batch of complete groups, and the admission bound reached
    "generation",  # fewer than a batch of complete groups, more may be issued (or a round is running)
    "staleness",  # async: a batch of complete groups, but taking it now would break max_staleness later
)


def wait_cause(state: BrokerState) -> str:
    """Which of WAIT_CAUSES holds the learner's next batch now (state: no batch could be formed)."""
    if len(state.complete) >= state.algo.rollout_batch_size:
        return "staleness"
    if state.mode == Mode.ASYNC and state.counts().accepted >= policy.admission_limit(
        state.algo, state.version
    ):
        return "admission"
    return "generation"


class LengthTable:
    """The drawn total response length of sample (group_id, index): group ids are issued 0, 1, 2, ... in
    every mode, so one seed gives every mode the same samples."""

    def __init__(self, sampler: LengthSampler, seed: int, group_size: int) -> None:
        self.sampler = sampler
        self.rng = np.random.default_rng(seed)
        self.group_size = group_size
        self.table = np.zeros(0, dtype=np.int64)

    def __call__(self, sample: Sample) -> int:
        pos = sample.group_id * self.group_size + sample.index
        while pos >= self.table.shape[0]:
            chunk = np.asarray(self.sampler.sample(self.rng, LENGTH_CHUNK_GROUPS * self.group_size))
            self.table = np.concatenate([self.table, np.maximum(chunk.astype(np.int64), 1)])
        return int(self.table[pos])


class SampleLengths:
    """The drawn total response length of a sample as the sim engine draws it (april.sample_draw)."""

    def __init__(self, sampler: LengthSampler, seed: int, prompt_corr: float = 0.0) -> None:
        self.draw = LengthDraw(sampler, seed, prompt_corr)
        self.drawn: dict[tuple[int, int], int] = {}

    def __call__(self, sample: Sample) -> int:
        key = sample.key
        if key not in self.drawn:
            prompt = prompt_key(sample.prompt_ids) if self.draw.prompt_corr else 0
            self.drawn[key] = max(1, self.draw(sample_key(*key), prompt))
        return self.drawn[key]


class Simulation:
    """One mode, run once (see the module docstring)."""

    def __init__(self, config: SimConfig, lengths: LengthSampler) -> None:
        self.cfg = config
        prompts = SyntheticPromptSource(
            config.dataset_size,
            seed=config.seed,
            prompt_len_min=config.prompt_len,
            prompt_len_max=config.prompt_len,
        )
        self.state = BrokerState(config.mode, config.algo, prompts)
        self.round_based = policy.is_round_based(config.mode)
        self.meter = Meter(config.engines)
        table: LengthTable | SampleLengths = (
            SampleLengths(lengths, config.seed, config.prompt_corr)
            if config.per_sample_lengths or config.prompt_corr
            else LengthTable(lengths, config.seed, config.algo.n_samples_per_prompt)
        )
        keep = config.resume_kv is ResumeKV.REUSE
        self.engines = [
            EngineModel(i, config.slots, config.cost, self.meter, table, keep) for i in range(config.engines)
        ]
        self.by_worker = {e.worker_id: e for e in self.engines}
        self.credit = [config.slots] * config.engines
        self.peer_version = [0] * config.engines  # what each worker reported loaded (WeightsLoaded)
        self.abort: set[int] | None = None  # engines that still owe an AbortDone
        self.abort_rounds = 0
        self.learner_waiting: int | None = 0  # step of the pending BatchRequest
        self.waiting_since = 0.0
        self.waits = dict.fromkeys(WAIT_CAUSES, 0.0)
        self.wait_mark: tuple[float, str] | None = None  # (since, cause) while the learner waits
        self.rollout_s = 0.0
        self.trained = 0
        self.records: list[StepRecord] = []
        self.tally = Tally()
        self.arrivals = ArrivalMeter()  # the load on the broker: samples returned per virtual second
        self.now = 0.0
        self.events = 0
        self.queue: list[
            tuple[float, int, int, int, int]
        ] = []  # (time, seq, engine or -1, generation, steps)
        self.seq = 0
        self.done = False

    # ------------------------------------------------------------------ the loop

    def run(self) -> SimResult:
        self._tick()
        while not self.done:
            if not self.queue:
                raise SimulationError(
                    f"simulate {self.cfg.mode.value}: nothing left to happen after {self.trained} of "
                    f"{self.cfg.steps} steps at t={self.now:.3f}s ({self.state.ledger().describe()})"
                )
            t, _, index, generation, steps = heapq.heappop(self.queue)
            if index >= 0 and generation != self.engines[index].generation:
                continue  # replaced by an earlier wake
            self.now = t
            self.meter.advance(t)
            self.events += 1
            if index < 0:
                self._learner_done()
            else:
                self._wake(self.engines[index], steps)
            if self.cfg.check_ledger_every_event:
                self.state.check_ledger(f"at t={t:.6f}")
        return self._result()

    def _push(self, t: float, index: int, generation: int = 0, steps: int = 0) -> None:
        self.seq += 1
        heapq.heappush(self.queue, (t, self.seq, index, generation, steps))

    def _schedule(self, engine: EngineModel, at: tuple[float, int] | None) -> None:
        """Wake `engine` at `at` unless it is already due no later."""
        if at is None or (engine.wake is not None and engine.wake[0] <= at[0]):
            return
        engine.wake = at
        engine.generation += 1
        self._push(max(at[0], self.now), engine.index, engine.generation, at[1])  # float slack: never back

    def _wake(self, engine: EngineModel, steps: int) -> None:
        """A step boundary: finished samples go back, then the worker reads its messages."""
        engine.wake = None
        engine.busy = True
        engine.advance(self.now, steps)
        finished = engine.take_finished()
        if finished:
            self._on_results(engine, finished, credit=len(finished))
        self._tick()
        while engine.inbox:
            self._read(engine, engine.inbox.pop(0))
        engine.busy = False
        self._schedule(engine, engine.next_finish())

    def _read(self, engine: EngineModel, msg: ToEngine) -> None:
        """The worker's handling of one broker message (actors/worker.py `_handle`)."""
        if isinstance(msg, Lease):
            ready = engine.admit(msg.work)
            if ready:
                self._on_results(engine, ready, credit=len(ready))
                self._tick()
        elif isinstance(msg, Weights):
            engine.load(msg.version)
            self.peer_version[engine.index] = max(self.peer_version[engine.index], msg.version)
        else:
            partials = engine.abort()
            if partials:
                self._on_results(engine, partials, credit=0)
            self._on_abort_done(engine)
            self._tick()

    def _send(self, engine: EngineModel, msg: ToEngine) -> None:
        engine.inbox.append(msg)
        if not engine.busy:
            self._schedule(engine, engine.next_boundary(self.now))

    # ------------------------------------------------------------------ the broker (server.py's glue)

    def _on_results(self, engine: EngineModel, items: list[Output], credit: int) -> None:
        self.arrivals.add(self.now, len(items))
        for lease_id, sample in items:
            self.state.accept_result(engine.worker_id, lease_id, sample)
        self.credit[engine.index] = min(self.credit[engine.index] + credit, engine.slots)
        self._dispatch(train=not self.state.round_complete())

    def _on_abort_done(self, engine: EngineModel) -> None:
        self.credit[engine.index] = engine.slots
        if self.abort is not None:
            self.abort.discard(engine.index)

    def _tick(self) -> None:
        if self.abort is not None and not self.abort:
            self.abort = None
            if self.round_based:
                self.state.park_queued_samples()
        if self.state.close_round_if_complete():
            if self.state.leased_samples:
                self._start_abort()
            else:
                self.state.park_queued_samples()
        self._dispatch()
        self._try_send_batch()

    def _dispatch(self, train: bool = True) -> None:
        """Spread training samples over the engines with credit, one Lease each [_dispatch,
        _lease_training]; no evaluations here."""
        state = self.state
        if self.abort is not None or not train or not state.dispatch_allowed():
            return
        available = state.leasable_samples()
        if available <= 0:
            return  # take_work would lease nothing to any worker
        engines = [e for e in self.engines if self.credit[e.index] > 0]
        free = [self.credit[e.index] for e in engines]
        work: list[list[tuple[int, int, Sample]]] = [[] for _ in engines]
        room = list(free)
        if state.algo.resume_affinity:
            versions: list[int | None] = [self.peer_version[e.index] for e in engines]
            held = state.take_held_partials([e.worker_id for e in engines], room, versions)
            for i, items in enumerate(held):
                work[i] += items
                room[i] -= len(items)
            available = state.leasable_samples()
        shares = policy.spread_leases(available, room, [e.slots for e in engines])
        short = False
        for engine, items, share in zip(engines, work, shares, strict=True):
            if share:
                got = state.take_work(engine.worker_id, share, self.peer_version[engine.index])
                items += got
                short = short or len(got) < share
        if short:
            order = sorted(range(len(engines)), key=lambda i: -(free[i] - len(work[i])) / engines[i].slots)
            for i in order:
                left = free[i] - len(work[i])
                if left > 0 and state.leasable_samples():
                    version = self.peer_version[engines[i].index]
                    work[i] += state.take_work(engines[i].worker_id, left, version)
        for engine, items in zip(engines, work, strict=True):
            if items:
                self.credit[engine.index] -= len(items)
                self._send(engine, Lease(items))

    def _start_abort(self) -> None:
        holders = sorted({self.by_worker[lease.worker_id].index for lease in self.state.leases.values()})
        self.abort = set(holders)
        self.abort_rounds += 1
        for i in holders:
            self._send(self.engines[i], Abort())

    def _on_weights(self, version: int) -> None:
        if not self.state.set_weights(version, f"sim://v{version}", ""):
            return
        for engine in self.engines:
            self._send(engine, Weights(version))
        if policy.abort_on_new_version(self.state.mode) and self.state.leased_samples and self.abort is None:
            self._start_abort()

    def _try_send_batch(self) -> None:
        state = self.state
        if self.learner_waiting is None:
            return
        if state.batch is None and len(state.complete) < state.algo.rollout_batch_size:
            self._note_wait(wait_cause(state))
            return  # select_batch needs a batch worth of complete groups
        batch = state.form_batch(self.learner_waiting)
        self._note_wait(None if batch is not None else wait_cause(state))
        if batch is None:
            return
        state.check_ledger(f"after forming batch {batch.batch_id}")
        self.learner_waiting = None
        self.rollout_s += self.now - self.waiting_since
        if self.round_based:
            self.meter.in_phase = False
        self._push(self.now + self.cfg.learner_step_s, -1)

    def _note_wait(self, cause: str | None) -> None:
        """The learner waits because of `cause` from now on (None: it got its batch)."""
        if self.wait_mark is not None:
            since, before = self.wait_mark
            self.waits[before] += self.now - since
        self.wait_mark = None if cause is None else (self.now, cause)

    # ------------------------------------------------------------------ the learner

    def _learner_done(self) -> None:
        batch = self.state.batch
        assert batch is not None, "the learner finished a step without a batch"
        self.tally.add_batch(batch.samples, batch.version)
        self.records.append(
            StepRecord(
                batch.batch_id,
                batch.version,
                self.now - self.cfg.learner_step_s,
                self.now,
                max(s.staleness(batch.version) for s in batch.samples),
                tuple(batch.group_ids),
            )
        )
        self._on_weights(self.state.version + 1)
        self.state.ack_batch(batch.batch_id, slots=self.cfg.engines * self.cfg.slots)
        self.state.check_ledger(f"after acking batch {batch.batch_id}")
        self.trained += 1
        if self.trained >= self.cfg.steps:
            self.done = True
            return
        if self.round_based:
            self.meter.in_phase = True
        self.learner_waiting = self.trained
        self.waiting_since = self.now
        self._tick()

    def _result(self) -> SimResult:
        buffered = sum(s.response_len for g in self.state.groups.values() for s in g.samples)
        buffered += sum(e.in_engine_tokens for e in self.engines)
        figs = compute_figures(
            wall_s=self.now,
            rollout_s=self.rollout_s,
            tally=self.tally,
            generated=sum(e.tokens for e in self.engines),
            buffered=buffered,
            meter=self.meter,
            slots_total=self.cfg.engines * self.cfg.slots,
            engines=self.cfg.engines,
            aborted=self.state.totals.aborted,
            resumed=self.state.totals.resumed,
            busy_s=sum(e.busy_s for e in self.engines),
            reprefill_s=self.cfg.cost.prefill_s(sum(e.reprefill_tokens for e in self.engines)),
            stale_kv_tokens=sum(e.stale_kv_tokens for e in self.engines),
            arrivals=self.arrivals,
        )
        ledger = self.state.check_ledger("at the end of the simulation")
        return SimResult(figs, ledger, tuple(self.records), self.abort_rounds, self.events, dict(self.waits))


def simulate(config: SimConfig, lengths: LengthSampler) -> SimResult:
    """Run one mode for `config.steps` learner steps in virtual time."""
    return Simulation(config, lengths).run()
