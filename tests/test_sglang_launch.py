"""`april up` starting its own SGLang servers (cli/sglang_servers.py): the plan, the checks before any
process starts, the start-up gate, and whole runs.

The servers of the whole runs are real processes: tests/sglang_launch_server.py, which parses the argv
april gives `python -m sglang.launch_server` with SGLang's own parser and serves the fake rebuilt from
SGLang's source. Those tests need the SGLang virtualenv (APRIL_SGLANG_PYTHON, built by `make
test-sglang`: SGLang 0.5.23 over a CPU torch, and uvicorn) and are marked `sglang`. The plan, the
one-line errors and the runs whose servers never come up need nothing but april.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from sglang_server import FakeSGLangServer
from test_up import check_run, child_pids, free_port_set, one_line_error, run_up, wait_all_exited

from actors.engine import EngineError
from actors.engines.sglang_launch import server_command, wait_ready
from april.config import Config
from april.placement import node_gpus, place
from april.ports import free_port_pair, free_ports
from cli.sglang_servers import SHARED_MEM_FRACTION, ServerGate, check_servers, server_specs
from cli.up_cmd import builtin_config, plan

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "models" / "tiny"
STAND_IN = REPO / "tests" / "sglang_launch_server.py"
SGLANG_PYTHON = Path(os.environ.get("APRIL_SGLANG_PYTHON", REPO / ".venv-sglang" / "bin" / "python"))


def sglang_config(**worker: Any) -> Config:
    base = builtin_config()
    return dataclasses.replace(base, worker=dataclasses.replace(base.worker, engine="sglang", **worker))


def flag(argv: tuple[str, ...] | list[str], name: str) -> str:
    return argv[list(argv).index(name) + 1]


# ---------------------------------------------------------------------- the plan


def test_plan_starts_a_server_per_worker_first_and_gives_each_worker_its_url(tmp_path: Path) -> None:
    launch = "/opt/sglang/bin/python -m sglang.launch_server"
    config = sglang_config(sglang_port=31000, sglang_launch=launch, sglang_args="--mem-fraction-static 0.7")
    specs = plan(config, tmp_path / "config.toml", tmp_path, place(config, (), 2), resume=False)
    assert [s.name for s in specs] == ["sglang-0", "sglang-1", "broker", "worker-0", "worker-1", "learner"]
    for i, server in enumerate(specs[:2]):
        assert server.program == ("/opt/sglang/bin/python", "-m", "sglang.launch_server")
        assert (flag(server.argv, "--host"), flag(server.argv, "--port")) == ("127.0.0.1", str(31000 + i))
        assert flag(server.argv, "--model-path") == config.worker.model
        assert flag(server.argv, "--max-running-requests") == str(config.worker.slots)
        assert flag(server.argv, "--weight-version") == "0" and flag(server.argv, "--tp-size") == "1"
        assert "--skip-tokenizer-init" in server.argv
        assert server.argv[-2:] == ("--mem-fraction-static", "0.7")  # the user's flags last: they win
        assert server.restart_argv == server.argv  # a restart comes back with its launch weights
        assert server.env == {}  # no GPU group: the devices every child sees
        assert server.log == tmp_path / "logs" / f"sglang-{i}.log" and server.max_restarts == 3
    for i, worker in enumerate(specs[3:5]):
        assert worker.argv[-2:] == ("--set", f"worker.sglang_urls=http://127.0.0.1:{31000 + i}")
        assert worker.restart_argv == worker.argv


def test_no_servers_when_the_run_names_its_own_or_runs_another_engine(tmp_path: Path) -> None:
    named = sglang_config(sglang_urls="http://10.0.0.5:30000")
    for config in (named, builtin_config()):
        specs = plan(config, tmp_path / "config.toml", tmp_path, place(config, (), 2), resume=False)
        assert [s.name for s in specs] == ["broker", "worker-0", "worker-1", "learner"]
        assert not any("sglang_urls" in a for s in specs for a in s.argv)
        check_servers(config.worker, 2)  # nothing to check: no server is started


def test_a_server_on_gpus_spans_them_and_shares_a_learners_gpu_by_a_fraction(tmp_path: Path) -> None:
    config = sglang_config(sglang_port=31000)
    specs = server_specs(config, tmp_path, [("0",), ("1", "2")], learner_gpus=("0",))
    assert [s.env for s in specs] == [{"CUDA_VISIBLE_DEVICES": "0"}, {"CUDA_VISIBLE_DEVICES": "1,2"}]
    assert [flag(s.argv, "--tp-size") for s in specs] == ["1", "2"]
    assert flag(specs[0].argv, "--mem-fraction-static") == f"{SHARED_MEM_FRACTION:g}"
    assert "--mem-fraction-static" not in specs[1].argv  # a GPU of its own: SGLang's own choice
    program = specs[0].program
    assert program == (sys.executable, "-m", "sglang.launch_server")  # default: april's own python


def test_on_a_node_each_server_and_its_worker_get_the_engines_gpus(tmp_path: Path) -> None:
    """A node of 8 GPUs, 2 per engine, 2 for the learner: server i spans engine i's GPUs (--tp-size 2,
    SGLang's own memory share: no GPU is the learner's), its worker sees the same, the learner its own."""
    config = sglang_config(gpus_per_engine=2)
    config = dataclasses.replace(config, learner=dataclasses.replace(config.learner, gpus=2))
    specs = {
        s.name: s for s in plan(config, tmp_path / "c.toml", tmp_path, place(config, node_gpus(8, {})), False)
    }
    assert sorted(specs) == sorted(
        ["broker", "learner", *(f"sglang-{i}" for i in range(3)), *(f"worker-{i}" for i in range(3))]
    )
    for i in range(3):
        gpus = f"{2 + 2 * i},{3 + 2 * i}"
        assert specs[f"sglang-{i}"].env == specs[f"worker-{i}"].env == {"CUDA_VISIBLE_DEVICES": gpus}
        assert flag(specs[f"sglang-{i}"].argv, "--tp-size") == "2"
        assert flag(specs[f"sglang-{i}"].argv, "--random-seed") == str(config.run.seed + i)
        assert "--mem-fraction-static" not in specs[f"sglang-{i}"].argv
    assert specs["learner"].env == {"CUDA_VISIBLE_DEVICES": "0,1"}
    assert specs["broker"].env == {"CUDA_VISIBLE_DEVICES": ""}


# ---------------------------------------------------------------------- checks before any process starts


def test_the_launch_command_and_the_ports_are_checked_before_any_process_starts(tmp_path: Path) -> None:
    base = ["--engine", "sglang", "--workers", "1", "--run-dir", str(tmp_path / "r"), *free_port_set()]
    base += [f"--set=worker.sglang_port={free_port_pair()}"]
    missing = one_line_error([*base, "--set", "worker.sglang_launch=/nowhere/python -m sglang.launch_server"])
    assert "worker.sglang_launch = '/nowhere/python -m sglang.launch_server': no program" in missing
    no_module = one_line_error(
        [*base, "--set", f"worker.sglang_launch={sys.executable} -m no_such_sglang_xyz"]
    )
    assert f"{sys.executable} cannot import no_such_sglang_xyz" in no_module
    assert not (tmp_path / "r").exists()  # nothing started, nothing written


def test_a_busy_server_port_is_one_line(tmp_path: Path) -> None:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        config = sglang_config(sglang_port=port, sglang_launch=f"{sys.executable} -c pass")
        with pytest.raises(
            EngineError, match=f"worker.sglang_port = {port}: port {port} on 127.0.0.1 is busy"
        ):
            check_servers(config.worker, 1)
    with pytest.raises(EngineError, match=r"need worker\.model"):
        check_servers(sglang_config(model="", sglang_launch=f"{sys.executable} -c pass").worker, 1)


# ---------------------------------------------------------------------- the start-up gate


def test_the_gate_releases_a_worker_once_its_server_answers_and_names_one_that_never_does() -> None:
    a, b = free_ports(2)
    with FakeSGLangServer(port=a):
        config = sglang_config(sglang_port=a, sglang_start_timeout_s=2.0)
        gate = ServerGate(config.worker, ["sglang-0"])
        assert gate.starting("sglang-0") and gate.has_server("worker-0") and not gate.has_server("worker-1")
        gate.watch("sglang-0")
        deadline = time.monotonic() + 60
        while not (released := gate.released()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert [name for name, _ in released] == ["sglang-0"] and gate.released() == []
        assert not gate.starting("sglang-0") and gate.late() is None
        gate.close()
    silent = ServerGate(sglang_config(sglang_port=b, sglang_start_timeout_s=1.0).worker, ["sglang-0"])
    silent.watch("sglang-0")
    deadline = time.monotonic() + 60
    while (late := silent.late()) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    said = f"sglang-0 did not answer http://127.0.0.1:{b}/health within 1s (worker.sglang_start_timeout_s)"
    assert late == ("sglang-0", said)
    assert silent.starting("sglang-0") and silent.released() == []


def failed_start(tmp_path: Path, launch: str, *extra: str) -> tuple[str, list[int]]:
    """`april up` with servers started by `launch` that never serve: its output and children."""
    run_dir = tmp_path / "run"
    args = ["--engine", "sglang", "--workers", "2", "--steps", "3", "--run-dir", str(run_dir)]
    args += [f"--set=worker.sglang_port={free_port_pair()}", f"--set=worker.sglang_launch={launch}", *extra]
    code, out, children = run_up(args, timeout=300)
    assert code == 1, out[-3000:]
    assert not (run_dir / "logs" / "worker-0.log").exists()  # no worker starts before its server answers
    assert not wait_all_exited(children)
    return out, children


def test_a_server_that_exits_while_starting_fails_the_run_with_its_last_line(tmp_path: Path) -> None:
    launch = shlex.join(
        [sys.executable, "-c", "import sys; print('loading'); sys.exit('CUDA out of memory')"]
    )
    out, _ = failed_start(tmp_path, launch)
    assert "april: error: sglang-0 exited 1 while starting: CUDA out of memory" in out, out[-3000:]
    assert "restarted" not in out  # it would fail alike


def test_a_server_that_never_answers_fails_the_run_at_its_deadline(tmp_path: Path) -> None:
    launch = shlex.join([sys.executable, "-c", "import time; time.sleep(600)"])
    out, children = failed_start(tmp_path, launch, "--set=worker.sglang_start_timeout_s=2")
    assert "did not answer http://127.0.0.1:" in out and "within 2s (worker.sglang_start_timeout_s)" in out
    assert len(children) >= 2  # the servers (and the broker) were running, and were stopped


# A server that answers /health and nothing else (other requests lose their connection: to its worker it
# is unreachable, not wrong), then dies after a few seconds, every time it is started.
FLAKY_SERVER = """
import http.server, sys, threading, time
class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path == "/health":
            self.send_response(200)
            self.end_headers()
        self.close_connection = True
