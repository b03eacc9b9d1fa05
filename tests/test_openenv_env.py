"""OpenEnv environment servers through april (april/envs/openenv_adapter.py, openenv_gateway.py), against
the real openenv-core from PyPI serving tests/openenv_server.py (in a venv of its own, `make
.venv-openenv`: its fastmcp needs mcp 2, verifiers 0.3 pins mcp < 2): an episode played through the
gateway, its state handed to a fresh environment at every step as to another worker, gets the rewards
openenv's own client gets for the same turns; a replayed step is answered once; a gateway restart, a
server restart, a gateway that is down and an idle session each fail the sample with one line, never a
hang; the missing package names the extra; and a real `april up` (sim engine, two workers, APRIL's aborts)
trains OpenEnv episodes, each recorded reward the server's for that transcript."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest
from test_up import check_run, run_up, wait_all_exited

from april.data.records import PromptRecord
from april.envs import openenv_adapter
from april.envs.openenv_adapter import OpenEnvEnvironment, with_gateway
from april.envs.openenv_gateway import Gateway, GatewayError, serve
from april.episode import EnvFailed, EpisodeError, Message, Role, StepKey
from april.failures import Reason
from april.ports import free_ports

REPO = Path(__file__).resolve().parent.parent
SERVER = Path(__file__).resolve().parent / "openenv_server.py"
TURNS = 3  # tests/openenv_server.py's episode length
APRIL = (sys.executable, "-c", "from cli.main import main; main()")
PYTHON = os.environ.get("APRIL_OPENENV_PYTHON") or str(REPO / ".venv-openenv" / "bin" / "python")
_venv = pytest.mark.skipif(
    not Path(PYTHON).exists(),
    reason=f"no openenv-core venv at {PYTHON}: `make .venv-openenv/.installed` (or set APRIL_OPENENV_PYTHON)",
)


def needs_openenv(test: Callable[..., None]) -> Callable[..., None]:
    """Marked `openenv` (`make test-openenv` runs them), and skipped without the openenv-core venv."""
    marked: Callable[..., None] = pytest.mark.openenv(_venv(test))
    return marked


class Server:
    """tests/openenv_server.py under the openenv venv's python, on a port of its own."""

    def __init__(self) -> None:
        (self.port,) = free_ports(1)
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen([PYTHON, str(SERVER), "serve", str(self.port)])
        deadline = time.monotonic() + 120
        from cli.openenv_cmd import server_answers

        while not server_answers(self.url):
            assert self.proc.poll() is None, "the OpenEnv server exited while starting"
            assert time.monotonic() < deadline, "the OpenEnv server did not answer within 120 s"
            time.sleep(0.2)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(30)


class RunningGateway:
    def __init__(self, urls: tuple[str, ...], idle_s: float = 600.0, port: int = 0) -> None:
        self.address = f"tcp://127.0.0.1:{port or free_ports(1)[0]}"
        self.gateway = Gateway(urls, idle_s)
        self._stop = threading.Event()
        self.thread = threading.Thread(
            target=serve, args=(self.gateway, self.address, self._stop.is_set), daemon=True
        )
        self.thread.start()

    def stop(self) -> None:
        self._stop.set()
        self.thread.join(30)
        assert not self.thread.is_alive()


@pytest.fixture(scope="module")
def server() -> Iterator[Server]:
    s = Server()
    s.start()
    yield s
    s.stop()


@pytest.fixture()
def gateway(server: Server) -> Iterator[RunningGateway]:
    g = RunningGateway((server.url,))
    yield g
    g.stop()


def make_env(
    server: Server, gateway: RunningGateway, args: dict[str, object] | None = None
) -> OpenEnvEnvironment:
    return OpenEnvEnvironment(f"openenv:{server.url}", with_gateway(json.dumps(args or {}), gateway.address))


def record(index: int) -> PromptRecord:
    ids = np.zeros(0, dtype=np.int32)
    ids.flags.writeable = False
    return PromptRecord(index, ids, "play", {})


