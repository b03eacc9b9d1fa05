"""Failures in plain sight (issue 34): sample errors carry their reason, the broker counts them and shows
their lines, a run whose samples all fail alike stops by itself with that one line, and a normal start
says no warning.

The broker core is driven directly (events in, decisions out); the status, the dashboard's events and
`april status` are rendered from the records the broker publishes; the learner's metrics line is built
from a batch. The whole path runs in real processes last: a real broker, a real `april worker` playing
episodes against an environment whose reset answers no messages (as a user's did: the run never ended,
105,000 warnings in 154 s), and a real `april learner`, which exits with the one line by itself."""

from __future__ import annotations

import dataclasses
import io
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from harness import Cluster, wait_for
from rich.console import Console
from test_broker_core import core_of, hello, leases

from april import protocol
from april.config import Mode
from april.failures import MAX_ERROR, Reason, failure, reason_of
from april.ledger import Ledger
from april.records import FinishReason, Sample, SampleStatus
from april.status import BrokerStatus, ErrorLine
from april.wire_records import SampleBatch
from broker.core import BrokerCore
from broker.decisions import Decision, LeaseOut, RunStopped
from broker.failures import LINE_EVERY_S
from cli.dashboard_state import DashboardState, apply_status
from cli.status_cmd import render_status
from learner.metrics import step_record

TINY = str(Path(__file__).resolve().parent.parent / "models" / "tiny")

# ------------------------------------------------------------------------------------------ the reasons


def test_an_error_starts_with_its_reason_and_one_without_is_other() -> None:
    error = failure(Reason.ENV_EMPTY_RESET, "environment reset answered\nno messages")
    assert error == "env_empty_reset: environment reset answered no messages"
    assert reason_of(error) is Reason.ENV_EMPTY_RESET
    assert reason_of("engine said no") is Reason.OTHER and reason_of("nonsense: x") is Reason.OTHER
    assert len(failure(Reason.REWARD_ERROR, "x" * 2000)) == MAX_ERROR


# ------------------------------------------------------------------------------------------ the broker core


class Worker0:
    """Worker w0 (4 slots) as the core sees it: what is leased to it is held until `serve` answers it."""

    def __init__(self, core: BrokerCore) -> None:
        self.core = core
        self.held: list[tuple[int, int, Sample]] = []
        self.seen: list[Decision] = []  # every decision so far
        self.answered = 0
        core.on_hello(hello("w0", 4), 0.0)

    def serve(self, answer: Callable[[Sample], Sample], now: float, samples: int) -> float:
        """Answer `samples` samples with `answer` as they are leased (by a tick, or as answers free
        slots), fewer if nothing more is leased; then tick once more. Returns the time."""
        while samples > 0:
            if not self.held:
                now += 0.01
                self._take(self.core.tick(now))
                if not self.held:
                    break
            take, self.held = self.held[:samples], self.held[samples:]
            samples -= len(take)
            self.answered += len(take)
            ids = [lease_id for lease_id, _, _ in take]
            self._take(self.core.on_samples("w0", ids, [answer(s) for _, _, s in take], len(ids), now))
        now += 0.01
        self._take(self.core.tick(now))
        return now

    def _take(self, decisions: list[Decision]) -> None:
        self.seen += decisions
        self.held += [item for d in decisions if isinstance(d, LeaseOut) for item in d.work]


def fails(reason: Reason, text: str = "it broke") -> Callable[[Sample], Sample]:
    return lambda s: s.failed(failure(reason, text))


def finishes(s: Sample) -> Sample:
    return s.extend([5, 6], [-0.5, -0.5], 0, FinishReason.STOP).scored(1.0)


def async_core(stop_after: int = 8) -> tuple[BrokerCore, Worker0]:
    core = core_of(Mode.ASYNC, rollout_batch_size=2, over_sampling_batch_size=4, max_staleness=4)
    core.failures.stop_after = stop_after
    core.liveness = False  # w0's heartbeats are not played: no silence makes it lost
    return core, Worker0(core)


