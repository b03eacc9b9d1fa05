"""`april status`: ask a running broker for its state and print it (a table, or one JSON object:
`BrokerStatus.to_json`, documented in docs/protocol.md section 12); with `--watch`, show the live
dashboard from the broker's PUB feed instead (read-only, until Ctrl-C).

`status_command` is the typer command (`cli/main.py` registers it); the work is in plain functions.
"""

from __future__ import annotations

import json
import re
import time
import uuid
from typing import Annotated

import typer
import zmq
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from april import protocol
from april.codec import ProtocolError
from april.config import BrokerConfig
from april.failures import NOTE_REASONS
from april.keys import ClientKeys, configured_client_keys
from april.ports import endpoint_problem
from april.status import BrokerStatus, WorkerStatus
from april.transport import dealer, recv, send
from cli.dashboard_feed import StatusFeed, watch
from cli.dashboard_state import DashboardState, apply_status
from cli.options import UserError


class StatusError(UserError):
    """No usable answer from the broker."""


def fetch_status(address: str, timeout_s: float, curve: ClientKeys | None = None) -> BrokerStatus:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = dealer(ctx, address, f"status-{uuid.uuid4().hex[:12]}", curve=curve)
    try:
        send(sock, protocol.StatusRequest())
        try:
            reply = recv(sock, int(timeout_s * 1000))
        except ProtocolError as exc:
            raise StatusError(f"broker at {address} sent a malformed reply: {exc}") from None
        if reply is None:
            raise StatusError(f"no broker answered at {address} within {timeout_s:g}s")
        if not isinstance(reply, protocol.StatusReply):
            raise StatusError(f"broker at {address} answered {type(reply).__name__}, expected StatusReply")
        return reply.status
    finally:
        sock.close(linger=0)
        ctx.term()


def engine_state(w: WorkerStatus) -> Text:
    if w.engine_ok:
        return Text("yes")
    if w.engine_detail == protocol.ENGINE_STARTING:
        return Text("starting", "yellow")
    return Text("DOWN", "bold red")


def render_status(status: BrokerStatus) -> Group:
    """The status as rich renderables (pure: tested against a capture console)."""
    ledger = status.ledger
    head = Table.grid(padding=(0, 2))
    head.add_row("mode", status.mode, "version", str(status.version), "uptime", f"{status.uptime_s:.0f}s")
    head.add_row(
        "in flight",
        f"{status.in_flight_groups} groups / {status.leased_samples} leased",
        "partial buffer",
        f"{status.partial_buffer} samples ({status.partial_groups} groups)",
        "complete",
        f"{status.complete_groups} groups",
    )
    ledger_line = Text(
        f"ledger: issued {ledger.issued} = trained {ledger.trained}"
        f" + waiting {ledger.complete_waiting} + in flight {ledger.in_flight}"
        f" + partial {ledger.partial} + dropped {sum(ledger.dropped.values())}"
        f"  ({'balanced' if status.ledger_balanced else 'NOT BALANCED'});"
        f"  rejected messages: {status.rejected.total}"
    )
    learner = status.learner
    learner_line = Text(
        "learner: not connected"
        if learner is None
        else f"learner: {learner.phase or 'connected'}; engine: {learner.engine or '-'}"
    )
    workers = Table(
        "worker",
        "engine",
        "slots",
        "credit",
        "leases",
        "version",
        "weights sync",
        "last seen",
        "engine ok",
        "failed / returned",
        "alive",
        title="workers",
    )
    workers.columns[0].no_wrap = True  # ids must stay whole: other columns give way
    workers.columns[1].overflow = "fold"  # where the engine runs (a URL) folds over lines, cut nowhere
    for w in status.workers:
        workers.add_row(
            Text(w.id),  # Text, not markup: names come from the peers
            Text(w.engine_label),  # and where it runs
            str(w.slots),
            str(w.credit),
            str(w.leases),
            str(w.version),
            w.weights_sync,  # transport and seconds of the version it serves
            f"{w.last_seen_s:.1f}s",
            engine_state(w),  # why it is down: below the table
            f"{w.failed_by_engine}/{w.returned_by_engine}",  # samples engine errors failed / returned
            "yes" if w.alive else "no",
        )
    down = [
        Text.assemble((f"{w.id}: engine down: ", "bold red"), w.engine_detail or "no reason given")
        for w in status.workers
        if not w.engine_ok and w.engine_detail != protocol.ENGINE_STARTING
    ]
    shown = status.pinned or status.totals.restarted
    pinned = [Text(f"pinned partials: {status.pinned_text}")] if shown else []
    staleness = Table("staleness", "partial samples", title="partial buffer staleness")
    for k, v in status.partial_staleness.items():
        staleness.add_row(Text(k), str(v))
    per_sample = status.messages_per_sample
    cost = Text(
        "messages from live workers per sample returned: "
        + ("-" if per_sample is None else f"{per_sample:.2f}")
        + " (worker.result_hold_ms and worker.usage_report_s lower it)"
    )
    return Group(head, ledger_line, *pinned, *_errors(status), learner_line, workers, cost, *down, staleness)


