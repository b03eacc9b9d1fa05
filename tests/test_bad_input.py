"""Bad input at the command line and in a running worker: one clear error line, or a reported failed sample.

The units behind these are tested where they live (config: test_config.py and test_cli.py; datasets:
test_data.py; model directories: test_torch_engine.py; the reward runner: test_rewards.py). Here the
commands themselves get a bad dataset or a model directory missing a file and must print one line and
exit 2, and a real worker with a reward function that raises or hangs must report those samples FAILED
(the broker drops their groups as `failed`, counted in the ledger) and keep serving the run.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from harness import Cluster, free_ports
from typer.testing import CliRunner

from cli.main import app

TINY = Path(__file__).resolve().parents[1] / "models" / "tiny"


def one_line_error(args: list[str]) -> str:
    result = CliRunner().invoke(app, args)
    lines = [x for x in result.output.splitlines() if x.strip()]
    assert result.exit_code == 2 and len(lines) == 1 and lines[0].startswith("april: error: "), result.output
    return lines[0]


def ports() -> list[str]:
    names = ("worker_port", "learner_port", "pub_port")
    return [f"--set=broker.{n}={p}" for n, p in zip(names, free_ports(3), strict=True)]


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (b'{"question": "q", "answer": "1"}\n', ":1: missing prompt field 'prompt'"),
        (b'{"prompt": "ok", "answer": "1"}\n{"prompt": "  ", "answer": "1"}\n', ":2: empty prompt"),
        ('{"prompt": "café", "answer": "1"}\n'.encode("latin-1"), ":1: not valid UTF-8"),
        (b"\n\n", ": dataset is empty"),
    ],
    ids=["missing-field", "empty-prompt", "not-utf8", "empty-file"],
)
def test_the_broker_names_a_bad_dataset_in_one_line(tmp_path: Path, content: bytes, expected: str) -> None:
    data = tmp_path / "data.jsonl"
    data.write_bytes(content)
    line = one_line_error(
        ["broker", "--run-dir", str(tmp_path / "run"), f"--set=data.source={data}", *ports()]
    )
    assert str(data) + expected in line


def model_without(tmp_path: Path, missing: str) -> Path:
    model = tmp_path / f"no-{missing}"
    shutil.copytree(TINY, model)
    (model / missing).unlink()
    return model


def test_a_worker_on_a_model_without_config_json(tmp_path: Path) -> None:
    model = model_without(tmp_path, "config.json")
    line = one_line_error(["worker", "--engine", "torch", "--model", str(model)])
    assert f"model directory '{model}' has no config.json" in line


def test_a_learner_on_a_model_without_weights(tmp_path: Path) -> None:
    model = model_without(tmp_path, "model.safetensors")
    args = [
        "learner",
        "--run-dir",
        str(tmp_path / "run"),
        "--model",
        str(model),
        "--set=learner.backend=torch",
    ]
    assert f"model directory '{model}' has no weights" in one_line_error(args)


def test_april_up_checks_the_model_directory_before_starting_anything(tmp_path: Path) -> None:
    model = model_without(tmp_path, "config.json")
    args = ["up", "--headless", "--run-dir", str(tmp_path / "run"), f"--set=learner.model={model}", *ports()]
    assert f"'{model}' has no config.json" in one_line_error(args)
    assert not (tmp_path / "run").exists()


def test_a_reward_that_raises_or_hangs_fails_its_sample_and_the_run_goes_on(
    cluster: Callable[..., Cluster], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "flaky_reward.py").write_text(  # by prompt: some groups hang, some raise, most score
        "import time, zlib\n"
        "def reward(response, answer, metadata):\n"
        "    pick = zlib.crc32(repr(sorted(metadata.items())).encode()) % 4\n"
        "    if pick == 0:\n"
        "        time.sleep(3600)\n"
        "    if pick == 1:\n"
        "        raise ValueError('no score for this one')\n"
        "    return float(pick % 2)\n"
    )
    monkeypatch.setenv("PYTHONPATH", str(tmp_path))
    c = cluster(
        run={"mode": "april"},
        worker={"reward": "flaky_reward:reward", "reward_timeout_s": 0.5},
    )
    c.start_broker()
    c.start_worker("w0")
    c.start_learner(steps=3, train_s=0.05)
    c.wait_exit("learner", 120)
    batches = c.batches()
    assert len(batches) == 3 and all(b["ok"] for b in batches)  # only finished samples were trained
    status = c.status()
    assert status.ledger_balanced and status.ledger.trained == 3 * 4
    assert status.ledger.dropped.get("failed", 0) > 0, status.ledger
    log = (c.tmp / "w0.log").read_text()
    assert "failed its reward: reward_timeout: reward timed out after 0.5s" in log
    assert "failed its reward: reward_error: reward raised ValueError: no score for this one" in log
    assert status.errors.get("reward_timeout", 0) > 0 and status.errors.get("reward_error", 0) > 0
    assert not status.stopped  # most samples score: the run goes on
    assert [w.id for w in status.workers] == ["w0"] and status.workers[0].alive
