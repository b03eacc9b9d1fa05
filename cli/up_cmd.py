"""`april up`: one command that runs a whole april run on this machine, with a live dashboard.

Owns the launch plan: which config a run gets (the built-in task on the shipped tiny model unless a
config file says otherwise; `--resume D` reuses D/config.toml), the checks that turn a doomed start into
one error line (bad config, missing model, unknown engine, a device torch does not see, busy port), the
children (`april broker`, K x `april worker`, `april learner`, each logging to D/logs/<role>-<id>.log,
and with engine sglang but no sglang_urls an SGLang server per worker, cli.sglang_servers), and the end
of the run: the learner finishing its steps, a child failing for good, or Ctrl-C / SIGTERM, after which
every child is stopped (learner and workers first, then the servers and the broker, so its snapshot has
everything) and D is left resumable. Crashed children are restarted within a bound (broker and learner
with --resume); a child that exits with a user error (exit 2) or could not start (`STARTUP_EXIT`) would
fail alike again: it is not restarted, and its one error line is reported once (several workers failing
alike included). The process plumbing is `cli.supervisor`; the view is `cli.dashboard` /
`cli.dashboard_feed` (its headless lines with --headless, and whenever stdout is not a terminal).
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
import signal
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from april.config import BrokerConfig, Config, Mode, WeightsTransport, write_config
from april.devices import check_device
from april.envs.openenv_adapter import is_openenv
from april.files import read_jsonl
from april.hf import TINY_MODEL
from april.keys import configured_client_keys, server_keys, weights_client_keys, weights_server_keys
from april.placement import Placement, Role, gpu_list, node_gpus, node_words, place, wants_gpus
from april.startup import STARTUP_EXIT
from cli.dashboard import export_svg
from cli.dashboard_feed import StatusFeed, run_headless, watch
from cli.dashboard_state import DashboardState, add_alert, add_event, add_start_error
from cli.openenv_cmd import GATEWAY, SERVER, check_openenv, openenv_specs, server_answers, server_url
from cli.options import USAGE_EXIT, UserError, resolve_config
from cli.sglang_servers import (
    ServerGate,
    check_servers,
    is_server,
    server_of,
    server_specs,
    worker_of,
)
from cli.sglang_servers import (
    server_url as sglang_url,
)
from cli.supervisor import ChildExit, ChildSpec, Supervisor
from learner.checkpoint import latest as latest_checkpoint
from learner.wandb_sink import check_wandb

MAX_RESTARTS = 3
BROKER_START_S = 60.0  # the broker answers its first status within this (imports + bind)
FINAL_EVAL_WAIT_S = 120.0  # after the last step, the final evaluation may take this long to finish
LEARNER = "learner"
BROKER = "broker"
# a child that exits so would exit so again: a user error (its input) or a start-up error (this machine)
FINAL_EXITS = (USAGE_EXIT, STARTUP_EXIT)
ERROR_PREFIX = "april: error: "  # how a child's one error line starts (cli.options)


class UpError(UserError):
    """`april up` cannot start as asked; the message is one line."""


@dataclass(frozen=True, slots=True)
class UpOptions:
    config: Path | None = None
    mode: Mode | None = None
    engine: str | None = None
    workers: int | None = None  # None: one per engine the node's GPUs fit (2 without GPUs)
    steps: int | None = None
    run_dir: Path | None = None
    resume: Path | None = None  # a run directory to continue
    headless: bool = False
    sets: tuple[str, ...] = ()
    screenshot: Path | None = None  # save the dashboard as SVG one step before the end (or at a stop)
    plan: bool = False  # print the placement and exit
    json: bool = False  # with plan: as JSON
    gpus: int | None = None  # plan for a node of this many GPUs instead of this machine's


def builtin_config() -> Config:
    """The run `april up` makes with no config file: the built-in task on the shipped tiny model."""
    from april.config import AlgoConfig, DataConfig, LearnerConfig, RunConfig, WorkerConfig

    model = str(TINY_MODEL)
    return Config(
        run=RunConfig(name="tiny", steps=100, mode=Mode.APRIL, eval_every=10),
        algo=AlgoConfig(
            rollout_batch_size=8,
            over_sampling_batch_size=16,
            n_samples_per_prompt=8,
            max_new_tokens=256,
            temperature=1.0,
            max_staleness=1,
        ),
        data=DataConfig(
            source="task"
        ),  # eval_size auto: 64 of the task's prompts, a tenth of a small dataset
        worker=WorkerConfig(engine="torch", slots=32, model=model, reward="exact", torch_threads=1),
        learner=LearnerConfig(
            model=model, backend="deepspeed", lr=1e-4, torch_threads=2, checkpoint_every=10
        ),
    )


def resolve(opts: UpOptions) -> tuple[Config, Path, bool]:
    """The run's config, its directory, and whether it resumes. Precedence: base (the resumed run's
    config.toml, the --config file, or the built-in run) < APRIL_* environment < options."""

    def load(base: Path) -> Config:
        flags = {"run__mode": opts.mode, "worker__engine": opts.engine, "run__steps": opts.steps}
        return resolve_config(base, list(opts.sets), **flags)

    if opts.resume is not None:
        base = opts.resume / "config.toml"
        if not base.is_file():
            raise UpError(f"--resume {opts.resume}: no config.toml there (not an april run directory)")
        return load(base), opts.resume, True
    if opts.config is not None:
        config = load(opts.config)
    elif not TINY_MODEL.is_dir():
        raise UpError(
            f"the built-in tiny model is not at {TINY_MODEL}: run `april sft --out {TINY_MODEL}` "
            "or pass --config with your own model"
        )
    else:
        import tempfile

        with tempfile.TemporaryDirectory(prefix="april-up-") as tmp:  # the built-in run as the base layer
            write_config(builtin_config(), Path(tmp) / "builtin.toml")
            config = load(Path(tmp) / "builtin.toml")
    run_dir = opts.run_dir or config.run_path()
    if (run_dir / "metrics.jsonl").exists() and not opts.plan:
        raise UpError(f"{run_dir} already holds a run: continue it with `april up --resume {run_dir}`")
    return config, run_dir, False


def connect_host(broker: BrokerConfig) -> str:
    """The address peers on this machine reach the broker at (loopback when it binds every interface)."""
    return "127.0.0.1" if broker.bind_host in ("0.0.0.0", "::", "*") else broker.bind_host


def wire_addresses(config: Config) -> Config:
    """Point workers and learner at this broker's ports (loopback when it binds every interface)."""
    b = config.broker
    host = connect_host(b)
    return dataclasses.replace(
        config,
        worker=dataclasses.replace(config.worker, broker=f"tcp://{host}:{b.worker_port}"),
        learner=dataclasses.replace(config.learner, broker=f"tcp://{host}:{b.learner_port}"),
    )


