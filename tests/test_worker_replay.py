"""One simulated run's events replayed into a stepped real worker: the same decisions.

`april simulate` runs one engine (broker/sim/engines.py); every event its worker core saw is recorded
(leases, turns that ended with their tokens, tool calls answered, aborts with the tokens each running
turn had). The real worker (actors/worker.py, with its episode driver, a real tool runner playing the
same episode plans in child processes, and an engine that ends each turn where the simulator did) is
then stepped through those events in order, and must make the same decisions: the same turns started
with the same budgets, the same steps and resets run, the same samples settled (status, finish reason,
tokens, observations), and the same credit granted, single-turn and episodes, with aborts, owed steps,
waited-for steps and the `env.max_turns` and budget cut-offs.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np
import pytest
from test_outbox import SentLink
from test_sim_episodes import config, workload

from actors.engine import GenerationOutput, GenerationRequest
from actors.episode_driver import EpisodeDriver
from actors.lengths import LengthSpec
from actors.reward_runner import RewardResult
from actors.tool_runner import ToolResult, ToolRunner, ToolRunnerSettings
from actors.worker import Worker
from april import protocol
from april.config import EnvConfig, Mode, WorkerConfig
from april.episode import ResetRequest
from april.records import FinishReason
from april.sim.byte_chat import ByteChat
from april.sim.byte_tokenizer import ByteTokenizer
from april.wire_records import SampleBatch
from april.worker_core import Decision, RunStep, Settle, StartTurn, WorkerCore
from broker.sim.engines import EngineModel
from broker.sim.model import Simulation

SLOTS = 3
TOKEN = 100  # every generated token (a byte of the byte tokenizer, never its stop id)

Event = tuple[str, Any]


def decision(d: Decision) -> tuple[Any, ...]:
    match d:
        case StartTurn():
            return ("start", d.lease_id, d.budget)
        case RunStep():
            return ("step", d.lease_id, d.reset)
        case Settle(sample=s):
            obs = [(o.start, o.end) for o in s.observations]
            return (
                "settle",
                d.lease_id,
                s.status.name,
                s.finish_reason.name,
                s.response_len,
                obs,
                d.to_score,
            )


def record_decisions(core: WorkerCore, into: list[tuple[Any, ...]]) -> None:
    """Every decision `core` makes is appended to `into` (its event methods wrapped on the instance)."""
    for name in ("lease", "fill", "turn_ended", "reset_answered", "step_answered", "fail"):
        method = getattr(core, name)

        def wrapped(*args: Any, _m: Any = method, **kwargs: Any) -> Any:
            out = _m(*args, **kwargs)
            into.extend(decision(d) for d in out)
            return out

        setattr(core, name, wrapped)
    abort = core.abort

    def aborted(killed: Any) -> Any:
        back, waited = abort(killed)
        into.extend(decision(d) for d in back)
        into.append(("waited", tuple(waited)))
        return back, waited

    core.abort = aborted  # type: ignore[method-assign]


# ---------------------------------------------------------------------------------------------------
# the simulated run, recorded


class RecordingEngine(EngineModel):
    """The simulator's engine, recording its worker's events (`events`), the credit the broker held as
    each began (`credit`), its core's decisions (`decisions`) and where each event's begin (`starts`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.events: list[Event] = []
        self.credit: list[int] = []
        self.decisions: list[tuple[Any, ...]] = []
        self.starts: list[int] = []
        self.at_once: list[list[tuple[int, int, FinishReason]]] = []  # per event: turns that ended at once
        record_decisions(self.core, self.decisions)

    def _event(self, kind: str, what: Any) -> None:
        self.starts.append(len(self.decisions))
        self.credit.append(self.core.credit)
        self.events.append((kind, what))
        self.at_once.append([])

    def _start(self, d: StartTurn, remaining: list[int]) -> Any:
        """(A turn with nothing to generate ends at once: the real engine returns it at its next step.)"""
        _, left = self.plans(d.sample).turn_of(d.sample.model_tokens, len(d.sample.observations))
        if min(left, d.budget) <= 0:
            reason = FinishReason.LENGTH if left > d.budget or not d.budget else FinishReason.STOP
            self.at_once[-1].append((d.lease_id, 0, reason))
        return super()._start(d, remaining)

    def admit(self, work: Any) -> Any:
        self._event("lease", [(lease_id, budget, sample) for lease_id, budget, sample in work])
        return super().admit(work)

    def take_finished(self) -> Any:  # a step boundary: the turns that ended, then the tools that answered
        done = np.flatnonzero(self.remaining <= 0).tolist()
        ended = [(self.seqs[i].lease_id, int(self.produced[i]), self.seqs[i].finish) for i in done]
        self._event("wake", (ended, []))
        return super().take_finished()

    def complete_tools(self, now: float) -> Any:
        answered = self.events[-1][1][1]
        answered += [i for _, i in sorted((c.due, i) for i, c in self.tools.items() if c.due <= now)]
        return super().complete_tools(now)

    def abort(self) -> Any:
        produced = {seq.lease_id: n for seq, n in zip(self.seqs, self.produced.tolist(), strict=True)}
        self._event("abort", produced)
        return super().abort()

    def load(self, version: int) -> None:
        if version > self.version:
            self._event("load", version)
        super().load(version)

    def replayed(self, n: int) -> list[tuple[Any, ...]]:
        """The decisions event `n` made."""
        end = self.starts[n + 1] if n + 1 < len(self.starts) else len(self.decisions)
        return self.decisions[self.starts[n] : end]


def simulated(monkeypatch: pytest.MonkeyPatch, fields: dict[str, str], episodes: Any) -> RecordingEngine:
    cfg = config(Mode.APRIL, b=2, n=2, over=4, slots=SLOTS, steps=6, max_new=60, fields=fields)
    engines: list[RecordingEngine] = []

    def make(*args: Any, **kwargs: Any) -> RecordingEngine:
        engines.append(RecordingEngine(*args, **kwargs))
        return engines[-1]

    monkeypatch.setattr("broker.sim.model.EngineModel", make)
    result = Simulation(cfg, LengthSpec.parse("uniform:min=4,max=80"), episodes).run()
    assert result.ledger.balanced
    (engine,) = engines
    return engine


# ---------------------------------------------------------------------------------------------------
# the real worker, stepped


class ReplayEngine:
    """An engine that ends each turn where the simulator did: `ends` for the next step, `produced` (the
    tokens each running turn has) for the next abort."""

    name = "replay"
    can_reuse_kv = False
    placement = "replay"

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self.version = 0
        self.requests: dict[int, GenerationRequest] = {}
        self.ends: list[tuple[int, int, FinishReason]] = []
        self.produced: dict[int, int] = {}

    @property
    def active(self) -> int:
        return len(self.requests)

    def add(self, requests: Sequence[GenerationRequest]) -> None:
        for r in requests:
            assert self.active < self.slots, "the worker overfilled its engine"
            self.requests[r.request_id] = r

    def step(self) -> list[GenerationOutput]:
        out = []
        for lease_id, n, reason in self.ends:
            request = self.requests.pop(lease_id)
            assert n <= request.max_new_tokens, f"lease {lease_id}: {n} tokens on a budget of {request}"
            out.append(GenerationOutput.of(lease_id, [TOKEN] * n, [0.0] * n, [self.version] * n, reason))
        self.ends = []
        return out

    def abort(self) -> list[GenerationOutput]:
        assert set(self.produced) == set(self.requests), (self.produced, list(self.requests))
        out = [
            GenerationOutput.of(i, [TOKEN] * n, [0.0] * n, [self.version] * n, FinishReason.ABORT)
            for i, n in self.produced.items()
        ]
        self.requests.clear()
        return out

    def load_weights(self, path: Any, version: int) -> None:
        self.version = version

    def probe(self) -> None:
        pass

    def close(self) -> None:
        pass


class ReplayRunner:
    """The real tool runner, whose answers the worker sees when the simulator saw them: a reset's at
    once, a step's once `release`d (an abort kills a repeatable step not released yet, as the simulator
    killed a tool still running)."""

    def __init__(self, runner: ToolRunner, repeatable: bool) -> None:
        self.runner = runner
        self.repeatable = repeatable
        self.held: dict[int, ToolResult] = {}  # answered, not yet seen
        self.released: list[int] = []  # to be seen, in this order

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runner, name)

    def submit(self, key: int, request: Any) -> None:
        if isinstance(request, ResetRequest):
            self.released.append(key)
        self.runner.submit(key, request)

    def settle(self) -> None:
        """Wait until every submitted reset and step has answered (the environment answers at once)."""
        deadline = time.monotonic() + 30
        while self.runner.pending:
            assert time.monotonic() < deadline, "the tool runner did not answer"
            self.held.update((r.key, r) for r in self.runner.poll(0.01))

    def poll(self, wait_s: float = 0.0) -> list[ToolResult]:
        self.settle()
        seen = [k for k in self.released if k in self.held]
        self.released = [k for k in self.released if k not in seen]
        return [self.held.pop(k) for k in seen]

    def cancel(self, key: int) -> bool:
        self.settle()
        if key in self.released:  # its answer is seen: a result read is never dropped
            return False
        if key in self.held and not self.repeatable:  # running, as the simulator has it: waited for
            return False
        self.held.pop(key, None)  # killed
        return True

    @property
    def pending(self) -> int:
        return len(self.held) + self.runner.pending


