"""The broker core (broker/core.py): events in, decisions out, the same whoever drives it.

Driven directly, event by event: the decisions of a round's end, a new version and a worker that has not
loaded it yet, and the same decisions again from the same events. Then the two drivers side by side: the
events the simulator (broker/sim/model.py) hands the core in a run, replayed as protocol messages into a
real `Broker` (broker/server.py, in this process, stepped by hand), give the very decisions the simulator
got, one by one.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from sim_setup import sim_config

from actors.lengths import LengthSpec
from april import protocol
from april.config import AlgoConfig, Config, ConfigError, Mode, RunConfig, replace_fields
from april.data import SyntheticPromptSource
from april.records import FinishReason, Sample
from april.sim.engine_cost import EngineCost
from april.sim.episode_plans import DrawnEpisodes, EpisodeWorkload
from april.wire_records import SampleBatch
from broker.core import BrokerCore
from broker.decisions import (
    BatchFormed,
    Decision,
    EvalFinished,
    LeaseOut,
    Refuse,
    Send,
    Settled,
    ToLearner,
    WorkerLost,
)
from broker.server import Broker
from broker.sim.model import Simulation
from broker.state import BrokerState

NO_LEASES = np.zeros(0, dtype=np.int64)
LONG_TAIL = LengthSpec.parse("mixture:0.7*lognormal:median=20,sigma=0.6,cap=200+0.3*fixed:200")


def core_of(mode: Mode, **algo: Any) -> BrokerCore:
    fields = {"rollout_batch_size": 1, "over_sampling_batch_size": 2, "n_samples_per_prompt": 2} | algo
    config = Config(run=RunConfig(mode=mode), algo=AlgoConfig(**fields))
    return BrokerCore(config, BrokerState(mode, config.algo, SyntheticPromptSource(50)), (), 0.0)


def hello(worker_id: str, slots: int, version: int = 0) -> protocol.WorkerHello:
    return protocol.WorkerHello(worker_id, "sim", slots, version, 1, "node", NO_LEASES)


def leases(decisions: list[Decision]) -> dict[str, list[int]]:
    return {
        d.worker_id: [lease_id for lease_id, _, _ in d.work] for d in decisions if isinstance(d, LeaseOut)
    }


def sent(decisions: list[Decision], kind: type) -> list[str]:
    return [d.worker_id for d in decisions if isinstance(d, Send) and isinstance(d.message, kind)]


def finished(work: list[tuple[int, int, Sample]], tokens: int = 3) -> tuple[list[int], list[Sample]]:
    ids = [lease_id for lease_id, _, _ in work]
    done = [s.extend([5] * tokens, [-0.5] * tokens, 0, FinishReason.STOP).scored(1.0) for _, _, s in work]
    return ids, done


def test_an_april_round_ends_with_an_abort_of_every_holder_in_registration_order() -> None:
    core = core_of(Mode.APRIL, over_sampling_batch_size=3)
    for worker_id in ("w1", "w0", "w2"):  # registered in this order
        assert sent(core.on_hello(hello(worker_id, 2), 0.0), protocol.Welcome) == [worker_id]
    first = core.tick(0.1)
    # three groups of two spread over the three, in queue order
    assert leases(first) == {"w1": [0, 1], "w0": [2, 3], "w2": [4, 5]}
    work = {d.worker_id: d.work for d in first if isinstance(d, LeaseOut)}
    out = core.on_samples("w0", *finished(work["w0"]), 2, 0.2)  # group 1 complete: so is the round
    assert [type(d) for d in out] == [Settled]  # w0's slots are free, but the round leases no more
    end = core.tick(0.3)
    assert sent(end, protocol.Abort) == ["w1", "w2"] and not core.state.round_open
    assert core.tick(0.4) == []  # nothing is leased while the abort runs
    for worker_id in ("w2", "w1"):
        back = [s.extend([7], [-1.0], 0, FinishReason.ABORT) for _, _, s in work[worker_id]]
        core.on_samples(worker_id, [lease_id for lease_id, _, _ in work[worker_id]], back, 0, 0.5)
        core.on_abort_done(worker_id, core.round_id, 2, (), 0.5)
    assert core.abort is not None and core.tick(0.6) == [] and core.abort is None and core.aborts_done == 1
    assert core.state.partial == 2 and core.state.leased_samples == 0  # parked for the next round


def test_a_new_version_aborts_async_work_and_leases_nothing_to_a_worker_still_loading_it() -> None:
    core = core_of(Mode.ASYNC, max_staleness=1)
    core.on_hello(hello("w0", 4), 0.0)
    first = core.tick(0.0)
    assert leases(first) == {"w0": [0, 1, 2, 3]}
    out = core.on_weights(1, "file:///v1", "0" * 64, 1.0)
    assert sent(out, protocol.WeightsReady) == ["w0"] and sent(out, protocol.Abort) == ["w0"]
    (work,) = (d.work for d in first if isinstance(d, LeaseOut))
    partial = [s.extend([9], [-1.0], 0, FinishReason.ABORT) for _, _, s in work]
    core.on_samples("w0", [0, 1, 2, 3], partial, 0, 1.1)
    core.on_abort_done("w0", core.round_id, 4, (), 1.1)
    assert leases(core.tick(1.2)) == {}  # w0 serves v0 still: nothing for it
    core.on_weights_loaded("w0", protocol.WeightsLoaded(1, True, ""))
    resumed = leases(core.tick(1.3))
    assert sorted(resumed["w0"]) == [4, 5, 6, 7]  # the four partials, leased again under new ids


def test_a_buffer_smaller_than_a_batch_is_refused_by_name() -> None:
    """broker.max_buffered_samples bounds the samples held; below one batch's, issuing stops short of
    every batch: the broker (and the simulator) refuse such a config at the start, in one line."""
    algo = AlgoConfig(rollout_batch_size=4, over_sampling_batch_size=4, n_samples_per_prompt=4)
    config = replace_fields(Config(algo=algo), {"broker.max_buffered_samples": "15"})
    with pytest.raises(ConfigError, match=r"broker\.max_buffered_samples = 15: .* = 16\)"):
        BrokerCore(config, BrokerState(Mode.ASYNC, algo, SyntheticPromptSource(50)), (), 0.0)
    BrokerCore(
        replace_fields(config, {"broker.max_buffered_samples": "16"}),
        BrokerState(Mode.ASYNC, algo, SyntheticPromptSource(50)),
        (),
        0.0,
    )


def test_the_same_events_give_the_same_decisions() -> None:
    def script(core: BrokerCore) -> list[Decision]:
        out = core.on_hello(hello("a", 3), 0.0) + core.on_hello(hello("b", 5), 0.0)
        out += core.tick(0.1)
        for d in list(out):
            if isinstance(d, LeaseOut):
                out += core.on_samples(d.worker_id, *finished(d.work), len(d.work), 0.2)
        core.on_learner_hello("learner")
        core.on_batch_request(0, -1, 0.3)
        out += core.tick(0.3)
        out += core.on_weights(1, "file:///v1", "0" * 64, 0.4)
        return out + core.tick(0.5)

    first, again = (digest(script(core_of(Mode.APRIL))) for _ in range(2))
    assert first == again and any(d[0] == "BatchFormed" for d in first)


# ------------------------------------------------------------------ the simulator and the server


class Recorder:
    """Stands in for the simulation's BrokerCore: forwards everything and notes each event it is handed
    (name, arguments, the simulation's time) with what it returned."""

    EVENTS = frozenset(
        {
            "on_hello",
            "on_samples",
            "on_credit",
            "on_abort_done",
            "on_weights_loaded",
            "on_learner_hello",
            "on_batch_request",
            "on_ack",
            "on_weights",
            "tick",
        }
    )

    def __init__(self, core: BrokerCore, clock: Callable[[], float]) -> None:
        self.core = core
        self.clock = clock
        self.calls: list[tuple[str, tuple[Any, ...], float, Any]] = []

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self.core, name)
        if name not in self.EVENTS:
            return attr

        def event(*args: Any) -> Any:
            out = attr(*args)
            self.calls.append((name, args, self.clock(), out))
            return out

        return event


