"""`april up`: the supervisor of child processes, the one-line start-up errors, and whole runs.

The supervisor is tested with real child processes (`april` commands that crash or hang); the runs are
real `april up --headless` processes: broker, workers and learner, checked through the run directory
(metrics.jsonl, the ledger) and the process table (no child outlives `april up`).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from april.ports import free_ports
from cli.main import app
from cli.supervisor import ChildSpec, Supervisor, log_tail, own_session_dying_with_parent

REPO = Path(__file__).resolve().parents[1]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie (exited, not yet reaped by its parent) is not alive
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False


def wait_all_exited(pids: list[int], within_s: float = 60.0) -> list[int]:
    """Wait until none of `pids` is alive (a killed process takes a moment to go); returns those left."""
    deadline = time.monotonic() + within_s
    while (left := [pid for pid in pids if alive(pid)]) and time.monotonic() < deadline:
        time.sleep(0.05)
    return left


# ---------------------------------------------------------------------- the supervisor


def test_a_crashing_child_is_restarted_with_its_restart_arguments_then_given_up(tmp_path: Path) -> None:
    sup = Supervisor()
    # `april broker` without --run-dir exits 2 at once: a crash on every start
    spec = ChildSpec("broker", ("broker",), ("broker", "--resume"), tmp_path / "logs" / "broker-0.log", 2)
    sup.start(spec)
    exits = []
    deadline = time.monotonic() + 60
    while len(exits) < 3 and time.monotonic() < deadline:
        exits += sup.poll(lambda name, code: False)
        time.sleep(0.1)
    assert [(e.code, e.restarted, e.restarts) for e in exits] == [(2, True, 1), (2, True, 2), (2, False, 2)]
    assert any("--run-dir" in line for line in exits[-1].tail), exits[-1].tail
    assert not sup.running("broker")


def test_a_finished_child_is_not_restarted(tmp_path: Path) -> None:
    sup = Supervisor()
    sup.start(ChildSpec("learner", ("--help",), ("--help",), tmp_path / "learner.log"))
    sup.children["learner"].proc.wait(60)
    exits = sup.poll(lambda name, code: code == 0)
    assert [(e.name, e.code, e.restarted) for e in exits] == [("learner", 0, False)]
    assert sup.poll(lambda name, code: code == 0) == []


def test_a_child_runs_its_own_program_with_its_own_environment(tmp_path: Path) -> None:
    """A non-april child (an SGLang server) gets its program and its env additions (its GPUs); the
    supervisor's other children do not see them."""
    code = "import os, sys; sys.exit(int(os.environ['APRIL_TEST_EXIT']))"
    sup = Supervisor()
    spec = ChildSpec(
        "sglang-0",
        ("-c", code),
        ("-c", code),
        tmp_path / "s.log",
        0,
        {"APRIL_TEST_EXIT": "7"},
        (sys.executable,),
    )
    sup.start(spec).proc.wait(60)
    assert [(e.name, e.code) for e in sup.poll(lambda name, code: False)] == [("sglang-0", 7)]
    assert "APRIL_TEST_EXIT" not in sup.env


def test_stop_kills_the_child_and_its_own_children(tmp_path: Path) -> None:
    """A child that ignores SIGTERM and has a child of its own: both are gone after stop()."""
    script = tmp_path / "stubborn.py"
    pid_file = tmp_path / "grandchild.pid"
    script.write_text(
        "import signal, subprocess, sys, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        f"p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(p.pid))\n"
        "time.sleep(600)\n"
    )
    sup = Supervisor()
    child = sup.start(ChildSpec("worker-0", ("--help",), ("--help",), tmp_path / "w.log"))
    child.proc.wait(60)
    # swap in the stubborn process through the same spawn path (own session, parent-death signal)
    child.proc = subprocess.Popen([sys.executable, str(script)], preexec_fn=own_session_dying_with_parent)
    deadline = time.monotonic() + 60
    while not (pid_file.exists() and pid_file.read_text()) and time.monotonic() < deadline:
        time.sleep(0.05)
    grandchild = int(pid_file.read_text())
    started = time.monotonic()
    sup.stop([["worker-0"]], grace_s=0.5)
    assert time.monotonic() - started < 60  # did not wait for the child that ignores SIGTERM (600 s)
    assert not wait_all_exited([child.proc.pid, grandchild])


