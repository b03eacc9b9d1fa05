"""The worker's episode driver: multi-turn samples played against an environment, turn by turn.

Owns every leased episode that is not in the engine: its reset or tool step running in the tool runner
(`actors.tool_runner`), or its next turn waiting for a slot (in `april.turn_queue`'s order). It builds
each turn's engine request (prompt + response so far, budget the least of the turn's and the episode's
tokens left), reads a turn that ended (parse, step), appends the observation (`Sample.observed`) and the
new state (`Sample.episode`), and settles an episode that is done (the environment's reward), cut off
(LENGTH, reward 0) or broken (FAILED). Each step runs under its `StepKey` (the sample's identity, the
step's index). On an abort it gives back what it holds, applying first every step result already in (a
result read is never dropped), killing a repeatable step that runs (owed on resume) and waiting for any
other. The rules are docs/episodes.md's "The episode driver".

Knows nothing of sockets, credit or the engine's API: the worker (actors/worker.py) adds the requests,
feeds back the turns that ended, and sends what is settled.
"""

from __future__ import annotations

import dataclasses
import enum
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from actors.engine import GenerationRequest
from actors.tokenizer import HFTokenizer, Tokenizer
from actors.tool_runner import ToolResult, ToolRunner, ToolRunnerSettings, load_env
from april.chat import ChatFormat, chat_format
from april.config import EnvConfig
from april.data import PromptRecord
from april.envs.openenv_adapter import is_openenv, with_gateway
from april.envs.verifiers_adapter import is_verifiers
from april.episode import (
    EnvStep,
    EpisodeError,
    EpisodeState,
    Message,
    ResetRequest,
    StepKey,
    StepRequest,
    holds_live_state,
)
from april.failures import Reason, failure
from april.records import FinishReason, Sample, SampleStatus
from april.turn_queue import TurnQueue

CUT_OFF_REWARD = 0.0  # an episode the driver ends (budget, max_turns) before the environment does


class Phase(enum.Enum):
    RESET = "reset"  # the environment's reset runs: the prompt comes from it
    STEP = "step"  # a turn's step runs
    READY = "ready"  # its next turn waits for a slot
    ENGINE = "engine"  # the worker has its turn in the engine
    RETURNING = "returning"  # aborted while a step it cannot kill runs: back to the broker once answered


@dataclass(slots=True)
class Episode:
    lease_id: int
    sample: Sample
    cap: int  # the response length the lease allows (its length at lease + budget)
    greedy: bool
    phase: Phase
    state: EpisodeState | None = None  # None until the reset answered
    turn: Message | None = None  # the turn whose step runs (Phase.STEP, RETURNING)
    started: bool = False  # had a turn in this worker's engine (answered episodes go before new leases)


@dataclass(frozen=True, slots=True)
class Settled:
    """An episode that leaves the driver: finished, failed, or back unfinished (INTERRUPTED). `credit`:
    1 when its lease never reached the engine, so the slot its lease took from the broker's credit was
    never used (nor freed) and is granted back with it."""

    lease_id: int
    sample: Sample
    credit: int = 0


