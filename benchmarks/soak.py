"""Soak: a whole april run under random SIGKILLs, then the books are checked.

What runs: the children `april up` would start (`cli.up_cmd.plan`: one `april broker`, `--workers`
`april worker` processes on the sim engine, one real `april learner` on the shipped tiny model, torch
backend, a checkpoint every step), supervised by `cli.supervisor.Supervisor` with unbounded restarts
(broker and learner restart with `--resume`, as under `april up`). For `--duration-s` from the first
trained step, a random worker is SIGKILLed every `--worker-every` seconds, the learner every
`--learner-every`, the broker every `--broker-every` (the learner and broker schedules are offset by half a
period so they do not coincide).

With `--episodes` every sample is an episode of `benchmarks/envs/step_ledger.py`'s `StepLedger`, whose steps
(non-repeatable, tens to hundreds of milliseconds each) log their StepKey to a side-effect file; at each
broker kill the soak reads what the broker's files hold (`broker.snapshot.resume`: its last state file
and the journal after it, everything it ever acknowledged), and counts each step's runs.

At the end the kills stop, the run is given time to recover (every child up, one more step trained),
the learner is stopped with SIGTERM (it finishes its step, as `april up` stops it), and then:
- the broker's ledger balances (`issued == trained + complete_waiting + in_flight + partial + dropped`);
- metrics.jsonl holds steps 0..S-1 once each, every line exactly N = B x n samples;
- the broker counted exactly S x B groups trained (S x N samples): no batch trained twice, none lost;
- the run's counters went on across broker restarts: the steps' `aborted` sum to at most the broker's
  total;
- with `--episodes`, no step the broker's files held when it was killed ran again after (the steps a
  killed worker had not returned run again, with their key, and are counted).
Prints a summary (kills survived per role, steps, trained samples, samples lost, steps run twice) and
writes it as JSON. Exit code 0 when every check holds, 1 otherwise.

Usage:
    .venv/bin/python benchmarks/soak.py --duration-s 1800                     # the 30-minute soak
    .venv/bin/python benchmarks/soak.py --duration-s 150 --worker-every 15 --learner-every 50 \
        --broker-every 60                                                     # a few minutes
    .venv/bin/python benchmarks/soak.py --smoke      # 8 s, each role killed once (the suite runs it)
    .venv/bin/python benchmarks/soak.py --smoke --episodes --broker-every 3    # episodes, broker kills
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import signal
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from april.config import load_config, write_config  # noqa: E402
from april.episode import EpisodeState  # noqa: E402
from april.files import read_jsonl, write_json  # noqa: E402
from april.hf import TINY_MODEL  # noqa: E402
from april.placement import place  # noqa: E402
from april.ports import free_ports  # noqa: E402
from april.status import BrokerStatus  # noqa: E402
from broker import snapshot  # noqa: E402
from broker.heldout import open_prompts  # noqa: E402
from cli.status_cmd import StatusError, fetch_status  # noqa: E402
from cli.supervisor import Supervisor  # noqa: E402
from cli.up_cmd import BROKER, LEARNER, plan, wire_addresses  # noqa: E402

UNBOUNDED = 1 << 30  # restarts allowed per child


def write_soak_config(path: Path, args: argparse.Namespace) -> None:
    worker_port, learner_port, pub_port = free_ports(3)
    model = str(TINY_MODEL)
    path.write_text(
        f'[run]\nname = "soak"\nmode = "{args.mode}"\nsteps = {UNBOUNDED}\nseed = {args.seed}\n'
        f"[algo]\nrollout_batch_size = {args.batch}\nover_sampling_batch_size = {2 * args.batch}\n"
        f"n_samples_per_prompt = {args.n}\nmax_new_tokens = 32\nmax_staleness = 1\n"
        "[data]\nsynthetic_vocab_size = 320\n"
        f"[broker]\nworker_port = {worker_port}\nlearner_port = {learner_port}\npub_port = {pub_port}\n"
        "heartbeat_interval_s = 0.5\nliveness = 3\nsnapshot_interval_s = 2.0\n"
        f'[worker]\nengine = "sim"\nslots = 4\nmodel = "{model}"\n'
        'sim_lengths = "lognormal:median=6,sigma=1.2,cap=32"\nsim_time_scale = 0.02\n'
        f'[learner]\nmodel = "{model}"\nbackend = "torch"\nlr = 1e-3\ncheckpoint_every = 1\n'
        "torch_threads = 1\n"
    )
    if args.episodes:  # episodes of StepLedger: 3 turns of at most 8 tokens in 64 (the env's steps last)
        text = path.read_text().replace("max_new_tokens = 32", "max_new_tokens = 64")
        text = text.replace("snapshot_interval_s = 2.0", "snapshot_interval_s = 30.0")  # the default
        path.write_text(text + '[env]\nname = "step_ledger:StepLedger"\nmax_turns = 4\nmax_turn_tokens = 8\n')


@dataclasses.dataclass
class Soak:
    run_dir: Path
    config_path: Path
    workers: int
    supervisor: Supervisor = dataclasses.field(default_factory=Supervisor)
    effects: Path | None = None  # the episodes' side-effect log (--episodes)
    # at each broker kill: the steps the broker's files held, and how many step runs the log had then
    durable: list[tuple[set[str], int]] = dataclasses.field(default_factory=list)
    kills: dict[str, int] = dataclasses.field(default_factory=lambda: {"worker": 0, LEARNER: 0, BROKER: 0})
    restarts: dict[str, int] = dataclasses.field(default_factory=dict)
    events: list[dict[str, Any]] = dataclasses.field(default_factory=list)

    def __post_init__(self) -> None:
        config = wire_addresses(load_config(self.config_path))
        write_config(config, self.config_path)
        self.address = config.learner.broker
        specs = plan(config, self.config_path, self.run_dir, place(config, (), self.workers), resume=False)
        self.specs = [dataclasses.replace(s, max_restarts=UNBOUNDED) for s in specs]

    def status(self, timeout_s: float = 1.0) -> BrokerStatus | None:
        try:
            return fetch_status(self.address, timeout_s)
        except StatusError:
            return None

    def start(self) -> None:
        broker, *others = self.specs
        self.supervisor.start(broker)
        wait(lambda: self.status() is not None, 120, "the broker to answer")
        for spec in others:
            self.supervisor.start(spec)

    def poll(self) -> None:
        for ex in self.supervisor.poll(lambda name, code: False):
            if ex.restarted:
                self.restarts[ex.name] = self.restarts.get(ex.name, 0) + 1
            else:
                raise RuntimeError(f"{ex.name} exited {ex.code} for good: {ex.tail}")

    def kill(self, name: str, t: float) -> None:
        child = self.supervisor.children[name]
        if child.proc.poll() is not None:
            return  # between a crash and its restart: the next poll restarts it
        status = self.status(0.5)
        os.killpg(child.proc.pid, signal.SIGKILL)  # its session: a worker's reward runner dies too
        child.proc.wait(10)
        if name == BROKER and self.effects is not None:  # before it restarts: what its files hold
            ran = len(step_runs(self.effects))
            self.durable.append((durable_steps(self.run_dir, self.config_path), ran))
        role = "worker" if name.startswith("worker-") else name
        self.kills[role] += 1
        moment = {
            "t": round(t, 1),
            "killed": name,
            "steps": self.steps(),
            "unacked_batch": None
            if status is None or status.unacked_batch is None
            else dataclasses.asdict(status.unacked_batch),
            "aborting": None if status is None else status.round.aborting,
            "learner_waiting": None
            if status is None or status.learner is None
            else status.learner.waiting_for_batch,
        }
        self.events.append(moment)
        print(f"[soak {t:7.1f}s] SIGKILL {name}: {moment}", flush=True)

    def steps(self) -> int:
        path = self.run_dir / "metrics.jsonl"
        return len(path.read_text().splitlines()) if path.exists() else 0

    def stop(self) -> None:
        self.supervisor.stop([[LEARNER, *(s.name for s in self.specs[1:-1])], [BROKER]])


def step_runs(effects: Path) -> list[str]:
    """The step keys of the side-effect log, one per run, in the order they ran (whole lines only: a step
    may be writing one)."""
    text = effects.read_text() if effects.exists() else ""
    return [line.split()[0] for line in text.split("\n")[:-1] if line]


def durable_steps(run_dir: Path, config_path: Path) -> set[str]:
    """The steps of every episode in the books the broker's files hold (the books a restart restores)."""
    config = load_config(config_path)
    source, _ = open_prompts(config)
    state = snapshot.resume(run_dir / "broker", config.run.mode, config.algo, source)
    keys = set()
    for group in state.groups.values():
        for s in group.samples:
            turns = EpisodeState.from_bytes(s.episode).turns if s.episode else 0
            keys |= {f"{s.group_id}-{s.index}-{k}" for k in range(turns)}
    return keys