port = int(sys.argv[sys.argv.index("--port") + 1])
server = http.server.HTTPServer(("127.0.0.1", port), Health)
threading.Thread(target=server.serve_forever, daemon=True).start()
time.sleep(4)
sys.exit("scheduler died")
"""


def test_a_server_out_of_restarts_ends_a_run_whose_workers_all_need_it(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    args = ["--engine", "sglang", "--workers", "1", "--steps", "3", "--run-dir", str(run_dir)]
    launch = shlex.join([sys.executable, "-c", FLAKY_SERVER])
    args += [f"--set=worker.sglang_port={free_port_pair()}", f"--set=worker.sglang_launch={launch}"]
    code, out, children = run_up(args, timeout=300)
    assert code == 1, out[-3000:]
    assert all(f"sglang-0 exited 1: restarted ({n}/3)" in out for n in (1, 2, 3)), out[-3000:]
    assert "sglang-0 exited 1: out of restarts" in out and "failed: sglang-0 exited 1 after 3 restarts" in out
    assert "worker-0 exited" not in out  # the worker outlived every server, waiting for one to serve
    assert not wait_all_exited(children)


# ---------------------------------------------------------------------- SGLang's own parser (sglang venv)


@pytest.fixture(scope="module")
def sglang_python() -> Path:
    """The SGLang virtualenv's python, able to import sglang and uvicorn (skipped where there is none)."""
    if not SGLANG_PYTHON.exists():
        pytest.skip(f"no SGLang virtualenv at {SGLANG_PYTHON} (set APRIL_SGLANG_PYTHON; make test-sglang)")
    for module in ("sglang", "uvicorn"):
        probe = subprocess.run(
            [str(SGLANG_PYTHON), "-c", f"import {module}"], capture_output=True, check=False
        )
        if probe.returncode != 0:
            pytest.skip(f"{SGLANG_PYTHON} cannot import {module} (make test-sglang builds it)")
    return SGLANG_PYTHON


