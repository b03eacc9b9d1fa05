"""A run across hosts that share no network address and no run directory (issue 15): broker, learner and
two torch workers, each in a network namespace of its own on a private segment (tests/netns.py), every
connection over that segment with CurveZMQ (a non-loopback bind needs it), and the workers' mount views
hiding the learner's run directory (and the broker's): a worker can have a weights version only through
the weights transport, never by reading the learner's files.

The run is the built-in task on the shipped tiny model in april mode, as `april up` composes it, smaller:
real `april broker`, `april learner` (torch backend) and `april worker` processes with one config file
and `--set` overrides. Checked through the learner's run directory (steps, versions, exactly N samples a
step, the ledger balanced on every line: test_up.check_run), the broker's status as `april status
--json` gives it from the broker's host (the ledger balanced, trained = steps x groups: no batch trained
twice; each worker's version) and the workers' logs (every version loaded). Mid-run one worker's link
goes down while it holds leases: the broker declares it dead and re-queues them, the link comes back up,
the worker rejoins and catches up on weights, and the books still balance. The last version, published as
the learner exits, has a test of its own: the learner serves it until every worker has it.

Skipped, with the reason, where namespaces cannot be made (not root, no iproute2, no permission).
"""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import wait_for
from netns import Network, require_namespaces
from test_up import check_run

from april.config import Config, Mode, WeightsTransport, write_config
from april.status import BrokerStatus

REPO = Path(__file__).resolve().parents[1]
APRIL = [sys.executable, "-c", "from cli.main import main; main()"]
HOSTS = ("broker", "learner", "worker-0", "worker-1")
WORKERS = ("worker-0", "worker-1")
GROUPS, PER_GROUP = 4, 4  # rollout_batch_size x n_samples_per_prompt: N = 16 samples a step
RUN_S = 600.0  # "did not hang": start-up and the whole run on a loaded 2-core machine
STEP_S = 300.0  # "did not hang": one step, or a moment the test waits for within one

# a worker's log line for a version it did not get (the file transport; the network transport)
FAILED_LOAD = re.compile(r"^.*weights v(\d+) (?:not loaded|cannot be had).*$", re.MULTILINE)
# `april status --json`'s code in a loop on the broker's host, a status a line (the test process is in
# none of the namespaces: it cannot reach the broker itself); a failed ask is a line too
STATUS_PROBE = """
import json, sys, time
from april.keys import configured_client_keys
from cli.status_cmd import StatusError, fetch_status
address, keys, out = sys.argv[1:4]
curve = configured_client_keys(keys)
while True:
    asked = time.time()  # a status asked after a moment was answered after it
    try:
        line = fetch_status(address, 5.0, curve).to_json()
    except StatusError as e:
        line = {"error": str(e)}
    line["t"] = asked
    with open(out, "a") as f:
        f.write(json.dumps(line) + "\\n")
    time.sleep(0.05)
"""


