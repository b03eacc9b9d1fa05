"""docs/slurm/, checked without Slurm: the scripts parse (`bash -n`), every `#SBATCH` directive and srun
flag is one Slurm documents, and a dry run of the batch script, with `srun`, `scontrol`, `torchrun`, the
SGLang server and the april roles replaced by recorders on PATH (`april keys` and everything else run for
real), launches what docs/multinode.md says: the broker on the head node binding a non-loopback address
with CurveZMQ keys, torchrun on each learner node (its flags parsed by torchrun's own parser, global rank 0
on the head), and on each worker node its own client keys, SGLang servers with the flags april's launcher
uses, and an `april worker` fetching weights over the network into a cache on its own disk. Every april
command line parses with the real CLI and resolves (with the TOML and the --set overrides) to a config.

Option names: Slurm's documentation, https://slurm.schedmd.com/sbatch.html#SECTION_OPTIONS and
https://slurm.schedmd.com/srun.html#SECTION_OPTIONS (the long names of doc/man/man1/sbatch.1 and srun.1 in
SchedMD/slurm at 284c3b9, August 2026).
"""

from __future__ import annotations

import ipaddress
import json
import os
import re
import stat
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import click
import pytest
import typer
import zmq.utils.z85
from typer.testing import CliRunner

from april.config import Config, WeightsTransport
from april.keys import authorized_keys, client_keys, read_public
from cli.main import app

REPO = Path(__file__).resolve().parent.parent
SLURM_DIR = REPO / "docs" / "slurm"
SBATCH = SLURM_DIR / "april.sbatch"
SCRIPTS = [SBATCH, SLURM_DIR / "learner-node.sh", SLURM_DIR / "worker-node.sh"]
CONFIG = SLURM_DIR / "april.toml"

_SBATCH_NAMES = (
    "account acctg-freq array batch bb bbf begin chdir cluster-constraint clusters comment "
    "consolidate-segments constraint container container-id contiguous core-spec cores-per-socket "
    "cpu-freq cpus-per-gpu cpus-per-task deadline delay-boot dependency distribution error exclude "
    "exclusive export export-file extra extra-node-info get-user-env gid gpu-bind gpu-freq gpus "
    "gpus-per-node gpus-per-socket gpus-per-task gres gres-flags help hint ignore-pbs input job-name "
    "kill-on-invalid-dep licenses mail-type mail-user mcs-label mem mem-bind mem-per-cpu mem-per-gpu "
    "mem-update mincpus network nice no-kill no-requeue nodefile nodelist nodes ntasks ntasks-per-core "
    "ntasks-per-gpu ntasks-per-node ntasks-per-socket oom-kill-step open-mode output overcommit "
    "oversubscribe parsable partition prefer priority profile propagate qos quiet reboot requeue "
    "reservation resources resv-ports runtime segment signal sockets-per-node spread-job spread-segments "
    "stepmgr switches test-only thread-spec threads-per-core time time-min tmp tres-bind tres-per-task "
    "uid usage use-min-nodes verbose version wait wait-all-nodes wckey wrap"
)
_SRUN_NAMES = (
    "account acctg-freq async bb bbf bcast bcast-exclude begin chdir cluster-constraint clusters comment "
    "compress consolidate-segments constraint container container-id contiguous core-spec "
    "cores-per-socket cpu-bind cpu-freq cpus-per-gpu cpus-per-task deadline delay-boot dependency "
    "disable-status distribution epilog error exact exclude exclusive export external-launcher extra "
    "extra-node-info gpu-bind gpu-freq gpus gpus-per-node gpus-per-socket gpus-per-task gres gres-flags "
    "help het-group hint ignore-signals immediate input job-name jobid kill-on-bad-exit label licenses "
    "mail-type mail-user mcs-label mem mem-bind mem-per-cpu mem-per-gpu mem-update mincpus mpi "
    "msg-timeout multi-prog network nice no-allocate no-kill nodefile nodelist nodes ntasks "
    "ntasks-per-core ntasks-per-gpu ntasks-per-node ntasks-per-socket oom-kill-step open-mode output "
    "overcommit overlap oversubscribe parsable partition prefer preserve-env priority profile prolog "
    "propagate pty qos quiet quit-on-interrupt reboot relative reservation resources resv-ports runtime "
    "segment send-libs signal slurmd-debug sockets-per-node spread-job spread-segments stepmgr switches "
    "task-epilog task-prolog test-only thread-spec threads threads-per-core time time-min tmp treewidth "
    "tres-bind tres-per-task unbuffered usage use-min-nodes verbose version wait wait-for-children wckey "
    "x11"
)
SBATCH_OPTIONS = frozenset(_SBATCH_NAMES.split())
SRUN_OPTIONS = frozenset(_SRUN_NAMES.split())
# srun options documented without a value; every other one is written --name=value in the scripts, so
# the command after the options is unambiguous (for the recorder as for a reader).
SRUN_SWITCHES = frozenset({"overlap", "exact", "label", "unbuffered", "quiet", "verbose", "pty"})