PARSE = """
import json, sys
from sglang.srt.server_args import prepare_server_args
keys = ["model_path", "host", "port", "skip_tokenizer_init", "max_running_requests", "weight_version",
        "tp_size", "mem_fraction_static", "enable_deterministic_inference"]
print(json.dumps([{k: getattr(prepare_server_args(argv), k) for k in keys} for argv in json.load(sys.stdin)]))
"""


@pytest.mark.sglang
def test_server_commands_parse_with_sglangs_own_parser(sglang_python: Path) -> None:
    commands = [
        server_command("/m", port=31000, slots=16),
        server_command("/m", port=31001, tp_size=2, mem_fraction=0.4, deterministic=True),
        server_command("/m", port=31002, mem_fraction=0.4, extra=["--mem-fraction-static", "0.7"]),
    ]
    argvs = [c[3:] for c in commands]  # after `python -m sglang.launch_server`
    proc = subprocess.run(
        [str(sglang_python), "-c", PARSE],
        input=json.dumps(argvs),
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    parsed = json.loads(proc.stdout.strip().splitlines()[-1])
    common = {"model_path": "/m", "host": "127.0.0.1", "skip_tokenizer_init": True, "weight_version": "0"}
    assert parsed[0] == {**common, "port": 31000, "max_running_requests": 16, "tp_size": 1,
                         "mem_fraction_static": None, "enable_deterministic_inference": False}  # fmt: skip
    assert parsed[1] == {**common, "port": 31001, "max_running_requests": 8, "tp_size": 2,
                         "mem_fraction_static": 0.4, "enable_deterministic_inference": True}  # fmt: skip
    assert parsed[2]["mem_fraction_static"] == 0.7  # the user's flag, given last, wins


def stand_in(python: Path, eos_per_mille: int = 60) -> str:
    """worker.sglang_launch for the stand-in: the toy model ends a response after ~1/eos_per_mille tokens."""
    return shlex.join([str(python), str(STAND_IN), "--eos-per-mille", str(eos_per_mille), "--"])


@pytest.mark.sglang
def test_the_stand_in_serves_what_its_argv_says_and_exits_0_on_sigterm(
    sglang_python: Path, tmp_path: Path
) -> None:
    port = free_port_pair()
    config = sglang_config(model=str(TINY), sglang_port=port, slots=12, sglang_launch=stand_in(sglang_python))
    (spec,) = server_specs(config, tmp_path, [()])
    proc = subprocess.Popen([*spec.program, *spec.argv], stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_ready(url, proc, 120)
        from actors.engines.sglang_http import http_call

        info = http_call(url, "GET", "/server_info")
        assert (info["version"], info["model_path"], info["weight_version"]) == ("0.5.23", str(TINY), "0")
        assert info["max_running_requests"] == 12 and info["skip_tokenizer_init"] is True
        assert info["context_length"] == 1024  # the tiny model's max_position_embeddings
        body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}}
        answer = http_call(url, "POST", "/generate", body)
        assert len(answer["output_ids"]) == 4 and all(3 <= t < 320 for t in answer["output_ids"])
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0, out.decode()[-3000:]
    assert b"The server is fired up and ready to roll!" in out and b"SIGTERM received" in out


