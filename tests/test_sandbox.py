"""actors.sandbox and the `python` environment: each limit is broken by code that breaks it.

The network test listens on 127.0.0.1 in the test's own namespace and checks a snippet cannot connect,
while the same snippet run without isolation can (so the failure is the isolation's). Where this machine
cannot make namespaces, the tests that need them skip and say why.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from actors.python_env import TIMEOUT_SLACK_S, PythonEnvironment
from actors.sandbox import Isolation, RunResult, Sandbox, SandboxError, SandboxLimits
from actors.tool_runner import ToolRunner, ToolRunnerSettings
from april.data import PromptRecord
from april.episode import EpisodeError, Message, ResetRequest, Role, StepRequest, ToolCall

LIMITS = SandboxLimits(cpu_s=2, wall_s=60, memory_mb=512, file_mb=1, output_bytes=4096)


def isolated(limits: SandboxLimits = LIMITS) -> Sandbox:
    try:
        return Sandbox(limits)
    except SandboxError as exc:
        pytest.skip(f"this machine cannot make user or network namespaces: {exc}")


@pytest.fixture(scope="module")
def sandbox() -> Sandbox:
    return isolated()


@pytest.fixture
def unisolated(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Make every isolating mode fail its probe, as on a machine without namespaces."""
    real = Sandbox._run

    def run(self: Sandbox, code: str, isolation: Isolation) -> RunResult:
        if isolation != Isolation.NONE:
            return RunResult(
                "sandbox: unshare (user and network namespaces) failed: Operation not permitted\n", 125
            )
        return real(self, code, isolation)

    monkeypatch.setattr(Sandbox, "_run", run)
    yield


@pytest.fixture
def server() -> Iterator[socket.socket]:
    """A TCP server on 127.0.0.1 in the test's network namespace, accepting without blocking."""
    srv = socket.create_server(("127.0.0.1", 0))
    srv.setblocking(False)
    yield srv
    srv.close()


CONNECT = """
import socket
try:
    socket.create_connection(("127.0.0.1", {port}), timeout=5).close()
    print("connected")
except OSError as exc:
    print("refused:", exc)
"""


def accepted(srv: socket.socket) -> bool:
    try:
        srv.accept()[0].close()
    except BlockingIOError:
        return False
    return True


def test_plain_code_runs_and_reports_how_it_ended(sandbox: Sandbox) -> None:
    assert sandbox.isolation in (Isolation.NETNS_NOBODY, Isolation.USER_NETNS)
    ok = sandbox.run("print(sum(range(10)))")
    assert (ok.output, ok.exit_code, ok.stopped, ok.describe()) == ("45\n", 0, "", "45\n")
    failed = sandbox.run("print('before')\nraise ValueError('boom')")
    assert failed.exit_code == 1 and failed.output.startswith("before\nTraceback")
    assert failed.describe().endswith("ValueError: boom\nexit code 1")
    assert sandbox.run("import sys; sys.exit(3)").describe() == "exit code 3"
    assert sandbox.run("import os; os.kill(os.getpid(), 15)").describe() == "killed by SIGTERM"


def test_no_network(sandbox: Sandbox, server: socket.socket) -> None:
    result = sandbox.run(CONNECT.format(port=server.getsockname()[1]))
    assert result.output.startswith("refused: [Errno 101] Network is unreachable"), result.output
    assert not accepted(server)


def test_the_network_test_would_see_a_connection_without_isolation(
    unisolated: None, server: socket.socket
) -> None:
    open_sandbox = Sandbox(SandboxLimits(allow_network=True))
    assert open_sandbox.isolation == Isolation.NONE
    assert open_sandbox.run(CONNECT.format(port=server.getsockname()[1])).output == "connected\n"
    assert accepted(server)


def test_no_isolation_is_refused_unless_allowed(unisolated: None) -> None:
    with pytest.raises(SandboxError) as err:
        Sandbox(SandboxLimits())
    message = str(err.value)
    assert message.startswith("python sandbox: cannot cut snippets off the network (sandbox: unshare")
    assert "set allow_network" in message and "\n" not in message


def test_the_python_environment_refuses_to_start_unisolated(unisolated: None) -> None:
    with pytest.raises(EpisodeError, match=r"^python sandbox: cannot cut snippets off the network"):
        PythonEnvironment()
    assert PythonEnvironment(SandboxLimits(allow_network=True)).sandbox.isolation == Isolation.NONE


def test_cpu_time_limit(sandbox: Sandbox) -> None:
    result = sandbox.run("while True:\n    pass")
    assert (result.exit_code, result.stopped) == (None, "CPU time limit of 2 s exceeded")


def test_memory_limit(sandbox: Sandbox) -> None:
    result = sandbox.run("x = bytearray(4 << 30)\nprint('allocated')")
    assert result.exit_code == 1 and result.output.rstrip().endswith("MemoryError"), result.output
    assert sandbox.run("x = bytearray(100 << 20)\nprint(len(x) >> 20)").output == "100\n"  # under the limit