NODES = ["n0", "n1", "n2", "n3"]
LEARNER_NODES, GPUS_PER_NODE, JOB_ID = 2, 2, "4242"
HEAD = NODES[0]

# One recorder for every stand-in: it appends {prog, argv, node, env} to $STUB_LOG, then acts its part.
RECORDER = """#!{python}
import json, os, signal, subprocess, sys
prog, argv = os.path.basename(sys.argv[0]), sys.argv[1:]
keep = ("SLURMD_NODENAME", "SLURM_NODEID", "SLURM_NNODES", "TMPDIR", "CUDA_VISIBLE_DEVICES")
with open(os.environ["STUB_LOG"], "a") as log:
    record = {{"prog": prog, "argv": argv, "env": {{k: os.environ.get(k) for k in keep}}}}
    log.write(json.dumps(record) + "\\n")
if prog == "scontrol" and argv[:2] == ["show", "hostnames"]:
    print("\\n".join(os.environ["STUB_NODES"].split(",")))
elif prog == "april" and argv[:1] == ["keys"]:
    os.execv({april!r}, ["april", *argv])
elif prog == "srun":
    # the batch script stops its steps with SIGTERM when the learner ends; the recorder finishes its
    # step first, so that the dry run records every task whatever the timing
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    opts = [a for a in argv[: next(i for i, a in enumerate(argv) if not a.startswith("-"))]]
    command = argv[len(opts):]
    nodes = dict(o[2:].split("=", 1) for o in opts if "=" in o)["nodelist"].split(",")
    stdin = sys.stdin.buffer.read()
    tasks = []
    for i, node in enumerate(nodes):  # one task per node, all at once, each in its node's environment
        tmp = os.path.join(os.environ["STUB_ROOT"], "nodes", node)
        os.makedirs(tmp, exist_ok=True)
        env = {{**os.environ, "SLURMD_NODENAME": node, "SLURM_NODEID": str(i),
                "SLURM_NNODES": str(len(nodes)), "TMPDIR": tmp}}
        tasks.append(subprocess.Popen(command, stdin=subprocess.PIPE, env=env))
    for task in tasks:
        task.communicate(stdin, timeout=120)
    sys.exit(max(task.returncode for task in tasks))
"""
STUBS = ("srun", "scontrol", "torchrun", "april", "python3", "curl")


@dataclass(frozen=True, slots=True)
class Call:
    prog: str
    argv: list[str]
    env: dict[str, str | None]


