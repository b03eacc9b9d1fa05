"""Child processes of `april up`: start them, notice crashes, restart within a bound, stop them all.

Owns process plumbing only: each child is an `april <role>` command (or another program, such as an
SGLang server) with its own environment additions, in its own session (so a final
SIGKILL of its process group also takes its own children, e.g. a worker's reward runner), logging to
its own file, and on Linux asked to receive SIGTERM if `april up` itself dies (no orphans). A crashed
child is restarted with its restart command line (e.g. with `--resume`) at most `max_restarts` times.
Knows nothing of the broker, the dashboard or what the roles do.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

PR_SET_PDEATHSIG = 1  # prctl option: signal this process when its parent dies (Linux)


@dataclass(frozen=True, slots=True)
class ChildSpec:
    name: str  # "broker", "worker-0", "learner": also the log file's stem
    argv: tuple[str, ...]  # the `april` arguments of the first start
    restart_argv: tuple[str, ...]  # the arguments of a restart (e.g. with --resume)
    log: Path
    max_restarts: int = 3
    env: Mapping[str, str] = field(default_factory=dict)  # set for this child only (CUDA_VISIBLE_DEVICES)
    program: tuple[str, ...] = ()  # a command other than `april` (argv follows it); empty: `april`

    def command(self, argv: Sequence[str]) -> list[str]:
        return [*self.program, *argv] if self.program else april_command(argv)


@dataclass(slots=True)
class Child:
    spec: ChildSpec
    proc: subprocess.Popen[bytes]
    restarts: int = 0
    exit_code: int | None = None  # set once it has exited for good (finished, or out of restarts)


@dataclass(frozen=True, slots=True)
class ChildExit:
    """What `Supervisor.poll` saw: a child that exited, whether it was restarted, and its log's tail."""

    name: str
    code: int
    restarted: bool
    restarts: int
    tail: tuple[str, ...] = field(default=())


def april_command(args: Sequence[str]) -> list[str]:
    """The command line that runs `april ARGS` with this interpreter (no PATH lookup)."""
    return [sys.executable, "-c", "from cli.main import main; main()", *args]


def dying_with_parent() -> None:  # runs in a child between fork and exec
    """Ask (Linux) for SIGTERM when the parent dies, so no child outlives the process that supervises it."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def own_session_dying_with_parent() -> None:  # runs in the child between fork and exec
    os.setsid()
    dying_with_parent()


def log_tail(path: Path, lines: int = 12) -> tuple[str, ...]:
    """The last `lines` lines of a log file (empty if it does not exist)."""
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 16384))
            text = f.read().decode("utf-8", errors="replace")
    except OSError:
        return ()
    return tuple(text.splitlines()[-lines:])


class Supervisor:
    def __init__(self, env: dict[str, str] | None = None) -> None:
        self.children: dict[str, Child] = {}
        self.env = {**os.environ, **(env or {})}

    def _spawn(self, spec: ChildSpec, argv: Sequence[str]) -> subprocess.Popen[bytes]:
        spec.log.parent.mkdir(parents=True, exist_ok=True)
        with open(spec.log, "ab") as out:  # the child keeps its own descriptor
            return subprocess.Popen(
                spec.command(argv),
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                env={**self.env, **spec.env},
                preexec_fn=own_session_dying_with_parent,
            )

    def start(self, spec: ChildSpec) -> Child:
        if spec.name in self.children:
            raise ValueError(f"a child named {spec.name!r} is already supervised")
        child = Child(spec, self._spawn(spec, spec.argv))
        self.children[spec.name] = child
        return child

    def running(self, name: str) -> bool:
        child = self.children.get(name)
        return child is not None and child.exit_code is None and child.proc.poll() is None

    def poll(self, is_done: Callable[[str, int], bool]) -> list[ChildExit]:
        """Check every child once. An exit that `is_done(name, code)` accepts is final; any other exit
        is a crash: restarted with its restart arguments while restarts remain."""
        seen = []
        for child in self.children.values():
            if child.exit_code is not None or (code := child.proc.poll()) is None:
                continue
            tail = () if code == 0 else log_tail(child.spec.log)
            if is_done(child.spec.name, code) or child.restarts >= child.spec.max_restarts:
                child.exit_code = code
                seen.append(ChildExit(child.spec.name, code, False, child.restarts, tail))
                continue
            child.restarts += 1
            child.proc = self._spawn(child.spec, child.spec.restart_argv)
            seen.append(ChildExit(child.spec.name, code, True, child.restarts, tail))
        return seen

    def stop(self, order: Sequence[Sequence[str]], grace_s: float = 5.0) -> None:
        """SIGTERM the children wave by wave (e.g. learner and workers, then the broker), each wave
        given `grace_s` to exit; then SIGKILL whatever is left, with its process group."""
        for wave in order:
            procs = [self.children[n].proc for n in wave if n in self.children]
            for proc in procs:
                if proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError):
                        proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + grace_s
            for proc in procs:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(max(0.0, deadline - time.monotonic()))
        for child in self.children.values():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(child.proc.pid, signal.SIGKILL)  # the child's session: it and its children
            with contextlib.suppress(subprocess.TimeoutExpired):
                child.proc.wait(2.0)