class EpisodeDriver:
    def __init__(self, env: EnvConfig, chat: ChatFormat, runner: ToolRunner) -> None:
        self.env = env
        self.chat = chat
        self.runner = runner
        self.episodes: dict[int, Episode] = {}  # lease id -> every episode leased and not settled
        self._waiting: TurnQueue[int] = TurnQueue()  # lease ids of READY episodes

    # ------------------------------------------------------------------ what the worker asks

    @property
    def busy(self) -> bool:
        """A reset or step is running (the worker's loop should look again soon)."""
        return self.runner.pending > 0

    @property
    def ready(self) -> int:
        return len(self._waiting)

    def lease_ids(self) -> list[int]:
        """Leases held here, outside the engine (a WorkerHello names them)."""
        return [i for i, e in self.episodes.items() if e.phase is not Phase.ENGINE]

    def lease(self, lease_id: int, budget: int, greedy: bool, sample: Sample) -> None:
        """Take a leased episode: reset it (a new one), run the step it owes, or queue its next turn."""
        ep = Episode(lease_id, sample, sample.response_len + budget, greedy, Phase.READY)
        self.episodes[lease_id] = ep
        if not sample.episode or sample.prompt_ids.shape[0] == 0:
            if sample.episode:  # its state is kept: only the prompt's tokens come from the reset
                ep.state = EpisodeState.from_bytes(sample.episode)
            ep.phase = Phase.RESET
            self.runner.submit(lease_id, ResetRequest(_record(sample)))
            return
        ep.state = EpisodeState.from_bytes(sample.episode)
        if ep.state.owed is not None:
            self._step(ep, ep.state.owed)
        else:
            self._waiting.put(lease_id, started=False)

    def next_request(self) -> tuple[GenerationRequest, Sample] | None:
        """The next turn to start (answered episodes first) and the sample the engine continues; the
        episode is the worker's until `turn_ended` or its return."""
        lease_id = self._waiting.take()
        if lease_id is None:
            return None
        ep = self.episodes[lease_id]
        ep.phase, ep.started = Phase.ENGINE, True
        s = ep.sample
        turn_left = self.env.max_turn_tokens - (s.response_len - _turn_start(s))
        budget = max(0, min(turn_left, ep.cap - s.response_len))
        return GenerationRequest(ep.lease_id, s.resume_input(), budget, ep.greedy), s

    def turn_ended(self, lease_id: int, sample: Sample, reason: FinishReason) -> Settled | None:
        """A turn left the engine with `reason` STOP or LENGTH (`sample`: with its tokens, RUNNING): the
        episode is cut off (its budget is spent), or its step starts (None)."""
        ep = self.episodes[lease_id]
        ep.sample = sample
        if reason == FinishReason.LENGTH and sample.response_len >= ep.cap:
            return self._settle(ep, _finished(sample, FinishReason.LENGTH, CUT_OFF_REWARD))
        text = self.chat.turn_text(sample.response_ids[_turn_start(sample) :].tolist())
        self._step(ep, self.chat.parse_turn(text))
        return None

    def poll(self) -> list[Settled]:
        """Apply the resets and steps that answered; return the episodes that settled."""
        settled = []
        for result in self.runner.poll():
            ep = self.episodes.get(result.key)
            if ep is None:
                continue
            try:
                done = self._answer(ep, result)
            except EpisodeError as exc:  # a state the driver cannot read: the sample is broken
                done = ep.sample.failed(failure(Reason.EPISODE_STATE, f"episode: {exc}"))
            if done is not None:
                unused = not ep.started and ep.phase is not Phase.RETURNING  # (an abort reset the credit)
                settled.append(self._settle(ep, done, credit=int(unused)))
        return settled

    def abort(self) -> tuple[list[Settled], list[int]]:
        """Give back every episode outside the engine: first the resets and steps that answered are
        applied (their results are kept, never run again), then waiting ones go back as they are, resets
        and repeatable steps still running are killed (a killed step is owed), others are waited for.
        Returns (back now, leases waited for); a waited-for one settles from `poll` once it answers. The
        credit of what goes back is 0: the AbortDone that follows sets the worker's credit."""
        back = [dataclasses.replace(s, credit=0) for s in self.poll()]
        waited = []
        for ep in list(self.episodes.values()):
            if ep.phase is Phase.ENGINE:
                continue
            if ep.phase in (Phase.RESET, Phase.STEP) and not self.runner.cancel(ep.lease_id):
                ep.phase = Phase.RETURNING
                waited.append(ep.lease_id)
                continue
            if ep.phase is Phase.RETURNING:
                waited.append(ep.lease_id)
                continue
            s = ep.sample
            if ep.phase is Phase.STEP:
                assert ep.state is not None and ep.turn is not None
                s = s.with_episode(dataclasses.replace(ep.state, owed=ep.turn).to_bytes())
            back.append(self._settle(ep, _interrupted(s)))
        return back, waited

    def forget(self, returned: Sequence[tuple[int, Sample]]) -> None:
        """Leases the worker returns (settled here, or engine partials and failures): a live state whose
        episode ended is freed; an interrupted one's stays, for its resume on this worker."""
        for lease_id, sample in returned:
            self._drop(lease_id)
            if sample.status is not SampleStatus.INTERRUPTED and holds_live_state(sample.episode):
                self.runner.release(EpisodeState.from_bytes(sample.episode).env_state)

    def close(self) -> None:
        self.runner.close()

    # ------------------------------------------------------------------ steps

    def _step(self, ep: Episode, turn: Message) -> None:
        """Run `turn`'s step under its key; the state's `turns` counts it once the step is applied."""
        assert ep.state is not None
        ep.phase, ep.turn = Phase.STEP, turn
        ep.state = dataclasses.replace(ep.state, owed=None)
        key = StepKey(ep.sample.group_id, ep.sample.index, ep.state.turns)
        self.runner.submit(ep.lease_id, StepRequest(ep.state.env_state, turn, key))

    def _answer(self, ep: Episode, result: ToolResult) -> Sample | None:
        """The sample settled by `result`, or None when the episode goes on (READY)."""
        if result.step is None:
            return ep.sample.failed(result.error[:500])
        if result.timed_out:  # the model is told; the sample carries it, so that it is counted
            ep.sample = ep.sample.noted(result.error)
        if ep.turn is None:  # a reset (its phase may be RETURNING: an abort came after it answered)
            return self._reset_answered(ep, result.step)
        return self._step_answered(ep, result.step)

    def _reset_answered(self, ep: Episode, step: EnvStep) -> Sample | None:
        s = ep.sample
        if s.prompt_ids.shape[0] == 0:
            ids = np.asarray(self.chat.prompt_ids(step.observation, self.runner.tools), dtype=np.int32)
            s = dataclasses.replace(s, prompt_ids=ids)
        if ep.state is None:
            ep.state = EpisodeState(step.state)
        ep.sample = s.with_episode(ep.state.to_bytes())
        if ep.phase is Phase.RETURNING:  # aborted: back with its prompt, a step it owes still owed
            return _interrupted(ep.sample)
        if ep.state.owed is not None:
            self._step(ep, ep.state.owed)
            return None
        return self._ready(ep)

    def _step_answered(self, ep: Episode, step: EnvStep) -> Sample | None:
        assert ep.state is not None
        turns = ep.state.turns + 1
        state = EpisodeState(step.state, turns)
        s = ep.sample.with_episode(state.to_bytes())
        ep.turn = None
        if step.done:
            assert step.reward is not None
            return _finished(s, FinishReason.STOP, step.reward)
        after_stop = s.response_len > 0 and int(s.response_ids[-1]) in self.chat.stop_ids
        obs = self.chat.observation_ids(step.observation, after_stop=after_stop)
        # no turn after the last one allowed, nor after an observation that leaves no room for one
        if turns >= self.env.max_turns or s.response_len + len(obs) >= ep.cap:
            return _finished(s, FinishReason.LENGTH, CUT_OFF_REWARD)
        ep.sample = s.observed(obs)
        ep.state = state
        return self._ready(ep)

    def _ready(self, ep: Episode) -> Sample | None:
        if ep.phase is Phase.RETURNING:
            return _interrupted(ep.sample)
        ep.phase = Phase.READY
        self._waiting.put(ep.lease_id, started=ep.started)
        return None

    def _settle(self, ep: Episode, sample: Sample, credit: int = 0) -> Settled:
        self._drop(ep.lease_id)
        return Settled(ep.lease_id, sample, credit)

    def _drop(self, lease_id: int) -> None:
        ep = self.episodes.pop(lease_id, None)
        if ep is not None and ep.phase is Phase.READY:
            self._waiting.remove(lease_id)