def preflight(config: Config) -> None:
    """Every check that can fail before a process starts, each as one line (UpError, or the domain's
    error: EngineError, ModelError, DatasetError, ConfigError, DeviceError, KeysError)."""
    from actors.episode_driver import check_env
    from actors.factory import check_worker
    from april.hf import check_model_dir
    from broker.heldout import open_prompts
    from cli.sim_options import check_simulated
    from learner.group_rewards import group_rewards

    check_worker(config.worker)  # the worker's device too
    if config.worker.engine == "sim":
        check_simulated(config)
    check_env(config.env, config.worker)
    group_rewards(config)  # a group-scored environment and what it rules out
    check_openenv(config.env)  # the gateway's package, and the server unless april up starts it
    if config.learner.backend != "sim":  # the simulated learner has no model, nor device
        check_model_dir(config.learner.model)
        check_device(config.learner.device, "learner.device")
    check_wandb(config.learner)  # wandb_project set and wandb not installed: the learner would fail
    open_prompts(config)  # the broker's prompts (a JSONL file read whole) and held-out split
    b = config.broker
    if b.curve_keys_dir:  # the broker's and the children's CurveZMQ keys (KeysError: one line)
        server_keys(Path(b.curve_keys_dir))
        configured_client_keys(b.curve_keys_dir)
        if config.weights.transport != WeightsTransport.FILE:  # the learner's weight service, its clients
            weights_server_keys(Path(b.curve_keys_dir))
            weights_client_keys(Path(b.curve_keys_dir))
    for name in ("worker_port", "learner_port", "pub_port"):
        port = getattr(b, name)
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            # as ZeroMQ binds: connections of a run that just ended, still in TIME_WAIT on the port, do not
            # make it busy (without this, `april up` right after another run refused for a minute)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind((b.bind_host, port))
                s.listen()  # only a socket listening on the port makes it busy
            except OSError as exc:
                busy = exc.errno == errno.EADDRINUSE
                raise UpError(
                    f"broker.{name} = {port} on {b.bind_host} is "
                    + (
                        "busy: is another april run going? (change it with --set broker." + name + "=...)"
                        if busy
                        else f"unusable: {exc.strerror}"
                    )
                ) from None


