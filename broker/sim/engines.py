"""Simulated rollout engines for `april simulate`: slots and decode steps in virtual time, vectorised, and
the worker around each, which holds the real worker's core.

Owns the engine side of the simulation: which turns each engine is decoding, how many tokens each has
produced, when its next step boundary falls, the tool calls its worker has running and when each
answers, and the broker messages it has not read yet. Every decision a worker makes (which lease goes
where, which waiting turn a free slot goes to, what a turn that ended or a step that answered leads to,
the cut-offs, what an abort gives back or waits for, the credit granted) is `april.worker_core`'s, the
real worker's (actors/worker.py): this module feeds it the events a real worker would see, in its order
(at a step boundary: the turns that ended, then the tool calls that answered, then free slots filled,
then credit granted; then the messages read), and carries out its decisions.

Cost model: `april.sim.engine_cost.EngineCost`, the one the sim engine a worker runs also uses (a decode
step over `active` sequences, plus the prefill of every input token admitted in that step). A turn's
input is prompt + response so far, less what this engine's prefix cache still holds of it
(`april.sim.prefix_cache`): a resumed partial pays its re-prefill (the resume hand-off cost), an
episode's next turn its observation at least. `busy_s` and `reprefill_tokens` give the re-prefill share
of engine time; `stale_kv_tokens` counts tokens generated while attending to KV computed under older
weights than the loaded ones (what resume_kv "reuse" costs in exactness).

Episodes (`april.sim.episode_plans`' plans: a single-turn sample is a plan of one turn): a reset answers at
once; a turn decodes its planned tokens (within its budget); its step runs as a tool call holding no
slot, the context kept in the prefix cache, and answers after the call's latency with the planned
observation (the episode's last step at the next boundary, done). A call an abort kills leaves the
sample owing it, as the episode driver marks it (`EpisodeState.owed`).

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
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from april.episode import EpisodeState, Message, Role
from april.protocol import Abort, WeightsReady
from april.records import FinishReason, Sample, SampleStatus
from april.sim.byte_tokenizer import ByteTokenizer
from april.sim.engine_cost import EngineCost
from april.sim.episode_plans import EpisodePlans, Plans, SingleTurn
from april.sim.prefix_cache import PrefixCache
from april.worker_core import Begin, Decision, Phase, RunStep, Settle, StartTurn, StepAnswer, WorkerCore
from broker.decisions import LeaseOut, Work
from broker.sim.figures import Meter

LengthOf = Callable[[Sample], int]  # the drawn total response length of a sample
Output = tuple[int, Sample]  # (lease id, the sample as returned to the broker)
BYTES = ByteTokenizer()  # the sim engine's tokenizer (actors.factory): a text prompt's ids, one a byte
_EPS = 1e-9  # float slack when placing a time on the step grid
RESET_STATE = EpisodeState(
    "{}"
).to_bytes()  # a simulated episode's state once reset (the plan holds the rest)
OWED_TURN = Message(Role.ASSISTANT, "")  # what a simulated episode whose step an abort killed owes


ToEngine = LeaseOut | Abort | WeightsReady  # what the broker core sends an engine (broker.decisions)


@dataclass(slots=True)
class _Seq:
    lease_id: int
    sample: Sample  # as this turn started (RUNNING): as leased, or with the lease's earlier turns
    finish: FinishReason  # once its tokens are out: STOP or LENGTH
    marks: list[tuple[int, int]]  # (tokens produced in this turn, version from then on)
    cached: int = 0  # input tokens the prefix cache gave back
    kv_version: int = 0  # weights version of the oldest KV it attends to
    prefilled: bool = False  # its first step ran: the KV of its whole input exists


@dataclass(frozen=True, slots=True)
class _Call:
    """A tool call running until `due`, holding no slot: the step after turn `call` of its episode."""

    call: int
    due: float  # when the tool answers (s)


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
        # the worker's rules: which lease goes where, what an abort gives back, the credit it grants
        p = self.plans
        self.core = (
            WorkerCore(slots, True, p.max_turns, p.max_turn_tokens)
            if isinstance(p, EpisodePlans)
            else WorkerCore(slots, False)
        )
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
        self.tools: dict[int, _Call] = {}  # lease id -> its tool call (killed ones dropped)
        self.leased_model: dict[int, int] = {}  # lease id -> the model tokens its sample had when leased
        self._ended_kv: dict[int, int] = {}  # lease id -> KV version of a turn that just ended here
        self.started_tools: list[float] = []  # when tool calls started since the driver last took them end

    @property
    def active(self) -> int:
        return len(self.seqs)

    @property
    def in_engine_tokens(self) -> int:
        """Model tokens generated in current leases and not yet returned to the broker."""
        held = sum(h.sample.model_tokens - self.leased_model[i] for i, h in self.core.held.items())
        return int(self.produced.sum()) + held

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

    # ------------------------------------------------------------------ the worker's events

    def take_finished(self) -> list[Output]:
        """Sequences whose turn ended: out of their slots, told to the worker core (a single-turn sample
        is returned; an episode's step starts, at t_base)."""
        done = np.flatnonzero(self.remaining <= 0)
        if done.shape[0] == 0:
            return []
        ended = [(self.seqs[i], int(self.produced[i])) for i in done.tolist()]
        self._keep(self.remaining > 0)
        self._ended_kv = {seq.lease_id: seq.kv_version for seq, _ in ended}  # for their steps' prefix cache
        out: list[Output] = []
        for seq, produced in ended:
            turn = _output(seq, produced, FinishReason.NONE)
            out += self._carry_out(self.core.turn_ended(seq.lease_id, turn, seq.finish))
        return out

    def admit(self, work: Work) -> list[Output]:
        """Leased samples, to the worker core: an owed tool call runs at once, the rest take free slots
        (prefilled in the next step) or wait for one. Returns those with nothing to generate."""
        self.core.leased(len(work))
        out: list[Output] = []
        for lease_id, budget, sample in work:
            if sample.prompt_ids.shape[0] == 0:  # a text prompt: tokenized as the sim engine's worker does
                ids = BYTES.encode_prompt(sample.prompt_text, sample.metadata)
                sample = dataclasses.replace(sample, prompt_ids=ids)
            self.leased_model[lease_id] = sample.model_tokens
            if self.core.episodic:  # (the episode driver's rule: reset, owed step, or next turn)
                begin, state = Begin.of_episode(sample)
                turns = state.turns if state is not None else 0
            else:
                begin, turns = Begin.TURN, 0
            out += self._carry_out(self.core.lease(lease_id, budget, False, sample, begin, turns))
        return out + self.fill()

    def complete_tools(self, now: float) -> list[Output]:
        """Tool calls answered by `now`, to the worker core (its observation, of the planned tokens).
        Returns what goes back to the broker: episodes cut off, and those an abort waited for."""
        answered = sorted(((c.due, i) for i, c in self.tools.items() if c.due <= now))
        out: list[Output] = []
        for _, lease_id in answered:
            call = self.tools.pop(lease_id)
            plan = self.plans(self.core.held[lease_id].sample)
            state = EpisodeState("{}", call.call + 1).to_bytes()  # (the plan holds the rest)
            if plan.ends_after(call.call):  # the episode's end (reward 0.0: no task here)
                answer = StepAnswer(state, done=True, reward=0.0)
            else:
                answer = StepAnswer(state, observation=np.zeros(plan.observations[call.call], dtype=np.int32))
            out += self._carry_out(self.core.step_answered(lease_id, answer))
        return out

    def tool_due(self, now: float) -> bool:
        """Whether a tool call (not killed since) has answered by `now`."""
        return any(c.due <= now for c in self.tools.values())

    def fill(self) -> list[Output]:
        """Free slots to waiting turns, in the worker core's order. Returns those with nothing to
        generate."""
        return self._carry_out(self.core.fill())

    def grant(self) -> int:
        """Free slots the broker does not hold as credit yet, granted now (the worker's LeaseRequest, or
        the credit of a SampleResult): the worker core's count."""
        return self.core.grant()

    def abort(self) -> list[Output]:
        """Every running sequence back as an INTERRUPTED partial with the tokens it has; the rest as the
        worker core gives them back: repeatable tool calls are killed (the sample owes the call), a
        non-repeatable one is waited for (`waited_for`). The worker's AbortDone then grants every slot."""
        out = []
        for seq, n in zip(self.seqs, self.produced.tolist(), strict=True):
            out.append((seq.lease_id, _output(seq, n, FinishReason.ABORT)))
            self._left(seq.lease_id)
            # its KV stays on the engine: all of it once prefilled, else only what the cache gave back
            s = seq.sample
            kv = int(s.prompt_ids.shape[0]) + s.response_len + n if seq.prefilled else seq.cached
            self.cache.store(s.key, kv, seq.kv_version)
        self._keep(np.zeros(self.active, dtype=bool))
        self.prefill = self.reprefill = 0
        stepping = self.core.in_phase(Phase.STEP)
        killed = {i: _owing(self.core.held[i].sample) for i in stepping} if self.repeatable_tools else {}
        for lease_id in killed:
            del self.tools[lease_id]
        back, _ = self.core.abort(killed)
        out += self._carry_out(back)
        self.core.set_credit(self.slots)
        return out

    def waited_for(self) -> list[int]:
        """Leases whose non-repeatable tool call an abort waits for: they come back when it answers."""
        return self.core.in_phase(Phase.RETURNING)

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

    # ------------------------------------------------------------------ the worker core's decisions

    def _carry_out(self, decisions: Sequence[Decision]) -> list[Output]:
        """Turns into slots, tool calls started, settled samples out (a single-turn one scored 0.0: no
        task here). Returns what goes back to the broker."""
        out: list[Output] = []
        before, remaining = self.active, list[int]()
        for d in decisions:
            match d:
                case StartTurn():
                    out += self._start(d, remaining)
                case RunStep():
                    out += self._call_tool(d)
                case Settle():
                    sample = d.sample.scored(0.0) if d.to_score else d.sample
                    out.append((d.lease_id, sample))
                    self._left(d.lease_id)
                    if sample.status is not SampleStatus.INTERRUPTED:
                        self.plans.forget(sample)
        self._commit(before, remaining)
        return out

    def _start(self, d: StartTurn, remaining: list[int]) -> list[Output]:
        """Start `d.sample`'s next turn in a free slot (its tokens to go appended to `remaining`); its end
        at once when it has nothing to generate."""
        sample = d.sample
        plan = self.plans(sample)
        _, left = plan.turn_of(sample.model_tokens, len(sample.observations))
        n = max(0, min(left, d.budget))
        finish = FinishReason.LENGTH if left > d.budget or not d.budget else FinishReason.STOP
        seq = _Seq(d.lease_id, sample, finish, [(0, self.version)])
        if n == 0:
            return self._carry_out(self.core.turn_ended(d.lease_id, sample, finish))
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
        return []

    def _call_tool(self, d: RunStep) -> list[Output]:
        """A reset answers at once (the plan has the prompt). The step after a turn runs as a tool call,
        holding no slot, answered at a step boundary (`complete_tools`): the episode's end at this one,
        a tool call after its latency, the context's KV kept in the prefix cache meanwhile."""
        lease_id = d.lease_id
        sample = self.core.held[lease_id].sample
        if d.reset:
            return self._carry_out(
                self.core.reset_answered(lease_id, sample.with_episode(RESET_STATE), False)
            )
        plan = self.plans(sample)
        call = len(sample.observations)
        kv_version = self._ended_kv.pop(lease_id, None)
        if plan.ends_after(call):
            due = self.t_base
        else:
            if kv_version is not None:  # its turn just left this engine: the context's KV is here
                kv = int(sample.prompt_ids.shape[0]) + sample.response_len
                self.cache.store(sample.key, kv, kv_version)
            due = self.t_base + plan.tool_s[call]
        self.tools[lease_id] = _Call(call, due)
        self.started_tools.append(due)
        return []

    def _commit(self, before: int, remaining: list[int]) -> None:
        """The sequences `_start` appended join the step arrays."""
        if remaining:
            self.produced = np.concatenate([self.produced, np.zeros(len(remaining), dtype=np.int64)])
            self.remaining = np.concatenate([self.remaining, np.asarray(remaining, dtype=np.int64)])
        self.meter.engine_changed(before, self.active, self.slots)

    def _keep(self, mask: npt.NDArray[np.bool_]) -> None:
        before = self.active
        self.seqs = [seq for seq, keep in zip(self.seqs, mask.tolist(), strict=True) if keep]
        self.stale_seqs = sum(seq.kv_version < self.version for seq in self.seqs)
        self.produced = self.produced[mask]
        self.remaining = self.remaining[mask]
        self.meter.engine_changed(before, self.active, self.slots)

    def _left(self, lease_id: int) -> None:
        """The lease left the worker: the core forgets it (a partial the engine returned)."""
        self.core.forget(lease_id)
        self.leased_model.pop(lease_id, None)


def _output(seq: _Seq, produced: int, reason: FinishReason) -> Sample:
    """The turn's sample extended by `produced` tokens, one segment per weights version (what the worker's
    `apply_output` builds from an engine output), then ended by `reason`: NONE (the turn ended: the
    worker core says what follows) or ABORT."""
    s = seq.sample
    ends = [start for start, _ in seq.marks[1:]] + [produced]
    for (start, version), end in zip(seq.marks, ends, strict=True):
        if end > start:
            s = s.extend(
                np.zeros(end - start, np.int32), np.zeros(end - start, np.float32), version, FinishReason.NONE
            )
    return s.ended(reason)


def _owing(s: Sample) -> Sample:
    """`s`, whose step an abort killed, owing it (as the episode driver marks it)."""
    state = EpisodeState.from_bytes(s.episode)
    return s.with_episode(dataclasses.replace(state, owed=OWED_TURN).to_bytes())