def open_episode_driver(
    env: EnvConfig, tokenizer: Tokenizer, settings: ToolRunnerSettings | None = None
) -> EpisodeDriver | None:
    """The driver `env` asks for (None: single-turn), its environment loaded and its tool processes
    started (`settings`, or `env.tool_processes` and `env.step_timeout_s`). A bad `env.name`, or no
    tokenizer to render the conversation with, is a one-line EpisodeError."""
    if not env.name:
        return None
    if is_openenv(env.name) and not env.gateway:
        raise EpisodeError(
            f"env.gateway is empty: env.name = {env.name!r} needs the OpenEnv session gateway's "
            "tcp://HOST:PORT (`april up` starts one; elsewhere run `april openenv-gateway`)"
        )
    if not isinstance(tokenizer, HFTokenizer):
        raise _needs_model(env)
    if settings is None:
        settings = ToolRunnerSettings(processes=env.tool_processes, step_timeout_s=env.step_timeout_s)
    try:
        runner = ToolRunner(env.name, settings, runner_args(env))
    except EpisodeError as exc:
        raise EpisodeError(f"env.name: {exc}") from None
    return EpisodeDriver(env, chat_format(tokenizer.tok, tokenizer.eos_token_ids), runner)


def check_env(env: EnvConfig, model: str) -> None:
    """What `open_episode_driver` would refuse, checked where no worker runs yet (`april up`'s preflight):
    a `env.name` that does not load, or no `worker.model` (the tokenizer comes from it). One line."""
    if not env.name:
        return
    if not model:
        raise _needs_model(env)
    try:
        load_env(env.name, runner_args(env))
    except EpisodeError as exc:
        raise EpisodeError(f"env.name: {exc}") from None