def test_stop_ends_each_wave_before_signalling_the_next(tmp_path: Path) -> None:
    """`april up` stops the learner and workers, then the broker: the broker gets SIGTERM only once the
    first wave has exited (an order, not a speed: the grace is a "did not hang" 60 s)."""
    script, order = tmp_path / "child.py", tmp_path / "order.txt"
    script.write_text(
        "import signal, sys, time\n"
        "def stop(*_):\n"
        f"    open({str(order)!r}, 'a').write(sys.argv[1] + '\\n')\n"
        "    sys.exit(0)\n"
        "signal.signal(signal.SIGTERM, stop)\n"
        f"open({str(tmp_path)!r} + '/' + sys.argv[1] + '.ready', 'w').close()\n"
        "time.sleep(600)\n"
    )
    sup = Supervisor()
    names = ("broker", "worker-0", "learner")
    for name in names:
        child = sup.start(ChildSpec(name, ("--help",), ("--help",), tmp_path / f"{name}.log"))
        child.proc.wait(60)
        child.proc = subprocess.Popen(
            [sys.executable, str(script), name], preexec_fn=own_session_dying_with_parent
        )
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"{n}.ready").exists() for n in names) and time.monotonic() < deadline:
        time.sleep(0.05)
    sup.stop([["learner", "worker-0"], ["broker"]], grace_s=60)
    stopped = order.read_text().split()
    assert sorted(stopped[:2]) == ["learner", "worker-0"] and stopped[2:] == ["broker"], stopped


def test_log_tail_reads_the_last_lines(tmp_path: Path) -> None:
    log = tmp_path / "x.log"
    log.write_text("".join(f"line {i}\n" for i in range(100)))
    assert log_tail(log, 3) == ("line 97", "line 98", "line 99")
    assert log_tail(tmp_path / "missing.log") == ()


# ---------------------------------------------------------------------- one-line start-up errors


def one_line_error(args: list[str]) -> str:
    result = CliRunner().invoke(app, ["up", "--headless", *args])
    assert result.exit_code == 2, result.output
    lines = [x for x in result.output.splitlines() if x.strip()]
    assert len(lines) == 1 and lines[0].startswith("april: error: "), result.output
    return lines[0]


@pytest.fixture
def sim_config(tmp_path: Path) -> Path:
    from april.hf import make_tiny_model

    model = make_tiny_model(tmp_path / "tiny", seed=0)
    cfg = tmp_path / "up.toml"
    cfg.write_text(
        f'[run]\nsteps = 3\n[worker]\nengine = "sim"\nmodel = "{model}"\n[learner]\nmodel = "{model}"\n'
    )
    return cfg


def test_unknown_engine(sim_config: Path, tmp_path: Path) -> None:
    line = one_line_error(
        ["--config", str(sim_config), "--engine", "tensorrt", "--run-dir", str(tmp_path / "r")]
    )
    assert "unknown engine 'tensorrt'" in line


def test_missing_model_directory(sim_config: Path, tmp_path: Path) -> None:
    args = [
        "--config",
        str(sim_config),
        "--set",
        "learner.model=/nowhere/model",
        "--run-dir",
        str(tmp_path / "r"),
    ]
    assert "'/nowhere/model' does not exist" in one_line_error(args)


def test_bad_config_value(sim_config: Path, tmp_path: Path) -> None:
    args = [
        "--config",
        str(sim_config),
        "--set",
        "algo.rollout_batch_size=0",
        "--run-dir",
        str(tmp_path / "r"),
    ]
    assert "algo.rollout_batch_size" in one_line_error(args)


