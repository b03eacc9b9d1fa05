"""The live dashboard: state folding and derived events, the pure render (fixed-width capture consoles),
the PUB feed on a real loopback socket, the headless lines and `april status --watch` without a broker."""

from __future__ import annotations

import dataclasses
import io
import math
import re
import time
from pathlib import Path
from typing import Any

import msgpack
import pytest
import typer
import zmq
from harness import free_ports
from rich.console import Console
from rich.screen import Screen
from typer.testing import CliRunner

from april import protocol
from april.ledger import Ledger
from april.status import (
    BrokerStatus,
    LearnerStatus,
    Rejected,
    RoundStatus,
    StepFigures,
    Totals,
    WorkerStatus,
)
from cli.dashboard import SPARK_CHARS, export_svg, render, sparkline
from cli.dashboard_feed import StatusFeed, progress_line, run_headless, watch
from cli.dashboard_state import (
    DASH,
    DashboardState,
    Series,
    add_alert,
    add_event,
    apply_status,
    clear_alert,
)
from cli.options import AprilGroup
from cli.status_cmd import StatusError, pub_address, status_command

T0 = 1_700_000_000.0  # wall clock of the first status


def worker(wid: str, **over: Any) -> WorkerStatus:
    w = WorkerStatus(
        id=wid, engine="sim", slots=8, credit=2, leases=6, tokens_generated=0, version=3, pid=100,
        host="node1", last_seen_s=0.2, restored=False, alive=True,
    )  # fmt: skip
    return dataclasses.replace(w, **over)


def status(uptime: float = 10.0, version: int = 3, tokens: int = 0, **over: Any) -> BrokerStatus:
    """A status as broker/status.py builds it."""
    s = BrokerStatus(
        run="gsm8k-tiny", steps=100, mode="april", version=version, epoch=0, uptime_s=uptime,
        round=RoundStatus(id=1, open=True, aborting=False, aborts_done=1),
        workers=[
            worker("w-a", tokens_generated=tokens, version=version),
            worker("w-b", engine="sglang", slots=16, leases=16, tokens_generated=2 * tokens, pid=200),
        ],
        learner=LearnerStatus(id="learner-0", last_seen_s=0.1, waiting_for_batch=False),
        learner_metrics={
            "step": version - 1, "version": version, "loss": 0.01234, "reward_mean": 0.25 + version / 100,
            "accuracy": 0.5, "learner/clip_frac": 0.125, "learner/approx_kl": 0.0012, "learner/wait_s": 0.5,
            "learner_time_s": 2.0, "weight_sync_s": 0.25, "samples_per_s": 12.5, "tokens_per_s": 3000.0,
            "staleness_mean": 0.4, "staleness_max": 2, "offpolicy_token_frac": 0.234, "aborted": 5,
            "resumed": 4,
        },
        in_flight_groups=12, leased_samples=22, queued_samples=3, partial_groups=4,
        partial_buffer=9, partial_staleness={"0": 6, "1": 2, "2": 1}, complete_groups=3,
        unacked_batch=None, cursor=40,
        ledger=Ledger(issued=40, trained=24, complete_waiting=3, in_flight=9, partial=2,
                      dropped={"filtered": 2}),
        totals=Totals(aborted=30, resumed=25, tokens_generated=3 * tokens, samples_finished=100,
                      batches_acked=version),
        eval=None,
        rejected=Rejected(by_reason={}, by_peer={}),
    )  # fmt: skip
    return dataclasses.replace(s, **over)


def with_worker(s: BrokerStatus, i: int, **over: Any) -> BrokerStatus:
    """`s` with worker `i` changed."""
    workers = list(s.workers)
    workers[i] = dataclasses.replace(workers[i], **over)
    return dataclasses.replace(s, workers=workers)


def with_metrics(s: BrokerStatus, **over: float) -> BrokerStatus:
    return dataclasses.replace(s, learner_metrics={**s.learner_metrics, **over})