def node_of(config: Config, gpus: int | None) -> tuple[str, ...]:
    """The GPUs to place on: a node of `gpus` GPUs (0..gpus-1), or those of this machine that the roles
    would use (torch is asked only when a role can run on a GPU)."""
    if gpus is not None:
        return node_gpus(gpus, {})
    if not wants_gpus(config):
        return ()
    from april.devices import gpu_count

    return node_gpus(gpu_count(), os.environ)


def plan(
    config: Config, config_path: Path, run_dir: Path, placement: Placement, resume: bool
) -> list[ChildSpec]:
    """The children of a run in start order, each with its GPUs: its SGLang servers (engine sglang without
    sglang_urls: one per worker, cli.sglang_servers), broker, workers, learner."""
    logs = run_dir / "logs"
    common = ("--config", str(config_path))
    again = ("--resume",) if resume else ()
    specs = []
    if placement.starts_sglang:
        specs += server_specs(config, run_dir, placement.engines, placement.learner, MAX_RESTARTS)
    gateway = ""
    if is_openenv(config.env.name):
        openenv, gateway = openenv_specs(config, config_path, run_dir, MAX_RESTARTS)
        specs += openenv
    args: tuple[str, ...]
    for p in placement.processes():
        env = placement.env(p.gpus)
        if p.role is Role.BROKER:
            args = ("broker", *common, "--run-dir", str(run_dir))
            log = logs / "broker-0.log"
            specs.append(ChildSpec(BROKER, (*args, *again), (*args, "--resume"), log, MAX_RESTARTS, env))
        elif p.role is Role.WORKER:
            i = int(p.name.removeprefix("worker-"))
            args = ("worker", *common, "--set", f"worker.worker_id={config.run.name}-w{i}")
            if placement.starts_sglang:
                args += ("--set", f"worker.sglang_urls={sglang_url(config.worker, i)}")
            if gateway:
                args += ("--set", f"env.gateway={gateway}")
            specs.append(ChildSpec(p.name, args, args, logs / f"{p.name}.log", MAX_RESTARTS, env))
        elif p.role is Role.LEARNER:
            args = ("learner", *common, "--run-dir", str(run_dir))
            log = logs / "learner-0.log"
            specs.append(ChildSpec(LEARNER, (*args, *again), (*args, "--resume"), log, MAX_RESTARTS, env))
    return specs


def print_plan(placement: Placement, config: Config, as_json: bool) -> None:
    """`april up --plan`: every process with its role and GPUs (JSON: a list of them)."""
    processes = placement.processes()
    if as_json:
        print(json.dumps([p.to_json() for p in processes]))
        return
    learner = f"learner {placement.learner_ranks} rank" + ("s" if placement.learner_ranks > 1 else "")
    shared = ", sharing its GPU with the engines" if placement.shared else ""
    print(
        f"april up plan for a node with {node_words(placement.node)}: {len(placement.engines)} x engine "
        f"{config.worker.engine}, {learner}{shared}"
    )
    for p in processes:
        ranks = f" ({p.ranks} ranks)" if p.ranks > 1 else ""
        print(f"  {p.name:<12} {p.role!s:<8} {gpu_list(p.gpus)}{ranks}")


