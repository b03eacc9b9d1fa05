"""`april status`: ask a running broker for its state and print it (a table, or one JSON object)."""

from __future__ import annotations

import json
import uuid
from typing import Any

import zmq
from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from april import protocol
from april.codec import ProtocolError
from april.transport import dealer, recv, send


class StatusError(Exception):
    """No usable answer from the broker."""


def fetch_status(address: str, timeout_s: float) -> dict[str, Any]:
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = dealer(ctx, address, f"status-{uuid.uuid4().hex[:12]}")
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
        state: dict[str, Any] = json.loads(reply.state_json)
        return state
    finally:
        sock.close(linger=0)
        ctx.term()


def render_status(state: dict[str, Any]) -> Group:
    """The status as rich renderables (pure: tested against a capture console)."""
    ledger = state["ledger"]
    dropped = sum(ledger["dropped"].values())
    head = Table.grid(padding=(0, 2))
    head.add_row(
        "mode", state["mode"], "version", str(state["version"]), "uptime", f"{state['uptime_s']:.0f}s"
    )
    head.add_row(
        "in flight",
        f"{state['in_flight_groups']} groups / {state['leased_samples']} leased",
        "partial buffer",
        f"{state['partial_buffer']} samples ({state['partial_groups']} groups)",
        "complete",
        f"{state['complete_groups']} groups",
    )
    ledger_line = Text(
        f"ledger: issued {ledger['issued']} = trained {ledger['trained']}"
        f" + waiting {ledger['complete_waiting']} + in flight {ledger['in_flight']}"
        f" + partial {ledger['partial']} + dropped {dropped}"
        f"  ({'balanced' if state['ledger_balanced'] else 'NOT BALANCED'});"
        f"  rejected messages: {state['rejected']['total']}"
    )
    workers = Table(
        "worker", "engine", "slots", "credit", "leases", "version", "last seen", "alive", title="workers"
    )
    for w in state["workers"]:
        workers.add_row(
            w["id"],
            w["engine"],
            str(w["slots"]),
            str(w["credit"]),
            str(w["leases"]),
            str(w["version"]),
            f"{w['last_seen_s']:.1f}s",
            "yes" if w["alive"] else "no",
        )
    staleness = Table("staleness", "partial samples", title="partial buffer staleness")
    for k, v in state["partial_staleness"].items():
        staleness.add_row(k, str(v))
    return Group(head, ledger_line, workers, staleness)


def print_status(state: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(state))
    else:
        Console().print(render_status(state))