def test_busy_port(sim_config: Path, tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        others = [x for x in free_port_set() if "pub_port" not in x]  # free, whatever else runs here
        args = ["--config", str(sim_config), f"--set=broker.pub_port={port}", *others]
        args += ["--run-dir", str(tmp_path / "r")]
        line = one_line_error(args)
    assert f"broker.pub_port = {port}" in line and "busy" in line


def port_in_time_wait() -> int:
    """A loopback port with no listener whose last connection is in TIME_WAIT, as a run that just ended
    leaves its ports (the side that closes first keeps TIME_WAIT: here the accepting one)."""
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        client = socket.create_connection(("127.0.0.1", port), timeout=60)
        accepted, _ = server.accept()
        accepted.close()  # the server side closes first: its end of the connection goes to TIME_WAIT
        client.close()
    # the old check's plain bind fails here: the port was "busy" without a listener
    with socket.socket() as probe, pytest.raises(OSError):
        probe.bind(("127.0.0.1", port))
    return port


def test_a_port_whose_last_run_just_ended_is_not_busy() -> None:
    from april.config import BrokerConfig, Config, LearnerConfig, WorkerConfig
    from cli.up_cmd import preflight

    port = port_in_time_wait()
    others = free_ports(2)
    config = Config(
        broker=BrokerConfig(pub_port=port, worker_port=others[0], learner_port=others[1]),
        worker=WorkerConfig(engine="sim"),
        learner=LearnerConfig(backend="sim"),
    )
    preflight(config)  # raised "broker.pub_port = P on 127.0.0.1 is busy" before


def test_resume_of_a_directory_that_is_not_a_run(tmp_path: Path) -> None:
    assert "no config.toml" in one_line_error(["--resume", str(tmp_path)])


# ---------------------------------------------------------------------- whole runs


def free_port_set() -> list[str]:
    names = ("worker_port", "learner_port", "pub_port")
    return [f"--set=broker.{n}={p}" for n, p in zip(names, free_ports(3), strict=True)]


def run_up(
    args: list[str], timeout: float, env: dict[str, str] | None = None, headless: bool = True
) -> tuple[int, str, list[int]]:
    """`april up ARGS` as a real process (its output piped: no terminal); returns its exit code, output and
    the pids of its children."""
    proc = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "from cli.main import main; main()",
            "up",
            *(["--headless"] if headless else []),
            *args,
            *free_port_set(),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        cwd=REPO,
        env=env,
    )
    children: set[int] = set()
    deadline = time.monotonic() + timeout
    while proc.poll() is None and time.monotonic() < deadline:
        children |= set(child_pids(proc.pid))
        time.sleep(0.2)
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    return proc.returncode, out.decode(errors="replace"), sorted(children)


def child_pids(pid: int) -> list[int]:
    try:
        out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    except FileNotFoundError:
        return []
    return [int(x) for x in out.split()]


def check_run(run_dir: Path, steps: int, samples: int) -> list[dict[str, object]]:
    from learner.metrics import REQUIRED

    lines = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == list(range(steps))
    assert [x["version"] for x in lines] == list(range(1, steps + 1))
    for line in lines:
        assert set(REQUIRED) <= set(line), set(REQUIRED) - set(line)
        assert line["samples"] == samples
        ledger = line["ledger"]
        assert isinstance(ledger, dict)
        accounted = sum(ledger[k] for k in ("trained", "complete_waiting", "in_flight", "partial"))
        assert ledger["issued"] == accounted + sum(ledger["dropped"].values())
    return lines


def sim_run_config(tmp_path: Path, mode: str) -> Path:
    from april.hf import make_tiny_model

    model = make_tiny_model(tmp_path / "tiny", seed=0)
    cfg = tmp_path / f"{mode}.toml"
    cfg.write_text(
        f'[run]\nmode = "{mode}"\n'
        "[algo]\nrollout_batch_size = 2\nover_sampling_batch_size = 4\nn_samples_per_prompt = 2\n"
        "max_new_tokens = 32\n[data]\nsynthetic_vocab_size = 320\n"
        f'[worker]\nengine = "sim"\nslots = 4\nmodel = "{model}"\n'
        'sim_lengths = "lognormal:median=6,sigma=1.2,cap=32"\nsim_time_scale = 0.02\n'
        f'[learner]\nmodel = "{model}"\nbackend = "torch"\nlr = 1e-3\ncheckpoint_every = 4\n'
    )
    return cfg


