"""`april data inspect`: the record count, the fields and their types, the first prompt as the model reads
it, the answer the reward gets and prompt token percentiles, all with the data.* keys a run uses; and
`april generate` on a Parquet dataset. Its bad-input cases (a missing file, a directory that is not a
dataset, a bad field, a missing model) are in tests/test_user_errors.py.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from test_data_formats import DAPO_INSTRUCTION, dapo_rows, make_chat_model, write_jsonl, write_parquet
from test_user_errors import april
from typer.testing import CliRunner, Result

from actors.tokenizer import HFTokenizer
from april.data import FilePromptSource
from cli.data_cmd import percentiles
from cli.main import app

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "models" / "tiny"
DAPO_KEYS = ("--set", "data.answer_key=reward_model.ground_truth")


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_chat_model(tmp_path_factory.mktemp("chat"))


@pytest.fixture(autouse=True)
def _no_april_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for var in list(os.environ):
        if var.upper().startswith("APRIL_"):
            monkeypatch.delenv(var)


def inspect(*args: str) -> Result:
    return CliRunner().invoke(app, ["data", "inspect", *args])


def expected_lengths(path: Path, model: Path) -> list[int]:
    """Each record's prompt length, tokenized here the way the worker does it."""
    source = FilePromptSource(path, answer_key="reward_model.ground_truth", shuffle=False)
    tokenizer = HFTokenizer(model)
    return [len(tokenizer.encode_prompt(r.text, r.metadata)) for r in map(source.get, range(len(source)))]


def test_inspect_a_dapo_parquet(tmp_path: Path) -> None:
    rows = dapo_rows(7)
    rows[5]["prompt"][0]["content"] += " (a longer question)" * 20
    path = write_parquet(tmp_path / "dapo-math-17k.parquet", rows)
    result = inspect(str(path), *DAPO_KEYS)
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f"source: parquet({path}, 7 prompts")
    assert lines[1] == "records: 7"
    assert lines[2:8] == [
        "fields:",
        "  data_source   string",
        "  prompt        list<element: struct<content: string, role: string>>",
        "  ability       string",
        "  reward_model  struct<ground_truth: string, style: string>",
        "  extra_info    struct<index: string>",
    ]
    assert lines[8:10] == ["first record:", "  answer given to the reward: '34'"]
    lengths = expected_lengths(path, TINY)
    assert lines[10] == f"  prompt as {TINY} reads it ({lengths[0]} tokens, last user message):"
    assert lines[11] == "    " + DAPO_INSTRUCTION.splitlines()[0]
    stats = percentiles(tuple(lengths))
    assert stats["max"] == max(lengths) > stats["p50"] == sorted(lengths)[3]
    assert lines[-1] == (
        f"prompt tokens ({TINY}, all 7 records): "
        f"p50 {stats['p50']}, p90 {stats['p90']}, p99 {stats['p99']}, max {stats['max']}"
    )


def test_percentiles_are_observed_lengths() -> None:
    lengths = tuple(range(1, 101))  # 1..100
    assert percentiles(lengths) == {"p50": 50, "p90": 90, "p99": 99, "max": 100}
    assert percentiles((7,)) == {"p50": 7, "p90": 7, "p99": 7, "max": 7}
    assert percentiles((3, 10)) == {"p50": 3, "p90": 10, "p99": 10, "max": 10}


def test_inspect_renders_through_the_chat_template_and_samples(tmp_path: Path, chat_model: Path) -> None:
    path = write_parquet(tmp_path / "dapo.parquet", dapo_rows(30))
    result = inspect(str(path), *DAPO_KEYS, "--model", str(chat_model), "--sample", "10")
    assert result.exit_code == 0, result.output
    out = result.stdout
    lengths = expected_lengths(path, chat_model)
    assert (
        f"  prompt as {chat_model} reads it ({lengths[0]} tokens, chat template):\n    <|user|>Solve" in out
    )
    assert "    <|assistant|>\n" in out
    assert f"prompt tokens ({chat_model}, a seeded sample of 10 records): " in out
    assert result.stderr == ""  # the model has a chat template: nothing to say


def test_inspect_says_once_that_the_model_has_no_chat_template(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "dapo.parquet", dapo_rows(4))
    result = april(["data", "inspect", str(path), *DAPO_KEYS], tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines() == [
        f"{TINY} has no chat template: chat prompts are given to it as the text of their last user message "
        "(system and earlier messages left out)"
    ]


def test_inspect_honours_the_config_file_and_the_data_keys(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "gsm8k.jsonl", [{"question": "2+2?", "answer": "2+2 = 4\n#### 4"}])
    config = tmp_path / "run.toml"
    config.write_text(f'[data]\nsource = "{path}"\nprompt_key = "question"\nanswer_format = "gsm8k"\n')
    result = inspect("--config", str(config))
    assert result.exit_code == 0, result.output
    assert "  answer given to the reward: '4'" in result.stdout
    assert "  question  string\n  answer    string\n" in result.stdout
    raw = inspect("--config", str(config), "--set", "data.answer_format=raw")
    assert "  answer given to the reward: '2+2 = 4\\n#### 4'" in raw.stdout


def test_inspect_the_built_in_task() -> None:
    result = inspect("task", "--sample", "50")
    assert result.exit_code == 0, result.output
    assert result.stdout.splitlines()[:2] == [
        "source: task(repeated-addition, size=1000000, seed=0)",
        "records: 1000000",
    ]
    assert "fields:" not in result.stdout


def test_generate_reads_a_parquet_dataset(tmp_path: Path) -> None:
    (tmp_path / "gt_reward.py").write_text(  # scores the answer the dataset gives, not the sim tokens
        "def reward(response, answer, metadata):\n    return float(answer == '35')\n"
    )
    path = write_parquet(tmp_path / "dapo.parquet", dapo_rows(3))
    args = [
        "generate", "--prompts", str(path), "--engine", "sim", "--json", "--set", "worker.sim_time_scale=0",
        "--set", "worker.sim_lengths=fixed:4", "--set", "worker.reward=gt_reward:reward", *DAPO_KEYS,
    ]  # fmt: skip
    result = april(args, tmp_path, str(tmp_path))
    assert result.returncode == 0, result.stderr
    rows = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["reward"] for r in rows] == [0.0, 1.0, 0.0]
    assert all(len(r["response_ids"]) == 4 for r in rows)
    assert all(r["prompt_ids"] for r in rows)
