"""compose/, checked without a Docker engine: both files (one machine, and the multi-node template) parse
and validate against the compose specification; every service runs a valid `april` command, whose resolved
config agrees with the broker's on ports and addresses; volumes are declared and mounted where the weights
hand-off needs them (on one machine a shared run directory; across machines none: no worker sees the
learner's run volume, each keeps its own cache and fetches over the network with CurveZMQ keys); the
image builds from files that exist; the entrypoint gives each worker replica its own id; and `make
compose-test` (compose/compose_test.py, which runs the files for real in CI) skips, not fails, where Docker
cannot run."""

from __future__ import annotations

import importlib.util
import ipaddress
import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any
from urllib.parse import urlsplit

import pytest
import yaml
from typer.testing import CliRunner

from april.config import Config, config_to_dict
from cli.main import app

REPO = Path(__file__).resolve().parent.parent
COMPOSE_DIR = REPO / "compose"
COMPOSE_FILE = COMPOSE_DIR / "docker-compose.yml"
MULTINODE_FILE = COMPOSE_DIR / "docker-compose.multinode.yml"
ROLE_SERVICES = {"broker", "worker", "learner", "worker-gpu", "learner-gpu"}
WORKER_SERVICES = {"worker", "worker-gpu"}
# The multi-node file's required host variables, as a user sets them on the head node.
HEAD_HOST = "10.0.0.1"
MULTINODE_VARS = {"HEAD_HOST": HEAD_HOST, "KEYS_DIR": "../keys"}
_VAR = re.compile(r"\$\{(\w+)(?:(:?[-?])([^}]*))?\}")


def interpolate(node: Any, given: dict[str, str] | None = None) -> Any:
    """Compose's interpolation with only the `given` variables set: ${VAR:-default} takes the default,
    ${VAR:?message} (a required variable) must be given."""
    given = given or {}

    def value(m: re.Match[str]) -> str:
        name, op, arg = m.group(1), m.group(2) or "", m.group(3) or ""
        if name in given:
            return given[name]
        assert "?" not in op, f"${{{name}}} is required ({arg}) but the test did not set it"
        return arg

    if isinstance(node, str):
        return _VAR.sub(value, node)
    if isinstance(node, dict):
        return {k: interpolate(v, given) for k, v in node.items()}
    if isinstance(node, list):
        return [interpolate(v, given) for v in node]
    return node


def load(path: Path = COMPOSE_FILE, given: dict[str, str] | None = None) -> dict[str, Any]:
    doc: dict[str, Any] = interpolate(yaml.safe_load(path.read_text(encoding="utf-8")), given)
    return doc


SERVICES: dict[str, dict[str, Any]] = load()["services"]
MULTINODE: dict[str, dict[str, Any]] = load(MULTINODE_FILE, MULTINODE_VARS)["services"]


def environment(service: dict[str, Any]) -> dict[str, str]:
    env = service.get("environment", {})
    if isinstance(env, list):
        env = dict(item.split("=", 1) for item in env)
    return {k: str(v) for k, v in env.items()}


def commands() -> list[tuple[str, list[str]]]:
    """(where, argv) for every service command and healthcheck command of both files."""
    out = []
    for label, services in (("", SERVICES), ("multinode ", MULTINODE)):
        for name, service in services.items():
            out.append((label + name, service["command"]))
            test = service.get("healthcheck", {}).get("test")
            if test:
                assert test[0] == "CMD", f"{name}: healthcheck {test!r}: expected the exec form [CMD, ...]"
                out.append((f"{label}{name} healthcheck", test[1:]))
    return out


def mounts(service: dict[str, Any]) -> list[dict[str, Any]]:
    """Volumes in long form (short 'source:target[:mode]' strings are expanded)."""
    out = []
    for v in service.get("volumes", []):
        if isinstance(v, str):
            source, target, *mode = v.split(":")
            kind = "bind" if source.startswith((".", "/", "~", "$")) else "volume"
            v = {"type": kind, "source": source, "target": target, "read_only": mode == ["ro"]}
        out.append(v)
    return out


