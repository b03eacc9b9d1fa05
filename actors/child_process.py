"""A long-lived child process that speaks JSON lines, driven without ever blocking the parent.

Used by `actors.supervisor` (the parent's rules the tool and reward runners share) and by the runners'
children; this module owns the mechanics. Parent side: `JsonLinesChild` starts `python -m MODULE ARGS...`
in its own session with the parent's import path, writes what the pipe takes (`send`), returns the
complete lines that have arrived (`receive`), and kills without waiting (`kill`; `Reaper` collects the
dead). Child side: `child_protocol` moves the protocol off stdin/stdout before any user code runs (a
`print` in a user function goes to stderr, never into the protocol), points stdin at /dev/null, and on
Linux asks for SIGKILL when the parent's thread exits, so a hung child never outlives its worker; `serve`
is a child's whole life (arguments, loading, "ready"/"fatal", then one answer per request).

The pipe carries JSON, never pickle. Knows nothing about rewards, environments or timeouts.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import selectors
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Container, Iterator, Sequence
from typing import Any, TypeVar

_READ_CHUNK = 1 << 16

LoadedT = TypeVar("LoadedT")


class JsonLinesChild:
    """One child process; its stdin and stdout are non-blocking pipes of JSON lines."""

    def __init__(self, module: str, args: Sequence[str]) -> None:
        path = [os.getcwd() if p == "" else p for p in sys.path]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(path)}  # the child sees what we import
        self.proc = subprocess.Popen(
            [sys.executable, "-m", module, *args],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0, env=env, start_new_session=True,
        )  # fmt: skip
        assert self.proc.stdin is not None and self.proc.stdout is not None
        os.set_blocking(self.proc.stdin.fileno(), False)
        os.set_blocking(self.proc.stdout.fileno(), False)
        self.spawned_at = time.monotonic()
        self._out = bytearray()  # bytes not yet written to the child
        self._in = bytearray()  # bytes read from the child, not yet a full line

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def idle_pipe(self) -> bool:
        """Everything sent has been written to the pipe."""
        return not self._out

    def fileno(self) -> int:
        assert self.proc.stdout is not None
        return self.proc.stdout.fileno()

    def send(self, message: dict[str, Any] | bytes) -> None:
        """Queue a message (a dict, or an encoded line) and write what the pipe takes now."""
        self._out += message if isinstance(message, bytes) else encode_line(message)
        self.flush()

    def flush(self) -> None:
        assert self.proc.stdin is not None
        while self._out:
            try:
                n = os.write(self.proc.stdin.fileno(), self._out)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return  # broken pipe: the child died; `receive` sees the end of file
            del self._out[:n]

    def receive(self) -> tuple[list[bytes], bool]:
        """(complete lines that have arrived, whether the child closed its stdout: it is gone). Lines before
        the end of file are returned with it: an exited child may still have unread messages."""
        self.flush()
        lines: list[bytes] = []
        eof = False
        while True:
            try:
                chunk = os.read(self.fileno(), _READ_CHUNK)
            except (BlockingIOError, InterruptedError):
                break
            if not chunk:
                eof = True
                break
            self._in += chunk
        while (end := self._in.find(b"\n")) != -1:
            lines.append(bytes(self._in[: end + 1]))
            del self._in[: end + 1]
        return lines, eof

    def exit_description(self, wait_s: float = 0.05) -> str:
        """How the child ended, after `receive` saw its end of file."""
        try:
            rc = self.proc.wait(timeout=wait_s)
        except subprocess.TimeoutExpired:
            return "closed its pipe"
        return describe_exit(rc)

    def kill(self) -> None:
        """SIGKILL, close the pipes, never wait (hand the child to a Reaper)."""
        with contextlib.suppress(OSError):
            self.proc.kill()
        for stream in (self.proc.stdin, self.proc.stdout):
            with contextlib.suppress(OSError):
                if stream is not None:
                    stream.close()
        self._out.clear()
        self._in.clear()

    def close_input(self, wait_s: float) -> None:
        """Close stdin (an idle child exits at end of file) and give it `wait_s` to do so."""
        assert self.proc.stdin is not None
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=wait_s)


class Reaper:
    """Killed children, collected without waiting (`reap`) or, at close, waited for briefly (`wait`)."""

    def __init__(self) -> None:
        self._dead: list[subprocess.Popen[bytes]] = []

    def add(self, child: JsonLinesChild) -> None:
        self._dead.append(child.proc)

    def reap(self) -> None:
        self._dead = [p for p in self._dead if p.poll() is None]

    def wait(self, wait_s: float = 1.0) -> None:
        for p in self._dead:
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=wait_s)  # after SIGKILL this returns almost at once
        self._dead.clear()


def wait_readable(children: Sequence[JsonLinesChild], wait_s: float) -> None:
    """Block up to `wait_s` until one of the children has output (or has exited)."""
    if not children or wait_s <= 0:
        return
    with selectors.DefaultSelector() as sel:
        for child in children:
            sel.register(child.fileno(), selectors.EVENT_READ)
        sel.select(wait_s)


def encode_line(message: dict[str, Any]) -> bytes:
    return json.dumps(message, ensure_ascii=False).encode() + b"\n"


def describe_exit(rc: int) -> str:
    if rc < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-rc).name}"
    return f"exit code {rc}"


# ---------------------------------------------------------------------------------------------------
# the child side


def set_parent_death_signal() -> None:
    """Linux: SIGKILL this process when the parent's thread exits, so a hung child never outlives it."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            ctypes.CDLL(None).prctl(1, int(signal.SIGKILL))  # 1 = PR_SET_PDEATHSIG


def child_protocol(version: int) -> tuple[Iterator[bytes], Callable[..., None]]:
    """In the child, before any user code: (the lines the parent sends, `send(**message)`). stdout becomes
    stderr and stdin /dev/null, so user code can neither corrupt nor read the protocol."""
    proto_in, proto_out = os.dup(0), os.dup(1)
    os.dup2(2, 1)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    set_parent_death_signal()

    def send(**message: Any) -> None:
        data = memoryview(encode_line({"v": version, **message}))
        while data:
            data = data[os.write(proto_out, data) :]

    def lines() -> Iterator[bytes]:
        with os.fdopen(proto_in, "rb") as inp:
            yield from inp

    return lines(), send


def serve(
    version: int,
    usage: str,
    argv: Sequence[str],
    arity: Container[int],
    load: Callable[..., LoadedT],
    load_error: type[Exception],
    answer: Callable[[LoadedT, dict[str, Any], Callable[..., None]], None],
) -> int:
    """A child's whole life (its exit status): check that `len(argv)` is in `arity`, `load(*argv)`
    (either failing is a "fatal" line; `load_error` carries the reason), say "ready", then
    `answer(loaded, message, send)` for every line the parent sends until it closes the pipe."""
    lines, send = child_protocol(version)
    if len(argv) not in arity:
        send(t="fatal", error=f"usage: {usage}, got {list(argv)!r}")
        return 2
    try:
        loaded = load(*argv)
    except load_error as exc:
        send(t="fatal", error=str(exc))
        return 1
    send(t="ready")
    for line in lines:
        answer(loaded, json.loads(line), send)
    return 0
