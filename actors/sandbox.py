"""Runs untrusted Python snippets, each in a fresh process with no network and CPU, memory, time, output
and file-size limits.

`Sandbox(limits)` finds at start-up how this machine can cut a snippet off the network, by running a probe
through the whole path: as root, new network and PID namespaces with the snippet run as user nobody; else
(or where nobody cannot run this Python) a new user namespace holding them (unprivileged user namespaces).
The new network namespace has only a loopback interface, down: no address, not even 127.0.0.1, can be
reached. Where neither works it refuses with a one-line SandboxError, unless `allow_network` is set.

`run(code)` runs `python -I -u -c CODE` in a fresh temporary working directory with a clean environment,
RLIMIT_CPU, RLIMIT_AS, RLIMIT_FSIZE, RLIMIT_NOFILE and no core files; it is killed past the wall-time limit
or when its output (stdout and stderr, merged) exceeds the limit, and whatever it started dies with it
(the PID namespace). Not isolated: the file system (the snippet can read, and as root in a user namespace
write, what its user can). This file is also the launcher that applies all this (`python -I sandbox.py
CONFIG`, see `_launch`), so it imports only the standard library.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import resource
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from enum import Enum
from typing import Any

CLONE_NEWUSER = 0x10000000
CLONE_NEWNET = 0x40000000
CLONE_NEWPID = 0x20000000
NOBODY = 65534
MAX_CODE_BYTES = 64 << 10  # a snippet travels as one argv string (Linux allows 128 KiB)
_PROBE_CODE = "print('ok')"


class SandboxError(Exception):
    """The sandbox cannot run here as configured; one line."""


class Isolation(Enum):
    NETNS_NOBODY = "network namespace, user nobody"
    USER_NETNS = "user and network namespaces"
    NONE = "none: network allowed"


@dataclass(frozen=True, slots=True)
class SandboxLimits:
    cpu_s: int = 10  # CPU seconds (RLIMIT_CPU): SIGXCPU at the limit (SIGKILL a second later if caught)
    wall_s: float = 15.0  # wall-clock seconds before the process group is killed
    memory_mb: int = 1024  # address space (RLIMIT_AS)
    file_mb: int = 16  # largest file it may write (RLIMIT_FSIZE)
    output_bytes: int = 16 << 10  # stdout + stderr kept; more kills the process
    open_files: int = 64  # RLIMIT_NOFILE
    allow_network: bool = False  # run without network isolation where namespaces are unavailable

    def __post_init__(self) -> None:
        for name in ("cpu_s", "wall_s", "memory_mb", "file_mb", "output_bytes", "open_files"):
            if not getattr(self, name) > 0:
                raise SandboxError(f"sandbox {name}: got {getattr(self, name)!r}, expected > 0")


@dataclass(frozen=True, slots=True)
class RunResult:
    output: str  # stdout and stderr as they interleaved, at most `output_bytes` (decoded, errors replaced)
    exit_code: int | None  # None when the sandbox killed it (see `stopped`)
    stopped: str = ""  # why the sandbox stopped it ("wall time limit of 15 s exceeded", ...), or ""

    def describe(self) -> str:
        """The result as a tool observation: the output, then a status line unless it exited with 0."""
        status = self.stopped or ("" if self.exit_code == 0 else _exit_status(self.exit_code))
        return self.output + (
            ("\n" if self.output and not self.output.endswith("\n") else "") + status if status else ""
        )


class Sandbox:
    def __init__(self, limits: SandboxLimits = SandboxLimits()) -> None:
        self.limits = limits
        self.isolation = self._probe()

    def run(self, code: str) -> RunResult:
        """Run `code` as a fresh `python -I -c` process under the limits; never raises for what the code
        does."""
        if len(code.encode()) > MAX_CODE_BYTES:
            return RunResult(
                "", None, f"code is {len(code.encode())} bytes, more than the {MAX_CODE_BYTES} allowed"
            )
        return self._run(code, self.isolation)

    def _probe(self) -> Isolation:
        modes = (
            [Isolation.NETNS_NOBODY, Isolation.USER_NETNS] if os.geteuid() == 0 else [Isolation.USER_NETNS]
        )
        failures = []
        for mode in modes:
            result = self._run(_PROBE_CODE, mode)
            if result.exit_code == 0 and result.output == "ok\n":
                return mode
            failures.append(
                result.output.strip().splitlines()[-1] if result.output.strip() else result.describe()
            )
        if self.limits.allow_network:
            return Isolation.NONE
        raise SandboxError(
            f"python sandbox: cannot cut snippets off the network ({'; '.join(failures)}); allow "
            "unprivileged user namespaces (sysctl kernel.unprivileged_userns_clone=1), run the worker as "
            "root, or set allow_network to run code with network access"
        )

    def _run(self, code: str, isolation: Isolation) -> RunResult:
        workdir = tempfile.mkdtemp(prefix="april-sandbox-")
        try:
            uid = NOBODY if isolation == Isolation.NETNS_NOBODY else None
            if uid is not None:
                os.chown(workdir, uid, uid)
            config = {
                "code": code,
                "isolation": isolation.name,
                "uid": uid,
                "parent": os.getpid(),
                **asdict(self.limits),
            }
            proc = subprocess.Popen(
                [sys.executable, "-I", os.path.abspath(__file__), json.dumps(config)],
                cwd=workdir,
                env=_clean_environment(workdir),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            return self._collect(proc)
        finally:
            shutil.rmtree(workdir, ignore_errors=True)

    def _collect(self, proc: subprocess.Popen[bytes]) -> RunResult:
        """Read the output until the process exits; kill its group past the wall time or output limit."""
        assert proc.stdout is not None
        limits, out, stopped = self.limits, bytearray(), ""
        deadline = time.monotonic() + limits.wall_s
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    stopped = f"wall time limit of {limits.wall_s:g} s exceeded"
                    break
                if not sel.select(min(left, 1.0)):
                    continue
                chunk = os.read(proc.stdout.fileno(), 1 << 16)
                if not chunk:
                    break
                out += chunk
                if len(out) > limits.output_bytes:
                    stopped = f"output limit of {limits.output_bytes} bytes exceeded"
                    break
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)  # also whatever it started in its group
        proc.stdout.close()
        rc = proc.wait()
        if not stopped and rc == -signal.SIGXCPU:
            stopped = f"CPU time limit of {limits.cpu_s} s exceeded"
        text = bytes(out[: limits.output_bytes]).decode("utf-8", "replace")
        return RunResult(text, None if stopped else rc, stopped)


def _clean_environment(workdir: str) -> dict[str, str]:
    """What the snippet's environment holds: nothing of the worker's (no tokens, no paths), one thread
    for numerical libraries (their thread pools would take the address space and the CPU time)."""
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": workdir,
        "TMPDIR": workdir,
        "LANG": "C.UTF-8",
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
    }


def _exit_status(rc: int | None) -> str:
    if rc is not None and rc < 0:
        with contextlib.suppress(ValueError):
            return f"killed by {signal.Signals(-rc).name}"
    return f"exit code {rc}"


# ---------------------------------------------------------------------------------------------------
# the launcher: runs as `python -I sandbox.py CONFIG` in the snippet's working directory


def _launch(config: dict[str, Any]) -> None:
    """Isolate this process, then run the snippet in a new PID namespace under the limits; exit as the
    snippet did (its exit code, or the signal that killed it). Set-up failures print one line, exit 125.

    Three processes: this launcher, outside the PID namespace, waits for the namespace's init (PID 1),
    which waits for the snippet (PID 2). When init exits, the kernel kills whatever the snippet left in
    the namespace, detached or not; each of the three dies with its parent (PR_SET_PDEATHSIG)."""
    libc = ctypes.CDLL(None, use_errno=True)
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))  # re-raising SIGXCPU below must not dump core
    isolation = Isolation[config["isolation"]]
    if isolation != Isolation.NONE:
        extra = CLONE_NEWUSER if isolation == Isolation.USER_NETNS else 0
        if libc.unshare(CLONE_NEWNET | CLONE_NEWPID | extra) != 0:
            _die(f"unshare ({isolation.value}) failed: {os.strerror(ctypes.get_errno())}")
    if isinstance(config["uid"], int):
        os.setgroups([])
        os.setgid(config["uid"])
        os.setuid(config["uid"])
    _die_with_parent(libc, config["parent"])  # after the uid change, which clears it
    status_r, status_w = os.pipe()  # init -> launcher: the snippet's wait status (init cannot re-raise it)
    init = os.fork()
    if init == 0:
        _die_with_parent(libc, os.getppid())
        snippet = os.fork()
        if snippet == 0:
            _die_with_parent(libc, os.getppid())
            _exec_snippet(config)
        os.write(status_w, str(os.waitpid(snippet, 0)[1]).encode())
        os._exit(0)
    os.close(status_w)
    os.waitpid(init, 0)
    status = os.read(status_r, 64)
    _exit_as(int(status) if status else None)


def _exec_snippet(config: dict[str, Any]) -> None:
    mb = 1 << 20
    limits = {
        resource.RLIMIT_CPU: (config["cpu_s"], config["cpu_s"] + 1),
        resource.RLIMIT_AS: (config["memory_mb"] * mb, config["memory_mb"] * mb),
        resource.RLIMIT_FSIZE: (config["file_mb"] * mb, config["file_mb"] * mb),
        resource.RLIMIT_NOFILE: (config["open_files"], config["open_files"]),
    }
    for which, soft_hard in limits.items():
        resource.setrlimit(which, soft_hard)
    try:
        os.execv(sys.executable, [sys.executable, "-I", "-u", "-c", config["code"]])  # -u: output in order
    except OSError as exc:
        _die(f"cannot run {sys.executable}: {exc.strerror}")


def _die_with_parent(libc: ctypes.CDLL, parent: int) -> None:
    libc.prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
    if os.getppid() != parent:
        os._exit(125)  # the parent exited before the signal was armed


def _exit_as(status: int | None) -> None:
    """Exit as the snippet did: the same exit code, or killed by the same signal (125: unknown)."""
    if status is not None and os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig != signal.SIGKILL:
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    os._exit(os.WEXITSTATUS(status) if status is not None and os.WIFEXITED(status) else 125)


def _die(message: str) -> None:
    print(f"sandbox: {message}", flush=True)
    os._exit(125)


if __name__ == "__main__":
    _launch(json.loads(sys.argv[1]))