def test_services_and_profiles() -> None:
    assert set(SERVICES) >= ROLE_SERVICES | {"status"}
    for name in ("broker", "worker", "learner"):  # the default (CPU) stack: no profile needed
        assert "profiles" not in SERVICES[name], name
    assert SERVICES["worker-gpu"]["profiles"] == ["gpu"]
    assert SERVICES["learner-gpu"]["profiles"] == ["gpu"]
    for name in ("worker", "worker-gpu"):  # --scale worker=N: nothing that names a single container
        assert "container_name" not in SERVICES[name] and "ports" not in SERVICES[name], name


@pytest.mark.parametrize("path", [COMPOSE_FILE, MULTINODE_FILE], ids=lambda p: p.name)
def test_validates_against_the_compose_specification(path: Path) -> None:
    exe = shutil.which("check-jsonschema") or str(Path(sys.executable).parent / "check-jsonschema")
    if not Path(exe).exists():
        pytest.skip("check-jsonschema is not installed (pip install -e '.[dev]')")
    done = subprocess.run(
        [exe, "--builtin-schema", "vendor.compose-spec", str(path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.parametrize(("where", "argv"), commands(), ids=[w for w, _ in commands()])
def test_every_command_is_a_valid_april_invocation(where: str, argv: list[str]) -> None:
    assert argv[0] == "april", f"{where}: {argv!r} is not an april command"
    result = CliRunner().invoke(app, [*argv[1:], "--help"])
    assert result.exit_code == 0, f"{where}: `{' '.join(argv)} --help` -> {result.exit_code}\n{result.output}"


@dataclass
class Resolved:
    """What a service's april command resolved, captured instead of running the role."""

    config: Config | None = None
    run_dir: Path | None = None
    status_address: str | None = None
    status_keys: str | None = None


def resolve(argv: list[str], env: dict[str, str], monkeypatch: pytest.MonkeyPatch) -> Resolved:
    """Run the command as the container would (its environment, its flags), with the role stubbed out."""
    import cli.learner_cmd
    import cli.main
    import cli.status_cmd
    import cli.worker_cmd

    got = Resolved()

    def role(config: Config, run_dir: Path | None = None, resume: bool = False) -> None:
        got.config, got.run_dir = config, run_dir

    def status(address: str, timeout_s: float, curve: object = None) -> None:
        got.status_address = address

    def status_keys(keys_dir: str) -> None:  # the key files exist only where the container runs
        got.status_keys = keys_dir

    monkeypatch.setattr(cli.status_cmd, "configured_client_keys", status_keys)
    monkeypatch.setattr(cli.main, "run_broker", role)
    monkeypatch.setattr(cli.worker_cmd, "run_worker", role)
    monkeypatch.setattr(cli.learner_cmd, "run_learner_process", role)
    monkeypatch.setattr(cli.status_cmd, "fetch_status", status)
    monkeypatch.setattr(cli.status_cmd, "print_status", lambda state, as_json: None)
    result = CliRunner().invoke(app, argv[1:], env=env)
    assert result.exit_code == 0, f"`{' '.join(argv)}` -> {result.exit_code}\n{result.output}"
    return got


def assert_connects(address: str, port: int, where: str) -> None:
    parts = urlsplit(address)
    assert parts.scheme == "tcp" and parts.port == port, f"{where}: {address!r}, expected port {port}"
    host = parts.hostname or ""
    assert host == "localhost" or ipaddress.ip_address(host).is_loopback, (
        f"{where}: {address!r}: the broker binds loopback only, so peers must connect to 127.0.0.1"
    )


def test_peers_connect_to_the_ports_the_broker_binds(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in [k for k in os.environ if k.startswith("APRIL_")]:  # the host's, not the container's
        monkeypatch.delenv(var)
    broker = resolve(SERVICES["broker"]["command"], environment(SERVICES["broker"]), monkeypatch)
    assert broker.config is not None
    bc = broker.config.broker
    host = bc.bind_host
    assert host == "localhost" or ipaddress.ip_address(host).is_loopback, "see cli/broker_cmd.py"
    shared = {s: config_to_dict(broker.config)[s] for s in ("run", "algo", "data", "broker")}
    for name, service in SERVICES.items():
        if name == "broker":
            continue
        assert service.get("network_mode") == "service:broker", (
            f"{name}: must share the broker's network namespace to reach its loopback ports"
        )
        assert "ports" not in service, f"{name}: publishes ports, but it has no network of its own"
        got = resolve(service["command"], environment(service), monkeypatch)
        if got.status_address is not None:
            assert_connects(got.status_address, bc.learner_port, name)
            continue
        assert got.config is not None, name
        if service["command"][1] == "worker":
            assert_connects(got.config.worker.broker, bc.worker_port, name)
        else:
            assert_connects(got.config.learner.broker, bc.learner_port, name)
            assert got.run_dir == broker.run_dir, f"{name}: run dir {got.run_dir}, broker's {broker.run_dir}"
        sections = {s: config_to_dict(got.config)[s] for s in shared}
        assert sections == shared, f"{name}: its [run]/[algo]/[data]/[broker] differ from the broker's"
    health = SERVICES["broker"]["healthcheck"]["test"][1:]
    assert_connects(resolve(health, {}, monkeypatch).status_address or "", bc.learner_port, "healthcheck")


@pytest.mark.parametrize("path", [COMPOSE_FILE, MULTINODE_FILE], ids=lambda p: p.name)
def test_named_volumes_are_declared(path: Path) -> None:
    doc = load(path, MULTINODE_VARS)
    declared = set(doc.get("volumes") or {})
    for name, service in doc["services"].items():
        for m in mounts(service):
            if m["type"] == "volume" and m.get("source"):  # no source: an anonymous, per-container volume
                assert m["source"] in declared, f"{name}: volume {m['source']!r} is not declared"


def test_the_run_directory_is_shared() -> None:
    runs_target: str | None = None
    for name, service in SERVICES.items():
        if name not in ROLE_SERVICES:
            continue
        runs = [m for m in mounts(service) if m["type"] == "volume" and m["source"] == "runs"]
        assert len(runs) == 1, f"{name}: mounts the runs volume {len(runs)} times"
        runs_target = runs_target or runs[0]["target"]
        # weights are announced by absolute path: every role must see the volume at the same place
        assert runs[0]["target"] == runs_target, f"{name}: runs at {runs[0]['target']}, others {runs_target}"
        command = service["command"]
        if "--run-dir" in command:
            run_dir = Path(command[command.index("--run-dir") + 1])
            assert run_dir.is_relative_to(runs_target), f"{name}: run dir {run_dir} outside {runs_target}"
            assert not runs[0].get("read_only"), f"{name}: writes its run directory, mounted read-only"
    for name in ROLE_SERVICES - {"broker"}:
        env = environment(SERVICES[name])
        model = env["APRIL_WORKER_MODEL" if "worker" in name else "APRIL_LEARNER_MODEL"]
        targets = [m["target"] for m in mounts(SERVICES[name]) if m["type"] == "bind"]
        assert model in targets, f"{name}: model {model} is not mounted (bind mounts: {targets})"


def test_multinode_services_run_on_their_hosts_network() -> None:
    assert set(MULTINODE) == set(SERVICES), "the template offers the same services as the one-host file"
    for name, service in MULTINODE.items():
        assert service.get("profiles") == SERVICES[name].get("profiles"), name
        assert service.get("network_mode") == "host", f"{name}: peers on other hosts must reach its ports"
        assert "ports" not in service and "container_name" not in service, name
    for name in WORKER_SERVICES:  # `up worker` on a worker node must not start a broker there too
        assert "depends_on" not in MULTINODE[name], f"{name}: depends on {MULTINODE[name]['depends_on']}"


def mounted_at(service: dict[str, Any], path: str) -> dict[str, Any]:
    """The mount whose target holds `path` (the deepest one), or fail naming the service's mounts."""
    held = [m for m in mounts(service) if Path(path).is_relative_to(m["target"])]
    assert held, f"{path} is on no mount (mounts: {[m['target'] for m in mounts(service)]})"
    return max(held, key=lambda m: len(Path(m["target"]).parts))


def is_loopback(host: str) -> bool:
    return host == "localhost" or ipaddress.ip_address(host).is_loopback


def test_multinode_roles_reach_each_other_through_the_head_node(monkeypatch: pytest.MonkeyPatch) -> None:
    from cli.broker_cmd import check_bind_host

    for var in [k for k in os.environ if k.startswith("APRIL_")]:
        monkeypatch.delenv(var)
    broker = resolve(MULTINODE["broker"]["command"], environment(MULTINODE["broker"]), monkeypatch)
    assert broker.config is not None
    bc, wc = broker.config.broker, broker.config.weights
    assert not is_loopback(bc.bind_host), "the broker must be reachable from the worker nodes"
    check_bind_host(bc.bind_host, bc.curve_keys_dir)  # the very check `april broker` makes: keys are set
    shared = {s: config_to_dict(broker.config)[s] for s in ("run", "algo", "data", "broker", "weights")}
    for name, service in MULTINODE.items():
        got = resolve(service["command"], environment(service), monkeypatch)
        if got.status_address is not None:
            keys_dir = got.status_keys
        else:
            assert got.config is not None, name
            keys_dir = got.config.broker.curve_keys_dir
        assert keys_dir, f"{name}: no CurveZMQ keys, but every peer is reached on a non-loopback address"
        keys = mounted_at(service, keys_dir)
        assert keys["type"] == "bind" and keys.get("read_only"), f"{name}: keys {keys_dir} mounted as {keys}"
        if got.status_address is not None:
            assert got.status_address == f"tcp://{HEAD_HOST}:{bc.learner_port}", name
            continue
        assert got.config is not None, name
        sections = {s: config_to_dict(got.config)[s] for s in shared}
        assert sections == shared, f"{name}: its {list(shared)} sections differ from the broker's"
        role = service["command"][1]
        if role == "worker":
            assert got.config.worker.broker == f"tcp://{HEAD_HOST}:{bc.worker_port}", name
        elif role == "learner":
            assert got.config.learner.broker == f"tcp://{HEAD_HOST}:{bc.learner_port}", name
            assert got.run_dir == broker.run_dir, f"{name}: run dir {got.run_dir}, broker's {broker.run_dir}"
    # the weights: served by the learner on the head node, fetched by workers that share no disk with it
    assert wc.transport.value == "network"
    assert not is_loopback(wc.bind_host) and wc.advertise_host == HEAD_HOST
    assert {wc.port, wc.port + 1}.isdisjoint({bc.worker_port, bc.learner_port, bc.pub_port})


def test_no_multinode_worker_sees_the_learners_run_directory() -> None:
    learner_volumes = {
        m["source"]
        for name in ("learner", "learner-gpu")
        for m in mounts(MULTINODE[name])
        if m["type"] == "volume" and m.get("source")
    }
    assert "runs" in learner_volumes  # the learner writes run/weights there
    env = environment(MULTINODE["worker"])
    for name in WORKER_SERVICES:
        service = MULTINODE[name]
        for m in mounts(service):
            assert not (m["type"] == "volume" and m.get("source") in learner_volumes), (
                f"{name}: mounts the learner's volume {m['source']!r} at {m['target']}"
            )
            assert not Path("/runs").is_relative_to(m["target"]), f"{name}: {m['target']} holds /runs"
        # the cache: a volume of the worker's own (anonymous: one per replica), written, never read-only
        cache = mounted_at(service, env["APRIL_WEIGHTS_CACHE_DIR"])
        assert cache["type"] == "volume" and not cache.get("source") and not cache.get("read_only"), cache
        assert environment(service)["APRIL_WEIGHTS_CACHE_DIR"] == env["APRIL_WEIGHTS_CACHE_DIR"]


def test_every_service_builds_from_the_one_dockerfile() -> None:
    for name, service in [*SERVICES.items(), *MULTINODE.items()]:
        build = service["build"]
        context = (COMPOSE_DIR / build["context"]).resolve()
        assert context == REPO, f"{name}: build context {context}, expected the repository root"
        assert (context / build["dockerfile"]) == COMPOSE_DIR / "Dockerfile", name
        assert build["args"]["VARIANT"] in ("cpu", "gpu"), name
    dockerfile = (COMPOSE_DIR / "Dockerfile").read_text(encoding="utf-8")
    # sources from the build context (COPY --from=STAGE copies between the Dockerfile's own stages)
    copies = re.findall(r"^COPY\s+(?!--from=)(.+?)\s+\S+$", dockerfile, flags=re.MULTILINE)
    assert copies
    for sources in copies:
        for source in sources.split():
            assert (REPO / source).exists(), f"Dockerfile: COPY {source}: no such path in the repository"


def entrypoint() -> ModuleType:
    spec = importlib.util.spec_from_file_location("compose_entrypoint", COMPOSE_DIR / "entrypoint.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_entrypoint_gives_each_worker_replica_its_own_id() -> None:
    ep = entrypoint()
    ids = set()
    for _ in range(4):
        env: dict[str, str] = {}
        ep.prepare(["april", "worker", "--engine", "torch"], env)
        ids.add(env["APRIL_WORKER_WORKER_ID"])
    assert len(ids) == 4
    env = {"APRIL_WORKER_WORKER_ID": "w7"}
    ep.prepare(["april", "worker"], env)
    assert env == {"APRIL_WORKER_WORKER_ID": "w7"}
    for argv in (["april", "broker", "--run-dir", "/runs/x"], ["april", "learner"], ["sh"]):
        env = {}
        ep.prepare(argv, env)
        assert env == {}, argv


def test_entrypoint_starts_the_workers_sglang_server(monkeypatch: pytest.MonkeyPatch) -> None:
    import actors.engines.sglang_launch as launch

    ep = entrypoint()
    started: list[list[str]] = []
    waited: list[str] = []

    class FakeServer:
        def __init__(self, command: list[str], env: dict[str, str]) -> None:
            started.append(command)

    monkeypatch.setattr(ep.subprocess, "Popen", FakeServer)
    monkeypatch.setattr(launch, "wait_ready", lambda url, proc, timeout_s: waited.append(url))
    env = {
        "LOCAL_SGLANG": "1",
        "LOCAL_SGLANG_ARGS": "--tp-size 2",
        "APRIL_WORKER_MODEL": "/model",
        "APRIL_WORKER_SLOTS": "12",
    }
    ep.prepare(["april", "worker", "--engine", "sglang"], env)
    (command,) = started
    port = command[command.index("--port") + 1]
    assert env["APRIL_WORKER_SGLANG_URLS"] == f"http://127.0.0.1:{port}" == waited[0]
    assert command[command.index("--model-path") + 1] == "/model"
    assert command[command.index("--max-running-requests") + 1] == "12"
    assert command[-2:] == ["--tp-size", "2"]
    with pytest.raises(SystemExit, match="APRIL_WORKER_MODEL"):
        ep.prepare(["april", "worker"], {"LOCAL_SGLANG": "1"})


def test_entrypoint_execs_the_command(monkeypatch: pytest.MonkeyPatch) -> None:
    ep = entrypoint()
    execs: list[tuple[str, list[str], dict[str, str]]] = []
    monkeypatch.setattr(ep.os, "execvpe", lambda file, args, env: execs.append((file, args, env)))
    ep.main(["april", "worker"])
    ((file, args, env),) = execs
    assert (file, args) == ("april", ["april", "worker"]) and env["APRIL_WORKER_WORKER_ID"]
    with pytest.raises(SystemExit, match="no command"):
        ep.main([])


def test_compose_test_skips_where_docker_cannot_run(tmp_path: Path) -> None:
    """`make compose-test` (CI) passes with one line where no engine can run: here a `docker` that no
    engine answers and a `dockerd` that will not start, as in a container without cgroups (as a user who
    is not root it stops earlier, for that reason). Nothing is installed: both commands are on PATH."""
    fakes = tmp_path / "bin"
    fakes.mkdir()
    for name, line in (
        ("docker", "Cannot connect to the Docker daemon at unix:///var/run/docker.sock."),
        ("dockerd", "failed to start daemon: Devices cgroup isn't mounted"),
    ):
        (fakes / name).write_text(f'#!/bin/sh\necho "{line}" >&2\nexit 1\n')
        (fakes / name).chmod(0o755)
    report = tmp_path / "report.json"
    env = {**os.environ, "PATH": f"{fakes}:{os.environ['PATH']}", "TMPDIR": str(tmp_path)}
    env.pop("BASE_IMAGE", None)
    proc = subprocess.run(
        [sys.executable, str(COMPOSE_DIR / "compose_test.py"), "--report", str(report)],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (line,) = proc.stdout.splitlines()
    assert line.startswith("compose-test: skipped: "), line
    outcome = json.loads(report.read_text())
    assert outcome["outcome"] == "skipped"
    expected = "isn't mounted" if os.geteuid() == 0 else "not root"
    assert expected in outcome["reason"], outcome
