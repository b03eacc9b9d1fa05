"""What every role's process does the same way at start: log to stderr, stop cleanly on SIGINT/SIGTERM."""

from __future__ import annotations

import logging
import signal
import sys
from collections.abc import Callable
from types import FrameType


def setup_logging() -> None:
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )


def stop_requested() -> Callable[[], bool]:
    """Install SIGINT/SIGTERM handlers; the returned callable turns True once either arrives, so the
    role's loop finishes its iteration and shuts down cleanly (returning leases, saving state)."""
    stopping = False

    def stop(signum: int, frame: FrameType | None) -> None:
        nonlocal stopping
        stopping = True

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    return lambda: stopping