class NoRewards:
    """Single-turn samples are scored elsewhere; the decisions are what is compared."""

    def submit(self, key: int, response_text: str, answer: str, metadata: dict[str, str]) -> None:
        pass

    def poll(self, wait_s: float = 0.0) -> list[RewardResult]:
        return []

    def close(self) -> None:
        pass


def replayed(
    sim: RecordingEngine, env: EnvConfig | None, repeatable: bool
) -> Iterator[tuple[int, list[Any]]]:
    """Step a real worker through the simulator's events; yields (the credit as each began, the
    decisions it made)."""
    driver = runner = None
    if env is not None:
        tools = ToolRunner(env.name, ToolRunnerSettings(processes=1, step_timeout_s=30.0))
        runner = ReplayRunner(tools, repeatable)
        driver = EpisodeDriver(env, ByteChat(ByteTokenizer()), runner, SLOTS)  # type: ignore[arg-type]
    cfg = WorkerConfig(worker_id="w0", slots=SLOTS)
    rewards: Any = NoRewards()  # (its duck type)
    no_factory: Any = None  # the engine is given below
    worker = Worker(cfg, ByteTokenizer(), rewards, no_factory, 0, episodes=driver)
    worker.link.close(linger_ms=0)
    worker.link = SentLink()  # type: ignore[assignment]
    engine = ReplayEngine(SLOTS)
    worker.engine = engine
    worker.health.come_up()
    decisions: list[tuple[Any, ...]] = []
    record_decisions(worker.core, decisions)
    try:
        for (kind, what), at_once in zip(sim.events, sim.at_once, strict=True):
            credit, mark = worker.core.credit, len(decisions)
            if kind == "lease":
                leased = protocol.Lease(
                    lease_ids=np.array([i for i, _, _ in what], dtype=np.int64),
                    budgets=np.array([b for _, b, _ in what], dtype=np.int32),
                    greedy=np.zeros(len(what), dtype=np.uint8),
                    samples=SampleBatch.from_samples([s for _, _, s in what]),
                )
                worker._handle(leased)
                if runner is not None:  # the simulator's resets answer at once
                    runner.settle()
                    worker._drive()
            elif kind == "wake":
                ended, answered = what
                if ended:
                    engine.ends = ended
                    worker._step()
                if runner is not None:
                    runner.released += answered
                worker._drive()
            elif kind == "load":  # (tokens from now on carry it; no decision depends on it)
                engine.version = what
            else:
                engine.produced = what
                worker._handle(protocol.Abort(1))
            if at_once:  # turns with nothing to generate: the engine's next step returns them
                engine.ends = at_once
                worker._step()
                worker._drive()
            yield credit, decisions[mark:]
    finally:
        worker.rewards.close()
        if driver is not None:
            driver.close()


