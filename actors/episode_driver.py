"""The worker's episode driver: multi-turn samples played against an environment, turn by turn.

Carries out the worker core's steps (`april.worker_core`: every rule of which lease goes where) against
the environment: runs each reset and step in the tool runner (`actors.tool_runner`) under its `StepKey`
(the sample's identity, the step's index), parses the turn that ended into the step's message, renders
a reset's prompt and a step's observation into token ids (`april.chat`), keeps each episode's state
(`Sample.episode`), and tells the core what answered. On an abort it applies first every result already
in (a result read is never dropped), kills the repeatable steps that run (the sample owes its step) and
lets the core wait for any other. The rules are docs/episodes.md's "The episode driver".

Knows nothing of sockets, credit or the engine's API: the worker (actors/worker.py) carries out the
core's other decisions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import numpy as np

from actors.sim_tools import SIM_ENV, SIM_ONLY, SimTools, check_sim
from actors.tokenizer import HFTokenizer, Tokenizer
from actors.tool_runner import ToolResult, ToolRunner, ToolRunnerSettings, load_env
from april.chat import ChatFormat, chat_format
from april.config import EnvConfig, WorkerConfig
from april.data import PromptRecord
from april.envs.openenv_adapter import is_openenv, with_gateway
from april.envs.verifiers_adapter import is_verifiers
from april.episode import (
    EpisodeError,
    EpisodeState,
    Message,
    ResetRequest,
    StepKey,
    StepRequest,
    holds_live_state,
)
from april.failures import Reason, failure
from april.records import Sample, SampleStatus
from april.sim.byte_chat import ByteChat
from april.sim.byte_tokenizer import ByteTokenizer
from april.worker_core import Begin, Decision, Phase, RunStep, StepAnswer, WorkerCore


class EpisodeDriver:
    def __init__(self, env: EnvConfig, chat: ChatFormat, runner: ToolRunner | SimTools, slots: int) -> None:
        self.env = env
        self.chat = chat
        self.runner = runner
        self.core = WorkerCore(slots, True, env.max_turns, env.max_turn_tokens)
        self.states: dict[int, EpisodeState] = {}  # lease id -> its state (once its reset answered)
        self.turn: dict[int, Message] = {}  # lease id -> the turn whose step runs

    # ------------------------------------------------------------------ what the worker asks

    @property
    def busy(self) -> bool:
        """A reset or step is running (the worker's loop should look again soon)."""
        return self.runner.pending > 0

    def next_answer_s(self) -> float | None:
        """Seconds until a step is known to answer (simulated tools know; None: poll)."""
        return self.runner.next_answer_s()

    def lease(self, lease_id: int, budget: int, greedy: bool, sample: Sample) -> list[Decision]:
        """Take a leased episode: reset it (a new one), run the step it owes, or queue its next turn. A
        state this worker cannot read raises EpisodeError (nothing is kept)."""
        begin, state = Begin.of_episode(sample)
        if state is not None:
            self.states[lease_id] = state
        turns = state.turns if state is not None else 0
        return self.run_steps(self.core.lease(lease_id, budget, greedy, sample, begin, turns))

    def run_steps(self, decisions: list[Decision]) -> list[Decision]:
        """Run the decisions' resets and steps; the others are the worker's."""
        rest: list[Decision] = []
        for d in decisions:
            if isinstance(d, RunStep):
                self._run(d)
            else:
                rest.append(d)
        return rest

    def poll(self) -> list[Decision]:
        """Tell the core the resets and steps that answered; its decisions (its steps run)."""
        out: list[Decision] = []
        for result in self.runner.poll():
            if result.key in self.core.held:
                out += self.run_steps(self._answered(result.key, result))
        return out

    def abort(self) -> tuple[list[Decision], list[int]]:
        """Give back every episode outside the engine (`WorkerCore.abort`): first the resets and steps that
        answered are applied (their results are kept, never run again), then a reset or repeatable step
        still running is killed (a killed step is owed). Returns (decisions, leases waited for); a
        waited-for one settles from `poll` once it answers. The credit is the AbortDone's."""
        out = self.poll()
        killed: dict[int, Sample] = {}
        for lease_id in self.core.in_phase(Phase.RESET, Phase.STEP):
            if self.runner.cancel(lease_id):
                s = self.core.held[lease_id].sample
                turn = self.turn.get(lease_id)
                if turn is not None:  # the killed step is owed: the resume runs it first
                    owed = dataclasses.replace(self.states[lease_id], owed=turn)
                    s = s.with_episode(owed.to_bytes())
                killed[lease_id] = s
        back, waited = self.core.abort(killed)
        return out + list(back), waited

    def forget(self, returned: Sequence[tuple[int, Sample]]) -> None:
        """Leases the worker returned (the core has forgotten them): their states go; a live state whose
        episode ended is freed, an interrupted one's stays, for its resume on this worker."""
        for lease_id, sample in returned:
            self.states.pop(lease_id, None)
            self.turn.pop(lease_id, None)
            if sample.status is not SampleStatus.INTERRUPTED and holds_live_state(sample.episode):
                self.runner.release(EpisodeState.from_bytes(sample.episode).env_state)

    def close(self) -> None:
        self.runner.close()

    # ------------------------------------------------------------------ resets and steps

    def _run(self, d: RunStep) -> None:
        """Submit the lease's reset, or the step of its owed turn or of the turn that ended, under its key."""
        held = self.core.held[d.lease_id]
        s = held.sample
        if d.reset:
            self.runner.submit(d.lease_id, ResetRequest(_record(s)))
            return
        state = self.states[d.lease_id]
        turn = state.owed
        if turn is None:
            turn = self.chat.parse_turn(self.chat.turn_text(s.response_ids[s.turn_start :].tolist()))
        self.states[d.lease_id] = dataclasses.replace(state, owed=None)
        self.turn[d.lease_id] = turn
        key = StepKey(s.group_id, s.index, state.turns)
        self.runner.submit(d.lease_id, StepRequest(state.env_state, turn, key))

    def _answered(self, lease_id: int, result: ToolResult) -> list[Decision]:
        held = self.core.held[lease_id]
        if result.step is None:
            return self.core.fail(lease_id, held.sample.failed(result.error[:500]))
        note = result.error if result.timed_out else ""  # the model is told; the sample carries it
        step = result.step
        try:
            if self.turn.pop(lease_id, None) is None:  # a reset (RETURNING when an abort came after it)
                s = held.sample.noted(note) if note else held.sample
                if s.prompt_ids.shape[0] == 0:
                    ids = np.asarray(
                        self.chat.prompt_ids(step.observation, self.runner.tools), dtype=np.int32
                    )
                    s = dataclasses.replace(s, prompt_ids=ids)
                state = self.states.setdefault(lease_id, EpisodeState(step.state))
                return self.core.reset_answered(
                    lease_id, s.with_episode(state.to_bytes()), state.owed is not None
                )
            state = EpisodeState(step.state, self.states[lease_id].turns + 1)
            self.states[lease_id] = state
            if step.done:
                return self.core.step_answered(
                    lease_id, StepAnswer(state.to_bytes(), True, step.reward, note=note)
                )
            s = held.sample
            after_stop = s.response_len > 0 and int(s.response_ids[-1]) in self.chat.stop_ids
            obs = np.asarray(
                self.chat.observation_ids(step.observation, after_stop=after_stop), dtype=np.int32
            )
            return self.core.step_answered(lease_id, StepAnswer(state.to_bytes(), observation=obs, note=note))
        except EpisodeError as exc:  # a state the driver cannot read: the sample is broken
            return self.core.fail(
                lease_id, held.sample.failed(failure(Reason.EPISODE_STATE, f"episode: {exc}"))
            )


def open_episode_driver(
    env: EnvConfig,
    tokenizer: Tokenizer,
    slots: int,
    settings: ToolRunnerSettings | None = None,
    sim: SimTools | None = None,
) -> EpisodeDriver | None:
    """The driver `env` asks for (None: single-turn) for a worker of `slots` engine slots, its environment
    loaded and its tool processes started (`settings`, or `env.tool_processes` and `env.step_timeout_s`);
    for `env.name = "sim"`, `sim`'s simulated tools in the byte chat. A bad `env.name`, or no tokenizer to
    render the conversation with, is a one-line EpisodeError."""
    if not env.name:
        return None
    if env.name == SIM_ENV:
        if sim is None or not isinstance(tokenizer, ByteTokenizer):
            raise EpisodeError(SIM_ONLY)
        return EpisodeDriver(env, ByteChat(tokenizer), sim, slots)
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
    return EpisodeDriver(env, chat_format(tokenizer.tok, tokenizer.eos_token_ids), runner, slots)


def check_env(env: EnvConfig, worker: WorkerConfig) -> None:
    """What `open_episode_driver` would refuse, checked where no worker runs yet (`april up`'s preflight):
    a `env.name` that does not load, or no `worker.model` (the tokenizer comes from it); the simulated
    episodes on anything but the sim engine without a model. One line."""
    if not env.name:
        return
    if env.name == SIM_ENV:
        check_sim(worker)
        return
    if not worker.model:
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