def replay(calls: list[tuple[str, tuple[Any, ...], float, Any]], broker: Broker) -> list[Decision]:
    """The simulation's events as the messages a worker or the learner sends, handed to the server's
    handlers at the same times (from the broker's start); returns every decision the server carried out.
    The batch the core hands out is not sent (the simulation's learner took it at once)."""
    seen: list[Decision] = []
    carry_out = broker._carry_out

    def noted(decisions: list[Decision], now: float, result: SampleBatch | None = None) -> None:
        seen.extend(decisions)
        carry_out(decisions, now, result)

    broker._carry_out = noted  # type: ignore[method-assign]
    broker._send_batch = lambda now: None  # type: ignore[method-assign]
    start, learner = broker.core.started, b"learner"
    for name, args, at, _ in calls:
        now = start + at
        match name:
            case "on_hello":
                broker._on_worker(args[0].worker_id.encode(), args[0], now)
            case "on_samples":
                worker, lease_ids, samples, credit = args[:4]
                batch = SampleBatch.from_samples(samples)
                msg = protocol.SampleResult(np.array(lease_ids, dtype=np.int64), batch, credit)
                broker._on_worker(worker.encode(), msg, now)
            case "on_credit":
                broker._on_worker(args[0].encode(), protocol.LeaseRequest(args[1]), now)
            case "on_abort_done":
                worker, round_id, credit, scoring = args[:4]
                done = protocol.AbortDone(round_id, credit, np.array(sorted(scoring), dtype=np.int64))
                broker._on_worker(worker.encode(), done, now)
            case "on_weights_loaded":
                broker._on_worker(args[0].encode(), args[1], now)
            case "on_learner_hello":
                broker._on_learner(learner, protocol.LearnerHello(args[0], 0, 1), now)
            case "on_batch_request":
                broker._on_learner(learner, protocol.BatchRequest(args[0], args[1]), now)
            case "on_ack":
                broker._on_learner(learner, protocol.BatchAck(args[0], {}), now)
            case "on_weights":
                broker._on_learner(learner, protocol.WeightsReady(*args[:3]), now)
            case "tick":
                broker.tick(now)
    return seen