def test_a_run_whose_samples_all_fail_alike_stops_with_that_line_and_leases_nothing_more() -> None:
    core, w0 = async_core(stop_after=8)
    core.on_batch_request(0, -1, 0.0)
    now = w0.serve(fails(Reason.ENV_EMPTY_RESET, "environment reset answered no messages"), 0.0, 100)
    assert core.failures.counts == {"env_empty_reset": 8}  # the 8th stopped it: nothing leased after it
    assert core.failures.stopped == (
        "the run stopped: 8 samples in a row failed alike (broker.stop_after_failures = 8): "
        "env_empty_reset: environment reset answered no messages"
    )
    assert [d for d in w0.seen if isinstance(d, RunStopped)] == [RunStopped(core.failures.stopped)]
    assert core.learner_waiting is None and leases(core.tick(now + 1)) == {}
    core.on_batch_request(0, -1, now + 2)  # asking again (a learner restarted): told again, nothing leased
    again = core.tick(now + 3)
    assert [type(d) for d in again] == [RunStopped]
    assert core.state.ledger().dropped == {"failed": 4} and core.failures.counts == {"env_empty_reset": 8}


@pytest.mark.parametrize("pattern", ["3 failed, 1 finished", "failing by turns for 2 reasons"])
def test_a_run_that_fails_some_samples_goes_on(pattern: str) -> None:
    """The rule needs every sample of the last K to fail for one reason: a sample that finishes, or a
    failure for another reason, between them keeps the run going (K = 4 here)."""
    core, w0 = async_core(stop_after=4)
    flaky = iter(range(10_000))

    def answer(s: Sample) -> Sample:
        k = next(flaky)
        if pattern.startswith("3"):
            return finishes(s) if k % 4 == 3 else fails(Reason.REWARD_ERROR)(s)
        return fails(Reason.REWARD_ERROR if k % 2 else Reason.REWARD_TIMEOUT)(s)

    w0.serve(answer, 0.0, 200)
    assert w0.answered == 200 and not core.failures.stopped and w0.held  # leased on
    assert core.failures.counts["reward_error"] >= 100


def test_errors_since_the_last_batch_go_into_it_and_a_tool_timeout_counts_without_failing() -> None:
    core, w0 = async_core(stop_after=0)  # never stops
    core.on_batch_request(0, -1, 0.0)
    k = iter(range(10_000))

    def answer(s: Sample) -> Sample:
        n = next(k)
        if n < 3:
            return fails(Reason.ENV_ERROR, "environment step raised ValueError: boom")(s)
        note = failure(Reason.TOOL_TIMEOUT, "tool call of add timed out after 5 s")
        return finishes(s.noted(note)) if n % 2 else finishes(s)

    w0.serve(answer, 0.0, 12)
    batch = core.state.batch
    assert batch is not None and batch.stats["errors/env_error"] == 3.0
    assert all(s.status == SampleStatus.FINISHED for s in batch.samples)
    noted = [s for s in batch.samples if s.error]  # trained, and their error with them
    assert noted and all(reason_of(s.error) is Reason.TOOL_TIMEOUT for s in noted)
    assert batch.stats["errors/tool_timeout"] >= len(noted)
    lines = {line.text: line for line in core.failures.lines.values()}
    assert lines["env_error: environment step raised ValueError: boom"].samples == 3


def test_a_new_error_line_of_a_reason_is_kept_at_most_every_few_seconds(
    caplog: pytest.LogCaptureFixture,
) -> None:
    core, w0 = async_core(stop_after=0)
    numbered = iter(range(10_000))

    def numbered_reward_error(s: Sample) -> Sample:
        return fails(Reason.REWARD_ERROR, f"reward raised: case {next(numbered)}")(s)

    with caplog.at_level(logging.WARNING, logger="april.broker"):
        w0.serve(numbered_reward_error, 0.0, 20)
        w0.serve(fails(Reason.ENV_ERROR), LINE_EVERY_S / 2, 2)  # another reason: shown at once
        w0.serve(numbered_reward_error, LINE_EVERY_S + 1, 4)
    texts = [line.text for line in core.failures.lines.values()]
    assert texts == [
        "reward_error: reward raised: case 0",
        "env_error: it broke",
        "reward_error: reward raised: case 20",
    ]
    assert [r.getMessage() for r in caplog.records] == [f"sample error: {t}" for t in texts]
    assert core.failures.counts == {"reward_error": 24, "env_error": 2}  # every sample counts


