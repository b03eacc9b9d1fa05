"""The worker core: a rollout worker's rules, as events in and decisions out.

Owns what a worker holds of each lease (its sample, the response length the lease allows, its steps
taken, whether it has had a turn in this engine, and where it stands: resetting, in a step, waiting for a
slot, in the engine), which waiting turn a free slot goes to (`april.turn_queue`), how a turn that ended
goes on (settled when single-turn, cut off at its budget, or its step), how a step's answer goes on
(finished, cut off at `env.max_turns` or by an observation that leaves no budget, or its next turn),
what an abort gives back and what it waits for, and how many free slots are granted to the broker as
credit. The rules are docs/episodes.md's "The episode driver" and "Slots"; credit is protocol.md's.

Knows nothing of sockets, engines, tools, tokenizers or time: `actors.worker` and its episode driver
drive it from the broker, the engine and the tool runner; `broker.sim.engines` from simulated engines
and tools, so `april simulate` and a worker decide alike for the same events.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

from april.episode import EpisodeState
from april.records import FinishReason, Sample, SampleStatus
from april.turn_queue import TurnQueue

CUT_OFF_REWARD = 0.0  # an episode the worker ends (budget, max_turns) before the environment does


class Phase(enum.Enum):
    RESET = "reset"  # the environment's reset runs: the prompt comes from it
    STEP = "step"  # a turn's step runs
    READY = "ready"  # its next turn waits for a slot
    ENGINE = "engine"  # its turn is in the engine
    RETURNING = "returning"  # aborted while a step that cannot be killed runs: back once answered


class Begin(enum.Enum):
    """Where a leased sample starts on this worker."""

    RESET = "reset"  # a new episode: the environment resets first
    STEP = "step"  # an abort killed its step: the step runs again first
    TURN = "turn"  # its next turn waits for a slot (every single-turn sample)

    @staticmethod
    def of_episode(sample: Sample) -> tuple[Begin, EpisodeState | None]:
        """Where a leased episode starts, and its state (None: never reset): one with no state, or no
        prompt ids, resets (a kept state keeps it: only the prompt comes anew); one owing a step runs it;
        any other waits for a slot. A state that cannot be read raises EpisodeError."""
        state = EpisodeState.from_bytes(sample.episode) if sample.episode else None
        if state is None or sample.prompt_ids.shape[0] == 0:
            return Begin.RESET, state
        return (Begin.TURN if state.owed is None else Begin.STEP), state


@dataclass(slots=True)
class Held:
    """A lease this worker holds."""

    lease_id: int
    sample: Sample  # as it stands: RUNNING, with every turn and observation applied so far
    cap: int  # the response length the lease allows (its length when leased + the lease's budget)
    greedy: bool
    phase: Phase
    turns: int  # the steps applied to it (every worker's): counted against env.max_turns
    started: bool = False  # had a turn in this engine (answered episodes take a slot first)


@dataclass(frozen=True, slots=True)
class StartTurn:
    """Add a turn to the engine: continue `sample` for at most `budget` tokens."""

    lease_id: int
    sample: Sample
    budget: int
    greedy: bool


@dataclass(frozen=True, slots=True)
class RunStep:
    """Run the lease's environment reset (`reset`) or the step of its last turn, holding no slot."""

    lease_id: int
    reset: bool


@dataclass(frozen=True, slots=True)
class Settle:
    """The lease leaves the worker with `sample`: FINISHED (scored, or `to_score` when single-turn),
    FAILED, or INTERRUPTED."""

    lease_id: int
    sample: Sample
    to_score: bool = False


@dataclass(frozen=True, slots=True)
class StepAnswer:
    """What a reset or step answered: the state after it (`Sample.episode`), whether the episode is done
    and its reward, the observation's tokens (not done), and a note the sample carries (a time-out)."""

    episode: bytes
    done: bool = False
    reward: float | None = None
    observation: npt.NDArray[np.int32] | None = None
    note: str = ""


Decision = StartTurn | RunStep | Settle


