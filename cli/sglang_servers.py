"""The SGLang servers `april up` starts when `worker.engine = "sglang"` names no `worker.sglang_urls`: one
server per engine (a GPU, a tensor-parallel group, or, on CPU, none), worker i driving server i.

Owns the plan (server i's command from `actors.engines.sglang_launch.server_command` with the run's
`worker.sglang_*` settings, its CUDA_VISIBLE_DEVICES, port `worker.sglang_port + i` on 127.0.0.1, its log
RUN_DIR/logs/sglang-<i>.log, the URL its worker is given), the checks before any process starts (the
launch command can start SGLang, the ports are free) and the start-up gate: each server is polled on
/health by a thread of its own until it answers or `worker.sglang_start_timeout_s` passes, and its worker
starts only once it answers. Does not own processes (cli.supervisor restarts a server that dies, as any
child; its worker holds no leases meanwhile and probes it, actors/worker.py) nor the run (cli.up_cmd).
"""

from __future__ import annotations

import errno
import os
import shlex
import shutil
import socket
import subprocess
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from actors.engine import EngineError
from actors.engines.sglang_http import http_call
from actors.engines.sglang_launch import check_server_env, launch_prefix, server_command
from april.config import Config, WorkerConfig
from april.placement import starts_sglang
from cli.supervisor import ChildSpec

SERVER_PREFIX = "sglang-"  # server i is child "sglang-<i>", its worker "worker-<i>"
WORKER_PREFIX = "worker-"
HOST = "127.0.0.1"  # the worker's own host: the adapter hands weights over as local directories
# A server on a GPU the learner trains on too gets this share of its memory for weights + KV cache
# (sglang/srt/arg_groups/memory_hook.py: mem_fraction_static); SGLang's own choice assumes the GPU is its.
SHARED_MEM_FRACTION = 0.4
# run by the launch command's program: exit 0 if it can import module argv[1] (not imported: fast)
FIND_MODULE = "import importlib.util, sys; sys.exit(importlib.util.find_spec(sys.argv[1]) is None)"
HEALTH_POLL_S = 1.0  # between /health tries while a server starts
HEALTH_CALL_S = 30.0  # one /health call: a warmed-up server answers after a one-token generation


def server_name(i: int) -> str:
    return f"{SERVER_PREFIX}{i}"


def server_url(worker: WorkerConfig, i: int) -> str:
    """The URL of server i, which worker i is given as its `worker.sglang_urls`."""
    return f"http://{HOST}:{worker.sglang_port + i}"


def is_server(name: str) -> bool:
    return name.startswith(SERVER_PREFIX)


def server_of(worker_child: str) -> str:
    """The server child of worker child `worker_child` ("worker-3" -> "sglang-3")."""
    return SERVER_PREFIX + worker_child.removeprefix(WORKER_PREFIX)


def worker_of(server: str) -> str:
    """The worker child that drives server child `server` ("sglang-3" -> "worker-3")."""
    return WORKER_PREFIX + server.removeprefix(SERVER_PREFIX)


def server_specs(
    config: Config,
    run_dir: Path,
    groups: Sequence[tuple[str, ...]],
    learner_gpus: Sequence[str] = (),
    max_restarts: int = 3,
) -> list[ChildSpec]:
    """One child per engine: `groups[i]` is engine i's CUDA_VISIBLE_DEVICES entries (empty: the devices
    this process sees, e.g. on CPU), its TP size their count; a group that shares a GPU with
    `learner_gpus` gets SHARED_MEM_FRACTION unless `worker.sglang_args` says otherwise. A restart runs the
    same command: a server comes back with its launch weights, and its worker reloads the newest."""
    w = config.worker
    extra = shlex.split(w.sglang_args)
    prefix = len(launch_prefix(w.sglang_launch))
    specs = []
    for i, group in enumerate(groups):
        shared = bool(set(group) & set(learner_gpus))
        command = server_command(
            w.model,
            port=w.sglang_port + i,
            host=HOST,
            slots=w.slots,
            extra=extra,
            launch=w.sglang_launch,
            tp_size=max(1, len(group)),
            mem_fraction=SHARED_MEM_FRACTION if shared else None,
            seed=config.run.seed + i,  # engine i's own, from the run's seed (as slime seeds engine i)
        )
        argv = tuple(command[prefix:])
        specs.append(
            ChildSpec(
                server_name(i),
                argv,
                argv,
                run_dir / "logs" / f"{server_name(i)}.log",
                max_restarts,
                env={"CUDA_VISIBLE_DEVICES": ",".join(group)} if group else {},
                program=tuple(command[:prefix]),
            )
        )
    return specs


