"""Faults with real processes: SIGKILL of a worker, the learner and the broker at chosen moments.

Each moment is hit deterministically: the test watches for it (a status field of the broker, a file the
process has open, a temp file in the weights directory), freezes the process with SIGSTOP, checks that it
is frozen inside the moment (the broker still holds the batch unacked, the weights file is still open, the
temp file still exists), and only then SIGKILLs it; a moment the process had already left is given back
(SIGCONT) and tried again later. After every scenario the run finishes its steps, the broker's ledger
balances and no sample is trained twice.

Workers are real `april worker` processes on the sim engine; the learner is the scripted one
(tests/peers.py, whose events name every trained sample) where the test is about workers, and the real
`april learner` (torch backend, tiny model, a checkpoint every step) where it is about the learner or
the broker. Short versions run in the default suite; `-m slow` runs more moments.
"""

from __future__ import annotations

import json
import os
import random
import re
import signal
import time
from collections import Counter
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import pytest
from harness import Cluster, wait_for

from april.config import BrokerConfig
from april.status import RoundStatus, WorkerStatus

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "models" / "tiny"


# ---------------------------------------------------------------------- moments


def fd_targets(pid: int) -> list[str]:
    """Where the process's open file descriptors point (empty once it is gone)."""
    out = []
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return []
    for fd in fds:
        try:
            out.append(os.readlink(f"/proc/{pid}/fd/{fd}"))
        except OSError:
            continue
    return out


def kill_inside(c: Cluster, name: str, inside: Callable[[], bool], timeout: float, what: str) -> float:
    """Wait until `inside()` holds, freeze `name`, and SIGKILL it if `inside()` still holds while it is
    frozen (else thaw it and wait again). Returns the wall time just before that last check: the broker had
    not given up on the process then (for the worker moments, it still held leases)."""
    proc = c.procs[name]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"{name} exited {proc.returncode} before {what}"
        if inside():
            proc.send_signal(signal.SIGSTOP)
            time.sleep(0.05)  # the last message it sent is read by the broker
            frozen = time.time()
            if inside():
                c.kill(name)
                return frozen
            proc.send_signal(signal.SIGCONT)
        time.sleep(0.002)
    raise AssertionError(f"never caught {name} {what} within {timeout}s; logs in {c.tmp}")


def worker_status(c: Cluster, worker: str) -> tuple[RoundStatus, WorkerStatus] | None:
    """The broker's abort round and its view of `worker` (None: no status, or the worker is unknown)."""
    status = c.try_status()
    if status is None:
        return None
    found = [w for w in status.workers if w.id == worker]
    return (status.round, found[0]) if found else None


def generating(c: Cluster, worker: str) -> Callable[[], bool]:
    def check() -> bool:
        got = worker_status(c, worker)
        return got is not None and got[1].leases > 0 and not got[0].aborting

    return check


def aborting(c: Cluster, worker: str) -> Callable[[], bool]:
    """An Abort is out and this worker still holds leases (it has not returned its partials)."""

    def check() -> bool:
        got = worker_status(c, worker)
        return got is not None and got[1].leases > 0 and got[0].aborting

    return check


def loading(c: Cluster, worker: str, weights: Path) -> Callable[[], bool]:
    """The worker has the announced weights file open (hashing it before the engine loads it)."""
    target = str(weights.resolve())
    return lambda: target in fd_targets(c.procs[worker].pid)


def log_time(line: str) -> float:
    """The wall time of a `setup_logging` line ("2026-01-01 10:00:00,123 ...")."""
    return datetime.strptime(line[:23], "%Y-%m-%d %H:%M:%S,%f").timestamp()


def reclaimed_at(c: Cluster, worker: str) -> list[float]:
    """When the broker declared `worker` dead and re-queued its leases (liveness or unconfirmed abort)."""
    pattern = re.compile(
        rf"worker {re.escape(worker)} (silent for .* leases re-queued|never confirmed abort)"
    )
    lines = [x for x in (c.tmp / "broker.log").read_text().splitlines() if pattern.search(x)]
    assert lines, f"the broker never declared {worker} dead"
    return [log_time(line) for line in lines]


# ---------------------------------------------------------------------- books


