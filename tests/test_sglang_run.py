"""SGLang end to end: whole runs whose workers generate with SGLang servers, the servers being the fake
rebuilt from SGLang's own source (tests/sglang_server.py: uvicorn with h11, the 0.5.23 request contract,
per-directory weight loading, weight versions in every answer).

- `april up --engine sglang` trains the shipped tiny model for three steps: every step exactly N
  samples, the ledger balanced, the server's weight_version advanced to every published version (loaded
  from a directory of its own), the held-out evaluation at v0 and v3, and the dashboard shows the SGLang
  worker.
- With `weights.transport = broadcast` the server is a rank of the learner's gloo group: from the first
  group on every version comes by the collective, each read back from the server before it serves, and
  the server ends holding the last published file's tensors.
- And a server killed and restarted mid-run (its launch weights, no group) is reloaded, rejoins the
  learner's group, and takes later versions from the collective again.
- A real `april worker --engine sglang` survives its server killed and restarted mid-run: the broker
  shows it down and leases it nothing, then leases again once it serves; the books are exact and the
  worker process is the same throughout (test_engine_failures' scenario, with the real adapter).
"""

from __future__ import annotations

import json
import re
import threading
import time
import urllib.request
from collections.abc import Callable
from pathlib import Path

import torch
from harness import Cluster
from safetensors.torch import load_file
from sglang_runtime import ToyModel
from sglang_server import FakeSGLangServer
from sglang_weights import HeldModel
from test_engine_failures import engine_killed_and_restarted_mid_run
from test_up import check_run, run_up

from april.ports import free_port_pair

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "models" / "tiny"


def tiny_server(**config: object) -> FakeSGLangServer:
    """A fake SGLang server whose toy model speaks the tiny model's ids (vocab 320, EOS 2): responses end
    after about 16 tokens, well inside the 256-token budget."""
    model = ToyModel(vocab_size=320, eos_token_id=2, eos_per_mille=60)
    return FakeSGLangServer(model=model, max_running_requests=64, **config)


def weight_version(url: str) -> str:
    with urllib.request.urlopen(f"{url}/model_info", timeout=60) as reply:
        return str(json.loads(reply.read())["weight_version"])


def assert_holds(held: HeldModel, published: dict[str, torch.Tensor]) -> None:
    """The server holds what the learner published last, at the server's own dtype: the learner publishes
    float32 and a bfloat16 server (the tiny model's launch dtype) rounds what it loads, as SGLang's
    weight loaders copy into their parameters (model_loader/weight_utils.py: default_weight_loader,
    `param.data.copy_`). Found by CI: once a step had changed the weights, float32 equality failed."""
    for name, tensor in published.items():
        want = tensor.to(held.dtype).float()
        assert torch.equal(torch.tensor(held.get_weights_by_name(name, 1 << 30)), want), name


def test_april_up_on_sglang_trains_loads_every_version_and_evaluates(tmp_path: Path) -> None:
    run_dir, svg = tmp_path / "run", tmp_path / "dashboard.svg"
    with tiny_server() as server:
        assert weight_version(server.url) == "default"  # the launch weights
        args = ["--engine", "sglang", "--workers", "1", "--steps", "3", "--run-dir", str(run_dir)]
        args += ["--set", f"worker.sglang_urls={server.url}", "--screenshot", str(svg)]
        code, out, _ = run_up(args, timeout=600)
        assert code == 0, out[-3000:]
        assert weight_version(server.url) == "3"  # every published version reached the server
        assert server.runtime is not None
        loads = [[Path(f) for f in files] for files in server.runtime.loaded_weight_files]
    check_run(run_dir, steps=3, samples=64)
    # each version came from a directory holding that version's file alone (SGLang loads them all)
    assert len(loads) == 3 and all(len(files) == 1 for files in loads)
    assert len({files[0].parent for files in loads}) == 3
    evals = [json.loads(x) for x in (run_dir / "eval.jsonl").read_text().splitlines()]
    assert [e["version"] for e in evals] == [0, 3] and all(e["n"] == 64 for e in evals)
    worker_log = next((run_dir / "logs").glob("worker-*.log")).read_text()
    assert "engine sglang ready" in worker_log and "Traceback" not in worker_log
    shown = svg.read_text()
    assert "sglang" in shown and "tiny-w0" in shown  # the dashboard's workers panel