def assert_replays(sim: RecordingEngine, env: EnvConfig | None, repeatable: bool = True) -> None:
    for n, (credit, got) in enumerate(replayed(sim, env, repeatable)):
        kind, _ = sim.events[n]
        want = sim.replayed(n)
        assert credit == sim.credit[n], f"event {n} ({kind}): credit {credit}, simulated {sim.credit[n]}"
        assert sorted(got, key=repr) == sorted(want, key=repr), f"event {n} ({kind})"
        assert got == want, f"event {n} ({kind}): same decisions, another order"


def kinds(sim: RecordingEngine, max_turns: int = 0) -> set[str]:
    """What the run exercised: the events that occurred, its settled samples' outcomes, steps, owed
    steps run at lease, steps an abort waited for, and episodes cut off at `max_turns`."""
    seen = {e for e, _ in sim.events}
    for n, (kind, what) in enumerate(sim.events):
        leased = {i for i, _, _ in what} if kind == "lease" else set()
        for d in sim.replayed(n):
            if d[0] == "settle":
                seen.add(f"{d[2]}/{d[3]}")
                if d[3] == "LENGTH" and max_turns and len(d[5]) == max_turns - 1:
                    seen.add("max_turns")
            elif d[0] == "waited" and d[1]:
                seen.add("waited for")
            elif d[0] == "step" and not d[2]:
                seen.add("owed step" if d[1] in leased else "step")
    return seen