def test_a_normal_start_says_no_warning(caplog: pytest.LogCaptureFixture) -> None:
    """Found by a user: every run began with "engine down, leasing it nothing: starting" for each worker
    (each starts so, until its engine is built)."""
    core, _ = async_core()
    with caplog.at_level(logging.INFO, logger="april.broker"):
        core.on_engine_health("w0", protocol.EngineHealth(False, protocol.ENGINE_STARTING, 0, 0))
        core.on_engine_health("w0", protocol.EngineHealth(True, "", 0, 0, "cpu"))
        core.on_engine_health("w0", protocol.EngineHealth(False, "server gone", 0, 2, "cpu"))
    said = [(r.levelno, r.getMessage()) for r in caplog.records]
    assert said == [
        (logging.INFO, "worker w0: engine starting, leasing it nothing until it is up"),
        (logging.INFO, "worker w0: engine is up"),
        (logging.WARNING, "worker w0: engine down, leasing it nothing: server gone"),
    ]


# ------------------------------------------------------------------------------------------ what people see


def published(uptime: float = 10.0, **over: Any) -> BrokerStatus:
    from test_dashboard import status

    return dataclasses.replace(status(uptime), **over)


def test_status_json_keeps_the_errors_and_an_older_status_reads_as_none() -> None:
    line = ErrorLine("env_error", "env_error: environment step raised ValueError: boom", 3)
    s = published(errors={"env_error": 3}, error_lines=[line], stopped="the run stopped: ...")
    back = BrokerStatus.from_json(s.to_json())
    assert (back.errors, back.error_lines, back.stopped) == ({"env_error": 3}, [line], "the run stopped: ...")
    older = s.to_json()
    for key in ("errors", "error_lines", "stopped"):
        del older[key]
    assert (lambda b: (b.errors, b.error_lines, b.stopped))(BrokerStatus.from_json(older)) == ({}, [], "")


def test_the_dashboard_shows_each_new_error_line_once_and_the_stop() -> None:
    first = ErrorLine("env_error", "env_error: environment step raised ValueError: boom", 1)
    note = ErrorLine("tool_timeout", "tool_timeout: tool call of add timed out after 5 s", 1)
    state = DashboardState(source="tcp://x")
    apply_status(state, published(uptime=1.0), 1.0)
    apply_status(state, published(uptime=2.0, error_lines=[first]), 2.0)
    apply_status(state, published(uptime=3.0, error_lines=[dataclasses.replace(first, samples=9), note]), 3.0)
    stopped = "the run stopped: 64 samples in a row failed alike (broker.stop_after_failures = 64): ..."
    apply_status(state, published(uptime=4.0, error_lines=[first, note], stopped=stopped), 4.0)
    apply_status(state, published(uptime=5.0, error_lines=[first, note], stopped=stopped), 5.0)
    shown = [(e.text, e.style) for e in list(state.events)[1:]]
    assert shown == [(first.text, "red"), (note.text, "yellow"), (stopped, "bold red")]


def test_april_status_shows_the_errors_by_reason_and_why_the_run_stopped() -> None:
    line = ErrorLine("env_empty_reset", "env_empty_reset: environment reset answered no messages", 64)
    s = published(errors={"env_empty_reset": 64}, error_lines=[line], stopped="the run stopped: 64 in a row")
    out = io.StringIO()
    Console(file=out, width=160).print(render_status(s))
    text = out.getvalue()
    assert "sample errors (since the broker started): env_empty_reset 64" in text
    assert "env_empty_reset: environment reset answered no messages  (64 samples)" in text
    assert "the run stopped: 64 in a row" in text
    quiet = io.StringIO()
    Console(file=quiet, width=160).print(render_status(published()))
    assert "sample errors (since the broker started): none" in quiet.getvalue()