def test_sigterm_stops_every_child_and_the_run_resumes_where_it_stopped(tmp_path: Path) -> None:
    cfg, run_dir = sim_run_config(tmp_path, "april"), tmp_path / "run"
    proc = subprocess.Popen(
        [sys.executable, "-c", "from cli.main import main; main()", "up", "--headless", "--config", str(cfg),
         "--run-dir", str(run_dir), "--steps", "1000", *free_port_set()],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=REPO,
    )  # fmt: skip
    children: set[int] = set()
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and (not metrics.exists() or len(metrics.read_text().splitlines()) < 6):
        children |= set(child_pids(proc.pid))
        time.sleep(0.2)
    assert len(children) == 4, children  # broker, 2 workers, learner
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)  # it stops (a generous "did not hang", not a speed)
    assert proc.returncode == 130, out
    assert not wait_all_exited(sorted(children)), out
    done = len(metrics.read_text().splitlines())
    code, out, _ = run_up(["--resume", str(run_dir), "--steps", str(done + 3)], timeout=300)
    assert code == 0, out
    check_run(run_dir, done + 3, samples=4)  # steps 0.. and versions 1.. with no gap and no repeat


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_headless_run_in_each_mode(tmp_path: Path, mode: str) -> None:
    cfg, run_dir = sim_run_config(tmp_path, mode), tmp_path / "run"
    code, out, children = run_up(
        ["--config", str(cfg), "--run-dir", str(run_dir), "--steps", "3"], timeout=300
    )
    assert code == 0, out
    assert [x for x in out.splitlines() if x.startswith("step ")][-1].startswith("step 3/3 v3")
    lines = check_run(run_dir, 3, samples=4)
    assert all(x["mode"] == mode for x in lines)
    if mode == "sync":
        assert all(x["aborted"] == 0 and x["resumed"] == 0 for x in lines)
    assert len(children) == 4 and not wait_all_exited(children)


def test_piped_april_up_prints_progress_and_a_normal_start_says_no_warning(tmp_path: Path) -> None:
    """Found by a user: `april up | tee run.log` printed nothing for the whole run (the dashboard needs a
    terminal, and nothing took its place), and every run began with "engine down, leasing it nothing:
    starting" warnings in the broker's log (each worker starts so, until its engine is built), and the
    learner's DeepSpeed "Setting accelerator to CPU" on a machine without a GPU."""
    cfg, run_dir = sim_run_config(tmp_path, "april"), tmp_path / "run"
    args = ["--config", str(cfg), "--run-dir", str(run_dir), "--steps", "3"]
    args += ["--set", "learner.backend=deepspeed"]  # the default learner
    code, out, children = run_up(args, timeout=300, headless=False)
    assert code == 0, out
    assert [x for x in out.splitlines() if x.startswith("step ")][-1].startswith("step 3/3 v3"), out
    for log in sorted((run_dir / "logs").glob("*.log")):
        warned = [line for line in log.read_text().splitlines() if " WARNING " in line]
        assert not warned, (log.name, warned)
    assert not wait_all_exited(children)


def test_a_run_whose_samples_all_fail_ends_by_itself_with_the_reason_said_once(tmp_path: Path) -> None:
    """Found by a user: a reset that answered no messages kept `april up` running for good (105,000
    warnings in 154 s). The broker stops such a run, the learner exits with the line, and `april up`
    reports it once and ends."""
    cfg, run_dir = sim_run_config(tmp_path, "april"), tmp_path / "run"
    tests = str(Path(__file__).resolve().parent)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, (tests, os.environ.get("PYTHONPATH"))))}
    args = ["--config", str(cfg), "--run-dir", str(run_dir), "--steps", "3", "--set", "learner.backend=sim"]
    args += ["--set", "env.name=episode_envs:EmptyResetEnv", "--set", "env.max_turn_tokens=8"]
    code, out, children = run_up(args, timeout=300, env=env)
    assert code == 1, out
    said = [line for line in out.splitlines() if line.startswith("april: error: ")]
    assert len(said) == 1, out
    assert said[0].startswith("april: error: the run stopped: 64 samples in a row failed alike"), out
    assert said[0].endswith("env_empty_reset: environment reset answered no messages: there is no prompt")
    assert "learner exited 2: not restarted" in out and "restarted (1/" not in out
    assert not wait_all_exited(children)


def test_the_default_run_on_the_tiny_model(tmp_path: Path) -> None:
    """`april up --headless --steps 3` with no config: the built-in task, the shipped tiny model, two torch
    workers and the DeepSpeed learner, in april mode."""
    from april.hf import TINY_MODEL

    if not TINY_MODEL.is_dir():
        pytest.fail(f"the shipped tiny model is missing from {TINY_MODEL}")
    run_dir = tmp_path / "run"
    code, out, children = run_up(["--steps", "3", "--run-dir", str(run_dir), "--set=run.eval_every=3"], 600)
    assert code == 0, out
    lines = check_run(run_dir, 3, samples=8 * 8)
    assert all(x["mode"] == "april" for x in lines)
    assert sum(x["aborted"] for x in lines) > 0 and sum(x["resumed"] for x in lines) > 0, lines
    assert all(0 <= x["accuracy"] <= 1 and x["response_len_max"] <= 256 for x in lines)
    evals = [json.loads(x) for x in (run_dir / "eval.jsonl").read_text().splitlines()]
    assert [e["version"] for e in evals] == [0, 3]  # the baseline and the final evaluation
    assert "held-out accuracy" in out
    assert len(children) == 4 and not wait_all_exited(children)