def own_rewards(url: str, jobs: list[tuple[int, list[str]]]) -> list[list[float]]:
    """The rewards openenv's own client (GenericEnvClient, synchronous) gets for each job's turns from
    reset(seed), one episode after another."""
    text = json.dumps([{"seed": seed, "turns": turns} for seed, turns in jobs])
    out = subprocess.run(
        [PYTHON, str(SERVER), "replay", url],
        input=text.encode(),
        capture_output=True,
        timeout=300,
        check=True,
    )
    rewards: list[list[float]] = json.loads(out.stdout)
    return rewards


def turn(text: str) -> Message:
    return Message(Role.ASSISTANT, text)


@needs_openenv
def test_an_episode_plays_as_openenvs_own_client(server: Server, gateway: RunningGateway) -> None:
    texts = ["one two", "three", "four five six seven"]
    step = make_env(server, gateway).reset(record(7))
    assert step.observation == (Message(Role.USER, "prompt: The count is 2. Say some words.\ncount: 2"),)
    for i, text in enumerate(texts):
        # a fresh environment each step, as another worker would make it: the state alone carries the episode
        step = make_env(server, gateway).step(step.state, turn(text), key=StepKey(1, 0, i))
        assert step.done == (i == TURNS - 1)
    (own,) = own_rewards(server.url, [(7, texts)])
    assert step.reward == pytest.approx(sum(own))
    assert gateway.gateway.sessions == {}  # the ended episode's session is closed at once

    last = make_env(server, gateway, {"reward": "last", "observation_fields": ["prompt"]})
    step = last.reset(record(7))
    assert step.observation == (Message(Role.USER, "The count is 2. Say some words."),)
    for text in texts:
        step = last.step(step.state, turn(text))
    assert step.reward == pytest.approx(own[-1])


@needs_openenv
def test_a_replayed_step_gets_its_first_answer(server: Server, gateway: RunningGateway) -> None:
    env = make_env(server, gateway)
    first = env.reset(record(0))
    once = env.step(first.state, turn("a b"), key=StepKey(3, 1, 0))
    again = env.step(first.state, turn("a b"), key=StepKey(3, 1, 0))  # a crashed worker's step, replayed
    assert again == once
    after = env.step(once.state, turn("c"), key=StepKey(3, 1, 1))
    assert "count: 3" in after.observation[0].content  # 0 + 2 + 1: the replay did not step the server again


def lost(call: object) -> EnvFailed:
    with pytest.raises(EnvFailed) as info:
        call()  # type: ignore[operator]
    assert info.value.reason is Reason.ENV_SESSION_LOST
    assert "\n" not in str(info.value)
    return info.value


@needs_openenv
def test_a_gateway_restart_fails_the_episode_with_one_line(server: Server) -> None:
    old = RunningGateway((server.url,))
    env = make_env(server, old)
    step = env.reset(record(1))
    old.stop()
    new = RunningGateway((server.url,), port=int(old.address.rpartition(":")[2]))
    try:
        exc = lost(lambda: env.step(step.state, turn("hi")))
        assert "the gateway restarted" in str(exc)
    finally:
        new.stop()


@needs_openenv
def test_a_server_restart_fails_the_episode_with_one_line() -> None:
    server = Server()
    server.start()
    gateway = RunningGateway((server.url,))
    try:
        env = make_env(server, gateway)
        step = env.reset(record(1))
        server.stop()
        server.start()  # the same URL: the sessions it held are gone
        exc = lost(lambda: env.step(step.state, turn("hi")))
        assert "lost: the OpenEnv server at" in str(exc)
        assert gateway.gateway.sessions == {}
        again = env.reset(record(1))  # the gateway serves the restarted server's new episodes
        assert not again.done
    finally:
        gateway.stop()
        server.stop()