def text(state: DashboardState, width: int = 120, now: float | None = None) -> str:
    console = Console(width=width, record=True, file=io.StringIO())
    console.print(render(state, T0 if now is None else now))
    out = console.export_text()
    assert max(len(line) for line in out.splitlines()) <= width
    return out


def fed(*statuses: BrokerStatus, source: str = "tcp://127.0.0.1:5557") -> DashboardState:
    """A state that received `statuses` one second apart."""
    state = DashboardState(source=source)
    for i, s in enumerate(statuses):
        apply_status(state, s, T0 - len(statuses) + 1 + i)
    return state


def line_with(out: str, needle: str) -> str:
    return next(line for line in out.splitlines() if needle in line)


def spark_row(out: str, label: str) -> str:
    """The sparkline characters of the `label` row of the "over the run" panel."""
    line = next(line for line in out.splitlines() if re.search(f"{re.escape(label)} +[{SPARK_CHARS}]", line))
    return "".join(c for c in line if c in SPARK_CHARS)


# ---------------------------------------------------------------------------------------------------
# render


@pytest.mark.parametrize("width", [120, 80])
def test_header_shows_run_mode_step_version_elapsed_and_throughput(width: int) -> None:
    out = text(fed(status(60.0, tokens=1000), status(61.0, tokens=1500)), width)
    for needle in ("run gsm8k-tiny", "mode april", "step 3/100", "policy v3", "elapsed 01:01"):
        assert needle in out, needle
    assert "1.5k tok/s generated" in out  # 3 x 500 tokens in one second of broker time
    assert "12.50 samples/s trained" in out
    assert "workers 2/2 alive" in out and "learner training" in out
    assert "tcp://127.0.0.1:5557" in out


@pytest.mark.parametrize("width", [120, 80])
def test_worker_rows_show_busy_slots_tokens_per_second_version_sync_and_liveness(width: int) -> None:
    before = status(10.0, version=4, tokens=0)
    after = with_worker(status(12.0, version=4, tokens=1000), 1, alive=False, last_seen_s=4.0, version=3)
    after = with_worker(after, 0, weights_transport="network", weights_sync_s=0.4123)
    out = text(fed(before, after), width)
    a, b = line_with(out, "w-a"), line_with(out, "w-b")
    assert "6/8" in a and "500" in a and "v4" in a and " up " in a  # 1000 tokens over 2 s
    assert "network 0.41s" in a  # how v4 came and how long it took to serve it
    assert "16/16" in b and "1.0k" in b and "v3" in b and "dead" in b and "4.0s" in b
    assert ("node1" in a) == (width >= 110)  # hosts only where there is room
    assert "workers 1/2 alive" in out


def styles_of(state: DashboardState, needle: str, width: int = 120) -> set[str]:
    """The styles of the rendered segments whose text holds `needle`."""
    console = Console(width=width, file=io.StringIO(), force_terminal=True)
    lines = console.render_lines(render(state, T0), console.options, pad=False)
    return {str(seg.style) for line in lines for seg in line if needle in seg.text}


@pytest.mark.parametrize("width", [120, 80])
def test_a_down_engine_shows_in_red_with_its_reason_and_what_engine_errors_cost(width: int) -> None:
    detail = "sglang http://gpu-1:30000 does not answer: connection refused"
    down = with_worker(
        status(), 1, engine_ok=False, engine_detail=detail, credit=0, leases=0, failed_by_engine=2,
        returned_by_engine=9,
    )  # fmt: skip
    state = fed(status(), down)
    out = text(state, width)
    assert "engine down" in line_with(out, "w-b") and " up " in line_with(out, "w-a")
    assert "0/16" in line_with(out, "w-b")  # it holds nothing
    assert any("red" in style for style in styles_of(state, "engine down", width))
    reason = line_with(out, "w-b: engine down: ")  # the reason, on a line of its own (wrapped when long)
    assert ("w-b: engine down: " + detail in reason) == (width >= 110)
    assert "sglang http://gpu-1:30000" in reason
    assert "engine errors: 2 samples failed · 9 returned as partials" in out
    assert "engine down" not in text(fed(status()), width) and "engine errors" not in text(
        fed(status()), width
    )


