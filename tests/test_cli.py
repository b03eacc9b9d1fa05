"""The `april` command line: help, one-line user errors (exit code 2), `april status` and its rendering.

Fast: errors are raised before anything binds; the tests that need a broker use the `cluster` fixture
(a real `april broker` subprocess on free loopback ports).
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
from harness import Cluster, free_ports
from rich.console import Console
from typer.testing import CliRunner, Result

from april.ledger import Ledger
from april.status import BrokerStatus, LearnerStatus, Rejected, RoundStatus, Totals, WorkerStatus
from cli.main import app
from cli.status_cmd import render_status

WIDE = {"COLUMNS": "200"}  # rich wraps help text to the terminal width


@pytest.fixture(autouse=True)
def _no_april_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """APRIL_* variables of the calling shell must not leak into the resolved configs."""
    for var in list(os.environ):
        if var.upper().startswith("APRIL_"):
            monkeypatch.delenv(var)


def invoke(*args: str) -> Result:
    return CliRunner().invoke(app, list(args), env=WIDE)


def error_line(result: Result) -> str:
    """The single `april: error:` line of a user error (exit code 2, nothing else printed)."""
    assert result.exit_code == 2, (result.exit_code, result.output)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("april: error:"), lines[0]
    assert result.stdout == ""
    return lines[0]


# ---------------------------------------------------------------------------------------------------
# help


def test_help_lists_the_commands() -> None:
    result = invoke("--help")
    assert result.exit_code == 0
    for command in ("broker", "status", "up"):
        assert f" {command} " in result.output, command


def test_broker_help_shows_the_slime_flags() -> None:
    result = invoke("broker", "--help")
    assert result.exit_code == 0
    for flag in (
        "--partial-rollout",
        "--over-sampling-batch-size",
        "--rollout-batch-size",
        "--n-samples-per-prompt",
    ):
        assert flag in result.output, flag


# ---------------------------------------------------------------------------------------------------
# config errors: one line, exit 2, before anything binds


def test_unknown_key_in_the_config_file(tmp_path: Path) -> None:
    config = tmp_path / "april.toml"
    config.write_text('[algo]\nrollout_batch_size = 4\nbogus_knob = 3\n\n[run]\nmode = "april"\n')
    line = error_line(invoke("broker", "--run-dir", str(tmp_path / "run"), "--config", str(config)))
    assert '"bogus_knob"' in line
    assert "[algo]" in line
    assert not (tmp_path / "run").exists()


def test_unknown_section_in_the_config_file(tmp_path: Path) -> None:
    config = tmp_path / "april.toml"
    config.write_text("[brokr]\nworker_port = 5555\n")
    line = error_line(invoke("broker", "--run-dir", str(tmp_path / "run"), "--config", str(config)))
    assert "[brokr]" in line


def test_over_sampling_below_rollout_batch_from_flags(tmp_path: Path) -> None:
    result = invoke(
        "broker",
        "--run-dir",
        str(tmp_path / "run"),
        "--rollout-batch-size",
        "8",
        "--over-sampling-batch-size",
        "4",
    )
    line = error_line(result)
    assert "algo.over_sampling_batch_size" in line
    assert "algo.rollout_batch_size" in line


def test_over_sampling_below_rollout_batch_from_the_file(tmp_path: Path) -> None:
    config = tmp_path / "april.toml"
    config.write_text("[algo]\nrollout_batch_size = 16\nover_sampling_batch_size = 8\n")
    line = error_line(invoke("broker", "--run-dir", str(tmp_path / "run"), "--config", str(config)))
    assert "algo.over_sampling_batch_size = 8" in line


def test_bad_set_value_names_the_key(tmp_path: Path) -> None:
    line = error_line(invoke("broker", "--run-dir", str(tmp_path / "run"), "--set", "broker.liveness=many"))
    assert "broker.liveness" in line


def test_partial_rollout_conflicts_with_another_mode(tmp_path: Path) -> None:
    line = error_line(
        invoke("broker", "--run-dir", str(tmp_path / "run"), "--mode", "sync", "--partial-rollout")
    )
    assert "run.mode" in line
    assert "partial_rollout" in line


def test_non_loopback_bind_host_needs_curve(tmp_path: Path) -> None:
    line = error_line(invoke("broker", "--run-dir", str(tmp_path / "run"), "--bind-host", "0.0.0.0"))
    assert "CurveZMQ" in line
    assert "0.0.0.0" in line
    assert not (tmp_path / "run").exists()


# ---------------------------------------------------------------------------------------------------
# status


def test_status_without_a_broker(tmp_path: Path) -> None:
    (port,) = free_ports(1)
    line = error_line(invoke("status", "--broker", f"tcp://127.0.0.1:{port}", "--timeout", "0.3"))
    assert "no broker answered" in line


def test_second_broker_on_busy_ports(tmp_path: Path, cluster: Callable[..., Cluster]) -> None:
    c = cluster()
    c.start_broker()
    other = tmp_path / "second-run"
    line = error_line(invoke("broker", "--run-dir", str(other), "--config", str(c.config_path)))
    assert "busy" in line
    assert str(c.ports[0]) in line
    assert c.status().mode == "april"  # the first broker is unharmed (answers within 60 s)


def test_status_json_and_table_of_a_running_broker(cluster: Callable[..., Cluster]) -> None:
    c = cluster()
    c.start_broker()
    result = invoke("status", "--broker", c.learner_address, "--json", "--timeout", "60")
    assert result.exit_code == 0, result.output
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1
    state = json.loads(lines[0])
    assert isinstance(state, dict)
    assert {"mode", "version", "ledger", "workers"} <= set(state)
    assert state["mode"] == "april"
    assert state["version"] == 0
    assert state["workers"] == []
    assert state["ledger_balanced"] is True

    text = render(BrokerStatus.from_json(state))  # the printed JSON reads back as the record
    assert "april" in text
    assert f"issued {state['ledger']['issued']}" in text

    table = invoke("status", "--broker", c.learner_address, "--timeout", "60")
    assert table.exit_code == 0, table.output
    assert "ledger" in table.stdout and "workers" in table.stdout


# ---------------------------------------------------------------------------------------------------
# render_status


def render(state: BrokerStatus) -> str:
    out = io.StringIO()
    Console(file=out, width=100).print(render_status(state))
    return out.getvalue()


def hand_state() -> BrokerStatus:
    return BrokerStatus(
        run="r",
        steps=10,
        mode="async",
        version=3,
        epoch=1,
        uptime_s=42.0,
        round=RoundStatus(id=5, open=True, aborting=False, aborts_done=5),
        workers=[
            WorkerStatus(
                id="gpu-node-7",
                engine="sglang",
                slots=64,
                credit=12,
                leases=52,
                tokens_generated=9000,
                version=3,
                pid=4242,
                host="node7",
                last_seen_s=1.5,
                restored=False,
                alive=True,
            )
        ],
        learner=LearnerStatus(id="learner-0", last_seen_s=0.5, waiting_for_batch=True),
        learner_metrics={},
        in_flight_groups=9,
        leased_samples=52,
        queued_samples=4,
        partial_groups=2,
        partial_buffer=6,
        partial_staleness={"0": 4, "1": 2},
        complete_groups=3,
        unacked_batch=None,
        cursor=31,
        ledger=Ledger(
            issued=31, trained=16, complete_waiting=3, in_flight=9, partial=2, dropped={"dynamic_filter": 1}
        ),
        totals=Totals(aborted=20, resumed=14, tokens_generated=9000, samples_finished=70, batches_acked=8),
        eval=None,
        rejected=Rejected(by_reason={"not_leased": 2}, by_peer={"gpu-node-7": {"not_leased": 2}}),
    )


def test_render_status_shows_mode_ledger_and_workers() -> None:
    text = render(hand_state())
    assert "async" in text
    # the ledger cell wraps at this width: check each figure
    for figure in ("issued 31 =", "trained 16", "waiting 3", "in flight 9", "partial 2", "dropped 1"):
        assert figure in text, figure
    row = next(line for line in text.splitlines() if "gpu-node-7" in line)
    for cell in ("sglang", "64", "12", "52", "1.5s", "yes"):
        assert cell in row, (cell, row)
    assert "6 samples (2 groups)" in text  # partial buffer
    lines = text.splitlines()
    assert any(line.startswith("│ 0 ") and "│ 4 " in line for line in lines), text  # staleness 0: 4
    assert any(line.startswith("│ 1 ") and "│ 2 " in line for line in lines), text  # staleness 1: 2


def test_render_status_shows_where_each_worker_and_the_learner_run() -> None:
    state = hand_state()
    text = render(state)
    assert "learner: connected; engine: -" in text  # a learner that has not said (no phase, no engine)
    placed = dataclasses.replace(
        state,
        workers=[dataclasses.replace(state.workers[0], placement="http://node7:30000")],
        learner=dataclasses.replace(
            state.learner, phase="training", engine="DeepSpeed ZeRO-3 on cuda, DeepSpeed FusedAdam, 8 ranks"
        ),
    )
    text = render(placed)
    assert "learner: training; engine: DeepSpeed ZeRO-3 on cuda, DeepSpeed FusedAdam, 8 ranks" in text
    cells = [line.split("│")[2].strip() for line in text.splitlines() if line.count("│") > 3]
    assert "".join(cells) == "sglang·http://node7:30000"  # the engine cell, folded over its lines
    assert "learner: not connected" in render(dataclasses.replace(state, learner=None))


def test_render_status_shows_a_down_engine_with_its_reason_and_the_engine_error_counts() -> None:
    state = hand_state()
    row = next(line for line in render(state).splitlines() if "gpu-node-7" in line)
    assert "│ yes " in row and "0/0" in row and "engine down" not in render(state)
    down = dataclasses.replace(
        state.workers[0],
        engine_ok=False,
        engine_detail="sglang http://node7:30000 does not answer",
        credit=0,
        leases=0,
        failed_by_engine=2,
        returned_by_engine=9,
    )
    text = render(dataclasses.replace(state, workers=[down]))
    row = next(line for line in text.splitlines() if "gpu-node-7" in line)
    assert "DOWN" in row and "2/9" in row and row.rstrip("│ ").endswith("yes")  # down, yet alive
    assert "gpu-node-7: engine down: sglang http://node7:30000 does not answer" in text


def test_render_status_shows_pinned_partials_per_worker_and_restarts() -> None:
    state = hand_state()
    assert "pinned partials" not in render(state)
    worker = dataclasses.replace(state.workers[0], pinned=2)
    totals = dataclasses.replace(state.totals, restarted=1, tokens_restarted=17)
    pinned = dataclasses.replace(
        state, workers=[worker], pinned=2, restarts={"worker_restarted": 1}, totals=totals
    )
    line = next(x for x in render(pinned).splitlines() if "pinned partials" in x)
    assert f"2 samples ({worker.id} 2)" in line and "restarted from prompt 1 (worker restarted 1), 17" in line


def test_render_status_flags_an_unbalanced_ledger_and_a_dead_worker() -> None:
    state = hand_state()
    state = dataclasses.replace(
        state,
        ledger=dataclasses.replace(state.ledger, issued=state.ledger.issued + 1),  # a group lost
        workers=[dataclasses.replace(state.workers[0], alive=False)],
    )
    text = render(state)
    assert "NO" in text
    row = next(line for line in text.splitlines() if "gpu-node-7" in line)
    assert row.rstrip("│ ").endswith("no"), row