class Run:
    """One `april up` run: its supervisor, its dashboard state and how it ended."""

    def __init__(
        self, config: Config, run_dir: Path, specs: list[ChildSpec], screenshot: Path | None = None
    ) -> None:
        from actors.episode_driver import resume_note  # (preflight has imported it already)

        self.screenshot = screenshot
        self.config = config
        self.run_dir = run_dir
        self.specs = specs
        self.supervisor = Supervisor()
        self.pub = f"tcp://{connect_host(config.broker)}:{config.broker.pub_port}"
        self.state = DashboardState(source=self.pub)
        self.outcome = ""  # "finished", "failed: ...", "interrupted"
        self.finished_at: float | None = None
        self.checkpoint = latest_checkpoint(run_dir / "checkpoints")  # the newest one seen
        self._signalled = False
        self.gate = ServerGate(config.worker, [s.name for s in specs if is_server(s.name)])
        self._started = False  # start() is done: workers may start as their servers answer
        self.resume_note = resume_note(config.env)  # what an aborted episode of this env does ("": none)

    def start(self, feed: StatusFeed) -> None:
        """SGLang servers (minutes on a GPU) and the broker first, the others once it publishes (so none of
        them starts in a backoff); a worker with a server of its own once that answers (`_check_servers`)."""
        if self.resume_note:
            add_event(self.state, time.time(), self.resume_note)
        for spec in self.specs:
            if is_server(spec.name) or spec.name in (BROKER, GATEWAY, SERVER):
                self._start(spec)
        deadline = time.monotonic() + BROKER_START_S
        while feed.poll(200) is None:
            self._check_exits()
            self._check_servers()
            if self.outcome:
                return
            if time.monotonic() > deadline:
                self.outcome = f"failed: the broker published nothing within {BROKER_START_S:.0f}s"
                return
        if not self._wait_openenv_server():
            return
        for spec in self.specs:
            if not (
                is_server(spec.name)
                or spec.name in (BROKER, GATEWAY, SERVER)
                or self.gate.has_server(spec.name)
            ):
                self._start(spec)
        self._started = True
        self._check_servers()

    def _wait_openenv_server(self) -> bool:
        """With `env.server_command`: wait until the OpenEnv server answers (workers reset at once), within
        `env.server_start_s`. False: the run failed (`outcome` says why)."""
        if not any(s.name == SERVER for s in self.specs):
            return True
        url = server_url(self.config.env)
        deadline = time.monotonic() + self.config.env.server_start_s
        while not server_answers(url):
            self._check_exits()
            if self.outcome:
                return False
            if time.monotonic() > deadline:
                self.outcome = (
                    f"failed: the OpenEnv server did not answer {url}/health within "
                    f"{self.config.env.server_start_s:g}s (log {self._log(SERVER)})"
                )
                return False
            time.sleep(0.5)
        add_event(self.state, time.time(), f"OpenEnv server answers at {url}", "green")
        return True

    def _start(self, spec: ChildSpec) -> None:
        self.supervisor.start(spec)
        if spec.name != BROKER:
            gpus = spec.env.get("CUDA_VISIBLE_DEVICES")
            where = f" on {gpu_list(gpus.split(','))}" if gpus else ""
            add_event(self.state, time.time(), f"started {spec.name}{where} (log {spec.log})")
        if is_server(spec.name):
            self.gate.watch(spec.name)

    def _check_servers(self) -> None:
        """Fail the run on a server past its start-up deadline; start the workers whose server answered."""
        late = self.gate.late()
        if late is not None:
            server, line = late
            add_start_error(self.state, server, ERROR_PREFIX + line)
            self.outcome = f"failed: {line}"
            return
        if not self._started:
            return
        for server, took in self.gate.released():
            add_event(self.state, time.time(), f"{server} answers after {took:.0f}s", "green")
            self._start(next(s for s in self.specs if s.name == worker_of(server)))

    def tick(self, state: DashboardState) -> bool:
        """Called by the view each refresh: supervise children; False once the run is over."""
        if self._signalled and not self.outcome:
            self.outcome = "interrupted"
        if not self.outcome:
            self._check_exits()
            self._check_servers()
        self._check_checkpoints()
        if state.last_step is not None and state.last_step + 2 >= self.config.run.steps:
            self.save_screenshot()  # one step before the end: everything still running
        if self.outcome != "finished":
            return not self.outcome
        # the learner is done: wait (bounded) for the final evaluation, and let the view catch up
        assert self.finished_at is not None
        waited = time.time() - self.finished_at
        if self.evaluating and self.final_eval() is None and waited < FINAL_EVAL_WAIT_S:
            return True
        last = state.last_step
        return not (last is not None and last + 1 >= self.config.run.steps) and waited < 3

    @property
    def evaluating(self) -> bool:
        return self.config.run.eval_every > 0 and self.config.data.eval_size != 0

    def final_eval(self) -> dict[str, Any] | None:
        """The evaluation at the final version, once the broker has logged it."""
        evals = read_evals(self.run_dir)
        return evals[-1] if evals and evals[-1]["version"] >= self.config.run.steps else None

    def _check_checkpoints(self) -> None:
        """An event per checkpoint the learner completes (the status feed does not carry them)."""
        found = latest_checkpoint(self.run_dir / "checkpoints")
        if found is not None and found != self.checkpoint:
            add_event(self.state, time.time(), f"checkpoint {found.name} saved", "green")
            self.checkpoint = found

    def _check_exits(self) -> None:
        for ex in self.supervisor.poll(self._final):
            self._report(ex)

    def _final(self, name: str, code: int) -> bool:
        """Whether an exit is not to be restarted: the learner done, an exit that says a restart would fail
        alike, or a server that exits before it ever answered."""
        return (name == LEARNER and code == 0) or code in FINAL_EXITS or self.gate.starting(name)

    def _report(self, ex: ChildExit) -> None:
        now = time.time()
        if self.gate.starting(ex.name):  # a server that never answered would fail alike again
            said = f": {ex.tail[-1].strip()}" if ex.tail else ""
            line = f"{ERROR_PREFIX}{ex.name} exited {ex.code} while starting{said}"
            add_start_error(self.state, ex.name, line)
            add_alert(self.state, f"{ex.name} (exit {ex.code})", ex.tail)
            self.outcome = f"failed: {ex.name} exited {ex.code} while starting (log {self._log(ex.name)})"
            return
        if ex.name == LEARNER and ex.code == 0 and not ex.restarted:
            self.outcome, self.finished_at = "finished", now
            add_event(self.state, now, f"learner finished {self.config.run.steps} steps", "green")
            return
        if ex.code in FINAL_EXITS and not ex.restarted:
            self._not_restarted(ex, now)
            return
        if ex.restarted:
            add_event(
                self.state,
                now,
                f"{ex.name} exited {ex.code}: restarted ({ex.restarts}/{MAX_RESTARTS})",
                "yellow",
            )
            add_alert(self.state, f"{ex.name} (exit {ex.code}, restarted)", ex.tail)
            return
        add_event(self.state, now, f"{ex.name} exited {ex.code}: out of restarts", "red")
        add_alert(self.state, f"{ex.name} (exit {ex.code})", ex.tail)
        if self._fatal(ex.name):
            self.outcome = f"failed: {ex.name} exited {ex.code} after {ex.restarts} restarts"

    def _not_restarted(self, ex: ChildExit, now: float) -> None:
        """A child whose exit says a restart would fail alike (a user error, or one that could not start):
        its error line shown once (workers of one config fail alike), the run failed if the child was the
        broker, the learner or the last worker."""
        said = [line for line in ex.tail if line.startswith(ERROR_PREFIX)]
        line = said[-1] if said else f"{ERROR_PREFIX}{ex.name} exited {ex.code}: see {self._log(ex.name)}"
        add_start_error(self.state, ex.name, line)
        add_event(
            self.state, now, f"{ex.name} exited {ex.code}: not restarted (it would fail alike)", "bold red"
        )
        if self._fatal(ex.name):
            self.outcome = f"failed: {ex.name} exited {ex.code}, not restarted"

    def _fatal(self, name: str) -> bool:
        """Whether the run cannot go on without child `name` (now exited for good)."""
        return name in (LEARNER, BROKER) or not any(
            self.supervisor.running(s.name)
            and (not self.gate.has_server(s.name) or self.supervisor.running(server_of(s.name)))
            for s in self.specs
            if s.name.startswith("worker-")
        )  # a worker whose server is gone for good serves nothing

    def _log(self, name: str) -> Path:
        return next(s.log for s in self.specs if s.name == name)

    def save_screenshot(self) -> None:
        if self.screenshot is not None:
            export_svg(self.state, self.screenshot)
            self.screenshot = None

    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        self._signalled = True

    def stop(self) -> None:
        workers = [s.name for s in self.specs if s.name.startswith("worker-")]
        self.gate.close()
        self.supervisor.stop([[LEARNER, *workers], [*self.gate.urls, BROKER, GATEWAY, SERVER]])