@pytest.mark.parametrize("width", [120, 80])
def test_where_each_worker_and_the_learner_run(width: int) -> None:
    """A worker's engine with its placement ("torch · cuda:0, cuda graphs"), the engine alone while it has
    none (starting, or a broker that predates placements); the learner's engine, device and AdamW."""
    engine = "DeepSpeed ZeRO-0 on cuda, torch fused AdamW, 1 rank"
    placed = with_worker(status(), 0, engine="torch", placement="cuda:0, cuda graphs")
    placed = dataclasses.replace(placed, learner=dataclasses.replace(placed.learner, engine=engine))
    out = text(fed(placed), width)
    assert "torch · cuda:0" in line_with(out, "w-a")  # the rest gives way to the ids at 80 columns
    assert ("torch · cuda:0, cuda graphs" in out) == (width >= 110)
    assert "sglang" in line_with(out, "w-b") and "·" not in line_with(out, "w-b")
    assert "engine    DeepSpeed ZeRO-0 on cuda," in out  # the learner panel (wrapped after it at 80)
    assert f"engine    {DASH}" in text(fed(status()), width)  # not said yet: a dash


def test_rollout_panel_shows_buffers_aborts_histogram_and_offpolicy_share() -> None:
    start = status(10.0, version=3)
    totals = Totals(aborted=34, resumed=26, tokens_generated=0, samples_finished=100, batches_acked=3)
    later = status(11.0, version=3, totals=totals)
    out = text(fed(start, later))
    assert "12 groups · 22 leased" in out
    assert "9 samples · 4 groups" in out and "3 groups waiting" in out
    aborted, resumed = line_with(out, "aborted").split(), line_with(out, "resumed").split()
    assert aborted[aborted.index("aborted") + 1 : aborted.index("aborted") + 4] == ["4", "5", "34"]
    assert resumed[resumed.index("resumed") + 1 : resumed.index("resumed") + 4] == ["1", "4", "26"]
    assert "23.4% of tokens" in out and "mean 0.40 · max 2" in out
    assert "0 ████████████ 6" in out  # the fullest staleness level gets the whole bar
    assert "1 ████░░░░░░░░ 2" in out
    assert "2 ██░░░░░░░░░░ 1" in out
    assert "balanced · issued 40 · trained 24 · dropped 2" in out


def test_staleness_histogram_merges_the_tail_and_says_when_empty() -> None:
    many = {str(k): 1 for k in range(9)}
    out = text(fed(status(partial_staleness=many)))
    assert ">=5" in out and " 8 " not in line_with(out, ">=5")
    assert "(partial buffer empty)" in text(fed(status(partial_staleness={})))


@pytest.mark.parametrize("width", [120, 80])
def test_learner_panel_shows_loss_reward_accuracy_clip_kl_and_step_time_split(width: int) -> None:
    out = text(fed(status(version=7)), width)
    assert "last step 6 -> v7" in out
    assert "0.01234" in line_with(out, "loss")
    assert "0.320" in line_with(out, "reward ")
    assert "0.500" in line_with(out, "accuracy")
    assert "0.125" in line_with(out, "clip frac")  # namespaced as in metrics.jsonl: learner/clip_frac
    assert "1.20e-03" in line_with(out, "approx KL")
    assert DASH in line_with(out, "entropy")  # not sent: a dash
    assert "2.75s" in line_with(out, "step time")
    for part in ("wait 0.50", "train 2.00", "sync 0.25"):
        assert part in out, part