@needs_openenv
def test_a_gateway_that_is_down_fails_within_the_deadline(server: Server) -> None:
    (port,) = free_ports(1)
    env = OpenEnvEnvironment(
        f"openenv:{server.url}", with_gateway('{"timeout_s": 0.5}', f"tcp://127.0.0.1:{port}")
    )
    exc = lost(lambda: env.reset(record(0)))
    assert "did not answer a open within 1.5s" in str(exc)


@needs_openenv
def test_a_server_that_stops_answering_fails_within_the_deadline(
    server: Server, gateway: RunningGateway
) -> None:
    env = make_env(server, gateway, {"timeout_s": 1})
    step = env.reset(record(0))
    exc = lost(lambda: env.step(step.state, turn("hang for a minute")))  # tests/openenv_server.py's HANG
    assert "did not answer a step within 1s" in str(exc)
    assert gateway.gateway.sessions == {}  # dropped: its connection is closed


@needs_openenv
def test_the_gateway_command_serves_until_sigterm(server: Server, tmp_path: Path) -> None:
    from april.envs.openenv_adapter import GatewayClient

    (port,) = free_ports(1)
    address = f"tcp://127.0.0.1:{port}"
    log = tmp_path / "gateway.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            [*APRIL, "openenv-gateway", "--bind", address, "--set", f"env.name=openenv:{server.url}"],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=REPO,
        )
    try:
        answer = GatewayClient(address).call({"t": "ping"}, 60.0)
        assert answer["ok"] is True and answer["sessions"] == 0
        env = OpenEnvEnvironment(f"openenv:{server.url}", with_gateway("", address))
        step = env.reset(record(4))
        assert "count: 4" in step.observation[0].content
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, log.read_text()
    assert f"OpenEnv gateway epoch {answer['epoch']} on {address}" in log.read_text()


@needs_openenv
def test_an_idle_session_is_closed(server: Server) -> None:
    g = RunningGateway((server.url,), idle_s=0.5)
    try:
        env = make_env(server, g)
        step = env.reset(record(0))
        deadline = time.monotonic() + 30
        while g.gateway.sessions and time.monotonic() < deadline:
            time.sleep(0.1)
        assert g.gateway.closed_idle == 1
        exc = lost(lambda: env.step(step.state, turn("late")))
        assert "idle over 0.5s" in str(exc)
    finally:
        g.stop()


def test_the_gateway_opens_sessions_on_its_own_server_only() -> None:
    answer = Gateway(("http://127.0.0.1:1",)).handle({"t": "open", "url": "http://169.254.169.254"})
    assert answer["ok"] is False and "serves http://127.0.0.1:1 only" in answer["error"]


@pytest.mark.parametrize(
    ("spec", "args", "expected"),
    [
        ("openenv:localhost:8000", "", "expected 'openenv:http://HOST:PORT'"),
        ("openenv:http://h:1", "[1]", "env.args = '[1]': expected a JSON object"),
        ("openenv:http://h:1", '{"rewards": "sum"}', "env.args: unknown key 'rewards'"),
        (
            "openenv:http://h:1",
            '{"reward": "mean"}',
            "env.args reward: got 'mean', expected one of sum, last",
        ),
        ("openenv:http://h:1", '{"timeout_s": 0}', "env.args timeout_s: got 0, expected a number > 0"),
    ],
)
def test_bad_settings_are_one_line(spec: str, args: str, expected: str) -> None:
    with pytest.raises(EpisodeError) as info:
        OpenEnvEnvironment(spec, args)
    assert expected in str(info.value) and "\n" not in str(info.value)


def test_a_missing_package_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    from april.config import EnvConfig
    from cli.openenv_cmd import GatewayStartError, check_openenv

    monkeypatch.setitem(sys.modules, "websockets.sync.client", None)
    with pytest.raises(GatewayError, match=r"install it: pip install 'april-rl\[openenv\]'"):
        Gateway(("http://127.0.0.1:1",))
    with pytest.raises(GatewayStartError) as info:  # april up's preflight says it before any process starts
        check_openenv(EnvConfig(name="openenv:http://127.0.0.1:1"))
    assert "pip install 'april-rl[openenv]'" in str(info.value) and "\n" not in str(info.value)