def _errors(status: BrokerStatus) -> list[Text]:
    """The sample errors by reason, the first line of each distinct one, and why the run stopped."""
    counts = ", ".join(f"{reason} {n}" for reason, n in status.errors.items()) or "none"
    out = [Text(f"sample errors (since the broker started): {counts}")]
    for line in status.error_lines:
        style = "yellow" if line.reason in NOTE_REASONS else "red"
        out.append(Text.assemble("  ", (line.text, style), f"  ({line.samples} samples)"))
    if status.stopped:
        out.append(Text(status.stopped, "bold red"))
    return out


def print_status(status: BrokerStatus, as_json: bool) -> None:
    if as_json:
        print(json.dumps(status.to_json()))
    else:
        Console().print(render_status(status))


def pub_address(broker_address: str, pub: str | None) -> str:
    """`pub` if given, else the PUB address beside `broker_address`: same host, default `broker.pub_port`."""
    if pub:
        return pub
    match = re.fullmatch(r"(\w+://[^/]+):\d+", broker_address)
    if match is None:
        raise StatusError(f"--broker must look like tcp://HOST:PORT, got {broker_address!r}")
    return f"{match.group(1)}:{BrokerConfig().pub_port}"


def watch_status(
    address: str,
    timeout_s: float,
    wait: bool,
    console: Console | None = None,
    curve: ClientKeys | None = None,
) -> None:
    """The live dashboard of the broker publishing at `address`, until Ctrl-C. Without `wait`, gives up
    (StatusError) when no status arrives within `timeout_s`; the broker publishes one every second."""
    try:
        feed = StatusFeed(address, curve)
    except zmq.ZMQError as exc:
        raise StatusError(f"cannot subscribe to {address!r}: {exc}") from None
    with feed:
        state = DashboardState(source=address)
        if not wait:
            first = feed.wait(timeout_s)
            if first is None:
                raise StatusError(f"no status from {address} within {timeout_s:g}s: is the broker running?")
            apply_status(state, first, time.time())
        watch(feed, state, console=console)


def status_command(
    broker_address: Annotated[str, typer.Option("--broker", help="The broker's learner port.")] = (
        "tcp://127.0.0.1:5556"
    ),
    as_json: Annotated[bool, typer.Option("--json", help="Print one JSON object.")] = False,
    timeout: Annotated[
        float,
        typer.Option(
            "--timeout", help="Seconds to wait for an answer (--watch: for the first status).", min=0
        ),
    ] = 3.0,
    watch_: Annotated[
        bool,
        typer.Option("--watch", "-w", help="Live full-screen dashboard from the PUB feed (Ctrl-C quits)."),
    ] = False,
    pub: Annotated[
        str | None,
        typer.Option("--pub", help="--watch: the PUB address (default: --broker's host, port 5557)."),
    ] = None,
    wait: Annotated[
        bool, typer.Option("--wait", help="--watch: wait for a broker to appear instead of giving up.")
    ] = False,
    keys: Annotated[
        str,
        typer.Option(
            "--keys",
            envvar="APRIL_BROKER_CURVE_KEYS_DIR",
            help="CurveZMQ key directory (broker.curve_keys_dir) when the broker requires keys.",
        ),
    ] = "",
) -> None:
    """Print a running broker's state (workers, in flight, buffers, ledger); --watch: the live dashboard."""
    for option, address in (("--broker", broker_address), ("--pub", pub or "")):
        problem = endpoint_problem(address) if address else None
        if problem:
            raise StatusError(f"{option} {address!r}: {problem}")
    curve = configured_client_keys(keys)
    if not watch_:
        print_status(fetch_status(broker_address, timeout, curve), as_json)
    elif as_json:
        raise StatusError("--json prints one status; it does not go with --watch")
    else:
        watch_status(pub_address(broker_address, pub), timeout, wait, curve=curve)
