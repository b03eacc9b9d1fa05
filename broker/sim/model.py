"""`april simulate`'s discrete-event model: the broker core driven in virtual time by simulated engines and
a simulated learner.

Owns the event loop in virtual time and what the processes around the broker do in it. The broker is the
real one's core (`broker.core.BrokerCore`, with its books and policy): every scheduling decision is taken
by the same code as in `april broker`, from the same events. Engines are `broker.sim.engines.EngineModel`;
the learner takes `learner.sim_step_s` (+ `sim_step_s_per_token` x trained response tokens, as
`learner/sim_trainer.py`) per batch. What each process sends the core, and when:
  - an engine at a step boundary where a sequence finishes or a message waits: its finished samples with
    their slots' credit (a worker's LeaseRequest and SampleResult together: scoring is instant), then the
    messages it has read: a Lease is admitted (samples with nothing to generate come straight back), a
    WeightsReady loaded (WeightsLoaded), an Abort answered (the running samples as partials, AbortDone);
    so an abort round-trip lasts until each holder's current step ends;
  - in episodes (`april.sim.episode_plans`, `broker.sim.engines`), the same engine at the boundary after a
    tool call answers, and the credit of a slot a turn gave up with no sample to return (a LeaseRequest);
    an AbortDone names the leases whose non-repeatable tool call the worker still waits for, and their
    samples follow when it answers;
  - the learner at the end of a step: WeightsReady v+1, BatchAck, BatchRequest for the next step;
  - the tick after every event, as the broker's loop ticks after every turn.
The run's config is the one a real run reads (`SimConfig.config`): mode, algo, broker, prompts, the sim
engine's cost and prefix cache (`worker.sim_*`), `worker.slots`, `worker.resume_kv`, steps and seed.
Not modelled: network latency, reward scoring time, weight loading time, evaluations, failures,
heartbeats and snapshots (a formed batch is handed over at once).
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field

import numpy as np

from april import protocol
from april.config import Config, ConfigError, Mode, ResumeKV
from april.ledger import Ledger
from april.records import Sample
from april.sim.episode_plans import EpisodePlans, EpisodeWorkload, Plans, SingleTurn
from april.sim.sample_draw import LengthDraw, LengthSampler, prompt_key, sample_key
from broker.core import BrokerCore
from broker.decisions import BatchFormed, Decision, LeaseOut, Refuse, Send
from broker.heldout import open_prompts
from broker.sim.engines import EngineModel, Output, ToEngine
from broker.sim.figures import ArrivalMeter, Figures, Meter, Tally, compute_figures
from broker.state import BrokerState, PendingBatch

LENGTH_CHUNK_GROUPS = 512  # groups whose lengths are drawn at once
LEARNER_ID = "sim-learner"
NO_LEASES = np.zeros(0, dtype=np.int64)
LEARNER = -1  # the queue's engine index of the learner's events
TOOL = -1  # the queue's generation of a tool call's answer (an engine's wakes count up from 0)


class SimulationError(RuntimeError):
    """The simulated run cannot go on (nothing left to happen before the last step): a bug or a
    configuration that can never fill a batch. One readable line."""


@dataclass(frozen=True, slots=True)
class SimConfig:
    """One simulated run: the run's config (`config`, as `april up` would read it) and its cluster."""

    config: Config
    engines: int = 8  # worker processes, one engine of `worker.slots` slots each
    # True: each sample's length drawn from (seed, group, index) exactly as the sim engine draws it
    # (april.sim.sample_draw), so `april bench --engine sim` runs the very same samples; False: one
    # seeded stream
    per_sample_lengths: bool = False
    check_ledger_every_event: bool = False  # debug: the books balance after every event (slow)

    def __post_init__(self) -> None:
        if self.engines < 1:
            raise ConfigError(f"simulate: engines = {self.engines}, expected >= 1")
        c = self.config.worker.sim_cost
        if c.step_ms(1) <= 0:  # virtual time must advance, or the event loop would never end
            raise ConfigError(
                f"simulate: step cost A={c.decode_ms:g}, B={c.decode_ms_per_seq:g}, "
                f"C={c.prefill_ms_per_token:g} ms: expected A + B > 0 (a step takes time "
                "(worker.sim_decode_ms, worker.sim_decode_ms_per_seq)"
            )

    @property
    def mode(self) -> Mode:
        return self.config.run.mode

    @property
    def slots(self) -> int:
        return self.config.worker.slots

    @property
    def steps(self) -> int:
        return self.config.run.steps


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
    """Which of WAIT_CAUSES holds the learner's next batch now (state: no batch could be formed). The
    broker's books and its mode policy answer; the batch rule is theirs."""
    if state.batch_worth_complete():
        return "staleness"  # complete groups enough, and still no batch: the mode held it back
    if state.mode_policy.held_by_admission(state.algo, state.counts(), state.version):
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
    """The drawn total response length of a sample as the sim engine draws it (april.sim.sample_draw)."""

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

    def __init__(
        self, config: SimConfig, lengths: LengthSampler, episodes: EpisodeWorkload | None = None
    ) -> None:
        self.cfg = config
        run = config.config
        self.cost = run.worker.sim_cost
        source, _ = open_prompts(run)  # the run's training prompts (the held-out ones are not simulated)
        # heartbeats are not modelled: no worker falls silent (an engine decoding a long tail sends nothing)
        self.core = BrokerCore(run, BrokerState(run.run.mode, run.algo, source), (), 0.0, liveness=False)
        self.round_based = self.core.state.mode_policy.round_based
        self.meter = Meter(config.engines)
        seed = run.run.seed
        prompt_corr = run.worker.sim_prompt_corr
        table: LengthTable | SampleLengths = (
            SampleLengths(lengths, seed, prompt_corr)
            if config.per_sample_lengths or prompt_corr
            else LengthTable(lengths, seed, run.algo.n_samples_per_prompt)
        )
        keep = run.worker.resume_kv is ResumeKV.REUSE
        plans: Plans = SingleTurn(table)
        if episodes is not None:  # every engine reads one table of plans: a sample may resume anywhere
            env = run.env
            plans = EpisodePlans(episodes, seed, env.max_turns, env.max_turn_tokens)
        repeatable = run.worker.sim_tool_repeatable
        self.engines = [
            EngineModel(i, config.slots, self.cost, self.meter, plans, keep, repeatable)
            for i in range(config.engines)
        ]
        self.by_worker = {e.worker_id: e for e in self.engines}
        self.training: PendingBatch | None = None  # the batch the learner trains
        self.handed_out_s = 0.0  # when it reached the learner
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
        # (time, seq, engine or LEARNER, generation or TOOL, steps): TOOL: one of its tool calls answers
        self.queue: list[tuple[float, int, int, int, int]] = []
        self.seq = 0
        self.done = False

    # ------------------------------------------------------------------ the loop

    def run(self) -> SimResult:
        core = self.core
        for e in self.engines:
            hello = protocol.WorkerHello(e.worker_id, "sim", e.slots, 0, 0, "sim", NO_LEASES)
            self._carry_out(core.on_hello(hello, 0.0))
        self._carry_out(core.on_learner_hello(LEARNER_ID))
        self._carry_out(core.on_batch_request(0, -1, 0.0))
        self._tick()
        while not self.done:
            if not self.queue:
                raise SimulationError(
                    f"simulate {self.cfg.mode}: nothing left to happen after {self.trained} of "
                    f"{self.cfg.steps} steps at t={self.now:.3f}s ({core.state.ledger().describe()})"
                )
            t, _, index, generation, steps = heapq.heappop(self.queue)
            tool = generation == TOOL
            if index != LEARNER and not tool and generation != self.engines[index].generation:
                continue  # replaced by an earlier wake
            if tool and not self.engines[index].tool_due(t):
                continue  # the call was killed by an abort
            self.now = t
            self.meter.advance(t)
            self.events += 1
            if index == LEARNER:
                self._learner_done()
            elif tool:  # the worker sees the answer at the engine's next step boundary
                engine = self.engines[index]
                self._schedule(engine, engine.next_boundary(t))
            else:
                self._wake(self.engines[index], steps)
            if self.cfg.check_ledger_every_event:
                core.state.check_ledger(f"at t={t:.6f}")
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

    # ------------------------------------------------------------------ the engines (a worker's side)

    def _wake(self, engine: EngineModel, steps: int) -> None:
        """A step boundary: finished samples go back with the slots nothing took (an ended turn's slot
        goes to an episode whose tool answered first), then the worker reads its messages."""
        engine.wake = None
        engine.busy = True
        engine.advance(self.now, steps)
        out = engine.take_finished()
        out += engine.complete_tools(self.now)
        out += engine.fill()
        self._arm_tools(engine)
        self._give_back(engine, out, engine.grant())
        self._tick()
        while engine.inbox:
            self._read(engine, engine.inbox.pop(0))
        engine.busy = False
        self._schedule(engine, engine.next_finish())

    def _read(self, engine: EngineModel, msg: ToEngine) -> None:
        """The worker's handling of one broker message (actors/worker.py `_handle`)."""
        core = self.core
        if isinstance(msg, LeaseOut):
            ready = engine.admit(msg.work)
            self._arm_tools(engine)
            self._give_back(engine, ready, engine.grant())
        elif isinstance(msg, protocol.WeightsReady):
            engine.load(msg.version)
            self._carry_out(
                core.on_weights_loaded(engine.worker_id, protocol.WeightsLoaded(msg.version, True, ""))
            )
        else:
            partials = engine.abort()
            if partials:
                self._return(engine, partials, credit=0)
            waited = engine.waited_for()
            self._carry_out(
                core.on_abort_done(engine.worker_id, msg.round_id, engine.slots, waited, self.now)
            )
        self._tick()

    def _return(self, engine: EngineModel, items: list[Output], credit: int) -> None:
        """Samples back to the broker, with `credit` freed slots."""
        self.arrivals.add(self.now, len(items))
        lease_ids = [lease_id for lease_id, _ in items]
        samples = [sample for _, sample in items]
        self._carry_out(self.core.on_samples(engine.worker_id, lease_ids, samples, credit, self.now))

    def _give_back(self, engine: EngineModel, items: list[Output], credit: int) -> None:
        """Samples back with `credit` freed slots (a SampleResult), or the credit alone (a LeaseRequest:
        the next tick leases it)."""
        if items:
            self._return(engine, items, credit)
        elif credit:
            self._carry_out(self.core.on_credit(engine.worker_id, credit))

    def _arm_tools(self, engine: EngineModel) -> None:
        """The engine's tool calls just started answer at their time."""
        for due in engine.started_tools:
            self._push(due, engine.index, TOOL)
        engine.started_tools.clear()

    def _send(self, engine: EngineModel, msg: ToEngine) -> None:
        engine.inbox.append(msg)
        if not engine.busy:
            self._schedule(engine, engine.next_boundary(self.now))

    # ------------------------------------------------------------------ the broker core's decisions

    def _carry_out(self, decisions: list[Decision]) -> None:
        for d in decisions:
            match d:
                case LeaseOut():
                    self._send(self.by_worker[d.worker_id], d)
                case Send(message=protocol.Abort() | protocol.WeightsReady() as msg):
                    self._send(self.by_worker[d.worker_id], msg)
                case BatchFormed(batch=batch):  # never `again`: no ack is lost here
                    self._hand_out(batch)
                case Refuse():
                    raise SimulationError(
                        f"simulate: the broker refused {d.peer_id}: {d.reason} ({d.detail})"
                    )
                case (
                    _
                ):  # a Welcome, to a worker or the learner; settled samples (no log here); no evaluations
                    pass

    def _tick(self) -> None:
        self._carry_out(self.core.tick(self.now))
        waiting = self.core.learner_waiting is not None
        self._note_wait(wait_cause(self.core.state) if waiting else None)

    def _note_wait(self, cause: str | None) -> None:
        """The learner waits because of `cause` from now on (None: it got its batch)."""
        if self.wait_mark is not None:
            since, before = self.wait_mark
            self.waits[before] += self.now - since
        self.wait_mark = None if cause is None else (self.now, cause)

    # ------------------------------------------------------------------ the learner

    def _hand_out(self, batch: PendingBatch) -> None:
        """The formed batch reaches the learner at once (no snapshot to wait for)."""
        self.training = batch
        self.handed_out_s = self.now
        self.rollout_s += self.now - self.waiting_since
        if self.round_based:
            self.meter.in_phase = False
        learner = self.cfg.config.learner
        tokens = sum(s.response_len for s in batch.samples)
        self._push(self.now + learner.sim_step_s + learner.sim_step_s_per_token * tokens, LEARNER)

    def _learner_done(self) -> None:
        batch = self.training
        assert batch is not None, "the learner finished a step without a batch"
        self.tally.add_batch(batch.samples, batch.version)
        self.records.append(
            StepRecord(
                batch.batch_id,
                batch.version,
                self.handed_out_s,
                self.now,
                max(s.staleness(batch.version) for s in batch.samples),
                tuple(batch.group_ids),
            )
        )
        core = self.core
        version = core.state.version + 1
        self._carry_out(core.on_weights(version, f"sim://v{version}", "", self.now))
        self._carry_out(core.on_ack(batch.batch_id, self.now))
        self.training = None
        self.trained += 1
        if self.trained >= self.cfg.steps:
            self.done = True
            return
        if self.round_based:
            self.meter.in_phase = True
        self._carry_out(core.on_batch_request(self.trained, batch.batch_id, self.now))
        self.waiting_since = self.now
        self._tick()

    def _result(self) -> SimResult:
        buffered = sum(s.model_tokens for g in self.core.state.groups.values() for s in g.samples)
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
            aborted=self.core.state.totals.aborted,
            resumed=self.core.state.totals.resumed,
            busy_s=sum(e.busy_s for e in self.engines),
            reprefill_s=self.cost.prefill_s(sum(e.reprefill_tokens for e in self.engines)),
            stale_kv_tokens=sum(e.stale_kv_tokens for e in self.engines),
            arrivals=self.arrivals,
        )
        ledger = self.core.state.check_ledger("at the end of the simulation")
        return SimResult(figs, ledger, tuple(self.records), self.core.round_id, self.events, dict(self.waits))


def simulate(config: SimConfig, lengths: LengthSampler, episodes: EpisodeWorkload | None = None) -> SimResult:
    """Run one mode for `config.steps` learner steps in virtual time; with `episodes`, each sample is an
    episode (`april.sim.episode_plans`), its turns' lengths from `episodes`, not `lengths`."""
    return Simulation(config, lengths, episodes).run()