def test_sparklines_follow_reward_accuracy_and_throughput_over_the_run() -> None:
    statuses = [
        with_metrics(status(10.0 + i, version=3 + i, tokens=100 * i * i), accuracy=i / 10) for i in range(8)
    ]
    out = text(fed(*statuses))
    assert spark_row(out, "reward") == "▁▂▃▄▅▆▇█"  # rising one level a step
    assert spark_row(out, "accuracy") == "▁▂▃▄▅▆▇█"
    assert "0.700" in line_with(out, "accuracy ▁")
    tokens = spark_row(out, "tok/s")
    assert len(tokens) == 7 and tokens[-1] == "█"  # one point per status after the first, rising


def test_sparkline_scales_and_fits_its_width() -> None:
    assert sparkline([], 10) == ""
    assert sparkline([0.0, 1.0], 10) == "▁█"
    assert sparkline([2.0, 2.0, 2.0], 10) == "▄▄▄"
    assert len(sparkline([float(i) for i in range(1000)], 40)) == 40
    assert sparkline([float(i) for i in range(1000)], 8) == SPARK_CHARS


def test_series_keeps_the_whole_run_in_bounded_memory() -> None:
    series = Series(capacity=16)
    for i in range(1000):
        series.add(float(i))
    series.add(math.nan)  # skipped
    assert len(series.values) <= 16 and series.stride > 1
    assert series.values[0] < 100 and series.values[-1] > 800


def test_missing_and_nan_metrics_render_as_dashes() -> None:
    nan = float("nan")
    odd = status(learner_metrics={"step": nan, "loss": nan, "reward_mean": nan})  # accuracy not sent
    odd = with_worker(odd, 1, id="[bold]w-b[/", engine="[red]", host="")  # names are never markup
    bare = status(
        workers=[], learner=None, learner_metrics={}, partial_staleness={}, ledger=Ledger(), eval=None
    )  # a broker that has seen nothing yet
    for state in (fed(odd), fed(bare)):
        for width in (120, 80):
            out = text(state, width)
            assert DASH in line_with(out, "loss") and DASH in line_with(out, "reward ")
            assert DASH in line_with(out, "accuracy") and DASH in line_with(out, "last step")
    out = text(fed(odd))
    assert "[bold]w-b[/" in out and "[red]" in out
    assert DASH in line_with(out, "[bold]w-b[/")  # no host: a dash
    bare_out = text(fed(bare))
    assert "no workers connected" in bare_out and "learner not connected" in bare_out
    assert "(partial buffer empty)" in bare_out


def test_before_the_first_status_and_when_the_feed_goes_silent() -> None:
    assert "waiting for the first status from tcp://h:1" in text(DashboardState(source="tcp://h:1"))
    state = fed(status())
    assert "is the broker running" not in text(state, now=T0 + 1)
    assert "no status for 12s: is the broker running?" in text(state, now=T0 + 12)


def test_alerts_show_the_tail_of_a_crashed_childs_log() -> None:
    state = fed(status())
    add_alert(state, "learner", [f"line {i}\n" for i in range(30)] + ["RuntimeError: CUDA out of memory"])
    out = text(state, 80)
    assert "learner crashed: last lines of its log" in out
    assert "RuntimeError: CUDA out of memory" in out and "line 29" in out and "line 10" not in out
    clear_alert(state, "learner")
    assert "crashed" not in text(state)


def test_a_known_console_height_gives_the_event_log_the_lines_left() -> None:
    state = fed(status())
    for i in range(60):
        add_event(state, T0, f"event number {i}")
    console = Console(width=100, height=50, record=True, file=io.StringIO())
    lines = console.render_lines(Screen(render(state, T0, height=50)), console.options, pad=False)
    rendered = ["".join(seg.text for seg in line) for line in lines]
    assert len(rendered) == 50
    assert "event number 59" in rendered[-2] and rendered[-1].startswith("╰")
    assert "event number 8 " not in "\n".join(rendered)  # older ones scrolled out


def test_export_svg_writes_a_screenshot(tmp_path: Path) -> None:
    path = tmp_path / "dashboard.svg"
    export_svg(fed(status(), status(11.0)), path, width=100, now=T0)
    svg = path.read_text()
    assert svg.startswith("<svg") and "gsm8k" in svg