def test_start_up_errors_are_one_line() -> None:
    from actors.episode_driver import open_episode_driver
    from april.config import EnvConfig
    from cli.openenv_cmd import GatewayStartError, check_bind, check_openenv

    (port,) = free_ports(1)
    with pytest.raises(GatewayStartError, match=f"no OpenEnv server answers http://127.0.0.1:{port}/health"):
        check_openenv(EnvConfig(name=f"openenv:http://127.0.0.1:{port}"))  # april up without server_command
    with pytest.raises(EpisodeError, match=r"env\.gateway is empty"):  # a worker started by hand, without one
        open_episode_driver(EnvConfig(name=f"openenv:http://127.0.0.1:{port}"), object(), 1)  # type: ignore[arg-type]
    with pytest.raises(GatewayStartError, match="not a loopback address"):
        check_bind("tcp://10.1.2.3:5600", allow_remote=False)
    check_bind("tcp://10.1.2.3:5600", allow_remote=True)
    with pytest.raises(GatewayStartError, match="expected tcp://HOST:PORT"):
        check_bind("127.0.0.1:5600", allow_remote=False)


def test_an_unreachable_schema_is_one_line() -> None:
    openenv_adapter.action_field.cache_clear()
    with pytest.raises(EnvFailed, match=r"cannot read the action schema at http://127\.0\.0\.1:1/schema"):
        openenv_adapter.action_field("http://127.0.0.1:1", "", 1.0)


@needs_openenv
def test_the_action_field_comes_from_the_schema(server: Server) -> None:
    openenv_adapter.action_field.cache_clear()
    assert openenv_adapter.action_field(server.url, "", 10.0) == "message"  # its one string field
    with pytest.raises(EpisodeError, match="action_field = 'msg': the action has fields"):
        openenv_adapter.action_field(server.url, "msg", 10.0)


# ---------------------------------------------------------------------------------------------------
# a real `april up`


def up_config(tmp_path: Path, model: Path, port: int, steps_extra: str = "") -> Path:
    cfg = tmp_path / "openenv.toml"
    command = f"{PYTHON} {SERVER} serve {port}"
    cfg.write_text(
        '[run]\nmode = "april"\n'
        "[algo]\nrollout_batch_size = 2\nover_sampling_batch_size = 8\nn_samples_per_prompt = 4\n"
        "max_new_tokens = 256\n"
        f'[env]\nname = "openenv:http://127.0.0.1:{port}"\nserver_command = "{command}"\n'
        "max_turns = 8\nmax_turn_tokens = 8\ntool_processes = 2\n"
        f'[worker]\nengine = "sim"\nslots = 4\nmodel = "{model}"\n'
        # responses longer than a whole episode: every turn takes its 8 tokens
        'sim_lengths = "lognormal:median=120,sigma=0.2,cap=160"\nsim_time_scale = 1.0\nsim_decode_ms = 15.0\n'
        f'[learner]\nmodel = "{model}"\nbackend = "sim"\nsim_step_s = 0.2\n' + steps_extra
    )
    return cfg


def prompt_index(row: dict[str, object]) -> int:
    """The record index a reset got (actors.episode_driver's `_record`): its reset's seed."""
    index = str(json.loads(str(row["metadata"])).get("prompt_index", ""))
    return int(index) if index.isdigit() else int(str(row["group_id"]))


def recorded_turns(row: dict[str, object], chat: object) -> list[str]:
    from test_verifiers_env import model_turns

    return [t.content for t in model_turns(row, chat)]


