"""A real `april worker` with the torch engine (tiny model made here) and with the SGLang adapter
(against the fake rebuilt from SGLang's source, tests/sglang_server.py) runs against a real broker:
samples come back with consistent tokens, log-probs and versions, weights are verified by sha256 before
loading, and a bad announcement is refused while the worker keeps serving its old weights."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from harness import Cluster, wait_for
from sglang_server import FakeSGLangServer

pytest.importorskip("torch")


def test_torch_worker_runs_april_rounds_and_verifies_weights(
    cluster: Callable[..., Cluster], tmp_path: Path
) -> None:
    from april.hf import make_tiny_model

    model = make_tiny_model(tmp_path / "tiny", seed=0)
    weights = next(model.glob("*.safetensors"))
    c = cluster(
        run={"mode": "april"},
        algo={
            "rollout_batch_size": 2,
            "over_sampling_batch_size": 4,
            "n_samples_per_prompt": 2,
            "max_new_tokens": 12,
        },
        worker={"engine": "torch", "model": str(model), "slots": 4},
        data={"synthetic_vocab_size": 320},  # prompt ids within the tiny model's vocabulary
    )
    c.start_broker()
    c.start_worker("tw0")
    c.start_learner(steps=3, train_s=0.05, weights_file=str(weights), bad_sha_at_step=1)
    c.wait_exit("learner", 300)
    batches = c.batches()
    assert len(batches) == 3 and all(b["ok"] for b in batches)
    status = c.status()
    assert status.ledger_balanced and status.ledger.trained == 6
    log = (c.tmp / "tw0.log").read_text()
    assert "weights v1 loaded" in log and "weights v3 loaded" in log
    assert "weights v2 not loaded" in log and "sha256" in log  # refused: kept serving v1
    assert status.workers[0].version == 3


def test_sglang_worker_against_the_fake_server(cluster: Callable[..., Cluster], tmp_path: Path) -> None:
    """Every published version reaches the server as a directory holding only that version's file."""
    weights = tmp_path / "weights" / "v000001.safetensors"
    weights.parent.mkdir()
    weights.write_bytes(b"weights")
    with FakeSGLangServer(max_running_requests=4, token_delay_s=0.002) as server:
        c = cluster(
            run={"mode": "april"},
            algo={
                "rollout_batch_size": 2,
                "over_sampling_batch_size": 4,
                "n_samples_per_prompt": 2,
                "max_new_tokens": 16,
            },
            worker={"engine": "sglang", "sglang_urls": server.url, "slots": 4},
        )
        c.start_broker()
        c.start_worker("sw0")
        c.start_learner(steps=2, train_s=0.05, weights_file=str(weights))
        c.wait_exit("learner", 90)
        batches = c.batches()
        assert len(batches) == 2 and all(b["ok"] for b in batches)
        assert c.status().ledger_balanced
        assert server.rt.generate_bodies
        wait_for(lambda: server.rt.weight_version == "2", 60, "the server to serve v2")
        loaded = server.rt.loaded_weight_files
    assert [len(files) for files in loaded] == [1, 1] and loaded[0][0] != loaded[1][0]
    assert all(Path(files[0]).parent != weights.parent for files in loaded)
    assert "weights v2 loaded" in (c.tmp / "sw0.log").read_text()


def test_a_request_the_engine_rejects_fails_one_sample_not_the_worker(
    cluster: Callable[..., Cluster], tmp_path: Path
) -> None:
    from april.hf import make_tiny_model

    model = make_tiny_model(tmp_path / "tiny", seed=0)
    c = cluster(
        run={"mode": "sync"},
        algo={
            "rollout_batch_size": 2,
            "over_sampling_batch_size": 2,
            "n_samples_per_prompt": 2,
            "max_new_tokens": 8,
        },
        worker={"engine": "torch", "model": str(model), "slots": 4},
        data={"synthetic_vocab_size": 1000},  # most prompts hold ids the model does not have
        broker={"liveness": 300},  # no kills here: a liveness window (60 s) no busy machine outstays
    )
    c.start_broker()
    c.start_worker("tw0")
    wait_for(lambda: c.status().ledger.dropped.get("failed", 0) >= 2, 60, "failed groups to be counted")
    status = c.status()
    assert status.ledger_balanced
    assert [w.id for w in status.workers] == ["tw0"]  # still alive and serving
    assert "cannot be generated" in (c.tmp / "tw0.log").read_text()
