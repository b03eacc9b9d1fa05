"""The `up` phase: `april up --headless` on the device, its whole run timed from the launch.

The built-in run (the task on the shipped tiny model, the torch engine, the DeepSpeed learner) for
`steps` steps with one worker, worker and learner on `params["device"]`, or with `placed` as april up
places it on the machine's GPUs (its `--plan` recorded first), and `sets` added (`--set`
overrides; the smoke size shrinks the batch). Free loopback ports, a scratch run directory. Measured:
seconds from the launch to the first trained step (metrics.jsonl's first line) and to the exit, each
step's time, and samples/s as the run's summary.json reports it. `april up` is stopped (SIGTERM, then
SIGKILL) `STOP_S` before the phase's timeout; a failed run prints its children's log tails into the
phase's log.
"""

from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from april.files import read_jsonl
from april.ports import free_ports
from gpu.record import PhaseRecord

REPO = Path(__file__).resolve().parents[2]
STOP_S = 15.0  # of the phase's time, kept to stop april up in good order before the check kills it


def command(params: dict[str, Any]) -> list[str]:
    """`april up`'s arguments as a user types them (without the ports and the run directory). `placed`:
    as on a node, april up's own placement (no worker count, no device pinned)."""
    args = ["up", "--headless", "--steps", str(params["steps"])]
    if not params.get("placed"):
        device = params["device"]
        args += ["--workers", "1", "--set", f"worker.device={device}", "--set", f"learner.device={device}"]
    for s in params["sets"]:
        args += ["--set", s]
    return args


def stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM (april up stops its children in order), then SIGKILL after 20 s."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def log_tails(run_dir: Path, lines: int = 40) -> None:
    for log in sorted((run_dir / "logs").glob("*.log")):
        tail = log.read_text(errors="replace").splitlines()[-lines:]
        print(f"--- {log.name} (last {len(tail)} lines)\n" + "\n".join(tail), file=sys.stderr)


def run(params: dict[str, Any], record: PhaseRecord) -> None:
    args = command(params)
    record.put("command", "april " + shlex.join(args))
    if params.get("placed"):  # the split it is about to run, as `april up --plan` prints it
        plan = [a for a in args if a != "--headless"] + ["--plan", "--json"]
        shown = subprocess.run(
            [sys.executable, "-c", "from cli.main import main; main()", *plan],
            cwd=REPO, capture_output=True, text=True, timeout=120,
        )  # fmt: skip
        record.put("plan", json.loads(shown.stdout) if shown.returncode == 0 else shown.stderr.strip())
    with tempfile.TemporaryDirectory(prefix="april-gpu-up-") as tmp:
        run_dir = Path(tmp) / "run"
        ports = zip(("worker_port", "learner_port", "pub_port"), free_ports(3), strict=True)
        argv = [
            *args,
            "--run-dir",
            str(run_dir),
            *(x for n, p in ports for x in ("--set", f"broker.{n}={p}")),
        ]
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH")))),
        }
        launched = time.time()
        proc = subprocess.Popen(
            [sys.executable, "-c", "from cli.main import main; main()", *argv], cwd=REPO, env=env
        )  # its output goes to this phase's log
        try:
            code = proc.wait(timeout=max(1.0, params["timeout_s"] - STOP_S))
        except subprocess.TimeoutExpired:
            stop(proc)
            code = None
        ended = time.time()
        lines = read_jsonl(run_dir / "metrics.jsonl", growing=True)
        summary_path = run_dir / "summary.json"
        summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
        record.put(
            "run",
            {
                "exit_code": code,
                "wall_s": ended - launched,
                "steps": len(lines),
                "first_step_s": lines[0]["time"] - launched if lines else None,
                "step_time_s": [x["step_time_s"] for x in lines],
                "samples_per_step": [x["samples"] for x in lines],
                "samples_per_s": summary.get("samples_per_s"),
                "tokens_generated": summary.get("tokens_generated"),
            },
        )
        if code != 0 or len(lines) != params["steps"]:
            log_tails(run_dir)
            why = "stopped at its deadline" if code is None else f"exited {code}"
            raise RuntimeError(f"april up {why} with {len(lines)} of {params['steps']} steps trained")