@pytest.mark.sglang
def test_the_stand_in_refuses_what_sglang_refuses(sglang_python: Path) -> None:
    cases = [
        (["--model-path", str(TINY), "--skip-tokenizer-init", "--no-such-flag"], 2,
         "sglang serve: error: unrecognized arguments: --no-such-flag"),
        (["--model-path", str(TINY), "--skip-tokenizer-init", "--context-length", "4096"], 1,
         "User-specified context_length (4096) is greater than the derived context_length (1024)"),
        (["--model-path", "/nowhere/model", "--skip-tokenizer-init"], 1, "OSError: "),  # no model: AutoConfig
    ]  # fmt: skip
    for argv, code, said in cases:
        proc = subprocess.run(
            [str(sglang_python), str(STAND_IN), *argv],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
        )
        assert (proc.returncode, said in proc.stderr) == (code, True), (argv, proc.stderr[-2000:])


# ---------------------------------------------------------------------- whole runs (sglang venv)


@pytest.mark.sglang
def test_april_up_starts_uses_and_stops_its_sglang_servers(sglang_python: Path, tmp_path: Path) -> None:
    run_dir, port = tmp_path / "run", free_port_pair()
    args = ["--engine", "sglang", "--workers", "2", "--steps", "3", "--run-dir", str(run_dir)]
    args += [f"--set=worker.sglang_port={port}", f"--set=worker.sglang_launch={stand_in(sglang_python)}"]
    code, out, children = run_up(args, timeout=600)
    assert code == 0, out[-3000:]
    check_run(run_dir, steps=3, samples=64)
    assert len(children) == 6  # two servers, the broker, two workers, the learner
    assert not wait_all_exited(children)  # every server stopped with the run
    for i in range(2):
        assert f"sglang-{i} answers after" in out
        server_log = (run_dir / "logs" / f"sglang-{i}.log").read_text()
        assert "ready to roll" in server_log and "SIGTERM received" in server_log
        worker_log = (run_dir / "logs" / f"worker-{i}.log").read_text()
        assert f"engine sglang ready (32 slots, http://127.0.0.1:{port + i})" in worker_log