def digest(decisions: list[Decision]) -> list[tuple[Any, ...]]:
    """What a decision decides, comparable: samples by identity and progress (their arrays are not
    compared by ==), a batch by its groups and samples (its stats are figures, not decisions). Heartbeats
    are left out: the simulator models no silence (its core's `liveness` is off)."""

    def sample(s: Sample) -> tuple[Any, ...]:
        return (s.group_id, s.index, s.status, s.response_len, s.segments, s.observations, s.resumes)

    out: list[tuple[Any, ...]] = []
    for d in decisions:
        match d:
            case LeaseOut():
                work = tuple((lease_id, budget, sample(s)) for lease_id, budget, s in d.work)
                out.append(("LeaseOut", d.worker_id, work, d.greedy))
            case Send(message=protocol.Heartbeat()):
                pass
            case Send():
                out.append(("Send", d.worker_id, d.message))
            case Refuse():
                out.append(("Refuse", d.peer_id, d.reason, d.detail, d.reply))
            case Settled():
                out.append(("Settled", tuple(sample(s) for s in d.samples), d.whole))
            case BatchFormed(batch=b):
                out.append(("BatchFormed", b.batch_id, b.step, b.version, tuple(b.group_ids)))
                out.append(("samples", tuple(sample(s) for s in b.samples)))
            case EvalFinished():
                out.append(("EvalFinished", d.result))
    return out


