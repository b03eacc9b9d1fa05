"""The learner's ranks as one process group, started by `april learner` itself (no hand-written torchrun).

`april learner` with `learner.gpus` > 1 and no launcher around it (no RANK in its environment) becomes
the group's parent: it starts its own command line once per rank with the environment torchrun gives a
rank (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT), each rank taking
`cuda:LOCAL_RANK` of the GPUs its parent was given. The ranks stay in the parent's session, so a signal to
the parent's process group (`april up`'s final SIGKILL) reaches them all; SIGTERM and SIGINT are passed on;
when one rank fails the others are stopped, and the group exits with the first failure's code (a user or
start-up error keeps its code, so `april up` does not restart what would fail alike). Owns processes
only: what a rank does is `learner.loop`'s.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from types import FrameType

from april.ports import free_ports
from cli.supervisor import dying_with_parent

STOP_GRACE_S = 30.0  # after one rank failed (or a stop), the others get this long before SIGKILL
POLL_S = 0.1


def launched() -> bool:
    """Whether this process is already one rank of a launcher's group (torchrun, deepspeed, ours)."""
    return "RANK" in os.environ


def rank_env(rank: int, ranks: int, port: int) -> dict[str, str]:
    """What torchrun sets for a rank on one node."""
    return {
        "RANK": str(rank),
        "LOCAL_RANK": str(rank),
        "WORLD_SIZE": str(ranks),
        "LOCAL_WORLD_SIZE": str(ranks),
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
    }


def run_ranks(ranks: int, command: Sequence[str] | None = None, env: Mapping[str, str] | None = None) -> int:
    """Run `command` (default: this process's own command line) as `ranks` ranks; their exit code."""
    argv = list(command) if command is not None else [sys.executable, *sys.orig_argv[1:]]
    port = free_ports(1)[0]
    base = dict(os.environ if env is None else env)
    procs = [
        subprocess.Popen(argv, env={**base, **rank_env(r, ranks, port)}, preexec_fn=dying_with_parent)
        for r in range(ranks)
    ]
    stopping: list[int] = []

    def forward(signum: int, frame: FrameType | None) -> None:
        stopping.append(signum)
        _signal_all(procs, signum)

    previous = {s: signal.signal(s, forward) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        return _wait(procs, stopping)
    finally:
        for s, handler in previous.items():
            signal.signal(s, handler)
        _kill_all(procs)


def _wait(procs: list[subprocess.Popen[bytes]], stopping: list[int]) -> int:
    """Until every rank exited: the first non-zero code (the others stopped after it), else 0."""
    failed: int | None = None
    deadline: float | None = None
    while [p.poll() for p in procs].count(None):  # every rank polled, each turn
        if failed is None:
            failed = next((p.returncode for p in procs if p.returncode not in (None, 0)), None)
            if failed is not None:
                _signal_all(procs, signal.SIGTERM)
        if deadline is None and (failed is not None or stopping):
            deadline = time.monotonic() + STOP_GRACE_S
        if deadline is not None and time.monotonic() > deadline:
            _kill_all(procs)
        time.sleep(POLL_S)
    if failed is None:
        failed = next((p.returncode for p in procs if p.returncode != 0), 0)
    return 128 - failed if failed < 0 else failed  # killed by signal N: 128 + N, as a shell says it


def _signal_all(procs: list[subprocess.Popen[bytes]], signum: int) -> None:
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signum)


def _kill_all(procs: list[subprocess.Popen[bytes]]) -> None:
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                p.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(5.0)
