"""Placement: which GPUs `april up` gives the learner and each engine (april/placement.py), its plan on the
command line (`april up --plan`), and the learner's ranks started by `april learner` itself
(cli/rank_group.py), with real processes."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from typer.testing import CliRunner

from april.config import Config, load_config
from april.placement import PlacementError, Role, node_gpus, place
from cli.main import app
from cli.rank_group import rank_env, run_ranks


def config(tmp_path: Path, toml: str = "") -> Config:
    path = tmp_path / "c.toml"
    path.write_text(toml)
    return load_config(path)


def test_a_node_of_eight_gpus_is_split_half_and_half_with_every_gpu_used_once(tmp_path: Path) -> None:
    p = place(config(tmp_path), node_gpus(8, {}))
    assert p.learner == ("0", "1", "2", "3") and p.learner_ranks == 4
    assert p.engines == (("4",), ("5",), ("6",), ("7",))
    used = Counter(g for proc in p.processes() for g in proc.gpus)
    assert sorted(used) == [str(i) for i in range(8)] and set(used.values()) == {1}
    assert not p.shared
    names = ["broker", "worker-0", "worker-1", "worker-2", "worker-3", "learner"]
    assert [x.name for x in p.processes()] == names


def test_tensor_parallel_engines_get_their_gpus_and_sglang_servers_are_placed_too(tmp_path: Path) -> None:
    cfg = config(tmp_path, '[worker]\nengine = "sglang"\ngpus_per_engine = 2\n[learner]\ngpus = 2\n')
    p = place(cfg, node_gpus(8, {}))
    assert p.learner == ("0", "1") and p.engines == (("2", "3"), ("4", "5"), ("6", "7"))
    servers = [x for x in p.processes() if x.role is Role.SGLANG]
    workers = [x for x in p.processes() if x.role is Role.WORKER]
    assert [s.gpus for s in servers] == [w.gpus for w in workers] == list(p.engines)
    with_urls = config(tmp_path, '[worker]\nengine = "sglang"\nsglang_urls = "http://h:30000"\n')
    user_servers = place(with_urls, node_gpus(8, {}))
    assert not [x for x in user_servers.processes() if x.role is Role.SGLANG]  # the user runs them
    assert user_servers.engines == ((), ())  # and they take none of april's placement


def test_the_visible_devices_are_the_node(tmp_path: Path) -> None:
    node = node_gpus(4, {"CUDA_VISIBLE_DEVICES": "6, 7,2,3"})
    assert node == ("6", "7", "2", "3")
    p = place(config(tmp_path), node, workers=1)
    assert p.learner == ("6", "7") and p.engines == (("2",),)  # fewer workers than fit: the rest idle
    assert p.env(p.engines[0]) == {"CUDA_VISIBLE_DEVICES": "2"}
    assert node_gpus(2, {"CUDA_VISIBLE_DEVICES": ""}) == ()


def test_one_gpu_is_shared_and_no_gpu_runs_every_role_on_the_cpu(tmp_path: Path) -> None:
    one = place(config(tmp_path), ("0",))
    assert one.learner == ("0",) and one.engines == (("0",),) and one.shared
    assert place(config(tmp_path), ("0",), workers=2).engines == (("0",), ("0",))
    cpu = place(config(tmp_path), ())
    assert cpu.learner == () and cpu.engines == ((), ()) and cpu.learner_ranks == 1
    assert cpu.env(()) == {}  # nothing to hide on a machine without GPUs
    two_ranks = place(config(tmp_path, "[learner]\ngpus = 2\n"), ())
    assert two_ranks.learner_ranks == 2  # CPU ranks (gloo): the multi-rank path on a CPU


def test_roles_that_run_on_no_gpu_get_none(tmp_path: Path) -> None:
    sim = place(config(tmp_path, '[worker]\nengine = "sim"\n'), node_gpus(8, {}))
    assert sim.learner == tuple(str(i) for i in range(8)) and sim.engines == ((), ())
    assert sim.env(()) == {"CUDA_VISIBLE_DEVICES": ""}  # a sim worker sees no GPU
    both_sim = place(config(tmp_path, '[worker]\nengine = "sim"\n[learner]\nbackend = "sim"\n'), ("0", "1"))
    assert both_sim.learner == () and both_sim.learner_ranks == 1
    torch_learner = place(config(tmp_path, '[learner]\nbackend = "torch"\n'), node_gpus(8, {}))
    assert torch_learner.learner == ("0",) and len(torch_learner.engines) == 7  # one process: one GPU


@pytest.mark.parametrize(
    ("toml", "gpus", "workers", "said"),
    [
        ("[learner]\ngpus = 9\n", 8, None, "learner.gpus = 9: this node has 8 GPUs"),
        ("[learner]\ngpus = 8\n", 8, None, "leaves the engines none of this node's 8 GPUs"),
        ("", 8, 5, "--workers 5 x worker.gpus_per_engine 1 needs 5 GPUs; the engines have 4"),
        ("[worker]\ngpus_per_engine = 2\n", 8, None, "engine 'torch' runs on one GPU"),
        ('[worker]\nengine = "vllm"\ngpus_per_engine = 4\n[learner]\ngpus = 6\n', 8, None, "engines have 2"),
        ('[worker]\nengine = "sglang"\ngpus_per_engine = 16\n', 8, None, "this node has 8 GPUs"),
        ('[worker]\ndevice = "cuda:3"\n', 8, None, "april up gives each process its own GPUs"),
        ('[learner]\nbackend = "torch"\ngpus = 2\n', 8, None, "learner.backend = 'torch' runs one process"),
        ("[learner]\ngpus = 2\n", 1, None, "learner.gpus = 2: this node has 1 GPU"),
    ],
)
def test_a_split_the_node_cannot_give_is_one_line(
    tmp_path: Path, toml: str, gpus: int, workers: int | None, said: str
) -> None:
    with pytest.raises(PlacementError, match=said.replace("(", r"\(").replace("'", "'")):
        place(config(tmp_path, toml), node_gpus(gpus, {}), workers)


def test_april_up_plan_prints_every_process_for_any_node(tmp_path: Path) -> None:
    out = CliRunner().invoke(app, ["up", "--plan", "--gpus", "8", "--json"])
    assert out.exit_code == 0, out.output
    processes = json.loads(out.output)
    assert {p["role"] for p in processes} == {"broker", "worker", "learner"}
    learner = next(p for p in processes if p["role"] == "learner")
    assert learner["gpus"] == [0, 1, 2, 3] and learner["ranks"] == 4
    assert sorted(g for p in processes for g in p["gpus"]) == list(range(8))
    text = CliRunner().invoke(app, ["up", "--plan", "--gpus", "2"])
    assert text.exit_code == 0 and "learner      learner  GPU 0" in text.output, text.output
    bad = CliRunner().invoke(app, ["up", "--plan", "--gpus", "8", "--workers", "9"])
    lines = [x for x in bad.output.splitlines() if x.strip()]
    assert bad.exit_code == 2 and len(lines) == 1, bad.output
    assert lines[0].startswith("april: error: --workers 9"), bad.output


RANK_SCRIPT = """
import os, signal, sys, time
out = sys.argv[1]
def stop(*_):
    open(os.path.join(out, "stopped" + os.environ["RANK"]), "w")
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
if os.environ["RANK"] == sys.argv[2]:
    others = [os.path.join(out, "rank" + str(r)) for r in range(3) if str(r) != sys.argv[2]]
    while not all(os.path.exists(x) for x in others):
        time.sleep(0.01)  # the others have their handler: the test is about the group, not a start-up race
    sys.exit(3)