def wait(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise RuntimeError(f"timed out after {timeout:.0f}s waiting for {what}")


def run(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    root = Path(args.out or tempfile.mkdtemp(prefix="april-soak-"))
    root.mkdir(parents=True, exist_ok=True)
    config_path = root / "soak.toml"
    write_soak_config(config_path, args)
    env = {}
    if args.episodes:  # the workers' tool processes import step_ledger from benchmarks/envs/, and log there
        effects = root / "effects"
        path = os.pathsep.join(
            filter(None, (str(REPO / "benchmarks" / "envs"), os.environ.get("PYTHONPATH")))
        )
        env = {"PYTHONPATH": path, "APRIL_SOAK_EFFECTS": str(effects)}
    soak = Soak(root / "run", config_path, args.workers, Supervisor(env))
    soak.effects = root / "effects" if args.episodes else None
    launched = time.monotonic()
    soak.start()
    due = {
        "worker": args.worker_every,
        LEARNER: args.learner_every / 2,
        BROKER: args.broker_every,
    }
    workers = [s.name for s in soak.specs if s.name.startswith("worker-")]
    try:
        # The kill schedule starts once the run is up (its first step trained), so every kill hits a
        # running system; the broker then has a snapshot to resume from (a broker killed before its first
        # snapshot cannot be restarted with --resume: "no broker snapshot ... (nothing to resume)").
        deadline = time.monotonic() + args.recover_s
        while soak.steps() < 1:
            if time.monotonic() > deadline:
                raise RuntimeError(f"timed out after {args.recover_s:.0f}s waiting for the first step")
            soak.poll()
            time.sleep(0.2)
        started = time.monotonic()
        while (t := time.monotonic() - started) < args.duration_s:
            soak.poll()
            for role, at in due.items():
                if t >= at:
                    soak.kill(rng.choice(workers) if role == "worker" else role, t)
                    every = {"worker": args.worker_every, LEARNER: args.learner_every}.get(role)
                    due[role] = at + (every or args.broker_every)
            time.sleep(0.2)
        # recovery: every child up and one more step trained after the last kill
        recovered_from = soak.steps()
        deadline = time.monotonic() + args.recover_s
        while soak.steps() <= recovered_from and time.monotonic() < deadline:
            soak.poll()
            time.sleep(0.2)
        recovered = soak.steps() > recovered_from
        learner = soak.supervisor.children[LEARNER].proc
        learner.send_signal(signal.SIGTERM)  # finishes its step, checkpoints, disconnects
        learner.wait(120)
        time.sleep(1.0)  # the broker reads the last ack
        status = soak.status(5.0)
    finally:
        soak.stop()
    return report(args, soak, status, recovered, time.monotonic() - launched)


def report(
    args: argparse.Namespace, soak: Soak, status: BrokerStatus | None, recovered: bool, wall_s: float
) -> dict[str, Any]:
    lines = read_jsonl(soak.run_dir / "metrics.jsonl")
    steps = [x["step"] for x in lines]
    n_per_step = args.batch * args.n
    trained_groups = -1 if status is None else status.ledger.trained
    aborted = sum(x["aborted"] for x in lines)
    checks = {
        "recovered after the last kill": recovered,
        "broker answered at the end": status is not None,
        "ledger balances": status is not None and status.ledger_balanced,
        "steps 0..S-1 once each": steps == list(range(len(steps))),
        "every step exactly N samples": all(x["samples"] == n_per_step for x in lines),
        "trained groups == steps x B": trained_groups == len(steps) * args.batch,
        "counters ran on (steps' aborted <= the broker's total)": status is not None
        and aborted <= status.totals.aborted,
    }
    episodes: dict[str, Any] = {}
    if soak.effects is not None:
        order = step_runs(soak.effects)
        runs = Counter(order)
        again = {key for key, n in runs.items() if n > 1}
        # a step the broker's files held when it was killed never runs after (before, it may have run
        # more than once: a killed worker's step it had not returned runs again, with its key)
        rerun = {key for held, ran in soak.durable for key in order[ran:] if key in held}
        checks["no step the broker had on disk ran again"] = not rerun
        episodes = {
            "steps_run": len(runs),
            "steps_run_twice": len(again),
            "steps_on_disk_at_broker_kills": len(set().union(*(held for held, _ in soak.durable))),
            "steps_on_disk_run_again": len(rerun),
        }
    summary = {
        "duration_s": args.duration_s,
        "wall_s": round(wall_s, 1),
        "kills": soak.kills,
        "restarts": soak.restarts,
        "steps": len(steps),
        "trained_samples": trained_groups * args.n,
        "expected_samples": len(steps) * n_per_step,
        "samples_lost": len(steps) * n_per_step - trained_groups * args.n,
        "ledger": {} if status is None else status.ledger.to_json(),
        "rejected": None if status is None else status.rejected.by_reason,
        "episodes": episodes,
        "checks": checks,
        "ok": all(checks.values()),
        "kill_moments": soak.events,
        "run_dir": str(soak.run_dir),
    }
    print(json.dumps({k: v for k, v in summary.items() if k != "kill_moments"}, indent=2), flush=True)
    write_json(soak.run_dir.parent / "soak.json", summary)
    return summary


# --smoke: one kill of each role (a worker at 3 s and 6 s, the learner at 5 s, the broker at 7 s after the
# first step) in an 8-second soak, then the same recovery and checks as a full one
SMOKE: dict[str, Any] = {"duration_s": 8.0, "worker_every": 3.0, "learner_every": 10.0, "broker_every": 7.0}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration-s", type=float, default=1800.0)
    p.add_argument("--worker-every", type=float, default=60.0)
    p.add_argument("--learner-every", type=float, default=600.0)
    p.add_argument("--broker-every", type=float, default=600.0)
    p.add_argument("--recover-s", type=float, default=180.0, help="time to train one more step at the end")
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--mode", default="april", choices=["sync", "april", "async"])
    p.add_argument("--batch", type=int, default=2, help="rollout_batch_size B (groups per step)")
    p.add_argument("--n", type=int, default=2, help="n_samples_per_prompt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--episodes", action="store_true", help="episodes with side effects (envs/step_ledger.py)")
    p.add_argument("--out", default="", help="directory for the run (a fresh temp dir by default)")
    p.add_argument("--smoke", action="store_true", help="8 s, each role killed once (options given win)")
    args = p.parse_args(argv)
    if args.smoke:  # the smoke sizes become the defaults, so options given on the command line still win
        p.set_defaults(**SMOKE)
        args = p.parse_args(argv)
    summary = run(args)
    return 0 if summary["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