def up_and_kill_a_worker(
    cfg: Path, run_dir: Path, steps: int, after_steps: int, env: dict[str, str] | None = None
) -> str:
    """`april up --headless` on `cfg` for `steps` steps; once `after_steps` are in its metrics, one of its
    two workers is SIGKILLed. Returns the run's output, once it has exited 0."""
    proc = subprocess.Popen(
        [sys.executable, "-c", "from cli.main import main; main()", "up", "--headless", "--config", str(cfg),
         "--run-dir", str(run_dir), "--steps", str(steps), *free_port_set()],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=REPO, env=env,
    )  # fmt: skip
    metrics = run_dir / "metrics.jsonl"
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline and (
        not metrics.exists() or len(metrics.read_text().splitlines()) < after_steps
    ):
        time.sleep(0.1)
    argv = {
        pid: Path(f"/proc/{pid}/cmdline").read_text(errors="replace").split("\0")
        for pid in child_pids(proc.pid)
    }
    workers = [pid for pid, args in argv.items() if args[3] == "worker"]  # python -c CODE ROLE ...
    assert len(workers) == 2
    os.kill(workers[0], signal.SIGKILL)
    text = proc.communicate(timeout=600)[0].decode(errors="replace")
    assert proc.returncode == 0, text
    return text


def test_a_killed_worker_is_restarted_and_the_run_carries_on(tmp_path: Path) -> None:
    cfg, run_dir = sim_run_config(tmp_path, "april"), tmp_path / "run"
    text = up_and_kill_a_worker(cfg, run_dir, steps=12, after_steps=2)
    assert "exited -9: restarted (1/3)" in text
    check_run(run_dir, 12, samples=4)


def test_the_learner_runs_as_the_ranks_april_up_starts_for_it(tmp_path: Path) -> None:
    """`learner.gpus = 2` on a machine without GPUs: two DeepSpeed ranks over gloo, started by `april
    learner` itself under `april up` (no torchrun line), training every step once; none left after."""
    cfg, run_dir = sim_run_config(tmp_path, "april"), tmp_path / "run"
    cfg.write_text(cfg.read_text().replace('backend = "torch"', 'backend = "deepspeed"\ngpus = 2'))
    proc = subprocess.Popen(
        [sys.executable, "-c", "from cli.main import main; main()", "up", "--headless", "--config", str(cfg),
         "--run-dir", str(run_dir), "--steps", "3", *free_port_set()],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, cwd=REPO,
    )  # fmt: skip
    ranks: set[int] = set()
    while proc.poll() is None:
        ranks |= {r for child in child_pids(proc.pid) for r in child_pids(child)}  # the learner's too
        time.sleep(0.2)
    out = proc.communicate(timeout=60)[0].decode(errors="replace")
    assert proc.returncode == 0, out
    check_run(run_dir, 3, samples=4)
    log = (run_dir / "logs" / "learner-0.log").read_text()
    assert "2 ranks" in log, log[-2000:]
    assert not wait_all_exited(sorted(ranks))


# ---------------------------------------------------------------------- errors a restart would meet again

# Python runs a `sitecustomize` module at every start: this one makes torch report one CUDA GPU. torch here
# is built without CUDA, so starting CUDA on that "GPU" really fails, as on a machine whose driver torch
# cannot use. Every process of the run (the children too) sees it.
UNUSABLE_GPU = "import torch\ntorch.cuda.is_available = lambda: True\ntorch.cuda.device_count = lambda: 1\n"
CUDA_FAILS = "april: error: {role}: CUDA could not start on 'cuda': "