# ---------------------------------------------------------------------------------------------------
# events derived from consecutive statuses


def events_between(before: BrokerStatus, after: BrokerStatus) -> list[str]:
    state = fed(before)
    seen = state.events_total
    apply_status(state, after, T0 + 1)
    return (
        [e.text for e in list(state.events)[seen - state.events_total :]] if state.events_total > seen else []
    )


def test_the_first_status_says_where_it_attached() -> None:
    state = fed(status())
    assert [e.text for e in state.events] == [
        "attached to tcp://127.0.0.1:5557: run gsm8k-tiny, mode april, v3, 2 workers"
    ]


def test_events_for_workers_joining_dying_coming_back_restarting_and_leaving() -> None:
    before = status()
    joined = dataclasses.replace(before, workers=[*before.workers, worker("w-c", host="node9", pid=9)])
    assert events_between(before, joined) == ["worker w-c joined (sim, 8 slots, node9 pid 9)"]
    died = with_worker(before, 0, alive=False, last_seen_s=3.5)
    assert events_between(before, died) == ["worker w-a died: silent for 3.5s"]
    assert events_between(died, before) == ["worker w-a is back"]
    restarted = with_worker(before, 1, pid=201)
    assert events_between(before, restarted) == ["worker w-b restarted (pid 200 → 201)"]
    left = dataclasses.replace(before, workers=before.workers[1:])
    assert events_between(before, left) == ["worker w-a left"]


def test_events_for_an_engine_going_down_and_coming_back() -> None:
    before = status()
    down = with_worker(before, 1, engine_ok=False, engine_detail="sglang http://gpu-1:30000 does not answer")
    assert events_between(before, down) == [
        "worker w-b: engine down: sglang http://gpu-1:30000 does not answer"
    ]
    assert events_between(down, down) == []
    assert events_between(down, before) == ["worker w-b: engine back"]
    joined_down = dataclasses.replace(before, workers=[*before.workers, worker("w-c", engine_ok=False)])
    assert events_between(before, joined_down) == [
        "worker w-c joined (sim, 8 slots, node1 pid 100)",
        "worker w-c: engine down: no reason given",
    ]


def test_events_for_weights_abort_rounds_learner_ledger_and_rejections() -> None:
    before = status(10.0, version=3)
    unbalanced = dataclasses.replace(before.ledger, issued=before.ledger.issued + 1)  # a group lost
    after = status(
        11.0,
        version=4,
        leased_samples=7,
        partial_buffer=5,
        ledger=unbalanced,
        round=RoundStatus(id=2, open=True, aborting=False, aborts_done=2),
        totals=dataclasses.replace(before.totals, aborted=before.totals.aborted + 6),
        rejected=Rejected(by_reason={"stale_lease": 3}, by_peer={}),
    )
    assert events_between(before, after) == [
        "abort round 2 done: 6 samples interrupted, 5 now partial",
        "weights v4 published (step 3: reward 0.290, loss 0.01234)",
        "ledger NOT balanced",
        "3 messages rejected so far (see `april status`)",
    ]
    aborting = status(
        11.0, leased_samples=7, round=RoundStatus(id=4, open=True, aborting=True, aborts_done=1)
    )
    assert events_between(before, aborting) == ["abort rounds 2-4 started: interrupting 7 leased samples"]
    gone = status(11.0, learner=None)
    assert events_between(before, gone) == ["learner learner-0 disconnected"]
    assert events_between(gone, status(12.0)) == ["learner learner-0 connected"]
    assert events_between(status(50.0), status(2.0)) == ["broker restarted"]


def test_events_render_newest_last() -> None:
    state = fed(status())
    add_event(state, T0, "checkpoint step 10 saved", "green")
    out = text(state, 80)
    assert out.index("attached to") < out.index("checkpoint step 10 saved")


# ---------------------------------------------------------------------------------------------------
# headless