def test_a_single_turn_run_replays_into_the_real_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    sim = simulated(monkeypatch, {}, None)
    assert {"lease", "wake", "abort", "FINISHED/STOP", "FINISHED/LENGTH"} <= kinds(sim)
    assert_replays(sim, None)


@pytest.mark.parametrize("repeatable", [True, False])
def test_an_episode_run_replays_into_the_real_worker(
    repeatable: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Episodes of 1-5 turns, at most 3 (`env.max_turns`) of at most 12 tokens, 60 tokens in all: cut
    off by max_turns and by budget; tool calls of 5-40 ms, killed (repeatable) or waited for by aborts."""
    turns, turn_tokens, tool_ms, obs = (
        "uniform:min=1,max=5",
        "uniform:min=2,max=16",
        "uniform:min=5,max=40",
        "uniform:min=1,max=8",
    )
    fields = {
        "env.max_turns": "3",
        "env.max_turn_tokens": "12",
        "worker.sim_tool_repeatable": str(repeatable).lower(),
    }
    sim = simulated(monkeypatch, fields, workload(turns, turn_tokens, tool_ms, obs))
    seen = kinds(sim, max_turns=3)
    assert {"lease", "wake", "abort", "step", "FINISHED/STOP", "max_turns", "INTERRUPTED/ABORT"} <= seen
    assert ("waited for" in seen) == (not repeatable) and ("owed step" in seen) == repeatable
    plan: dict[str, Any] = {
        "turns": turns,
        "turn_tokens": turn_tokens,
        "tool_ms": tool_ms,
        "observations": obs,
    }
    plan |= {"seed": 0, "max_turns": 3, "max_turn_tokens": 12, "repeatable": repeatable}
    monkeypatch.setenv("APRIL_TEST_PLAN", json.dumps(plan))
    env = EnvConfig(name="episode_envs:PlanEnv", max_turns=3, max_turn_tokens=12)
    assert_replays(sim, env, repeatable)