@pytest.mark.parametrize(
    ("mode", "algo"),
    [
        (Mode.APRIL, {"over_sampling_batch_size": 4, "resume_affinity": True}),
        (Mode.ASYNC, {"max_staleness": 1}),
        (Mode.SYNC, {"over_sampling_batch_size": 2}),
    ],
)
def test_the_simulator_and_a_stepped_real_broker_make_the_same_decisions(
    tmp_path: Path, mode: Mode, algo: dict[str, Any]
) -> None:
    fields = {"rollout_batch_size": 2, "n_samples_per_prompt": 2, "max_new_tokens": 200} | algo
    cfg = sim_config(
        mode,
        AlgoConfig(**fields),
        engines=2,
        slots=4,
        cost=EngineCost(1.0, 0.1, 0.0),
        learner_step_s=0.01,
        steps=4,
        prompt_len=8,
    )
    sim = Simulation(cfg, LONG_TAIL)
    recorder = Recorder(sim.core, lambda: sim.now)
    sim.core = recorder  # type: ignore[assignment]
    result = sim.run()
    assert result.ledger.trained == 4 * 2
    assert sim.now < 3.0  # within the liveness window: the server, which heartbeats, declares no one dead
    simulated = [d for *_, out in recorder.calls if isinstance(out, list) for d in out]
    kinds = {type(d) for d in simulated}
    assert {LeaseOut, Send, Settled, BatchFormed} <= kinds
    if mode != Mode.SYNC:  # every abort decision is compared too
        assert any(isinstance(d, Send) and isinstance(d.message, protocol.Abort) for d in simulated)

    broker = Broker(cfg.config, tmp_path / "run")
    try:
        served = replay(recorder.calls, broker)
        assert broker.core.state.ledger() == sim.core.state.ledger()
    finally:
        broker.close()
    assert digest(served) == digest(simulated)


@pytest.mark.parametrize("repeatable", [True, False])
@pytest.mark.parametrize(("mode", "algo"), [(Mode.APRIL, {"over_sampling_batch_size": 4}), (Mode.ASYNC, {})])
def test_the_simulator_and_a_stepped_real_broker_make_the_same_decisions_on_episodes(
    tmp_path: Path, mode: Mode, algo: dict[str, Any], repeatable: bool
) -> None:
    """Episodes add credit without results (a turn's slot given back while its tool runs), samples with
    observations, and aborts that leave non-repeatable tool calls owed (AbortDone names them; their
    samples follow): the real broker decides the same."""
    fields = {"rollout_batch_size": 2, "n_samples_per_prompt": 2, "max_new_tokens": 200} | algo
    cfg = sim_config(
        mode,
        AlgoConfig(**fields),
        engines=2,
        slots=2,
        cost=EngineCost(1.0, 0.1, 0.0),
        learner_step_s=0.01,
        steps=4,
        prompt_len=8,
    )
    cfg = type(cfg)(replace_fields(cfg.config, {"worker.sim_tool_repeatable": repeatable}), cfg.engines)
    turns = LengthSpec.parse("uniform:min=1,max=4")
    tool_ms = LengthSpec.parse("lognormal:median=10,sigma=1,cap=100")
    observations = LengthSpec.parse("uniform:min=1,max=8")
    episodes = EpisodeWorkload(DrawnEpisodes(turns, LONG_TAIL, tool_ms, observations), observations)
    sim = Simulation(cfg, LONG_TAIL, episodes)
    recorder = Recorder(sim.core, lambda: sim.now)
    sim.core = recorder  # type: ignore[assignment]
    result = sim.run()
    assert result.ledger.trained == 4 * 2
    assert sim.now < 3.0  # within the liveness window
    names = [name for name, *_ in recorder.calls]
    assert "on_credit" in names  # a slot given back while its episode's tool ran
    aborts = [args for name, args, *_ in recorder.calls if name == "on_abort_done"]
    assert aborts and any(args[3] for args in aborts) != repeatable  # non-repeatable: calls waited for
    simulated = [d for *_, out in recorder.calls if isinstance(out, list) for d in out]
    assert any(s.observations for d in simulated if isinstance(d, BatchFormed) for s in d.batch.samples)

    broker = Broker(cfg.config, tmp_path / "run")
    try:
        served = replay(recorder.calls, broker)
        assert broker.core.state.ledger() == sim.core.state.ledger()
    finally:
        broker.close()
    assert digest(served) == digest(simulated)


