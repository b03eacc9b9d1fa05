"""`april broker`: run the broker process until SIGINT/SIGTERM, snapshotting on the way out."""

from __future__ import annotations

import errno
import logging
from pathlib import Path

import zmq

from april.config import Config, write_config
from april.ports import is_loopback
from broker.server import Broker
from broker.snapshot import SnapshotError
from cli.options import UserError
from cli.process import setup_logging, stop_requested


class BrokerStartError(UserError):
    """The broker cannot start as configured (busy port, non-loopback bind without keys, ...)."""


def check_bind_host(host: str, curve_keys_dir: str) -> None:
    """Loopback is always allowed; any other address only with CurveZMQ keys (encrypted, authenticated)."""
    if not is_loopback(host) and not curve_keys_dir:
        raise BrokerStartError(
            f"broker.bind_host = {host!r}: binding a non-loopback address needs CurveZMQ keys: run "
            "`april keys generate DIR` and set broker.curve_keys_dir = DIR (or bind 127.0.0.1 and tunnel)"
        )


def run_broker(config: Config, run_dir: Path, resume: bool) -> None:
    check_bind_host(config.broker.bind_host, config.broker.curve_keys_dir)
    setup_logging()
    try:
        broker = Broker(config, run_dir, resume=resume)  # a bad dataset fails here, before RUN_DIR exists
    except SnapshotError as exc:
        raise BrokerStartError(str(exc)) from None
    run_dir.mkdir(parents=True, exist_ok=True)
    try:
        broker.bind()
    except zmq.ZMQError as exc:
        broker.close()
        if exc.errno == errno.EADDRINUSE:
            raise BrokerStartError(
                f"a broker port ({config.broker.worker_port}, {config.broker.learner_port} or "
                f"{config.broker.pub_port}) on {config.broker.bind_host} is busy: is another broker running?"
            ) from None
        raise BrokerStartError(f"cannot bind on {config.broker.bind_host}: {exc}") from None
    write_config(config, run_dir / "config.toml")
    should_stop = stop_requested()
    try:
        broker.serve(should_stop)
    finally:
        broker.close()
        logging.getLogger("april.broker").info("broker stopped; state saved in %s", run_dir / "broker")