class MultiHost:
    """The four hosts and what runs on them; the test's own view of every file (it is in no mount view)."""

    def __init__(self, net: Network, tmp: Path, transport: WeightsTransport, steps: int) -> None:
        self.net, self.tmp = net, tmp
        self.keys = tmp / "keys"
        done = net.run("broker", [*APRIL, "keys", "generate", str(self.keys)], timeout=120)
        assert done.returncode == 0, done.stderr
        self.broker_run, self.learner_run = tmp / "broker-run", tmp / "learner-run"
        self.config = tmp / "april.toml"
        write_config(self.compose(transport, steps), self.config)
        self.status_log = tmp / "status.jsonl"
        self._statuses: list[tuple[float, BrokerStatus]] = []  # parsed so far ...
        self._status_read = 0  # ... from the log's first this many bytes (whole lines)
        self.steps = steps
        self.procs: dict[str, subprocess.Popen[bytes]] = {}

    def address(self, host: str) -> str:
        return self.net.host(host).address

    def compose(self, transport: WeightsTransport, steps: int) -> Config:
        """The built-in run (cli.up_cmd.builtin_config), smaller, wired across the hosts."""
        from cli.up_cmd import builtin_config

        base = builtin_config()
        broker, learner = self.address("broker"), self.address("learner")
        return dataclasses.replace(
            base,
            run=dataclasses.replace(base.run, name="multihost", mode=Mode.APRIL, steps=steps, eval_every=0),
            algo=dataclasses.replace(
                base.algo,
                rollout_batch_size=GROUPS,
                over_sampling_batch_size=2 * GROUPS,
                n_samples_per_prompt=PER_GROUP,
                max_new_tokens=48,
            ),
            broker=dataclasses.replace(
                base.broker, bind_host=broker, curve_keys_dir=str(self.keys), debug_ledger=True
            ),
            worker=dataclasses.replace(
                base.worker, broker=f"tcp://{broker}:{base.broker.worker_port}", slots=8
            ),
            learner=dataclasses.replace(
                base.learner,
                broker=f"tcp://{broker}:{base.broker.learner_port}",
                backend="torch",
                torch_threads=1,
                checkpoint_every=0,
            ),
            weights=dataclasses.replace(
                base.weights,
                transport=transport,
                bind_host=learner,
                advertise_host=learner,
                chunk_bytes=1 << 18,  # the tiny model's 1.8 MB in several chunks, some in flight at once
            ),
        )

    def log(self, name: str) -> Path:
        return self.tmp / "logs" / f"{name}.log"

    def start(self, host: str, args: list[str], hidden: tuple[Path, ...] = ()) -> None:
        self.procs[host] = self.net.start(host, [*APRIL, *args], self.log(host), hidden=hidden, cwd=REPO)

    def assert_healthy(self) -> None:
        """No process failed and no worker failed to have a version: either ends the test at once (a run
        that cannot succeed is not waited out)."""
        for host, proc in self.procs.items():
            assert proc.poll() in (None, 0), f"{host} exited {proc.returncode}"
        for worker in WORKERS:
            failed = list(FAILED_LOAD.finditer(self.text(worker)))
            assert not failed, f"{worker}: {failed[0][0]}"

    def wait(self, predicate: Callable[[], Any], timeout: float, what: str) -> Any:
        """wait_for, checking the run's health on every poll; a timeout shows the logs' last lines."""

        def check() -> Any:
            self.assert_healthy()
            return predicate()

        try:
            return wait_for(check, timeout, what, interval=0.2)
        except AssertionError as e:
            raise AssertionError(f"{e}\n{self.tails()}") from None

    def start_all(self) -> None:
        """The broker (and the status probe beside it), the workers, then the learner; the workers see
        neither run directory, the broker not the learner's, the learner not the broker's."""
        config = ["--config", str(self.config)]
        self.start(
            "broker", ["broker", *config, "--run-dir", str(self.broker_run)], hidden=(self.learner_run,)
        )
        probe = [
            sys.executable,
            "-c",
            STATUS_PROBE,
            self.broker_address,
            str(self.keys),
            str(self.status_log),
        ]
        self.net.start("broker", probe, self.tmp / "logs" / "status-probe.log", cwd=REPO)
        self.wait(lambda: self.latest() is not None, STEP_S, "the broker to answer status on its address")
        for worker in WORKERS:
            sets = [
                "--set",
                f"worker.worker_id={worker}",
                "--set",
                f"weights.cache_dir={self.tmp / worker}-cache",
            ]
            self.start(worker, ["worker", *config, *sets], hidden=(self.learner_run, self.broker_run))
        self.start(
            "learner", ["learner", *config, "--run-dir", str(self.learner_run)], hidden=(self.broker_run,)
        )

    @property
    def broker_address(self) -> str:
        return f"tcp://{self.address('broker')}:{Config().broker.learner_port}"

    def statuses(self) -> list[tuple[float, BrokerStatus]]:
        """Every status the probe got so far, with the wall time it asked for it (the lines written since
        the last call are parsed; a line still being written waits for the next)."""
        if self.status_log.exists():
            with open(self.status_log, "rb") as f:
                f.seek(self._status_read)
                new = f.read()
            whole = new[: new.rfind(b"\n") + 1]
            self._status_read += len(whole)
            for line in whole.decode().splitlines():
                obj = json.loads(line)
                if "error" not in obj:
                    t = obj.pop("t")
                    self._statuses.append((t, BrokerStatus.from_json(obj)))
        return list(self._statuses)

    def latest(self) -> BrokerStatus | None:
        got = self.statuses()
        return got[-1][1] if got else None

    def april_status(self) -> BrokerStatus:
        """`april status --json` itself, run on the broker's host."""
        args = [
            "status",
            "--json",
            "--broker",
            self.broker_address,
            "--keys",
            str(self.keys),
            "--timeout",
            "30",
        ]
        done = self.net.run("broker", [*APRIL, *args], timeout=120)
        assert done.returncode == 0, done.stderr
        return BrokerStatus.from_json(json.loads(done.stdout))

    def steps_done(self) -> int:
        metrics = self.learner_run / "metrics.jsonl"
        return len(metrics.read_text().splitlines()) if metrics.exists() else 0

    def text(self, name: str) -> str:
        return self.log(name).read_text(errors="replace") if self.log(name).exists() else ""

    def loaded(self, worker: str) -> list[int]:
        """The versions `worker` logged as loaded, in order."""
        return [int(v) for v in re.findall(r"weights v(\d+) loaded", self.text(worker))]

    def tails(self) -> str:
        return "\n".join(f"--- {h} ---\n" + "\n".join(self.text(h).splitlines()[-25:]) for h in HOSTS)