def test_progress_line_has_the_step_figures() -> None:
    s = status(version=7)
    line = progress_line(s.step_figures, s.steps)
    assert line == (
        "step 7/100 v7  reward 0.320  acc 0.500  loss 0.01234  12.50 samples/s  3.0k tok/s  "
        "aborted 5  resumed 4"
    )
    assert progress_line(StepFigures.read({}), 100) is None
    assert "reward -" in (progress_line(StepFigures.read({"step": 0, "reward_mean": float("nan")}), 5) or "")
    assert (progress_line(StepFigures.read({"step": 0}), None) or "").startswith("step 1/? ")


def test_learner_phase_shows_while_it_starts() -> None:
    learner = LearnerStatus(
        id="learner-0",
        last_seen_s=0.1,
        waiting_for_batch=False,
        phase="loading model",
        phase_detail="models/tiny",
        phase_s=4.2,
    )
    out = text(fed(status(learner=learner, learner_metrics={})))
    assert "learner loading model (models/tiny) · 4s" in out
    engine = dataclasses.replace(learner, phase="initialising engine", phase_detail="deepspeed zero 0")
    assert "initialising engine (deepspeed zero 0) · 4s" in text(fed(status(learner=engine)))
    waiting = dataclasses.replace(learner, phase="waiting for batch", waiting_for_batch=True)
    assert "learner waiting for a batch" in text(fed(status(learner=waiting)))
    training = dataclasses.replace(learner, phase="training", waiting_for_batch=False)
    assert "learner training" in text(fed(status(learner=training)))
    silent = dataclasses.replace(learner, phase="", phase_detail="", waiting_for_batch=False)
    assert "learner training" in text(fed(status(learner=silent)))  # a learner that reports no phase


# ---------------------------------------------------------------------------------------------------
# the PUB feed, on a real socket


@pytest.fixture
def publisher() -> Any:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = ctx.socket(zmq.PUB)
    port = sock.bind_to_random_port("tcp://127.0.0.1")
    yield sock, f"tcp://127.0.0.1:{port}"
    sock.close(linger=0)
    ctx.term()


def publish(sock: zmq.Socket[bytes], state: BrokerStatus) -> None:
    """Exactly as broker/server.py publishes."""
    sock.send_multipart([b"status", *protocol.encode(protocol.StatusReply(state))])