def check_servers(worker: WorkerConfig, engines: int) -> None:
    """What would stop `engines` servers from starting, as one line (EngineError): no model to serve, a
    launch command that is not there or cannot import SGLang, an environment that spoils log-probs, a
    busy port. Nothing to check when the run names its servers (`worker.sglang_urls`)."""
    if not starts_sglang(worker):
        return
    if not worker.model:
        raise EngineError(
            "engine sglang with no worker.sglang_urls: april up starts SGLang servers, which need "
            "worker.model (an HF model directory); or give worker.sglang_urls"
        )
    check_server_env(os.environ)
    check_launch(worker.sglang_launch)
    for i in range(engines):
        check_port(worker, worker.sglang_port + i)


def check_launch(launch: str) -> None:
    """The launch command's program exists, and a `-m MODULE` of it is importable by that program."""
    command = launch_prefix(launch)
    shown = f"worker.sglang_launch = {launch!r}" if launch else f"{command[0]} -m sglang.launch_server"
    program = shutil.which(command[0])
    if program is None:
        raise EngineError(f"{shown}: no program {command[0]!r} (expected the command starting a server)")
    if "-m" in command[:-1]:
        module = command[command.index("-m") + 1].split(".")[0]
        found = subprocess.run(
            [program, "-c", FIND_MODULE, module], capture_output=True, timeout=120, check=False
        )
        if found.returncode != 0:
            raise EngineError(
                f"{shown}: {program} cannot import {module} (install sglang there, point "
                "worker.sglang_launch at SGLang's own environment, or give worker.sglang_urls)"
            )
    elif len(command) > 1 and command[1].endswith(".py") and not Path(command[1]).is_file():
        raise EngineError(f"{shown}: no script {command[1]!r}")


def check_port(worker: WorkerConfig, port: int) -> None:
    if port > 65535:
        raise EngineError(f"worker.sglang_port = {worker.sglang_port}: server port {port} is past 65535")
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds: TIME_WAIT is not busy
        try:
            s.bind((HOST, port))
            s.listen()
        except OSError as exc:
            why = "busy: is another SGLang server running?" if exc.errno == errno.EADDRINUSE else exc.strerror
            raise EngineError(
                f"worker.sglang_port = {worker.sglang_port}: port {port} on {HOST} is {why} "
                "(change it with --set worker.sglang_port=...)"
            ) from None


class ServerGate:
    """Which of a run's servers have answered /health since their process started. `watch` starts a
    daemon thread per server; the run asks `released` for the workers it may start now and `late` for a
    server past its deadline. A server is "starting" until it first answers: an exit then is final."""

    def __init__(self, worker: WorkerConfig, names: Sequence[str]) -> None:
        self.timeout_s = worker.sglang_start_timeout_s
        self.urls = {name: server_url(worker, int(name.removeprefix(SERVER_PREFIX))) for name in names}
        self._started: dict[str, float] = {}  # name -> monotonic time its process started
        self._answered: dict[str, float] = {}  # name -> seconds it took to answer
        self._released: set[str] = set()
        self._gave_up: set[str] = set()  # past the deadline without an answer
        self._lock = threading.Lock()
        self._closed = threading.Event()

    def watch(self, name: str) -> None:
        """Server `name`'s process has just started: poll it until it answers or its deadline passes."""
        self._started[name] = time.monotonic()
        threading.Thread(target=self._poll, args=(name,), daemon=True, name=f"gate-{name}").start()

    def _poll(self, name: str) -> None:
        deadline = self._started[name] + self.timeout_s
        while not self._closed.is_set() and time.monotonic() < deadline:
            try:
                http_call(self.urls[name], "GET", "/health", timeout_s=HEALTH_CALL_S)
            except EngineError:  # refused while it loads, 503 while it warms up
                self._closed.wait(HEALTH_POLL_S)
                continue
            with self._lock:
                self._answered[name] = time.monotonic() - self._started[name]
            return
        with self._lock:
            if not self._closed.is_set():
                self._gave_up.add(name)

    def has_server(self, child: str) -> bool:
        """Whether child `child` is a worker driving a server of this gate (it starts once that answers)."""
        return child.startswith(WORKER_PREFIX) and server_of(child) in self.urls

    def starting(self, name: str) -> bool:
        with self._lock:
            return name in self.urls and name not in self._answered

    def released(self) -> list[tuple[str, float]]:
        """Servers that answered since the last call, with the seconds they took (oldest first)."""
        with self._lock:
            new = [(n, s) for n, s in self._answered.items() if n not in self._released]
        self._released.update(n for n, _ in new)
        return new

    def late(self) -> tuple[str, str] | None:
        """A server that has not answered within `worker.sglang_start_timeout_s`, and one line saying so."""
        with self._lock:
            late = sorted(self._gave_up)
        if not late:
            return None
        name = late[0]
        return name, (
            f"{name} did not answer {self.urls[name]}/health within {self.timeout_s:g}s "
            "(worker.sglang_start_timeout_s)"
        )

    def close(self) -> None:
        self._closed.set()
