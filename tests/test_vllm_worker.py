"""A real `april worker --engine vllm` (vLLM's CPU build, in-process async engine) against a real broker:
april rounds with aborts and resumes, and published weights verified by sha256 and reloaded in place."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from harness import Cluster

pytest.importorskip("vllm")
pytestmark = pytest.mark.vllm


def test_vllm_worker_runs_april_rounds(cluster: Callable[..., Cluster], tmp_path: Path) -> None:
    from april.hf import make_tiny_model

    model = make_tiny_model(
        tmp_path / "tiny", seed=0, hidden=64, heads=2
    )  # head size 32: vLLM CPU supports it
    weights = next(model.glob("*.safetensors"))
    c = cluster(
        run={"mode": "april"},
        algo={
            "rollout_batch_size": 2,
            "over_sampling_batch_size": 4,
            "n_samples_per_prompt": 2,
            "max_new_tokens": 12,
        },
        worker={"engine": "vllm", "model": str(model), "slots": 4, "max_seq_len": 1024},
        data={"synthetic_vocab_size": 320},
        broker={"liveness": 100},  # vLLM starts in tens of seconds: keep the worker alive meanwhile
    )
    c.start_broker()
    c.start_worker("vw0")
    c.start_learner(steps=2, train_s=0.05, weights_file=str(weights), liveness=100)
    c.wait_exit("learner", 240)
    batches = c.batches()
    assert len(batches) == 2 and all(b["ok"] for b in batches)
    status = c.status()
    assert status.ledger_balanced and status.ledger.trained == 4
    log = (c.tmp / "vw0.log").read_text()
    assert "weights v1 loaded" in log and "weights v2 loaded" in log