def test_the_metrics_line_counts_the_errors_by_reason() -> None:
    samples = [
        Sample(0, i, np.array([1, 2], np.int32)).extend([3], [-0.1], 0, FinishReason.STOP).scored(1.0)
        for i in range(2)
    ]
    batch = protocol.Batch(
        0,
        0,
        0,
        SampleBatch.from_samples(samples),
        {"errors/env_error": 3.0, "errors/tool_timeout": 1.0},
        Ledger(issued=1, trained=0, complete_waiting=1),
    )
    record = step_record(
        step=0, version=1, mode="async", batch=batch, step_time_s=1.0, learner_time_s=0.5,
        weight_sync_s=0.1, train={"loss": 0.0},
    )  # fmt: skip
    assert record["errors"] == {"env_error": 3, "tool_timeout": 1}
    quiet = dataclasses.replace(batch, stats={})
    assert step_record(
        step=0, version=1, mode="async", batch=quiet, step_time_s=1.0, learner_time_s=0.5,
        weight_sync_s=0.1, train={"loss": 0.0},
    )["errors"] == {}  # fmt: skip


# ------------------------------------------------------------------------------------------ real processes


@pytest.fixture
def env_on_path(monkeypatch: pytest.MonkeyPatch) -> None:
    """tests/ on the PYTHONPATH of the processes a test starts: its workers import the env from there."""
    tests = str(Path(__file__).resolve().parent)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, (tests, os.environ.get("PYTHONPATH")))))


@pytest.mark.parametrize("env", ["EmptyResetEnv", "NotJsonStateEnv", "BrokenEnv"])
def test_a_run_on_a_broken_environment_stops_by_itself_with_one_line(
    cluster: Callable[..., Cluster], env_on_path: None, env: str
) -> None:
    """A reset that answers no messages (found: the run never finished, the torch engine refusing every
    prompt of no tokens; the sim engine here, which generates from none, trained on them before),
    a step that answers a state that is not JSON (found: accepted, the next step failed) and a step that
    raises (found: the message only inside failed samples in the broker's binary log): the learner
    exits 2 with one line naming the reason, the broker's status says why it stopped and counts the
    samples, and nothing more is leased."""
    reason = {
        "EmptyResetEnv": "env_empty_reset",
        "NotJsonStateEnv": "env_bad_state",
        "BrokenEnv": "env_error",
    }[env]
    c = cluster(
        run={"mode": "april"},
        algo={"max_new_tokens": 64},
        env={"name": f"episode_envs:{env}", "max_turns": 4, "max_turn_tokens": 8},
        broker={"stop_after_failures": 16},
        worker={"model": TINY, "sim_lengths": "lognormal:median=4,sigma=0.5,cap=8"},
        learner={"backend": "sim"},
    )
    c.start_broker()
    c.start_worker("w0")
    log = c.start_learner_process("learner", "run.steps=3")
    assert c.wait_exit("learner", 120) == 2  # by itself: a generous "did not hang", not a speed
    said = [line for line in log.read_text().splitlines() if line.startswith("april: error: ")]
    assert len(said) == 1, log.read_text()[-3000:]
    assert said[0].startswith(
        "april: error: the run stopped: 16 samples in a row failed alike (broker.stop_after_failures = 16): "
        f"{reason}: "
    )
    status = c.status()
    assert status.stopped == said[0].removeprefix("april: error: ")
    assert status.errors.get(reason, 0) >= 16 and status.ledger_balanced
    assert [line.reason for line in status.error_lines] == [reason]
    settled = wait_for(lambda: (s := c.status()).leased_samples == 0 and s, 60, "the leases out to return")
    time.sleep(1.0)
    assert c.status().ledger.issued == settled.ledger.issued  # nothing issued since
    assert not (c.run_dir / "metrics.jsonl").exists()  # nothing trained