@pytest.fixture
def hosts(tmp_path: Path) -> Iterator[Network]:
    require_namespaces()
    with Network(HOSTS) as net:
        yield net


def test_with_the_file_transport_workers_cannot_load_a_version_they_cannot_see(
    hosts: Network, tmp_path: Path
) -> None:
    """The mount views work: the learner publishes v1 in its run directory and announces its path, and
    neither worker finds the file there (each keeps serving v0 and tells the broker)."""
    run = MultiHost(hosts, tmp_path, WeightsTransport.FILE, steps=1)
    run.start_all()
    for worker in WORKERS:
        wait_for(lambda w=worker: "weights v1 not loaded" in run.text(w), RUN_S, f"{worker} to fail v1")
        assert "does not exist" in run.text(worker)
        assert run.loaded(worker) == []
    assert (run.learner_run / "weights" / "v000001.safetensors").is_file()  # there, for the learner's host
    status = run.april_status()
    assert all(w.version == 0 for w in status.workers), status.workers
    assert status.rejected.by_reason.get("weights_not_loaded", 0) >= len(WORKERS), status.rejected


STEPS = 30  # enough that the run is still going when the cut-off worker is back (about 0.4 s a step idle)
DOWN_AFTER = 3  # steps trained before worker-1's link goes down
SERVED = STEPS  # every version, the last too: the learner serves it until every worker has it


def cut_while_holding(run: MultiHost, worker: str) -> tuple[int, float]:
    """Take `worker`'s link down while it holds leases and is up to date on weights, and check the broker
    still counts leases on it once the link is down (asked after the cut): otherwise the link comes back
    up and the moment is tried again. Returns the leases it held and the wall time of the cut."""
    deadline = time.monotonic() + STEP_S
    while time.monotonic() < deadline:
        run.assert_healthy()
        status = run.latest()
        mine = [w for w in status.workers if w.id == worker] if status is not None else []
        current = run.loaded(worker) == list(range(1, run.steps_done() + 1))
        if status is None or status.round.aborting or not mine or mine[0].leases == 0 or not current:
            time.sleep(0.05)
            continue
        run.net.link_down(worker)
        cut = time.time()
        after = wait_for(
            lambda cut=cut: [s for t, s in run.statuses() if t > cut], 60, "a status after the cut"
        )[0]
        held = [w.leases for w in after.workers if w.id == worker]
        if held and held[0] > 0:
            return held[0], cut
        run.net.link_up(worker)
    raise AssertionError(f"never cut {worker} off while it held leases; logs in {run.tmp}")