class WorkerCore:
    """The leases of one worker with `slots` engine slots; `episodic`: every lease is an episode with
    at most `max_turns` turns of at most `max_turn_tokens` tokens (else single-turn)."""

    def __init__(self, slots: int, episodic: bool, max_turns: int = 0, max_turn_tokens: int = 0) -> None:
        self.slots = slots
        self.episodic = episodic
        self.max_turns = max_turns
        self.max_turn_tokens = max_turn_tokens
        self.held: dict[int, Held] = {}  # lease id -> every lease not settled
        self.waiting: TurnQueue[int] = TurnQueue()  # lease ids of READY leases
        self.active = 0  # leases in the engine
        self.credit = slots  # free slots the broker holds as this worker's credit

    # ------------------------------------------------------------------ events

    def leased(self, n: int) -> None:
        """A Lease of `n` samples arrived: each took one of the broker's credit."""
        self.credit = max(0, self.credit - n)

    def lease(
        self, lease_id: int, budget: int, greedy: bool, sample: Sample, begin: Begin, turns: int = 0
    ) -> list[Decision]:
        """A leased sample with `turns` steps taken: its reset or owed step runs, or its turn waits for a
        slot (`fill`)."""
        held = Held(lease_id, sample, sample.response_len + budget, greedy, Phase.READY, turns)
        self.held[lease_id] = held
        if begin is Begin.TURN:
            self.waiting.put(lease_id, started=False)
            return []
        held.phase = Phase.RESET if begin is Begin.RESET else Phase.STEP
        return [RunStep(lease_id, reset=begin is Begin.RESET)]

    def fill(self) -> list[StartTurn]:
        """Free slots to waiting turns: answered episodes first, then leases not started here."""
        out = []
        while self.active < self.slots and (lease_id := self.waiting.take()) is not None:
            held = self.held[lease_id]
            held.phase, held.started = Phase.ENGINE, True
            self.active += 1
            s = held.sample
            budget = held.cap - s.response_len
            if self.episodic:  # a turn's tokens so far count against env.max_turn_tokens
                budget = min(budget, self.max_turn_tokens - (s.response_len - s.turn_start))
            budget = max(0, budget)
            out.append(StartTurn(lease_id, s, budget, held.greedy))
        return out

    def turn_ended(self, lease_id: int, sample: Sample, reason: FinishReason) -> list[Decision]:
        """A turn left the engine with `reason` STOP or LENGTH (`sample`: with its tokens, RUNNING), freeing
        its slot: a single-turn sample settles (to be scored), an episode whose budget is spent is cut
        off, any other runs its step."""
        held = self.held[lease_id]
        self._leave_engine(held)
        held.sample = sample
        if not self.episodic:
            return [self._settle(held, _ended(sample, reason), to_score=True)]
        if reason == FinishReason.LENGTH and sample.response_len >= held.cap:
            return [self._settle(held, _ended(sample, FinishReason.LENGTH, CUT_OFF_REWARD))]
        held.phase = Phase.STEP
        return [RunStep(lease_id, reset=False)]

    def reset_answered(self, lease_id: int, sample: Sample, owes_step: bool) -> list[Decision]:
        """The reset answered (`sample`: with its prompt and state): back if an abort waited for it, its
        owed step runs, or its turn waits for a slot."""
        held = self.held[lease_id]
        held.sample = sample
        if held.phase is Phase.RETURNING:
            return [self._settle(held, _ended(sample, FinishReason.ABORT))]
        if owes_step:
            held.phase = Phase.STEP
            return [RunStep(lease_id, reset=False)]
        return self._ready(held)

    def step_answered(self, lease_id: int, answer: StepAnswer) -> list[Decision]:
        """The step of the lease's last turn answered: done finishes it with the environment's reward; a
        step after the last turn `max_turns` allows, or whose observation leaves no budget for a turn, cuts
        it off (the observation not appended); else the observation is appended and its turn waits."""
        held = self.held[lease_id]
        held.turns += 1
        s = held.sample.with_episode(answer.episode)
        if answer.note:
            s = s.noted(answer.note)
        if answer.done:
            assert answer.reward is not None, "a done step carries its reward"
            return [self._settle(held, _ended(s, FinishReason.STOP, answer.reward))]
        obs = answer.observation if answer.observation is not None else np.zeros(0, dtype=np.int32)
        if held.turns >= self.max_turns or s.response_len + obs.shape[0] >= held.cap:
            return [self._settle(held, _ended(s, FinishReason.LENGTH, CUT_OFF_REWARD))]
        held.sample = s.observed(obs)
        return self._ready(held)

    def fail(self, lease_id: int, failed: Sample) -> list[Decision]:
        """A reset or step failed the lease's sample (`failed`: FAILED)."""
        return [self._settle(self.held[lease_id], failed)]

    def abort(self, killed: Mapping[int, Sample]) -> tuple[list[Settle], list[int]]:
        """Give back every lease outside the engine: waiting ones as they are; a reset or step in
        `killed` (the holder could kill it) as the sample given there; any other reset or step is waited
        for (RETURNING: it settles when it answers). Returns (back now, leases waited for). The engine's
        leases are the holder's to return (`forget`); the AbortDone that follows sets the credit."""
        back = self.return_waiting()
        waited = []
        for held in list(self.held.values()):
            if held.phase in (Phase.RESET, Phase.STEP) and held.lease_id in killed:
                back.append(self._settle(held, _ended(killed[held.lease_id], FinishReason.ABORT)))
            elif held.phase in (Phase.RESET, Phase.STEP, Phase.RETURNING):
                held.phase = Phase.RETURNING
                waited.append(held.lease_id)
        return back, waited

    def return_waiting(self) -> list[Settle]:
        """Every turn waiting for a slot back as it is (INTERRUPTED), in the order slots would go."""
        return [
            self._settle(self.held[i], _ended(self.held[i].sample, FinishReason.ABORT))
            for i in self.waiting.drain()
        ]

    def forget(self, lease_id: int) -> Held | None:
        """The lease left the worker by the holder's doing (an engine partial or failure): dropped."""
        held = self.held.pop(lease_id, None)
        if held is None:
            return None
        if held.phase is Phase.ENGINE:
            self._leave_engine(held)
        elif held.phase is Phase.READY:
            self.waiting.remove(lease_id)
        return held

    # ------------------------------------------------------------------ credit

    def grant(self) -> int:
        """Free slots (`free`) the broker does not hold as credit yet, granted now."""
        fresh = max(0, self.free() - self.credit)
        self.credit += fresh
        return fresh

    def set_credit(self, credit: int) -> None:
        """The broker's credit for this worker is now `credit` (an AbortDone, a hello, an engine down)."""
        self.credit = credit

    def free(self) -> int:
        """Slots neither in the engine nor kept for a lease not started here (a reset or owed step keeps
        the slot its credit was for; a step after a turn here holds none)."""
        unstarted = sum(1 for h in self.held.values() if not h.started and h.phase is not Phase.RETURNING)
        return max(0, self.slots - self.active - unstarted)

    # ------------------------------------------------------------------ queries

    @property
    def ready(self) -> int:
        return len(self.waiting)

    def in_phase(self, *phases: Phase) -> list[int]:
        return [i for i, h in self.held.items() if h.phase in phases]

    # ------------------------------------------------------------------ helpers

    def _ready(self, held: Held) -> list[Decision]:
        if held.phase is Phase.RETURNING:
            return [self._settle(held, _ended(held.sample, FinishReason.ABORT))]
        held.phase = Phase.READY
        self.waiting.put(held.lease_id, started=held.started)
        return []

    def _leave_engine(self, held: Held) -> None:
        assert held.phase is Phase.ENGINE, f"lease {held.lease_id} is {held.phase.value}, not in the engine"
        self.active -= 1
        held.phase = Phase.READY  # (until the caller says where it goes)

    def _settle(self, held: Held, sample: Sample, to_score: bool = False) -> Settle:
        self.held.pop(held.lease_id, None)
        return Settle(held.lease_id, sample, to_score)


def _ended(sample: Sample, reason: FinishReason, reward: float | None = None) -> Sample:
    """`sample` with its finish reason (ABORT: INTERRUPTED), scored with `reward` when given."""
    s = sample.ended(reason)
    return s if reward is None or s.status is not SampleStatus.FINISHED else s.scored(reward)
