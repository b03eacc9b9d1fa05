"""SGLang end to end: whole runs whose workers generate with SGLang servers, the servers being the fake
rebuilt from SGLang's own source (tests/sglang_server.py: uvicorn with h11, the 0.5.23 request contract,
per-directory weight loading, weight versions in every answer).

- `april up --engine sglang` trains the shipped tiny model for three steps: every step exactly N
  samples, the ledger balanced, the server's weight_version advanced to every published version (loaded
  from a directory of its own), the held-out evaluation at v0 and v3, and the dashboard shows the SGLang
  worker.
- A real `april worker --engine sglang` survives its server killed and restarted mid-run: the broker
  shows it down and leases it nothing, then leases again once it serves; the books are exact and the
  worker process is the same throughout (test_engine_failures' scenario, with the real adapter).
"""

from __future__ import annotations

import json
import urllib.request
from collections.abc import Callable
from pathlib import Path

from harness import Cluster
from sglang_runtime import ToyModel
from sglang_server import FakeSGLangServer
from test_engine_failures import engine_killed_and_restarted_mid_run
from test_up import check_run, run_up

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