def run_up(opts: UpOptions) -> int:
    """Run to the end; returns the exit code (0: every step trained; 1: a child failed; 130: stopped).
    With `opts.plan`, print the placement and return 0 (nothing checked but the config and the split)."""
    config, run_dir, resume = resolve(opts)
    placement = place(config, node_of(config, opts.gpus), opts.workers)
    if opts.plan:
        print_plan(placement, config, opts.json)
        return 0
    config = wire_addresses(placement.resolved(config))
    preflight(config)
    check_servers(config.worker, len(placement.engines))  # the SGLang servers it would start (one per worker)
    run_dir.mkdir(parents=True, exist_ok=True)
    config_path = run_dir / "config.toml"
    write_config(config, config_path)
    run = Run(config, run_dir, plan(config, config_path, run_dir, placement, resume), opts.screenshot)
    if run.resume_note and (opts.headless or not sys.stdout.isatty()):  # the dashboard shows it as an event
        print(f"april up: {run.resume_note}", flush=True)
    previous = signal.signal(signal.SIGTERM, run.on_signal)
    try:
        with StatusFeed(run.pub, configured_client_keys(config.broker.curve_keys_dir)) as feed:
            run.start(feed)
            # the dashboard needs a terminal: piped (`april up | tee run.log`) the progress lines go instead
            if not run.outcome and (opts.headless or not sys.stdout.isatty()):
                run_headless(feed, run.state, run.tick, metrics=run_dir / "metrics.jsonl")
            elif not run.outcome:
                watch(feed, run.state, run.tick)
                if not run.outcome:
                    run.outcome = "interrupted"  # the view returned on Ctrl-C
    except KeyboardInterrupt:
        run.outcome = run.outcome or "interrupted"
    finally:
        run.save_screenshot()  # stopped before the learner finished: the view as it is
        print(f"april up: stopping ({run.outcome or 'interrupted'}) ...", file=sys.stderr, flush=True)
        run.stop()
        signal.signal(signal.SIGTERM, previous)
    for role, tail in run.state.alerts.items():
        print(f"--- {role}: last lines of its log", file=sys.stderr)
        print("\n".join(tail), file=sys.stderr)
    for line in run.state.start_errors:  # once, however many children said it
        print(line, file=sys.stderr)
    print(summary_line(run), file=sys.stderr)
    if run.outcome == "finished":
        return 0
    return 130 if run.outcome == "interrupted" else 1


def read_evals(run_dir: Path) -> list[dict[str, Any]]:
    """The evaluations the broker logged in RUN_DIR/eval.jsonl (oldest first; it may be writing one)."""
    return read_jsonl(run_dir / "eval.jsonl", growing=True)


def summary_line(run: Run) -> str:
    path = run.run_dir / "summary.json"
    if run.outcome == "finished" and path.exists():
        s = json.loads(path.read_text())
        evals = read_evals(run.run_dir)
        held_out = (
            f"; held-out accuracy {evals[0]['accuracy']:.3f} (v{evals[0]['version']}) -> "
            f"{evals[-1]['accuracy']:.3f} (v{evals[-1]['version']})"
            if evals
            else ""
        )
        return (
            f"april up: {s['steps']} steps in {run.run_dir}: reward {s['reward_mean_first']:.3f} -> "
            f"{s['reward_mean_last']:.3f}, {s['samples_per_s']:.2f} samples/s{held_out}; ledger {s['ledger']}"
        )
    return f"april up: {run.outcome}; {run.run_dir} is resumable: april up --resume {run.run_dir}"