@dataclass(frozen=True, slots=True)
class DryRun:
    calls: list[Call]
    root: Path
    run_dir: Path

    def of(self, prog: str, *head: str) -> list[Call]:
        return [c for c in self.calls if c.prog == prog and c.argv[: len(head)] == list(head)]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory: pytest.TempPathFactory) -> DryRun:
    root = tmp_path_factory.mktemp("slurm")
    stubs = root / "bin"
    stubs.mkdir()
    real_april = str(Path(sys.executable).parent / "april")
    for name in STUBS:
        path = stubs / name
        path.write_text(RECORDER.format(python=sys.executable, april=real_april), encoding="utf-8")
        path.chmod(path.stat().st_mode | stat.S_IXUSR)
    submit = root / "submit"
    submit.mkdir()
    log = root / "calls.jsonl"
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("APRIL_", "SLURM"))},
        "PATH": f"{stubs}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
        "STUB_LOG": str(log),
        "STUB_ROOT": str(root),
        "STUB_NODES": ",".join(NODES),
        "SLURM_JOB_ID": JOB_ID,
        "SLURM_JOB_NODELIST": "n[0-3]",
        "SLURM_SUBMIT_DIR": str(submit),
        "SLURM_DIR": str(SLURM_DIR),
        "MODEL": str(REPO / "models" / "tiny"),
        "LEARNER_NODES": str(LEARNER_NODES),
        "GPUS_PER_NODE": str(GPUS_PER_NODE),
    }
    done = subprocess.run(
        ["bash", str(SBATCH)], env=env, cwd=submit, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout + done.stderr
    calls = [Call(**json.loads(line)) for line in log.read_text(encoding="utf-8").splitlines()]
    return DryRun(calls, root, submit / "runs" / f"april-{JOB_ID}")


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda p: p.name)
def test_scripts_are_valid_bash(script: Path) -> None:
    done = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr


def test_sbatch_directives_are_slurm_options_before_the_first_command() -> None:
    directives: list[str] = []
    first_command: int | None = None
    for number, line in enumerate(SBATCH.read_text(encoding="utf-8").splitlines(), 1):
        if line.startswith("#SBATCH"):
            # sbatch stops reading directives at the first line that is neither a comment nor blank
            assert first_command is None, (
                f"line {number}: #SBATCH after the first command (line {first_command})"
            )
            directives.append(line.split(None, 1)[1])
        elif line.strip() and not line.lstrip().startswith("#"):
            first_command = first_command or number
    assert {"--nodes=3", "--ntasks-per-node=1", "--gpus-per-node=8"} <= set(directives)
    for directive in directives:
        name = re.fullmatch(r"--([a-z0-9-]+)(=\S+)?", directive)
        assert name, f"#SBATCH {directive}: expected --name or --name=value"
        assert name.group(1) in SBATCH_OPTIONS, f"#SBATCH {directive}: not an sbatch option"


def srun_options(call: Call) -> dict[str, str]:
    options: dict[str, str] = {}
    for arg in call.argv:
        if not arg.startswith("-"):
            break
        name, _, value = arg[2:].partition("=")
        assert arg.startswith("--") and name in SRUN_OPTIONS, f"srun {arg}: not an srun option"
        assert value or name in SRUN_SWITCHES, f"srun {arg}: takes a value, written --{name}=VALUE"
        options[name] = value
    return options


def command_of(call: Call) -> list[str]:
    return call.argv[len(srun_options(call)) :]


def test_srun_steps_place_each_role_on_its_nodes(dry_run: DryRun) -> None:
    steps = dry_run.of("srun")
    placed: dict[str, list[str]] = {}
    for step in steps:
        options = srun_options(step)
        nodes = options["nodelist"].split(",")
        assert set(nodes) <= set(NODES), options
        assert int(options.get("nodes", "0")) == len(nodes), f"--nodes disagrees with --nodelist: {options}"
        command = command_of(step)
        role = command[1] if command[0] == "april" else f"{Path(command[1]).name} {command[2]}"
        placed.setdefault(role, []).extend(nodes)
    learners, workers = NODES[:LEARNER_NODES], NODES[LEARNER_NODES:]
    assert placed == {
        "broker": [HEAD],
        "learner-node.sh " + dry_run.run_dir.as_posix(): learners,
        "worker-node.sh keys": workers,  # one step per node: each gets its own keys on stdin
        "worker-node.sh run": workers,
    }