# ------------------------------------------------------------------ the contract: decisions, liveness


def test_every_event_returns_a_list_of_decisions() -> None:
    """Each event method and the tick are annotated to return list[Decision], and do."""
    events = [name for name in vars(BrokerCore) if name.startswith("on_")] + ["tick"]
    assert len(events) >= 17
    for name in events:
        assert inspect.signature(getattr(BrokerCore, name)).return_annotation == "list[Decision]", name
    core = core_of(Mode.APRIL)
    calls: list[list[Decision]] = [
        core.on_hello(hello("w0", 2), 0.0),
        core.on_heard("w0", 0.1),
        core.on_sent("w0", 0.1),
        core.on_credit("w0", 1),
        core.on_engine_health("w0", protocol.EngineHealth(True, "", 0, 0)),
        core.on_learner_hello("learner"),
        core.on_batch_request(0, -1, 0.2),
        core.on_ack(7, 0.3),
        core.on_weights(1, "file:///v1", "0" * 64, 0.4),
        core.on_weights_loaded("w0", protocol.WeightsLoaded(1, True, "")),
        core.tick(0.5),
        core.on_learner_gone(),
        core.on_worker_lost("w0"),
    ]
    assert all(isinstance(out, list) for out in calls)
    assert [type(d) for d in calls[7]] == [Refuse, ToLearner]  # an ack of no batch: refused, answered
    assert calls[-1] == [WorkerLost("w0")] and "w0" not in core.workers


def test_the_tick_loses_silent_workers_and_sends_heartbeats_to_quiet_ones() -> None:
    """Liveness is the core's (zguide's majordomo purge_workers / send_heartbeats): a worker heard from
    within liveness x interval (3 x 1 s) lives, a quieter one is lost with its leases re-queued; a worker
    sent nothing for an interval gets a Heartbeat, and any message sent counts."""
    core = core_of(Mode.APRIL, over_sampling_batch_size=2)
    core.on_hello(hello("w0", 2), 0.0)
    core.on_hello(hello("w1", 2), 0.0)
    first = core.tick(0.0)
    assert leases(first) == {"w0": [0, 1], "w1": [2, 3]} and not sent(first, protocol.Heartbeat)
    assert sent(core.tick(0.5), protocol.Heartbeat) == []
    assert sent(core.tick(1.0), protocol.Heartbeat) == ["w0", "w1"]
    core.on_sent("w1", 1.5)  # e.g. a ResultAck the server sent on its own
    core.on_heard("w1", 1.9)
    assert sent(core.tick(2.0), protocol.Heartbeat) == ["w0"]
    out = core.tick(3.1)  # w0 silent for 3.1 s: lost, its two leases queued again
    assert [d for d in out if isinstance(d, WorkerLost)] == [WorkerLost("w0")]
    assert "w0" not in core.workers and core.state.leased_samples == 2 and len(core.state.queue) == 2
    assert sent(out, protocol.Heartbeat) == ["w1"]
    off = core_of(Mode.APRIL)
    off.liveness = False  # april simulate: no silence is modelled
    off.on_hello(hello("w0", 2), 0.0)
    late = off.tick(100.0)
    assert not [d for d in late if isinstance(d, WorkerLost)] and not sent(late, protocol.Heartbeat)
    assert "w0" in off.workers
