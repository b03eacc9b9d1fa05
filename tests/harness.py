"""A small cluster of real processes for broker integration tests.

Starts `april broker` and scripted peers (tests/peers.py) as subprocesses on free loopback ports, reads
their JSON-line event files, asks the broker for its status, and kills everything at the end.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from april.config import load_config
from april.ports import free_ports
from april.status import BrokerStatus
from broker.server import Broker
from cli.status_cmd import StatusError, fetch_status

PEERS = str(Path(__file__).with_name("peers.py"))
SCRIPTED_ENGINE = str(Path(__file__).with_name("scripted_engine.py"))


def local_broker(run_dir: Path, overrides: dict[str, Any]) -> tuple[Broker, list[int]]:
    """A broker in this process, bound on free loopback ports (worker, learner, pub, returned): async, one
    group a batch, 8 new tokens, no evaluation, then `overrides`."""
    ports = free_ports(3)
    config = load_config(
        overrides={
            "run.mode": "async",
            "algo.rollout_batch_size": 1,
            "algo.over_sampling_batch_size": 1,
            "algo.max_new_tokens": 8,
            "data.eval_size": 0,
            "broker.worker_port": ports[0],
            "broker.learner_port": ports[1],
            "broker.pub_port": ports[2],
            **overrides,
        }
    )
    broker = Broker(config, run_dir)
    broker.bind()
    return broker, ports


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


class Cluster:
    def __init__(self, tmp: Path, **config: dict[str, Any]) -> None:
        self.tmp = tmp
        self.run_dir = tmp / "run"
        self.ports = free_ports(3)
        sections: dict[str, dict[str, Any]] = {
            "run": {"mode": "april", "seed": 0},
            "algo": {
                "rollout_batch_size": 4,
                "over_sampling_batch_size": 8,
                "n_samples_per_prompt": 2,
                "max_new_tokens": 24,
                "max_staleness": 1,
            },
            "data": {"source": "synthetic", "synthetic_prompt_len_min": 3, "synthetic_prompt_len_max": 6},
            "broker": {
                "worker_port": self.ports[0],
                "learner_port": self.ports[1],
                "pub_port": self.ports[2],
                "heartbeat_interval_s": 0.2,
                "liveness": 3,
                "abort_timeout_s": 1.0,
                "abort_retries": 2,
                "snapshot_interval_s": 1.0,
                "debug_ledger": True,
            },
        }
        sections["worker"] = {
            "broker": f"tcp://127.0.0.1:{self.ports[0]}",
            "engine": "sim",
            "slots": 8,
            "sim_lengths": "lognormal:median=8,sigma=1.0,cap=40",
            "sim_time_scale": 0.2,
            # the step these tests' time scales are chosen for (3 ms wall a step at 0.2; test_faults'
            # comments), stated rather than taken from the defaults, which model a faster GPU engine
            "sim_decode_ms": 15.0,
            "sim_prefill_ms_per_token": 0.01,
        }
        sections["learner"] = {"broker": f"tcp://127.0.0.1:{self.ports[1]}"}
        for name, values in config.items():
            sections.setdefault(name, {}).update(values)
        self.config = sections
        self.config_path = tmp / "april.toml"
        self.config_path.write_text(
            "".join(
                f"[{name}]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in values.items()) + "\n"
                for name, values in sections.items()
            )
        )
        self.procs: dict[str, subprocess.Popen[bytes]] = {}
        self.events: dict[str, Path] = {}

    @property
    def worker_address(self) -> str:
        return f"tcp://127.0.0.1:{self.ports[0]}"

    @property
    def learner_address(self) -> str:
        return f"tcp://127.0.0.1:{self.ports[1]}"

    def start_broker(self, resume: bool = False) -> None:
        cmd = [
            sys.executable,
            "-c",
            "from cli.main import main; main()",
            "broker",
            "--run-dir",
            str(self.run_dir),
            "--config",
            str(self.config_path),
        ]
        with open(self.tmp / "broker.log", "ab") as log:  # the child keeps its own descriptor
            self.procs["broker"] = subprocess.Popen(
                [*cmd, "--resume"] if resume else cmd, stdout=log, stderr=subprocess.STDOUT
            )
        wait_for(self.try_status, 60, "the broker to answer status")

    def start_worker(self, name: str, *sets: str) -> Path:
        """A real `april worker` process (engine and settings from the [worker] section)."""
        log = self.tmp / f"{name}.log"
        cmd = [
            sys.executable,
            "-c",
            "from cli.main import main; main()",
            "worker",
            "--config",
            str(self.config_path),
            "--set",
            f"worker.worker_id={name}",
        ]
        for item in sets:
            cmd += ["--set", item]
        with open(log, "ab") as out:  # the child keeps its own descriptor
            self.procs[name] = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        return log

    def start_scripted_worker(self, name: str, **script: Any) -> Path:
        """A real worker process, `april worker`'s own code with tests/scripted_engine.py's engine
        (`script`: an EngineScript's fields) in place of the configured one."""
        log = self.tmp / f"{name}.log"
        cmd = [sys.executable, SCRIPTED_ENGINE, str(self.config_path), name, json.dumps(script)]
        with open(log, "ab") as out:  # the child keeps its own descriptor
            self.procs[name] = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
        return log

    def start_learner_process(
        self, name: str, *sets: str, resume: bool = False, env: dict[str, str] | None = None
    ) -> Path:
        """A real `april learner` process (settings from the [learner] section); `env` is added to the
        environment (e.g. RANK/WORLD_SIZE for one rank of a launched learner)."""
        log = self.tmp / f"{name}.log"
        cmd = [
            sys.executable,
            "-c",
            "from cli.main import main; main()",
            "learner",
            "--config",
            str(self.config_path),
            "--run-dir",
            str(self.run_dir),
            "--broker",
            self.learner_address,
        ]
        for item in sets:
            cmd += ["--set", item]
        if resume:
            cmd.append("--resume")
        with open(log, "ab") as out:  # the child keeps its own descriptor
            self.procs[name] = subprocess.Popen(
                cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **(env or {})}
            )
        return log

    def start_peer(self, role: str, name: str, **args: Any) -> Path:
        events = self.tmp / f"{name}.jsonl"
        address = self.worker_address if role == "worker" else self.learner_address
        spec = {"address": address, "events": str(events), **args}
        if role == "worker":
            spec.setdefault("worker_id", name)
        with open(self.tmp / f"{name}.err", "ab") as err:  # the child keeps its own descriptor
            self.procs[name] = subprocess.Popen([sys.executable, PEERS, role, json.dumps(spec)], stderr=err)
        self.events[name] = events
        return events

    def start_learner(self, name: str = "learner", **args: Any) -> Path:
        algo = self.config["algo"]
        args.setdefault("samples_per_batch", algo["rollout_batch_size"] * algo["n_samples_per_prompt"])
        args.setdefault("group_size", algo["n_samples_per_prompt"])
        return self.start_peer("learner", name, **args)

    def read(self, name: str) -> list[dict[str, Any]]:
        path = self.events[name]
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def try_status(self) -> BrokerStatus | None:
        try:
            return fetch_status(self.learner_address, 0.5)
        except StatusError:
            return None

    def status(self) -> BrokerStatus:
        status: BrokerStatus = wait_for(self.try_status, 60, "broker status")
        return status

    def wait_exit(self, name: str, timeout: float) -> int:
        try:
            return self.procs[name].wait(timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(f"{name} did not finish within {timeout}s; logs in {self.tmp}") from None

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        proc = self.procs[name]
        proc.send_signal(sig)
        proc.wait(60)

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(60)

    def batches(self, learner: str = "learner") -> list[dict[str, Any]]:
        return [e for e in self.read(learner) if e["kind"] == "batch"]