def test_april_up_on_sglang_takes_versions_from_the_broadcast_each_read_back(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    with tiny_server(model_dir=str(TINY)) as server:
        args = ["--engine", "sglang", "--workers", "1", "--steps", "4", "--run-dir", str(run_dir)]
        args += ["--set", f"worker.sglang_urls={server.url}", "--set", "weights.transport=broadcast"]
        args += ["--set", f"weights.port={free_port_pair()}"]
        code, out, _ = run_up(args, timeout=600)
        assert code == 0, out[-3000:]
        assert weight_version(server.url) == "4"
        assert server.runtime is not None and server.runtime.held is not None
        updates, reads = server.runtime.distributed_updates, server.runtime.weights_reads
        last = load_file(str(run_dir / "weights" / "v000004.safetensors"))
        assert_holds(server.runtime.held, last)
    lines = check_run(run_dir, steps=4, samples=64)
    # v1 was announced before the worker had joined the group: it came by the network; v2 to v4 by the
    # collective (each line counts the workers serving the version its batch was generated with)
    assert [line["workers_synced_network"] for line in lines] == [0, 1, 0, 0]
    assert [line["workers_synced_broadcast"] for line in lines] == [0, 0, 1, 1]
    assert [line["learner/broadcast_reached"] for line in lines] == [0, 1, 1, 1]
    # v2, v3 and v4: one bucket each (the tiny model is far below weights.bucket_bytes), each read back
    assert len(updates) == 3 and all(sorted(u) == sorted(last) for u in updates)
    worker_log = next((run_dir / "logs").glob("worker-*.log")).read_text()
    checked = [
        int(v) for v in re.findall(r"weights v(\d+) loaded in [\d.]+s \(broadcast, checked", worker_log)
    ]
    assert checked == [2, 3, 4] and len(reads) >= len(checked)
    assert "Traceback" not in worker_log, worker_log[worker_log.find("Traceback") - 2000 :][:6000]


def test_a_killed_sglang_server_rejoins_the_broadcast_mid_run(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    with tiny_server(model_dir=str(TINY)) as server:
        first = server.runtime

        def kill_once_a_version_came_by_broadcast() -> None:
            deadline = time.monotonic() + 300
            while time.monotonic() < deadline and not (first and first.distributed_updates):
                time.sleep(0.05)
            server.stop()
            time.sleep(1.5)
            server.start()

        killer = threading.Thread(target=kill_once_a_version_came_by_broadcast, daemon=True)
        killer.start()
        args = ["--engine", "sglang", "--workers", "1", "--steps", "6", "--run-dir", str(run_dir)]
        args += ["--set", f"worker.sglang_urls={server.url}", "--set", "weights.transport=broadcast"]
        args += ["--set", f"weights.port={free_port_pair()}", "--set", "weights.timeout_s=10"]
        code, out, _ = run_up(args, timeout=600)
        killer.join(60)
        assert code == 0, out[-3000:]
        again = server.runtime
        assert again is not None and again is not first and again.held is not None  # restarted
        assert weight_version(server.url) == "6"
        assert again.distributed_updates  # it rejoined the group after its restart
        assert_holds(again.held, load_file(str(run_dir / "weights" / "v000006.safetensors")))
    check_run(run_dir, steps=6, samples=64)
    worker_log = next((run_dir / "logs").glob("worker-*.log")).read_text()
    after = worker_log.split("engine serves again")[-1]
    assert re.search(r"weights v\d+ loaded in [\d.]+s \(broadcast, checked", after), after[-3000:]
    assert "Traceback" not in worker_log, worker_log[worker_log.find("Traceback") - 2000 :][:6000]


def test_a_worker_survives_its_sglang_server_killed_and_restarted_mid_run(
    cluster: Callable[..., Cluster], tmp_path: Path
) -> None:
    with tiny_server() as server:
        # a liveness window of 2 s, not the harness's 0.6: once, in a full suite, the worker answering an
        # abort as its server was killed went 0.6 s without a message and was declared dead (a stall of
        # the loaded machine; production's window is 3 s)
        c = cluster(
            run={"mode": "april"},
            worker={"engine": "sglang", "sglang_urls": server.url, "slots": 8},
            broker={"liveness": 10},
        )
        c.start_broker()
        log = c.start_worker("w0")
        engine_killed_and_restarted_mid_run(
            c, log, server.stop, server.start, "sglang", weights_file=str(TINY / "model.safetensors")
        )
        assert weight_version(server.url) == "3"  # the restarted server was given the newest weights