def test_torchrun_flags_parse_and_put_rank_0_on_the_head(dry_run: DryRun) -> None:
    from torch.distributed.run import get_args_parser

    calls = dry_run.of("torchrun")
    assert sorted(c.env["SLURMD_NODENAME"] or "" for c in calls) == NODES[:LEARNER_NODES]
    for call in calls:
        try:
            args = get_args_parser().parse_args(call.argv)
        except SystemExit:  # argparse's answer to an unknown flag or a missing value (printed above)
            pytest.fail(f"torchrun {' '.join(call.argv)}: torchrun's parser refuses it")
        assert args.nnodes == str(LEARNER_NODES) and args.nproc_per_node == str(GPUS_PER_NODE)
        assert int(args.node_rank) == int(call.env["SLURM_NODEID"] or -1)
        assert (int(args.node_rank) == 0) == (call.env["SLURMD_NODENAME"] == HEAD)
        assert args.master_addr == HEAD and Path(args.training_script).name == "april"
        assert args.training_script_args[0] == "learner"


def april_commands(dry_run: DryRun) -> Iterator[tuple[str | None, list[str]]]:
    """(node, argv after `april`) of every april command the dry run ran, torchrun's included."""
    for call in dry_run.calls:
        if call.prog == "april":
            yield call.env["SLURMD_NODENAME"], call.argv
        elif call.prog == "torchrun":
            yield (
                call.env["SLURMD_NODENAME"],
                call.argv[[Path(a).name for a in call.argv].index("april") + 1 :],
            )


def parse_cli(argv: list[str]) -> None:
    """Parse argv with the real click commands, down to the leaf, without running anything."""
    command: click.Command = typer.main.get_command(app)
    ctx = command.make_context("april", list(argv), resilient_parsing=False)
    while isinstance(command, click.Group):
        name, sub, rest = command.resolve_command(ctx, ctx.protected_args + ctx.args)
        assert sub is not None and name is not None, argv
        command, ctx = sub, sub.make_context(name, rest, parent=ctx)


def test_every_april_command_parses(dry_run: DryRun) -> None:
    commands = list(april_commands(dry_run))
    seen = {tuple(argv[:2]) if argv[0] == "keys" else (argv[0],) for _, argv in commands}
    assert seen == {("keys", "generate"), ("keys", "add-client"), ("broker",), ("learner",), ("worker",)}
    for _, argv in commands:
        try:
            parse_cli(argv)
        except click.ClickException as exc:
            pytest.fail(f"april {' '.join(argv)}: {exc.format_message()}")


def resolve(argv: list[str], monkeypatch: pytest.MonkeyPatch) -> tuple[Config, Path | None]:
    """The config (and run dir) `april ARGV` starts its role with; the role itself is not run."""
    import cli.learner_cmd
    import cli.main
    import cli.worker_cmd

    got: list[tuple[Config, Path | None]] = []

    def role(config: Config, run_dir: Path | None = None, resume: bool = False) -> None:
        got.append((config, run_dir))

    monkeypatch.setattr(cli.main, "run_broker", role)
    monkeypatch.setattr(cli.worker_cmd, "run_worker", role)
    monkeypatch.setattr(cli.learner_cmd, "run_learner_process", role)
    result = CliRunner().invoke(app, argv, env={})
    assert result.exit_code == 0, f"april {' '.join(argv)} -> {result.exit_code}\n{result.output}"
    return got[0]