def first_status(sock: zmq.Socket[bytes], feed: StatusFeed, state: BrokerStatus) -> BrokerStatus:
    """Publish until the subscription is up (a SUB misses what is sent before it joins)."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        publish(sock, state)
        got = feed.poll(50)
        if got is not None:
            return got
    raise AssertionError("the feed received nothing in 60 s")


def test_status_feed_receives_the_newest_status_and_skips_junk(publisher: Any) -> None:
    sock, address = publisher
    with StatusFeed(address) as feed:
        assert first_status(sock, feed, status(1.0)) == status(1.0)
        sock.send_multipart([b"status", b"not a message"])
        sock.send_multipart([b"status", *protocol.encode(protocol.Heartbeat())])
        header, body = protocol.encode(protocol.StatusReply(status(1.5)))
        junk = msgpack.unpackb(body)
        junk["status"]["workers"] = "junk"  # well-formed msgpack, not a status
        sock.send_multipart([b"status", header, msgpack.packb(junk)])
        publish(sock, status(2.0))
        publish(sock, status(3.0))
        deadline, got = time.monotonic() + 60, None
        while got is None or (got.uptime_s < 3.0 and time.monotonic() < deadline):
            got = feed.poll(200) or got
        assert got.uptime_s == 3.0  # the newest; the older one queued with it is skipped
        assert feed.undecodable == 3 and "status.workers: expected a list" in feed.last_error
        assert feed.poll(0) is None


def test_headless_prints_events_and_one_line_per_learner_step(publisher: Any) -> None:
    sock, address = publisher
    out, calls = io.StringIO(), 0

    def tick(state: DashboardState) -> bool:
        nonlocal calls
        calls += 1
        if calls == 1:
            publish(sock, status(2.0, version=4))
        return state.last_step != 3 and calls < 1200  # a cap against hanging: 60 s of 50 ms ticks

    with StatusFeed(address) as feed:
        first_status(sock, feed, status(1.0, version=3))  # warms the subscription up
        publish(sock, status(1.0, version=3))
        run_headless(feed, DashboardState(source=address), tick, out=out, period_s=0.05)
    lines = out.getvalue().splitlines()
    assert "attached to" in lines[0] and any("weights v4 published" in line for line in lines)
    steps = [line for line in lines if line.startswith("step ")]
    assert steps == [progress_line(status(version=v).step_figures, 100) for v in (3, 4)]


def test_watch_refreshes_calls_tick_and_stops_when_tick_says_so(publisher: Any) -> None:
    sock, address = publisher
    console = Console(width=100, height=40, file=io.StringIO(), force_terminal=True)
    seen: list[int] = []

    def tick(state: DashboardState) -> bool:
        if state.statuses == 0:
            publish(sock, status(1.0))
        seen.append(state.statuses)
        return len(seen) < 3000 and (state.statuses == 0 or len(seen) < 10)  # cap: 60 s at 50 Hz

    with StatusFeed(address) as feed:
        watch(feed, DashboardState(source=address), tick, refresh_per_second=50, console=console)
    assert seen[-1] >= 1
    assert "gsm8k-tiny" in console.file.getvalue()  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------------------------------
# april status --watch


def status_app() -> typer.Typer:
    app = typer.Typer(cls=AprilGroup)  # april's one-line errors (cli.options), as cli/main.py's app
    app.command("status")(status_command)
    app.command("other")(lambda: None)  # two commands: `status` stays a subcommand, as in cli/main.py
    return app


def test_status_watch_without_a_broker_exits_with_one_line() -> None:
    (port,) = free_ports(1)
    started = time.monotonic()
    result = CliRunner().invoke(
        status_app(), ["status", "--watch", "--pub", f"tcp://127.0.0.1:{port}", "--timeout", "0.3"]
    )
    assert time.monotonic() - started < 60  # gave up (after its 0.3 s) rather than waiting on forever
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines() == [
        f"april: error: no status from tcp://127.0.0.1:{port} within 0.3s: is the broker running?"
    ]


def test_status_watch_rejects_json_and_a_malformed_broker_address() -> None:
    for args in (["--json"], ["--broker", "localhost"], ["--pub", "tcp://nowhere"]):
        result = CliRunner().invoke(status_app(), ["status", "--watch", *args])
        assert result.exit_code == 2 and result.stderr.startswith("april: error:"), result.output


def test_pub_address_defaults_to_the_brokers_host() -> None:
    assert pub_address("tcp://10.0.0.5:5556", None) == "tcp://10.0.0.5:5557"
    assert pub_address("tcp://10.0.0.5:5556", "tcp://h:9") == "tcp://h:9"
    with pytest.raises(StatusError, match="--broker must look like"):
        pub_address("10.0.0.5", None)


def test_pinned_partials_and_their_restarts_show_per_worker_with_an_event() -> None:
    """Episodes whose state lives in a worker's memory: the rollouts panel counts them per worker and the
    restarts from their prompt; a restart is an event line. Nothing shows while there are none."""
    assert "pinned" not in text(fed(status()))
    before = with_worker(status(10.0, pinned=3), 1, pinned=3)
    restarted = dataclasses.replace(before.totals, restarted=2, tokens_restarted=240)
    after = with_worker(status(11.0, pinned=3, restarts={"worker_lost": 2}, totals=restarted), 1, pinned=3)
    out = text(fed(before, after))
    row = line_with(out, "pinned")
    assert "3 samples (w-b 3) · 2 restarted" in row
    assert events_between(before, after) == [
        "2 pinned partials restarted from their prompt (their worker's memory was lost: 240 tokens dropped)"
    ]