def server_pid(up: int, port: int) -> int:
    """The pid of the stand-in server on `port` among `april up`'s children."""
    for pid in child_pids(up):
        argv = Path(f"/proc/{pid}/cmdline").read_text(errors="replace").split("\0")
        if str(STAND_IN) in argv and flag(argv, "--port") == str(port):
            return pid
    raise AssertionError(f"no server on port {port} among the children of {up}")


@pytest.mark.sglang
def test_a_killed_sglang_server_is_restarted_and_its_worker_serves_again(
    sglang_python: Path, tmp_path: Path
) -> None:
    """One worker: once its server is killed, every later step needs that worker serving again. Weights
    go over the broadcast: before the kill and, once the restarted server has rejoined, after it."""
    run_dir, port = tmp_path / "run", free_port_pair()
    proc = subprocess.Popen(
        [sys.executable, "-c", "from cli.main import main; main()", "up", "--headless", "--engine", "sglang",
         "--workers", "1", "--steps", "6", "--run-dir", str(run_dir), *free_port_set(),
         f"--set=worker.sglang_port={port}", f"--set=worker.sglang_launch={stand_in(sglang_python)}",
         "--set=weights.transport=broadcast", f"--set=weights.port={free_port_pair()}"],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=REPO,
    )  # fmt: skip
    try:
        metrics = run_dir / "metrics.jsonl"
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and (not metrics.exists() or not metrics.read_text().strip()):
            assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
            time.sleep(0.1)
        killed = server_pid(proc.pid, port)
        os.kill(killed, signal.SIGKILL)
        children: set[int] = set()
        while proc.poll() is None and time.monotonic() < deadline + 300:
            children |= set(child_pids(proc.pid))  # the restarted server among them
            time.sleep(0.2)
        out, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    text = out.decode(errors="replace")
    assert proc.returncode == 0, text[-3000:]
    assert "sglang-0 exited -9: restarted (1/3)" in text and "worker-0 exited" not in text
    lines = check_run(run_dir, steps=6, samples=64)
    # killed after step 0: the restarted server, back on its launch weights, rejoined the group, and the
    # last versions reached it by the broadcast again, each read back before it served
    assert [x["workers_synced_broadcast"] for x in lines[-2:]] == [1, 1], lines
    worker_log = (run_dir / "logs" / "worker-0.log").read_text()
    assert "engine down" in worker_log and "engine serves again" in worker_log
    assert (run_dir / "logs" / "sglang-0.log").read_text().count("ready to roll") == 2
    assert len(children - {killed}) == 4  # the restarted server, the broker, the worker, the learner
    assert not wait_all_exited(sorted(children))