def assert_scripted_books(c: Cluster, steps: int) -> None:
    """Scripted learner: every batch exactly N in complete groups, no sample twice, the ledger balances."""
    batches = {b["batch"]: b for b in c.batches()}.values()
    assert len(batches) == steps and all(b["ok"] for b in batches)
    trained = Counter(tuple(k) for b in batches for k in b["keys"])
    assert all(n == 1 for n in trained.values()), "a sample was trained twice"
    status = c.status()
    b, n = c.config["algo"]["rollout_batch_size"], c.config["algo"]["n_samples_per_prompt"]
    assert status.ledger_balanced, status.ledger
    assert status.ledger.trained == steps * b and len(trained) == steps * b * n


def metrics_lines(c: Cluster) -> list[dict[str, Any]]:
    return [json.loads(x) for x in (c.run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_learner_books(c: Cluster, steps: int) -> None:
    """Real learner: steps 0..S-1 once each, exactly N samples each, and the broker counted S x B groups
    trained: a batch trained twice or acked without being trained would break the count."""
    lines = metrics_lines(c)
    assert [x["step"] for x in lines] == list(range(steps))
    assert [x["version"] for x in lines] == list(range(1, steps + 1))
    b, n = c.config["algo"]["rollout_batch_size"], c.config["algo"]["n_samples_per_prompt"]
    assert all(x["samples"] == b * n for x in lines)
    status = c.status()
    assert status.ledger_balanced, status.ledger
    assert status.ledger.trained == steps * b, status.ledger


# ---------------------------------------------------------------------- workers


def test_worker_sigkilled_while_generating_aborting_and_loading_weights(
    cluster: Callable[..., Cluster], tmp_path: Path
) -> None:
    weights = tmp_path / "weights.bin"  # announced with its real sha256: every worker hashes 48 MB per step
    weights.write_bytes(os.urandom(48 << 20))
    c = cluster(run={"mode": "april"}, algo={"max_new_tokens": 40})
    c.start_broker()
    c.start_worker("w0")
    c.start_learner(steps=14, train_s=0.2, weights_file=str(weights))
    moments = [
        ("gen", generating, 2.0),  # slow decode (30 ms a step): leases held for a while
        ("abort", aborting, 5.0),  # slower: the round's abort waits on its decode step
        ("load", lambda c, w: loading(c, w, weights), 0.2),
    ]
    kills: dict[str, float] = {}
    for name, moment, time_scale in moments:
        c.start_worker(name, f"worker.sim_time_scale={time_scale}")
        kills[name] = kill_inside(c, name, moment(c, name), 60, f"{moment.__name__}")
    c.wait_exit("learner", 120)
    assert_scripted_books(c, 14)
    status = c.status()
    assert {w.id for w in status.workers} == {"w0"}
    for name, killed in kills.items():  # found dead after the kill, its leases re-queued (books above)
        assert any(t >= killed for t in reclaimed_at(c, name)), name
    assert status.totals.resumed > 0  # interrupted samples were resumed (by w0: the only one left)


# ---------------------------------------------------------------------- the learner


def real_learner_cluster(
    cluster: Callable[..., Cluster], model: Path, steps: int, snapshot_interval_s: float = 1.0
) -> Cluster:
    return cluster(
        run={"mode": "april", "steps": steps},
        broker={"snapshot_interval_s": snapshot_interval_s},
        algo={"rollout_batch_size": 2, "over_sampling_batch_size": 4, "n_samples_per_prompt": 2},
        data={"synthetic_vocab_size": 320},
        worker={"model": str(TINY), "slots": 4},
        learner={
            "model": str(model),
            "backend": "torch",
            "lr": 1e-3,
            "checkpoint_every": 1,
            "torch_threads": 1,
        },
    )


def checkpointed(c: Cluster, step: int) -> bool:
    return (c.run_dir / "checkpoints" / f"step_{step:08d}").is_dir()


def training(c: Cluster, min_step: int) -> Callable[[], bool]:
    """The learner is between receiving the batch of step k >= `min_step` and acking it: the broker sent
    it (the learner asks for none) and has no ack, the checkpoint of the steps before k is complete and
    the metrics line of step k is not written yet. Remembers (batch id, k) in `check.held`."""

    def check() -> bool:
        status = c.try_status()
        if status is None or status.learner is None or status.unacked_batch is None:
            return False
        batch, k = status.unacked_batch.batch_id, status.unacked_batch.step
        if status.learner.waiting_for_batch or k < min_step or not checkpointed(c, k):
            return False
        check.held = (batch, k)  # type: ignore[attr-defined]
        return len(metrics_lines(c)) == k

    return check


def metrics_lines_exist(c: Cluster) -> bool:
    return (c.run_dir / "metrics.jsonl").exists()


def publishing(c: Cluster, min_step: int) -> Callable[[], bool]:
    """A weights temp file exists while the checkpoint of step >= `min_step` is complete: the learner is
    writing the next version (before the rename)."""
    weights = c.run_dir / "weights"

    def check() -> bool:
        temps = weights.is_dir() and any(p.name.endswith(".tmp") for p in weights.iterdir())
        return temps and checkpointed(c, min_step)

    return check


def just_acked(c: Cluster) -> Callable[[], bool]:
    """The broker counted one more batch acked than when this was made: the learner has just acked."""
    acked = c.status().totals.batches_acked

    def check() -> bool:
        status = c.try_status()
        return status is not None and status.totals.batches_acked > acked

    return check


def test_learner_sigkilled_after_receiving_a_batch_and_during_a_weight_publish(
    cluster: Callable[..., Cluster], tmp_path: Path
) -> None:
    from april.hf import make_tiny_model

    # wider than models/tiny: an 8 MB weights file takes long enough to write that the test can catch it
    model = make_tiny_model(tmp_path / "model", seed=0, hidden=256)
    c = real_learner_cluster(cluster, model, steps=12)
    c.start_broker()
    c.start_worker("w0")
    c.start_worker("w1")
    c.start_learner_process("learner")
    before_ack = training(c, min_step=2)
    kill_inside(c, "learner", before_ack, 300, "between a batch and its ack")
    held, first_step = before_ack.held  # type: ignore[attr-defined]
    assert c.status().unacked_batch.batch_id == held  # still held for the next learner
    c.start_learner_process("learner", resume=True)
    kill_inside(c, "learner", publishing(c, min_step=first_step + 2), 300, "writing weights")
    leftovers = [p.name for p in (c.run_dir / "weights").iterdir() if p.name.endswith(".tmp")]
    assert leftovers, "the kill did not land inside a weights publish"
    c.start_learner_process("learner", resume=True)
    # right after an ack: the step is in the checkpoint already (the learner acks last), not trained again
    kill_inside(c, "learner", just_acked(c), 300, "just after an ack")
    c.start_learner_process("learner", resume=True)
    assert c.wait_exit("learner", 600) == 0, (c.tmp / "learner.log").read_text()[-3000:]
    assert_learner_books(c, 12)
    broker_log = (c.tmp / "broker.log").read_text()
    assert re.search(rf"batch {held} for step {first_step} sent \(\d+ samples\), 2 times", broker_log), (
        "the batch the killed learner held was not sent again"
    )
    resumed = re.findall(r"resumed from \S+: step (\d+)", (c.tmp / "learner.log").read_text())
    assert len(resumed) == 3 and int(resumed[0]) == first_step, resumed  # from the last checkpoint
    assert_no_half_written_weights(c)


def assert_no_half_written_weights(c: Cluster) -> None:
    """Weights are written to a temp name and renamed (learner.weights.publish), workers check the sha256
    before loading (actors.worker): no worker ever failed a load, the temp file of the killed publish was
    cleaned up by the next one, every published file is whole, and both workers run the last version."""
    from safetensors import safe_open

    weights = c.run_dir / "weights"
    assert not [p for p in weights.iterdir() if p.name.endswith(".tmp")]
    for path in weights.glob("v*.safetensors"):
        with safe_open(str(path), "pt") as f:  # a torn file fails here
            assert list(f.keys())
    for worker in ("w0", "w1"):
        assert "not loaded" not in (c.tmp / f"{worker}.log").read_text(), worker
    final = len(metrics_lines(c))
    assert all(w.version == final for w in c.status().workers)


# ---------------------------------------------------------------------- the broker


def kill_and_resume_broker(c: Cluster, rng: random.Random, kills: int, every: int) -> list[int]:
    """SIGKILL the broker `kills` times at random moments (a random wait after every `every` steps),
    restart it with --resume each time; returns the epochs seen after each restart."""
    epochs = []
    for i in range(kills):
        done = (i + 1) * every
        wait_for(lambda n=done: metrics_lines_exist(c) and len(metrics_lines(c)) >= n, 120, f"{done} steps")
        time.sleep(rng.uniform(0.0, 1.0))
        assert c.procs["learner"].poll() is None, "the run ended before the broker was killed"
        c.kill("broker")
        c.start_broker(resume=True)
        after = c.status()
        assert after.ledger_balanced, after.ledger
        assert after.cursor >= after.ledger.issued >= done  # the data cursor is back
        epochs.append(after.epoch)
    return epochs


def run_with_broker_kills(cluster: Callable[..., Cluster], steps: int, kills: int, seed: int) -> None:
    """At the default snapshot interval, as users run: what the broker acknowledged since its last state
    file comes back from the journal after it, and the run's counters go on."""
    c = real_learner_cluster(
        cluster, TINY, steps=steps, snapshot_interval_s=BrokerConfig().snapshot_interval_s
    )
    c.start_broker()
    c.start_worker("w0", "worker.sim_time_scale=1.0")  # about a second a step: the kills land mid-run
    c.start_worker("w1", "worker.sim_time_scale=1.0")
    c.start_learner_process("learner")
    every = max(1, steps // (kills + 1))
    assert kill_and_resume_broker(c, random.Random(seed), kills, every) == list(range(1, kills + 1))
    assert c.wait_exit("learner", 240) == 0, (c.tmp / "learner.log").read_text()[-3000:]
    assert_learner_books(c, steps)
    status = c.status()
    assert sorted(w.id for w in status.workers) == ["w0", "w1"]  # both came back by themselves
    assert all(w.alive and not w.restored for w in status.workers)
    # the counters ran on across the restarts: the steps' aborted and resumed sum to no more than the
    # run's totals (a broker that forgot them started again from 0, below what its steps had reported)
    lines = metrics_lines(c)
    aborted, resumed = sum(x["aborted"] for x in lines), sum(x["resumed"] for x in lines)
    assert 0 < aborted <= status.totals.aborted and resumed <= status.totals.resumed, status.totals


def test_broker_sigkilled_twice_and_resumed_workers_and_learner_reconnect(
    cluster: Callable[..., Cluster],
) -> None:
    run_with_broker_kills(cluster, steps=9, kills=2, seed=7)


@pytest.mark.slow
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_broker_sigkilled_at_many_random_moments(cluster: Callable[..., Cluster], seed: int) -> None:
    run_with_broker_kills(cluster, steps=30, kills=6, seed=seed)


@pytest.mark.slow
def test_workers_sigkilled_at_every_moment_three_times(
    cluster: Callable[..., Cluster], tmp_path: Path
) -> None:
    weights = tmp_path / "weights.bin"
    weights.write_bytes(os.urandom(48 << 20))
    c = cluster(run={"mode": "april"}, algo={"max_new_tokens": 40})
    c.start_broker()
    c.start_worker("w0")
    c.start_worker("w1")
    c.start_learner(steps=40, train_s=0.2, weights_file=str(weights))
    kills: dict[str, float] = {}
    for round_ in range(3):
        for name, moment, time_scale in (
            ("gen", generating, 2.0),
            ("abort", aborting, 5.0),
            ("load", lambda c, w: loading(c, w, weights), 0.2),
        ):
            victim = f"{name}{round_}"
            c.start_worker(victim, f"worker.sim_time_scale={time_scale}")
            kills[victim] = kill_inside(c, victim, moment(c, victim), 60, name)
    c.wait_exit("learner", 240)
    assert_scripted_books(c, 40)
    for name, killed in kills.items():
        assert any(t >= killed for t in reclaimed_at(c, name)), name


def snapshotted_lease_workers(c: Cluster) -> list[str]:
    """The workers holding leases in the broker's last snapshot (none before the first)."""
    from broker import snapshot

    try:
        return snapshot.read(c.run_dir / "broker").lease_workers
    except snapshot.SnapshotError:
        return []


def test_a_restarted_broker_asks_a_worker_it_knows_only_from_its_snapshot_to_say_hello(
    cluster: Callable[..., Cluster],
) -> None:
    """A worker holding leases when the broker died is restored from the snapshot but gets no new work
    until it says hello. When the broker restarts faster than the worker's liveness window, the worker's
    socket reconnects by itself and never finds the broker silent, so the broker must ask (found on a
    quiet machine: both workers were restored, never leasable, and the run stalled)."""
    import numpy as np
    import zmq

    from april import protocol
    from april.transport import dealer, recv, send

    # a liveness window (60 s) that the restart below stays inside however loaded the machine is
    c = cluster(run={"mode": "april"}, broker={"snapshot_interval_s": 0.2, "liveness": 300})
    c.start_broker()
    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    sock = dealer(ctx, c.worker_address, "w0")
    try:
        send(sock, protocol.WorkerHello("w0", "raw", 2, 0, os.getpid(), "localhost", np.zeros(0, np.int64)))
        leases = wait_for(
            lambda: [m for m in [recv(sock, 200)] if isinstance(m, protocol.Lease)], 60, "a lease"
        )
        assert leases
        wait_for(lambda: c.status().ledger.in_flight > 0, 60, "the lease in the books")
        # a snapshot holding the lease (reading it is safe here: no sample completes, so the broker
        # appends nothing to its complete-groups log meanwhile)
        wait_for(lambda: "w0" in snapshotted_lease_workers(c), 60, "a snapshot holding the lease")
        c.kill("broker")
        c.start_broker(resume=True)  # at once: well inside the worker's liveness window
        assert [w.restored for w in c.status().workers] == [True]
        asked = None
        deadline = time.monotonic() + 60
        while asked is None and time.monotonic() < deadline:
            send(sock, protocol.Heartbeat())
            msg = recv(sock, 200)
            if isinstance(msg, protocol.Error) and msg.code == "not_registered":
                asked = msg
        assert asked is not None, "the restored worker was never asked to say hello"
    finally:
        sock.close(linger=0)
        ctx.term()


def test_learner_says_hello_again_to_a_broker_that_does_not_know_it() -> None:
    """A restarted broker that the learner's socket reconnected to by itself answers every message with
    Error(not_registered): it is never silent, so only a new hello gets the learner its batch (found by
    benchmarks/soak.py: the learner waited forever)."""
    import threading

    import zmq
    from test_codec import EXAMPLES

    from april import protocol
    from learner.client import BrokerClient

    ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    client = BrokerClient(f"tcp://127.0.0.1:{port}", version=3, last_batch_id=7)
    router.recv_multipart()  # its first hello went to the broker that then died
    got: list[object] = []
    deadline = time.monotonic() + 60  # gives up (fails) rather than hang
    worker = threading.Thread(
        target=lambda: got.append(client.next_batch(8, lambda: time.monotonic() > deadline)), daemon=True
    )
    worker.start()
    hellos = 0
    while worker.is_alive() and time.monotonic() < deadline:
        if not router.poll(100):
            continue
        identity, *frames = router.recv_multipart()
        msg = protocol.decode(frames)
        reply: protocol.Message = protocol.Error("not_registered", "send LearnerHello first")
        if isinstance(msg, protocol.LearnerHello):
            hellos += 1
            reply = EXAMPLES[protocol.Batch]
        router.send_multipart([identity, *protocol.encode(reply)])
    worker.join(60)
    client.close()
    router.close(linger=0)
    ctx.term()
    assert hellos == 1 and isinstance(got[0], protocol.Batch), got


# ---------------------------------------------------------------------- april up


def test_april_up_reports_a_restart_on_the_dashboard_and_gives_up_after_the_bound(tmp_path: Path) -> None:
    """What `april up` does with a crashed child's exit (`Run._report`): a restart is an event and an alert
    with the log's tail on the dashboard; out of restarts, a broker or learner fails the run. The process
    side (a real SIGKILLed worker restarted, the run finishing) is tests/test_up.py."""
    from test_dashboard import fed, status, text

    from april.config import Config
    from cli.supervisor import ChildExit
    from cli.up_cmd import MAX_RESTARTS, Run

    run = Run(Config(), tmp_path, [])
    run.state = fed(status())
    run._report(ChildExit("worker-0", -9, True, 1, ("Killed",)))
    shown = text(run.state, 120)
    assert f"worker-0 exited -9: restarted (1/{MAX_RESTARTS})" in shown and "Killed" in shown
    assert run.outcome == ""  # the run goes on
    run._report(ChildExit("broker", 1, False, MAX_RESTARTS, ("SnapshotError: state.snap truncated",)))
    assert run.outcome == f"failed: broker exited 1 after {MAX_RESTARTS} restarts"
    shown = text(run.state, 120)
    assert "broker exited 1: out of restarts" in shown and "SnapshotError" in shown