def test_a_run_across_hosts_with_a_link_down_and_up_mid_round(hosts: Network, tmp_path: Path) -> None:
    run = MultiHost(hosts, tmp_path, WeightsTransport.NETWORK, steps=STEPS)
    run.start_all()
    run.wait(lambda: run.steps_done() >= DOWN_AFTER, RUN_S, f"{DOWN_AFTER} steps")
    held, cut = cut_while_holding(run, "worker-1")
    loaded_before = run.loaded("worker-1")  # every version published so far (cut_while_holding)
    try:
        dead = re.compile(r"worker worker-1 (silent for .* (\d+) leases re-queued|never confirmed abort)")
        found = run.wait(
            lambda: dead.search(run.text("broker")), STEP_S, "the broker to declare worker-1 dead"
        )
        if found.group(2) is not None:  # the silence path counts what it re-queued: all it held
            assert int(found.group(2)) == held, (found.group(0), held)
        # its leases came back: the broker's books balance without worker-1
        gone = run.wait(
            lambda: [s for t, s in run.statuses() if t > cut and "worker-1" not in {w.id for w in s.workers}],
            STEP_S,
            "a status without worker-1",
        )[-1]
        assert gone.ledger_balanced, gone.ledger
    finally:
        run.net.link_up("worker-1")
    up_at = time.time()

    def rejoined() -> bool:  # said hello again and was given work
        return any(
            t > up_at and w.id == "worker-1" and w.alive and (w.leases > 0 or w.tokens_generated > 0)
            for t, s in run.statuses()
            for w in s.workers
        )

    run.wait(rejoined, STEP_S, "worker-1 to rejoin and lease again")
    assert len(re.findall(r"worker worker-1 registered", run.text("broker"))) >= 2  # the start, the rejoin
    run.wait(lambda: run.steps_done() >= STEPS, RUN_S, f"{STEPS} steps")

    lines = check_run(run.learner_run, STEPS, samples=GROUPS * PER_GROUP)  # once each, exactly N, ledger
    # the batches' weights figures: no worker ever had a version from the learner's file
    assert all(x["workers_synced_file"] == 0 for x in lines), lines
    assert lines[-1]["workers_synced_network"] == len(WORKERS), lines[-1]
    status = run.april_status()
    assert status.ledger_balanced, status.ledger
    assert status.ledger.trained == STEPS * GROUPS, status.ledger  # a batch trained twice would count twice
    assert sorted(w.id for w in status.workers) == list(WORKERS)
    assert all(w.alive and w.version >= SERVED for w in status.workers), status.workers
    assert all(w.weights_transport == "network" and w.weights_sync_s > 0 for w in status.workers), status
    # every version the learner served reached every worker: worker-0 loaded each in turn; worker-1 each
    # until its link went down, then (having missed some, or none) newer ones only, in order
    assert run.loaded("worker-0")[:SERVED] == list(range(1, SERVED + 1)), run.loaded("worker-0")
    after_cut = [v for v in run.loaded("worker-1")[len(loaded_before) :] if v <= SERVED]
    assert run.loaded("worker-1")[: len(loaded_before)] == loaded_before
    assert len(loaded_before) >= DOWN_AFTER and after_cut == sorted(set(after_cut)), run.loaded("worker-1")
    assert after_cut[0] > loaded_before[-1] and after_cut[-1] == SERVED, run.loaded("worker-1")


def test_the_last_version_reaches_every_worker(hosts: Network, tmp_path: Path) -> None:
    run = MultiHost(hosts, tmp_path, WeightsTransport.NETWORK, steps=2)
    run.start_all()
    run.wait(lambda: run.steps_done() >= 2, RUN_S, "2 steps")
    run.wait(
        lambda: all(run.loaded(w)[-1:] == [2] for w in WORKERS),
        STEP_S,
        "both workers on v2",
    )
    assert all(w.version == 2 and w.weights_transport == "network" for w in run.april_status().workers)