def runner_args(env: EnvConfig) -> str:
    """The args the environment is made with: `env.args`, and for `openenv:URL` the gateway's address."""
    return with_gateway(env.args, env.gateway) if is_openenv(env.name) else env.args


def resume_note(env: EnvConfig) -> str:
    """What happens to an episode of `env` that APRIL aborts or whose worker dies, in one line for the
    dashboard ("" for single-turn runs)."""
    if not env.name:
        return ""
    where = (
        "its state travels as JSON in the sample: an aborted episode resumes on any worker, and so does one "
        "whose worker died"
    )
    if is_openenv(env.name):
        return (
            f"env {env.name}: its state is a session the OpenEnv gateway holds: an aborted episode resumes "
            "on any worker, and so does one whose worker died; a server or gateway restart fails it"
        )
    if is_verifiers(env.name):
        return (
            f"env {env.name}: a state written down in full travels as JSON: an aborted episode resumes on "
            "any worker; a state holding live objects stays with its worker: an aborted episode resumes "
            "there, and restarts from its prompt if that worker dies"
        )
    return f"env {env.name}: {where}"


def _needs_model(env: EnvConfig) -> EpisodeError:
    return EpisodeError(f"env.name = {env.name!r} needs worker.model: its tokenizer renders the conversation")


def _record(sample: Sample) -> PromptRecord:
    """The prompt record a reset reads: the sample's text and metadata (environments read text)."""
    index = sample.metadata.get("prompt_index", "")
    return PromptRecord(
        int(index) if index.isdigit() else sample.group_id,
        sample.prompt_ids,
        sample.prompt_text,
        dict(sample.metadata),
    )


def _turn_start(sample: Sample) -> int:
    """Where the current model turn starts in the response: after the last observation."""
    return sample.observations[-1].end if sample.observations else 0


def _finished(sample: Sample, reason: FinishReason, reward: float) -> Sample:
    version = sample.segments[-1].version if sample.segments else 0
    return sample.extend([], [], version, reason).scored(reward)


def _interrupted(sample: Sample) -> Sample:
    version = sample.segments[-1].version if sample.segments else 0
    return sample.extend([], [], version, FinishReason.ABORT)