def unusable_gpu_env(tmp_path: Path) -> dict[str, str]:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(UNUSABLE_GPU)
    path = os.pathsep.join(p for p in (str(site), str(REPO), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path}


def test_a_worker_whose_gpu_cannot_start_exits_with_one_line_and_the_startup_code(tmp_path: Path) -> None:
    from april.hf import TINY_MODEL
    from april.startup import STARTUP_EXIT

    args = ["worker", "--engine", "torch", "--model", str(TINY_MODEL), "--set", "worker.device=cuda"]
    result = subprocess.run(
        [sys.executable, "-c", "from cli.main import main; main()", *args],
        env=unusable_gpu_env(tmp_path), cwd=tmp_path, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == STARTUP_EXIT, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(CUDA_FAILS.format(role="worker")), result.stderr
    assert lines[0].endswith('or set worker.device = "cpu"') and "Traceback" not in result.stderr


def test_april_up_reports_a_learner_that_cannot_start_once_and_does_not_restart_it(tmp_path: Path) -> None:
    cfg, run_dir = sim_run_config(tmp_path, "april"), tmp_path / "run"
    args = ["--config", str(cfg), "--run-dir", str(run_dir), "--steps", "2", "--set", "learner.device=cuda"]
    code, out, children = run_up(args, 300, env=unusable_gpu_env(tmp_path))
    assert code == 1, out
    said = [line for line in out.splitlines() if line.startswith("april: error: ")]
    assert len(said) == 1 and said[0].startswith(CUDA_FAILS.format(role="learner")), out
    assert "learner exited 3: not restarted" in out and "restarted (1/" not in out, out
    log = (run_dir / "logs" / "learner-0.log").read_text()
    assert log.count("april: error: ") == 1  # started once
    assert "Traceback" not in out + log
    assert not wait_all_exited(children)


def test_april_up_reports_workers_that_cannot_start_once(tmp_path: Path) -> None:
    """Two workers of one config fail alike: the line is reported once, neither is restarted, and the
    run ends once no worker is left."""
    cfg, run_dir = sim_run_config(tmp_path, "april"), tmp_path / "run"
    args = ["--config", str(cfg), "--run-dir", str(run_dir), "--steps", "2", "--workers", "2"]
    args += ["--set", "worker.engine=torch", "--set", "worker.device=cuda", "--set", "learner.device=cpu"]
    code, out, children = run_up(args, 300, env=unusable_gpu_env(tmp_path))
    assert code == 1, out
    said = [line for line in out.splitlines() if line.startswith("april: error: ")]
    assert len(said) == 1 and said[0].startswith(CUDA_FAILS.format(role="worker")), out
    for i in range(2):
        assert f"worker-{i} exited 3: not restarted" in out, out
        assert (run_dir / "logs" / f"worker-{i}.log").read_text().count("april: error: ") == 1
    assert "restarted (1/" not in out and "Traceback" not in out
    assert not wait_all_exited(children)


def test_a_user_error_or_a_start_error_is_shown_once_on_the_dashboard(tmp_path: Path) -> None:
    """`Run._report` for exits a restart would meet again (2: a user error; 3: could not start): one
    red panel per distinct line naming every child that said it, an event per child, and the run failed
    once no worker is left (`_fatal`)."""
    from test_dashboard import fed, status, text

    from april.config import Config
    from cli.supervisor import ChildExit
    from cli.up_cmd import Run

    specs = [ChildSpec(name, (), (), tmp_path / f"{name}.log") for name in ("broker", "worker-0", "worker-1")]
    run = Run(Config(), tmp_path, specs)
    run.state = fed(status())
    line = "april: error: worker: CUDA could not start on 'cuda': no driver; or set worker.device = \"cpu\""
    run._report(ChildExit("worker-0", 3, False, 0, ("INFO starting", line)))
    run._report(ChildExit("worker-1", 3, False, 0, ("INFO starting", line)))
    assert run.state.start_errors == {line: ["worker-0", "worker-1"]}
    assert run.outcome == "failed: worker-1 exited 3, not restarted"  # no worker left
    shown = text(run.state, 160)
    assert shown.count("CUDA could not start on 'cuda'") == 1
    assert "worker-0, worker-1: not restarted (a restart would fail alike)" in shown
    assert "worker-0 exited 3: not restarted" in shown and "worker-1 exited 3: not restarted" in shown
    run._report(ChildExit("broker", 2, False, 0, ()))  # no error line in its log: it is named with its code
    assert f"april: error: broker exited 2: see {tmp_path / 'broker.log'}" in run.state.start_errors