def test_wall_time_limit() -> None:
    sandbox = isolated(SandboxLimits(wall_s=2))
    result = sandbox.run("print('started', flush=True)\nimport time\ntime.sleep(600)")
    assert (result.output, result.exit_code, result.stopped) == (
        "started\n",
        None,
        "wall time limit of 2 s exceeded",
    )


def test_output_limit(sandbox: Sandbox) -> None:
    result = sandbox.run("print('x' * 100_000_000)")
    assert result.stopped == "output limit of 4096 bytes exceeded" and result.exit_code is None
    assert result.output == "x" * 4096


def test_file_size_limit(sandbox: Sandbox) -> None:
    code = """
import os
try:
    with open("big", "wb") as f:
        for _ in range(100):
            f.write(b"x" * (1 << 20))
except OSError as exc:
    print(exc)
print(os.path.getsize("big"))
"""
    result = sandbox.run(code)
    assert result.output == f"[Errno 27] File too large\n{1 << 20}\n", result.output


def test_open_files_limit() -> None:
    sandbox = isolated(SandboxLimits(open_files=16))
    code = """
files = []
try:
    for i in range(100):
        files.append(open(f"f{i}", "w"))
except OSError as exc:
    print(exc)
"""
    assert sandbox.run(code).output.startswith("[Errno 24] Too many open files")


def test_clean_environment_and_a_fresh_working_directory(
    sandbox: Sandbox, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("APRIL_TEST_SECRET", "do-not-leak")
    code = (
        "import json, os\n"
        "print(json.dumps([os.getcwd(), os.environ['HOME'], sorted(os.environ), os.listdir('.')]))"
    )
    first, second = (json.loads(sandbox.run(code).output) for _ in range(2))
    cwd, home, names, files = first
    assert home == cwd and os.path.basename(cwd).startswith("april-sandbox-") and files == []
    assert "APRIL_TEST_SECRET" not in names and "PYTHONPATH" not in names
    assert second[0] != cwd and not os.path.exists(cwd)  # each run gets its own, removed afterwards


def test_what_the_snippet_starts_dies_with_it(sandbox: Sandbox) -> None:
    """A detached child holding the output pipe would keep the run going until the wall limit; it is
    killed with the snippet's PID namespace instead."""
    code = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(600)\nprint('parent done')"
    assert sandbox.run(code) == RunResult("parent done\n", 0, "")


def test_big_code_is_refused_without_running(sandbox: Sandbox) -> None:
    result = sandbox.run("#" * (100 << 10))
    assert result.stopped == "code is 102400 bytes, more than the 65536 allowed"


def test_the_python_environment_runs_code_and_scores_the_answer() -> None:
    try:
        env = PythonEnvironment(LIMITS)
    except EpisodeError as exc:
        pytest.skip(f"this machine cannot make user or network namespaces: {exc}")
    (tool,) = env.tools
    assert tool.name == "run_python" and tool.repeatable and tool.timeout_s == LIMITS.wall_s + TIMEOUT_SLACK_S
    first = env.reset(PromptRecord(0, np.zeros(0, dtype=np.int32), "What is 6*7?", {"answer": "42"}))
    turn = Message(
        Role.ASSISTANT,
        "",
        (
            ToolCall("call_0", "run_python", {"code": "print(6*7)"}),
            ToolCall("call_1", "run_python", {"src": "1"}),
        ),
    )
    step = env.step(first.state, turn)
    assert [m.content for m in step.observation] == [
        "42\n",
        'error: run_python takes one string argument, code; got {"src": "1"}',
    ]
    assert env.step(first.state, Message(Role.ASSISTANT, "Answer: 42")).reward == 1.0
    assert env.step(first.state, Message(Role.ASSISTANT, "Answer: 41")).reward == 0.0


def test_the_python_environment_runs_in_the_tool_runner() -> None:
    isolated()  # skips where namespaces are unavailable
    with ToolRunner("python", ToolRunnerSettings(processes=1, step_timeout_s=60)) as runner:
        runner.submit(1, ResetRequest(PromptRecord(0, np.zeros(0, dtype=np.int32), "q", {"answer": "3"})))
        results: list[Any] = []
        while not results:
            results = runner.poll(wait_s=1.0)
        assert results[0].step is not None
        code = (
            "import socket\ntry:\n    socket.create_connection(('1.1.1.1', 53), timeout=3)\n"
            "except OSError as e:\n    print(e)"
        )
        runner.submit(
            2,
            StepRequest(
                results[0].step.state,
                Message(Role.ASSISTANT, "", (ToolCall("c", "run_python", {"code": code}),)),
            ),
        )
        results = []
        while not results:
            results = runner.poll(wait_s=1.0)
        assert results[0].step.observation[0].content == "[Errno 101] Network is unreachable\n"
