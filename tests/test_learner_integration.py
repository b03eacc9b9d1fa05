"""The learner process against the real broker and a real torch worker (tiny model made here): it trains
exactly N samples per step, publishes versions 1..K that the worker verifies and loads, writes one
metrics.jsonl line per step with every field of docs/design.md section 7, and its weights files load back
into the model. Launched as two ranks under DeepSpeed ZeRO-3, as users run it, it does the same through
rank 0, and its checkpoint is refused (one line, nothing loaded or changed) by a learner resuming with
another number of ranks."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from harness import Cluster

torch = pytest.importorskip("torch")


def test_learner_trains_exactly_n_and_publishes_versions(
    cluster: Callable[..., Cluster], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from april.files import sha256_file
    from april.hf import load_model, make_tiny_model
    from april.weights_uri import version_path
    from learner.metrics import REQUIRED
    from learner.weights import load_published

    model_dir = make_tiny_model(tmp_path / "tiny", seed=0)
    # a user reward with variance (a random model never matches the exact answers: all-zero advantages)
    (tmp_path / "parity_reward.py").write_text(
        "def reward(response, answer, metadata):\n    return float(len(response.encode()) % 2)\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    c = cluster(
        run={"mode": "april", "steps": 3},
        algo={
            "rollout_batch_size": 2,
            "over_sampling_batch_size": 4,
            "n_samples_per_prompt": 2,
            "max_new_tokens": 12,
            "temperature": 1.0,
        },
        data={"synthetic_vocab_size": 320},
        worker={"engine": "torch", "model": str(model_dir), "slots": 4, "reward": "parity_reward:reward"},
        learner={"model": str(model_dir), "backend": "torch", "lr": 1e-3, "checkpoint_every": 2},
    )
    c.start_broker()
    c.start_worker("tw0")
    c.start_learner_process("learner")
    assert c.wait_exit("learner", 600) == 0, (c.tmp / "learner.log").read_text()[-2000:]
    lines = [json.loads(x) for x in (c.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines] == [0, 1, 2] and [x["version"] for x in lines] == [1, 2, 3]
    for line in lines:
        assert set(REQUIRED) <= set(line)
        assert line["samples"] == 4 and line["groups"] == 2
        assert line["learner/grad_norm"] >= 0 and line["loss"] == line["loss"]  # not NaN
        assert line["ledger"]["issued"] == sum(
            line["ledger"][k] for k in ("trained", "complete_waiting", "in_flight", "partial")
        ) + sum(line["ledger"]["dropped"].values())
    model = load_model(model_dir)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    path = version_path(c.run_dir / "weights", 3)
    state = load_published(path, sha256_file(path))
    model.load_state_dict(state)
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items()), "weights never changed"
    assert "weights v3 loaded" in (c.tmp / "tw0.log").read_text()
    assert (c.run_dir / "checkpoints").exists() and (c.run_dir / "summary.json").exists()
    assert c.status().ledger.trained == 6


def test_two_rank_zero3_learner_trains_exactly_n_through_rank_zero(
    cluster: Callable[..., Cluster], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`april learner` launched as 2 ranks (gloo) under ZeRO-3: rank 0 alone talks to the broker, both
    train, the weights are gathered for publishing and the checkpoint is split by rank. Resuming it with
    one rank is refused with one line before anything loads."""
    pytest.importorskip("deepspeed")
    from april.hf import make_tiny_model
    from april.ports import free_ports

    model_dir = make_tiny_model(tmp_path / "tiny", seed=0)
    (tmp_path / "parity_reward.py").write_text(
        "def reward(response, answer, metadata):\n    return float(len(response.encode()) % 2)\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    c = cluster(
        run={"mode": "april", "steps": 2},
        algo={"rollout_batch_size": 2, "over_sampling_batch_size": 4, "n_samples_per_prompt": 2,
              "max_new_tokens": 12},
        data={"synthetic_vocab_size": 320},
        worker={"engine": "torch", "model": str(model_dir), "slots": 4, "reward": "parity_reward:reward"},
        learner={"model": str(model_dir), "backend": "deepspeed", "zero_stage": 3, "lr": 1e-3,
                 "checkpoint_every": 2},
    )  # fmt: skip
    c.start_broker()
    c.start_worker("tw0")
    port = str(free_ports(1)[0])
    for rank in (0, 1):
        env = {"RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1",
               "MASTER_PORT": port}  # fmt: skip
        c.start_learner_process(f"learner{rank}", env=env)
    for rank in (0, 1):
        assert c.wait_exit(f"learner{rank}", 600) == 0, (c.tmp / f"learner{rank}.log").read_text()[-2000:]
    lines = [json.loads(x) for x in (c.run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [x["version"] for x in lines] == [1, 2] and all(x["samples"] == 4 for x in lines)
    assert c.status().ledger.trained == 4
    assert len(list((c.run_dir / "checkpoints").glob("step_*/rng_rank*.json"))) == 2
    # ZeRO-3 splits the optimizer state (and the weights) by rank: why another layout cannot resume it
    assert len(list((c.run_dir / "checkpoints").rglob("zero_pp_rank_*_optim_states.pt"))) == 2
    weights = sorted(p.name for p in (c.run_dir / "weights").iterdir())
    assert weights == ["v000001.safetensors", "v000002.safetensors"]  # gathered from both ranks' shards

    # the same run resumed by one rank: refused before the model loads or the broker hears of it
    def learner_files() -> dict[Path, int]:  # what the learner writes (the broker's snapshot is its own)
        found = [c.run_dir / "metrics.jsonl", *(c.run_dir / "checkpoints").rglob("*"),
                 *(c.run_dir / "weights").rglob("*")]  # fmt: skip
        return {p: p.stat().st_mtime_ns for p in found if p.is_file()}

    before = learner_files()
    log = c.start_learner_process("learner-one-rank", resume=True)
    assert c.wait_exit("learner-one-rank", 120) == 2
    lines = log.read_text().strip().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith("april: error: checkpoint ") and "step_00000002" in lines[0]
    assert "written by 2 ranks of DeepSpeed ZeRO-3; this learner runs 1 rank of DeepSpeed ZeRO-3" in lines[0]
    assert learner_files() == before  # metrics, checkpoints and weights untouched
    assert c.status().ledger.trained == 4