def test_roles_reach_the_head_with_keys_and_workers_cache_weights_locally(
    dry_run: DryRun, monkeypatch: pytest.MonkeyPatch
) -> None:
    from cli.broker_cmd import check_bind_host

    for var in [k for k in os.environ if k.startswith("APRIL_")]:
        monkeypatch.delenv(var)
    keys = dry_run.run_dir / "keys"
    roles: dict[str, list[tuple[str | None, Config, Path | None]]] = {}
    for node, argv in april_commands(dry_run):
        if argv[0] != "keys":
            roles.setdefault(argv[0], []).append((node, *resolve(argv, monkeypatch)))
    ((node, broker, broker_run_dir),) = roles["broker"]
    assert node == HEAD and broker_run_dir == dry_run.run_dir
    bc = broker.broker
    assert not ipaddress.ip_address(bc.bind_host).is_loopback and bc.curve_keys_dir == str(keys)
    check_bind_host(bc.bind_host, bc.curve_keys_dir)
    assert (keys / "broker.key_secret").is_file()
    authorized = authorized_keys(keys / "authorized")
    for node, config, run_dir in roles["learner"]:
        assert config.learner.broker == f"tcp://{HEAD}:{bc.learner_port}" and run_dir == dry_run.run_dir
        assert config.broker.curve_keys_dir == str(keys), node
    assert sorted(node or "" for node, _, _ in roles["worker"]) == NODES[LEARNER_NODES:]
    servers = dry_run.of("python3", "-m", "sglang.launch_server")
    for node, config, _ in roles["worker"]:
        assert config.worker.broker == f"tcp://{HEAD}:{bc.worker_port}" and config.worker.engine == "sglang"
        local = dry_run.root / "nodes" / (node or "")
        # its own client pair, authorised by the broker; the broker's secret never leaves the head node
        node_keys = Path(config.broker.curve_keys_dir)
        assert node_keys.is_relative_to(local), f"{node}: keys {node_keys} are not on its own disk"
        assert client_keys(node_keys).server_public == read_public(keys / "broker.key")
        assert zmq.utils.z85.decode(read_public(node_keys / "client.key")) in authorized, node
        assert not (node_keys / "broker.key_secret").exists(), node
        # the weight service's public key, to fetch over CURVE; its secret stays with the learner
        assert read_public(node_keys / "weights.key") == read_public(keys / "weights.key"), node
        assert not (node_keys / "weights.key_secret").exists(), node
        # weights over the network into a cache on the node's own disk, outside the learner's run dir
        assert config.weights.transport == WeightsTransport.NETWORK
        assert Path(config.weights.cache_dir).is_relative_to(local), config.weights.cache_dir
        worker_argv = next(argv for n, argv in april_commands(dry_run) if n == node and argv[0] == "worker")
        assert not any(str(dry_run.run_dir) in arg for arg in worker_argv), "a worker needs no run dir"
        ports = {int(url.rsplit(":", 1)[1]) for url in config.worker.sglang_urls.split(",")}
        mine = [s for s in servers if s.env["SLURMD_NODENAME"] == node]
        assert {int(s.argv[s.argv.index("--port") + 1]) for s in mine} == ports and len(
            ports
        ) == GPUS_PER_NODE
        assert len({s.env["CUDA_VISIBLE_DEVICES"] for s in mine}) == GPUS_PER_NODE, "one GPU per server"
    for role, resolved in roles.items():
        for node, config, _ in resolved:
            assert config.weights.transport == WeightsTransport.NETWORK, (role, node)
            assert (config.run, config.algo, config.data) == (broker.run, broker.algo, broker.data), (
                role,
                node,
            )
    assert not ipaddress.ip_address(broker.weights.bind_host).is_loopback  # reached from the worker nodes


def test_sglang_servers_take_the_flags_aprils_launcher_uses(dry_run: DryRun) -> None:
    from actors.engines.sglang_launch import server_command

    known = {a for a in server_command("/m", port=1, deterministic=True) if a.startswith("--")}
    servers = dry_run.of("python3", "-m", "sglang.launch_server")
    assert len(servers) == GPUS_PER_NODE * (len(NODES) - LEARNER_NODES)
    for server in servers:
        flags = {a for a in server.argv if a.startswith("--")}
        assert flags <= known, f"not flags april's SGLang launcher passes: {sorted(flags - known)}"


def test_the_config_file_names_only_known_keys() -> None:
    from april.config import load_config

    config = load_config(CONFIG, env={})
    assert config.weights.transport == WeightsTransport.NETWORK and config.worker.engine == "sglang"