open(os.path.join(out, "rank" + os.environ["RANK"]), "w").write(
    ",".join(os.environ[k] for k in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")))
time.sleep(0 if sys.argv[2] == "none" else 600)
"""


def test_the_ranks_get_a_launchers_environment_and_one_failure_stops_them_all(tmp_path: Path) -> None:
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    assert run_ranks(3, [sys.executable, str(script), str(tmp_path), "none"]) == 0
    seen = sorted((tmp_path / f"rank{r}").read_text().split(",") for r in range(3))
    assert [s[:4] for s in seen] == [[str(r), str(r), "3", "127.0.0.1"] for r in range(3)]
    assert len({s[4] for s in seen}) == 1  # one rendezvous port for all
    for r in range(3):
        (tmp_path / f"rank{r}").unlink()
    assert run_ranks(3, [sys.executable, str(script), str(tmp_path), "1"]) == 3  # rank 1's code
    assert (tmp_path / "stopped0").exists() and (tmp_path / "stopped2").exists()  # SIGTERMed, not left
    assert rank_env(1, 2, 29500)["LOCAL_WORLD_SIZE"] == "2"


def test_a_signal_to_the_group_reaches_every_rank(tmp_path: Path) -> None:
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    code = (
        "import sys; from cli.rank_group import run_ranks; "
        f"sys.exit(run_ranks(2, [sys.executable, {str(script)!r}, {str(tmp_path)!r}, 'never']))"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[1])
    deadline = time.monotonic() + 60
    while not all((tmp_path / f"rank{r}").exists() for r in range(2)) and time.monotonic() < deadline:
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == 0
    assert (tmp_path / "stopped0").exists() and (tmp_path / "stopped1").exists()