@needs_openenv
def test_april_up_trains_openenv_episodes_through_aborts(tmp_path: Path) -> None:
    from actors.tokenizer import HFTokenizer
    from april.chat import chat_format
    from april.hf import make_tiny_model

    model = make_tiny_model(tmp_path / "tiny", seed=0)
    (port,) = free_ports(1)
    cfg = up_config(tmp_path, model, port)
    run_dir = tmp_path / "run"
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO / "tests"), os.environ.get("PYTHONPATH")))),
    }
    code, out, children = run_up(
        ["--config", str(cfg), "--run-dir", str(run_dir), "--steps", "3", "--workers", "2"], 400, env
    )
    assert code == 0, out
    assert f"env openenv:http://127.0.0.1:{port}: its state is a session the OpenEnv gateway holds" in out
    check_run(run_dir, 3, samples=8)  # the books balance at every step
    rows = [
        r
        for f in sorted((run_dir / "rollouts" / "train").glob("*.parquet"))
        for r in pq.read_table(f).to_pylist()
    ]
    assert len(rows) == 3 * 8
    assert any(r["aborts"] > 0 and r["turns"] > 1 for r in rows), "no episode was aborted mid-episode"
    moved = [r for r in rows if len({p["worker"] for p in r["pieces"] if p["worker"]}) > 1]
    assert moved, "no episode resumed on another worker than it started on"
    chat = chat_format(HFTokenizer(str(model)).tok)
    server = Server()  # a fresh one: the run's has stopped with it
    server.start()
    try:
        for row in rows:
            assert row["finish_reason"] == "stop" and row["status"] == "finished", (
                row["finish_reason"],
                row["error"],
            )
        jobs = [(prompt_index(row), recorded_turns(row, chat)) for row in rows]
        assert all(len(turns) == TURNS for _, turns in jobs)
        own = own_rewards(server.url, jobs)
        assert [r["reward"] for r in rows] == pytest.approx([sum(x) for x in own])
    finally:
        server.stop()
    assert not wait_all_exited(children)


def descendant(pid: int, word: str) -> int | None:
    """A process under `pid` whose command line has `word`."""
    from test_up import child_pids

    todo = child_pids(pid)
    while todo:
        p = todo.pop()
        try:
            if word in Path(f"/proc/{p}/cmdline").read_bytes().decode(errors="replace"):
                return p
        except OSError:
            continue
        todo += child_pids(p)
    return None


@needs_openenv
def test_april_up_goes_on_when_its_gateway_restarts(tmp_path: Path) -> None:
    from test_up import free_port_set

    from april.hf import make_tiny_model

    model = make_tiny_model(tmp_path / "tiny", seed=0)
    (port,) = free_ports(1)
    cfg = up_config(tmp_path, model, port)
    run_dir = tmp_path / "run"
    tests = str(REPO / "tests")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (tests, os.environ.get("PYTHONPATH"))))}
    argv = [
        "--config",
        str(cfg),
        "--run-dir",
        str(run_dir),
        "--steps",
        "4",
        "--workers",
        "2",
        *free_port_set(),
    ]
    proc = subprocess.Popen(
        [*APRIL, "up", "--headless", *argv],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        cwd=REPO,
        env=env,
    )
    try:
        # once a step has trained, kill the gateway (no goodbye) while episodes hold sessions on it
        metrics = run_dir / "metrics.jsonl"
        deadline = time.monotonic() + 400
        while not (metrics.exists() and metrics.read_text().strip()) and proc.poll() is None:
            assert time.monotonic() < deadline, "no step trained within 400 s"
            time.sleep(0.2)
        gateway = descendant(proc.pid, "openenv-gateway")
        assert gateway is not None, "no openenv-gateway process under april up"
        os.kill(gateway, signal.SIGKILL)
        out, _ = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    text = out.decode(errors="replace")
    assert proc.returncode == 0, text
    lines = check_run(run_dir, 4, samples=8)  # the run went on, its books balanced
    errors = [line["errors"] for line in lines]
    assert sum(e.get(Reason.ENV_SESSION_LOST.value, 0) for e in errors) > 0, errors  # type: ignore[attr-defined]
    assert not {k for e in errors for k in e} - {Reason.ENV_SESSION_LOST.value}, errors  # type: ignore[attr-defined]
