"""Simulated rollout engines for `april simulate`: slots and decode steps in virtual time, vectorised, and
the episodes their workers hold between turns.

Owns the engine side of the simulation: which leased samples each engine is decoding, how many tokens
each has produced, when its next step boundary falls, and the broker messages it has not read yet; and
what the worker around it keeps (actors/worker.py and its episode driver, docs/design.md section 3).

Cost model: `april.sim.engine_cost.EngineCost`, the one the sim engine a worker runs also uses (a decode
step over `active` sequences, plus the prefill of every input token admitted in that step). A fresh
sample's input is its prompt; a resumed partial re-prefills prompt + the response so far (the resume
hand-off cost), less what this engine's prefix cache still holds of it (`april.sim.prefix_cache`, the rule
the sim engine follows too: the same re-prefill for the same events). `busy_s` and `reprefill_tokens`
give the re-prefill share of engine time; `stale_kv_tokens` counts tokens generated while attending to
KV computed under older weights than the loaded ones (what resume_kv "reuse" costs in exactness).

Episodes (`broker.sim.episodes`: a single-turn sample is an episode of one turn). A sequence decodes one
model turn. When a turn that is not the last ends, its slot is free again (the worker grants it back as
credit unless an episode waits for it) and the episode runs its tool call, holding no slot, for the
call's latency; the engine's prefix cache keeps the context (stored as an interrupted prefix is, so a
weight update under resume_kv "recompute", or eviction, costs its re-prefill). The tool's answer is
appended as an observation and the episode waits for a slot in `april.turn_queue`'s order, the episode
driver's (ahead of leases the worker holds unstarted, such as a lease that found no free slot because an
answered episode took a slot granted as credit); its next turn prefills what the cache lacks: the
observation, at least. A lease that owes a tool call (an abort killed it) runs it at once, holding no
slot, as the driver runs an owed step. Budgets: a turn generates at most its planned tokens
(`env.max_turn_tokens` applied in the plan) and the lease's budget (model + observation tokens). Cut off
as the episode driver cuts (docs/episodes.md): an answer that would leave no budget for another turn, or
the call after the last turn `env.max_turns` allows, ends the episode (LENGTH) without being appended. An
abort returns running turns as partials, answered episodes and unstarted leases as they are, and tool
calls as the tools allow: a repeatable one is killed (the sample, owing it, runs it again when leased), a
non-repeatable one is waited for and its sample goes back with the answer when it comes (`waited_for`:
the AbortDone names those leases as still owed).

Vectorised: all sequences of an engine advance together, so between two events an engine is an
arithmetic progression of step boundaries (the first step longer by its prefill). It is woken only at a
boundary where a sequence finishes or where a message (or a tool's answer) waits, never once per token.
Messages are read at step boundaries, as the worker reads its socket between decode steps; a lease
granted mid-step joins the next step. Times of tool calls started are left in `started_tools` for the
driver to schedule.

Knows nothing of scheduling: the broker core (`broker.core`, driven by `broker.sim.model`) decides what
to lease and when to abort.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from april.protocol import Abort, WeightsReady
from april.records import FinishReason, Sample
from april.sim.byte_tokenizer import ByteTokenizer
from april.sim.engine_cost import EngineCost
from april.sim.prefix_cache import PrefixCache
from april.turn_queue import TurnQueue
from broker.decisions import LeaseOut, Work
from broker.sim.episodes import EpisodePlan, EpisodePlans, Plans, SingleTurn
from broker.sim.figures import Meter

LengthOf = Callable[[Sample], int]  # the drawn total response length of a sample
Output = tuple[int, Sample]  # (lease id, the sample as returned to the broker)
BYTES = ByteTokenizer()  # the sim engine's tokenizer (actors.factory): a text prompt's ids, one a byte
_EPS = 1e-9  # float slack when placing a time on the step grid


ToEngine = LeaseOut | Abort | WeightsReady  # what the broker core sends an engine (broker.decisions)


@dataclass(frozen=True, slots=True)
class _Lease:
    """What the worker keeps of a lease across the turns it runs."""

    lease_id: int
    cap: int  # response tokens the sample may reach in this lease (as leased + the lease's budget)
    leased_model: int  # model tokens it had when leased
    plan: EpisodePlan


@dataclass(slots=True)
class _Seq:
    lease: _Lease
    sample: Sample  # as this turn started (RUNNING): as leased, or with the lease's earlier turns
    finish: FinishReason  # once its tokens are out: STOP or LENGTH (finished), NONE (a tool call follows)
    marks: list[tuple[int, int]]  # (tokens produced in this turn, version from then on)
    cached: int = 0  # input tokens the prefix cache gave back
    kv_version: int = 0  # weights version of the oldest KV it attends to
    prefilled: bool = False  # its first step ran: the KV of its whole input exists

    @property
    def lease_id(self) -> int:
        return self.lease.lease_id


@dataclass(slots=True)
class _Episode:
    """An episode in its tool call until `due`, holding no slot."""

    lease: _Lease
    sample: Sample  # RUNNING: its last turn appended
    call: int  # which of the plan's tool calls
    due: float  # when the tool answers (s)
    started: bool  # it has had a turn in this engine (a resumed lease's owed call: not yet)
    returning: bool = False  # aborted while its non-repeatable tool ran: back to the broker when answered


@dataclass(frozen=True, slots=True)
class _Waiting:
    """A turn waiting for a slot: an episode its tool answered, or a lease not started here."""

    lease: _Lease
    sample: Sample


class EngineModel:
    """One simulated engine with `slots` concurrent sequences and its worker's held episodes (see the
    module docstring). `plans`: each sample's episode, or a length per sample (single-turn)."""

    def __init__(
        self,
        index: int,
        slots: int,
        cost: EngineCost,
        meter: Meter,
        plans: Plans | LengthOf,
        keep_kv_across_updates: bool = False,
        repeatable_tools: bool = True,
    ) -> None:
        self.index = index
        self.worker_id = f"sim-{index}"
        self.slots = slots
        self.cost = cost
        self.meter = meter
        self.plans: Plans = plans if isinstance(plans, EpisodePlans | SingleTurn) else SingleTurn(plans)
        self.repeatable_tools = repeatable_tools
        self.version = 0
        self.seqs: list[_Seq] = []
        self.produced = np.zeros(0, dtype=np.int64)  # (active,) tokens of each sequence in this turn
        self.remaining = np.zeros(0, dtype=np.int64)  # (active,) tokens until each one's turn ends
        self.t_base = 0.0  # time (s) of the step boundary the engine was last brought to
        self.prefill = 0  # input tokens paid in the next step
        self.inbox: list[ToEngine] = []
        self.wake: tuple[float, int] | None = None  # the scheduled wake: (time, steps after t_base)
        self.generation = 0  # bumped whenever `wake` is replaced, so stale queue entries are skipped
        self.tokens = 0  # response tokens generated, every lease
        self.busy = False  # inside a wake: new messages are read before it ends
        self.cache = PrefixCache(cost.prefix_cache_tokens, keep_kv_across_updates)
        self.reprefill = 0  # of `prefill`: input tokens of resumed samples the cache missed
        self.admitted = False  # sequences admitted since the last step
        self.reprefill_tokens = 0  # paid, every lease
        self.busy_s = 0.0  # time spent in decode steps
        self.stale_kv_tokens = 0  # tokens generated attending to KV of older weights than the loaded ones
        self.stale_seqs = 0  # running sequences attending to such KV (kept up to date: advance is hot)
        self.tools: dict[int, _Episode] = {}  # lease id -> episode in a tool call
        self.waiting: TurnQueue[_Waiting] = TurnQueue()  # turns waiting for a slot, in the worker's order
        self.credit = slots  # free slots the broker holds as this worker's credit, as the worker reckons
        self.started_tools: list[float] = []  # when tool calls started since the driver last took them end

    @property
    def active(self) -> int:
        return len(self.seqs)

    @property
    def in_engine_tokens(self) -> int:
        """Model tokens generated in current leases and not yet returned to the broker."""
        running = int(self.produced.sum())
        running += sum(seq.sample.model_tokens - seq.lease.leased_model for seq in self.seqs)
        held: list[_Episode | _Waiting] = [*self.tools.values(), *self.waiting]
        return running + sum(e.sample.model_tokens - e.lease.leased_model for e in held)

    # ------------------------------------------------------------------ the step grid

    def boundary(self, steps: int) -> float:
        """Time of the boundary `steps` (>= 1) decode steps after t_base."""
        first = self.cost.step_s(self.active, self.prefill)
        return self.t_base + first + (steps - 1) * self.cost.step_s(self.active)

    def next_boundary(self, t: float) -> tuple[float, int]:
        """The first moment at or after `t` where the engine reads messages: (time, steps after t_base).
        An idle engine reads at once."""
        if not self.seqs:
            return max(t, self.t_base), 0
        first = self.cost.step_s(self.active, self.prefill)
        if t <= self.t_base + first + _EPS:
            return self.boundary(1), 1
        steps = 1 + math.ceil((t - self.t_base - first) / self.cost.step_s(self.active) - _EPS)
        return self.boundary(steps), steps

    def next_finish(self) -> tuple[float, int] | None:
        """The boundary where the next sequence's turn ends, or None when idle."""
        if not self.seqs:
            return None
        steps = int(self.remaining.min())
        return self.boundary(steps), steps

    def advance(self, now: float, steps: int) -> None:
        """Bring the engine to `now`, the boundary `steps` steps after t_base (0 for an idle engine)."""
        if steps:
            self.produced += steps
            self.remaining -= steps
            self.tokens += steps * self.active
            self.stale_kv_tokens += steps * self.stale_seqs
            self.busy_s += now - self.t_base
            if self.admitted:  # their first step ran (even one whose whole input was cached)
                for seq in self.seqs:
                    seq.prefilled = True
                self.admitted = False
            self.reprefill_tokens += self.reprefill
            self.prefill = self.reprefill = 0
        self.t_base = now

    # ------------------------------------------------------------------ sequences

    def take_finished(self) -> list[Output]:
        """Sequences whose turn ended: out of their slots. A finished sample is returned (FINISHED); an
        episode with turns to come starts its tool call (at t_base)."""
        done = np.flatnonzero(self.remaining <= 0)
        if done.shape[0] == 0:
            return []
        out = []
        for i in done.tolist():
            seq, produced = self.seqs[i], int(self.produced[i])
            if seq.finish == FinishReason.NONE:
                self._end_turn(seq, produced)
            else:
                out.append((seq.lease_id, _output(seq, produced, seq.finish)))
                self.plans.forget(seq.sample)
        self._keep(self.remaining > 0)
        return out

    def admit(self, work: Work) -> list[Output]:
        """Start leased samples (prefilled in the next step), or hold them while no slot is free. Returns
        those with nothing to generate."""
        self.credit -= len(work)
        before, ready, remaining = self.active, [], list[int]()
        for lease_id, budget, sample in work:
            if sample.prompt_ids.shape[0] == 0:  # a text prompt: tokenized as the sim engine's worker does
                ids = BYTES.encode_prompt(sample.prompt_text, sample.metadata)
                sample = dataclasses.replace(sample, prompt_ids=ids)
            lease = self._lease(lease_id, budget, sample)
            turn, left = lease.plan.turn_of(sample.model_tokens, len(sample.observations))
            if left <= 0 and not lease.plan.ends_after(turn):  # an abort killed its call: it runs again now
                self._call_tool(lease, sample, turn, started=False)
            elif self.active >= self.slots:
                self.waiting.put(_Waiting(lease, sample), started=False)
            elif (out := self._start(lease, sample, remaining)) is not None:
                ready.append(out)
        self._commit(before, remaining)
        return ready

    def complete_tools(self, now: float) -> list[Output]:
        """Tool calls answered by `now`: each answer becomes an observation and its episode waits for a
        slot. Returns what goes back to the broker instead: episodes left without budget for another turn
        (FINISHED) and those an abort waited for (INTERRUPTED)."""
        answered = sorted((e for e in self.tools.values() if e.due <= now), key=lambda e: e.due)
        out: list[Output] = []
        for e in answered:
            del self.tools[e.lease.lease_id]
            plan = e.lease.plan
            # cut off (the episode driver's rule): the call after the last allowed turn, or an answer that
            # leaves no budget for another turn; the answer is not appended
            room = e.lease.cap - e.sample.response_len
            if plan.ends_with_call(e.call) or plan.observations[e.call] >= room:
                out.append((e.lease.lease_id, _settle(e.sample, FinishReason.LENGTH)))
                self.plans.forget(e.sample)
                continue
            sample = e.sample.observed(np.zeros(plan.observations[e.call], dtype=np.int32))
            if e.returning:
                out.append((e.lease.lease_id, _settle(sample, FinishReason.ABORT)))
            else:
                self.waiting.put(_Waiting(e.lease, sample), started=e.started)
        return out

    def tool_due(self, now: float) -> bool:
        """Whether a tool call (not killed since) has answered by `now`."""
        return any(e.due <= now for e in self.tools.values())

    def fill(self) -> list[Output]:
        """Free slots to answered episodes first, then to leases held unstarted. Returns those of the
        latter with nothing to generate."""
        before, ready, remaining = self.active, [], list[int]()
        while self.active < self.slots and (w := self.waiting.take()) is not None:
            if (out := self._start(w.lease, w.sample, remaining)) is not None:
                ready.append(out)
        self._commit(before, remaining)
        return ready

    def grant(self) -> int:
        """Free slots the broker does not hold as credit yet: granted now (the worker's LeaseRequest, or
        the credit of a SampleResult)."""
        fresh = max(0, self.slots - self.active - self.credit)
        self.credit += fresh
        return fresh

    def abort(self) -> list[Output]:
        """Every running sequence back as an INTERRUPTED partial with the tokens it has; answered episodes,
        unstarted leases and killed (repeatable) tool calls back as they are. A non-repeatable tool call
        is waited for (`waited_for`). The worker's AbortDone then grants every slot."""
        out = []
        for seq, n in zip(self.seqs, self.produced.tolist(), strict=True):
            out.append((seq.lease_id, _output(seq, n, FinishReason.ABORT)))
            # its KV stays on the engine: all of it once prefilled, else only what the cache gave back
            s = seq.sample
            kv = int(s.prompt_ids.shape[0]) + s.response_len + n if seq.prefilled else seq.cached
            self.cache.store(s.key, kv, seq.kv_version)
        self._keep(np.zeros(self.active, dtype=bool))
        self.prefill = self.reprefill = 0
        out += [(w.lease.lease_id, _settle(w.sample, FinishReason.ABORT)) for w in self.waiting.drain()]
        for lease_id, e in list(self.tools.items()):
            if self.repeatable_tools:
                out.append((lease_id, _settle(e.sample, FinishReason.ABORT)))
                del self.tools[lease_id]
            else:
                e.returning = True
        self.credit = self.slots
        return out

    def waited_for(self) -> list[int]:
        """Leases whose non-repeatable tool call an abort waits for: they come back when it answers."""
        return [lease_id for lease_id, e in self.tools.items() if e.returning]

    def load(self, version: int) -> None:
        """New weights: tokens from the next step on carry `version`."""
        if version <= self.version:
            return
        self.version = version
        self.cache.update(version)
        self.stale_seqs = self.active  # every running sequence's KV predates these weights
        for seq, n in zip(self.seqs, self.produced.tolist(), strict=True):
            if seq.marks[-1][0] == n:
                seq.marks[-1] = (n, version)
            else:
                seq.marks.append((n, version))

    def _lease(self, lease_id: int, budget: int, sample: Sample) -> _Lease:
        return _Lease(lease_id, sample.response_len + budget, sample.model_tokens, self.plans(sample))

    def _start(self, lease: _Lease, sample: Sample, remaining: list[int]) -> Output | None:
        """Start `sample`'s next turn in a free slot (its tokens to go appended to `remaining`); an Output
        when it has nothing to generate."""
        turn, left = lease.plan.turn_of(sample.model_tokens, len(sample.observations))
        last = lease.plan.ends_after(turn)
        budget = lease.cap - sample.response_len
        n = max(0, min(left, budget))
        finish = (FinishReason.STOP if last else FinishReason.NONE) if left <= budget else FinishReason.LENGTH
        seq = _Seq(lease, sample, finish, [(0, self.version)])
        if n == 0:
            return (lease.lease_id, _output(seq, 0, finish if budget else FinishReason.LENGTH))
        self.seqs.append(seq)
        remaining.append(n)
        prompt = int(sample.prompt_ids.shape[0])
        hit = self.cache.take(sample.key, prompt + sample.response_len)
        seq.cached = hit.tokens
        seq.kv_version = min(hit.kv_version, self.version) if hit.tokens else self.version
        self.prefill += prompt + sample.response_len - hit.tokens
        # re-prefill: what an engine held before (up to its last model token) and this one lacks; an
        # observation appended since is new input
        seen = prompt + sample.segments[-1].end if sample.segments else 0
        self.reprefill += max(0, seen - hit.tokens)
        self.stale_seqs += seq.kv_version < self.version
        self.admitted = True
        return None

    def _commit(self, before: int, remaining: list[int]) -> None:
        """The sequences `_start` appended join the step arrays."""
        if remaining:
            self.produced = np.concatenate([self.produced, np.zeros(len(remaining), dtype=np.int64)])
            self.remaining = np.concatenate([self.remaining, np.asarray(remaining, dtype=np.int64)])
        self.meter.engine_changed(before, self.active, self.slots)

    def _end_turn(self, seq: _Seq, produced: int) -> None:
        """A turn with turns to come ended: its context's KV stays in the prefix cache, its tool runs."""
        sample = _output(seq, produced, FinishReason.NONE)
        self.cache.store(sample.key, int(sample.prompt_ids.shape[0]) + sample.response_len, seq.kv_version)
        self._call_tool(seq.lease, sample, len(sample.observations), started=True)

    def _call_tool(self, lease: _Lease, sample: Sample, call: int, started: bool) -> None:
        due = self.t_base + lease.plan.tool_s[call]
        self.tools[lease.lease_id] = _Episode(lease, sample, call, due, started)
        self.started_tools.append(due)

    def _keep(self, mask: npt.NDArray[np.bool_]) -> None:
        before = self.active
        self.seqs = [seq for seq, keep in zip(self.seqs, mask.tolist(), strict=True) if keep]
        self.stale_seqs = sum(seq.kv_version < self.version for seq in self.seqs)
        self.produced = self.produced[mask]
        self.remaining = self.remaining[mask]
        self.meter.engine_changed(before, self.active, self.slots)


def _output(seq: _Seq, produced: int, reason: FinishReason) -> Sample:
    """The turn's sample extended by `produced` tokens, one segment per weights version (what the worker's
    `apply_output` builds from an engine output), then settled by `reason` (NONE: the episode goes on)."""
    s = seq.sample
    ends = [start for start, _ in seq.marks[1:]] + [produced]
    for (start, version), end in zip(seq.marks, ends, strict=True):
        if end > start:
            s = s.extend(
                np.zeros(end - start, np.int32), np.zeros(end - start, np.float32), version, FinishReason.NONE
            )
    return _settle(s, reason)


def _settle(s: Sample, reason: FinishReason) -> Sample:
    """`s` with its finish reason: INTERRUPTED (ABORT), RUNNING (NONE) or FINISHED and scored (reward 0:
    no task here)."""
    last_version = s.segments[-1].version if s.segments else 0
    s = s.extend([], [], last_version, reason)
    return s if reason in (FinishReason.ABORT, FinishReason.NONE) else s.scored(0.0)
