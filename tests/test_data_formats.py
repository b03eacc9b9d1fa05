"""Datasets as users have them: every format `data.source` reads, and the published datasets end to end.

Formats: JSON Lines, a JSON array, Parquet, an Arrow IPC file and stream, a `datasets` save_to_disk
directory (written here by the real `datasets` package) and a DatasetDict of splits; each is told by its
content, gives the same records from the same rows, and names a bad record (file:line or "row N") and its
field in one line.

The published datasets are rebuilt here, a few rows each, with their real schemas (nothing is downloaded):

- DAPO-Math-17k (huggingface.co/datasets/BytedTsinghua-SIA/DAPO-Math-17k, data/dapo-math-17k.parquet):
  `data_source` string ("math_dapo"), `prompt` list of {content, role} structs (one user message that
  opens "Solve the following math problem step by step. The last line of your response should be of the
  form Answer: $Answer ..."), `ability` string ("MATH"), `reward_model` struct {ground_truth, style
  ("rule-lighteval/MATH_v2")}, `extra_info` struct {index: string}. The column layout is the dataset_info
  of its published copies (e.g. huggingface.co/datasets/koajoel/DAPO-Math-17k-dedup, README.md); the
  prompt's wording is quoted by users of the set (github.com/elliot-zzh/from-transparent-to-opaque,
  dataset/dapo_math.py).
- GSM8K (huggingface.co/datasets/openai/gsm8k, config "main"): `question` and `answer` strings, the answer
  being the worked solution whose last line is "#### 72". verl's examples/data_preprocess/gsm8k.py takes
  the number after "#### " (commas removed) as the ground truth and writes Parquet rows {data_source
  "openai/gsm8k", prompt [{role user, content question + an instruction}], ability "math", reward_model
  {style "rule", ground_truth}, extra_info {split, index, answer, question}}.
- MATH (verl's examples/data_preprocess/math_dataset.py, from DigitalLearningGmbH/MATH-lighteval):
  `problem`, `level`, `type`, `solution` strings, the final answer boxed in the solution.
- DeepScaleR (huggingface.co/datasets/agentica-org/DeepScaleR-Preview-Dataset, its dataset card):
  deepscaler.json, a JSON array of {problem, solution, answer} objects (rllm reads it with json.load:
  github.com/rllm-org/rllm, rllm/data/utils.py).
"""

from __future__ import annotations

import gzip
import json
import logging
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from actors.rewards import exact_reward, math_reward
from actors.tokenizer import HFTokenizer, no_chat_template
from april.config import AnswerFormat, DataConfig, load_config
from april.data import DatasetError, FilePromptSource, PromptRecord, records
from april.sources import open_source
from broker.heldout import split_held_out

REPO = Path(__file__).resolve().parents[1]
TINY = REPO / "models" / "tiny"

DAPO_INSTRUCTION = (
    "Solve the following math problem step by step. The last line of your response should be of the form "
    "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n"
)
DAPO_REMINDER = '\n\nRemember to put your answer on its own line after "Answer:".'
GSM8K_INSTRUCTION = 'Let\'s think step by step and output the final answer after "####".'
MATH_INSTRUCTION = "Let's think step by step and output the final answer within \\boxed{}."


def dapo_rows(n: int = 3) -> list[dict[str, Any]]:
    return [
        {
            "data_source": "math_dapo",
            "prompt": [{"content": f"{DAPO_INSTRUCTION}What is {i} + 34?{DAPO_REMINDER}", "role": "user"}],
            "ability": "MATH",
            "reward_model": {"ground_truth": str(i + 34), "style": "rule-lighteval/MATH_v2"},
            "extra_info": {"index": f"9a9b6eb4-a1cb-49d1-8c1e-62eaf2f7{i:04d}"},
        }
        for i in range(n)
    ]


GSM8K_ROWS = [
    {
        "question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips "
        "in May. How many clips did Natalia sell altogether in April and May?",
        "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
        "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72",
    },
    {
        "question": "A company pays $250 per worker for 4 workers. How much does it pay?",
        "answer": "It pays 250 * 4 = <<250*4=1000>>1000 dollars.\n#### 1,000",
    },
]


def gsm8k_verl_rows() -> list[dict[str, Any]]:
    """GSM8K as verl's examples/data_preprocess/gsm8k.py writes it."""
    return [
        {
            "data_source": "openai/gsm8k",
            "prompt": [{"role": "user", "content": row["question"] + " " + GSM8K_INSTRUCTION}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": truth},
            "extra_info": {
                "split": "train",
                "index": i,
                "answer": row["answer"],
                "question": row["question"],
            },
        }
        for i, (row, truth) in enumerate(zip(GSM8K_ROWS, ["72", "1000"], strict=True))
    ]


MATH_ROWS = [
    {
        "problem": "What is $\\frac{1}{4} + \\frac{1}{4}$?",
        "level": "Level 1",
        "type": "Prealgebra",
        "solution": "We add: $\\frac{1}{4}+\\frac{1}{4} = \\frac{2}{4}$, which is $\\boxed{\\frac{1}{2}}$.",
    }
]
DEEPSCALER_ROWS = [
    {
        "problem": "Let $a_n=6^{n}+8^{n}$. Determine the remainder upon dividing $a_ {83}$ by $49$.",
        "solution": "$6^{83} + 8^{83} \\equiv 14 \\cdot 6 \\equiv \\boxed{035} \\pmod{49}$",
        "answer": "35",
    },
    {"problem": "What is $2^{10}$?", "solution": "", "answer": "1024"},
]


# --- writers: the same rows in every format -----------------------------------------------------------


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def write_json(path: Path, rows: list[Any]) -> Path:
    path.write_text(json.dumps(rows, indent=2), encoding="utf-8")
    return path


def write_parquet(path: Path, rows: list[dict[str, Any]]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def write_arrow(path: Path, rows: list[dict[str, Any]], *, stream: bool) -> Path:
    table = pa.Table.from_pylist(rows)
    open_writer = pa.ipc.new_stream if stream else pa.ipc.new_file
    with pa.OSFile(str(path), "wb") as sink, open_writer(sink, table.schema) as writer:
        writer.write_table(table)
    return path


def save_to_disk(path: Path, rows: list[dict[str, Any]], **shards: int) -> Path:
    import datasets

    datasets.Dataset.from_list(rows).save_to_disk(str(path), **shards)
    return path


def save_splits(path: Path, splits: dict[str, list[dict[str, Any]]]) -> Path:
    import datasets

    datasets.DatasetDict({k: datasets.Dataset.from_list(v) for k, v in splits.items()}).save_to_disk(
        str(path)
    )
    return path


WRITERS: dict[str, Callable[[Path, list[dict[str, Any]]], Path]] = {
    "jsonl": lambda d, rows: write_jsonl(d / "data.jsonl", rows),
    "json": lambda d, rows: write_json(d / "data.json", rows),
    "parquet": lambda d, rows: write_parquet(d / "data.parquet", rows),
    "arrow": lambda d, rows: write_arrow(d / "data.arrow", rows, stream=False),
    "arrow-stream": lambda d, rows: write_arrow(d / "data-00000-of-00001.arrow", rows, stream=True),
    "hf-dataset": lambda d, rows: save_to_disk(d / "saved", rows, num_shards=2),
}


def same(a: PromptRecord, b: PromptRecord) -> bool:
    return (
        a.prompt_index == b.prompt_index
        and np.array_equal(a.prompt_ids, b.prompt_ids)
        and a.text == b.text
        and a.metadata == b.metadata
    )


# --- every format: the same records, the PromptSource contract ----------------------------------------


def mixed_rows(n: int = 9) -> list[dict[str, Any]]:
    """Text, chat and token-id prompts can't share an Arrow column, so: chat prompts with extras (a
    scalar field, one sometimes null, and a message with a key the others lack: null in Arrow's struct)."""
    rows = dapo_rows(n)
    for i, row in enumerate(rows):
        row["level"] = i % 3
        row["score"] = None if i % 2 else 0.5
    rows[2]["prompt"].insert(0, {"content": "Be brief.", "role": "system", "name": "setup"})
    return rows


@pytest.mark.parametrize("fmt", list(WRITERS))
def test_every_format_gives_the_jsonl_records_in_order_and_shuffled(tmp_path: Path, fmt: str) -> None:
    rows = mixed_rows()
    path = WRITERS[fmt](tmp_path, rows)
    reference = FilePromptSource(
        write_jsonl(tmp_path / "ref.jsonl", rows), answer_key="reward_model.ground_truth", seed=4
    )
    source = FilePromptSource(path, answer_key="reward_model.ground_truth", seed=4)
    assert len(source) == len(rows)
    for cursor in range(3 * len(rows)):  # three epochs, each a different permutation
        assert same(source.get(cursor), reference.get(cursor)), (fmt, cursor)
    first = FilePromptSource(path, answer_key="reward_model.ground_truth", shuffle=False).get(0)
    assert first.metadata == {
        "data_source": "math_dapo",
        "ability": "MATH",
        "level": "0",
        "score": "0.5",
        "answer": "34",
        "prompt_index": "0",
        "messages": json.dumps(rows[0]["prompt"], sort_keys=True),
    }
    assert source.describe().startswith(f"{source.rows.kind}({path}, 9 prompts")


@pytest.mark.parametrize("fmt", ["parquet", "hf-dataset", "jsonl"])
def test_held_out_split_and_epochs_over_a_file_source(tmp_path: Path, fmt: str) -> None:
    """The broker's use (broker.heldout over the source): held-out prompts never reach training."""
    source = FilePromptSource(WRITERS[fmt](tmp_path, dapo_rows(12)), answer_key="reward_model.ground_truth")
    train, held = split_held_out(source, 3)
    held_ids = {r.prompt_index for r in held}
    for epoch in range(2):
        drawn = [train.get(epoch * len(train) + p).prompt_index for p in range(len(train))]
        assert sorted(drawn) == sorted(set(range(12)) - held_ids)


@pytest.mark.parametrize("fmt", ["jsonl", "parquet", "hf-dataset"])
def test_records_dropped_from_the_budget_are_built_again_the_same(
    tmp_path: Path, fmt: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = WRITERS[fmt](tmp_path, dapo_rows(40))
    whole = FilePromptSource(path, answer_key="reward_model.ground_truth", shuffle=False)
    monkeypatch.setattr(records, "KEPT_PROMPT_BYTES", 3 * 2048)  # a few records
    small = FilePromptSource(path, answer_key="reward_model.ground_truth", shuffle=False)
    kept = small.get(39)
    assert small.get(39) is kept  # kept: built once
    for cursor in [*range(40), 0, 39, 17]:
        assert same(small.get(cursor), whole.get(cursor)), cursor
    assert small.get(39) is not kept  # dropped meanwhile, built again from its row


def test_a_parquet_dataset_without_pyarrow_is_one_line(tmp_path: Path) -> None:
    """Where pyarrow is absent (the lent GPU machine: its wheel is not carried there), a Parquet
    `data.source` is refused in one line that says what to do; `april data inspect` exits 2 with it."""
    from image_python import image_env

    path = write_parquet(tmp_path / "dapo.parquet", dapo_rows())
    done = subprocess.run(
        [sys.executable, "-c", "from cli.main import main; main()", "data", "inspect", str(path)],
        env=image_env(tmp_path / "image"),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 2, done.stdout + done.stderr
    assert done.stderr.strip().splitlines() == [
        f"april: error: {path}: reading it needs pyarrow, which this Python lacks "
        "(No module named 'pyarrow'); expected pyarrow installed (pip install pyarrow), or the rows as "
        "JSON Lines, which need nothing"
    ]


def test_the_format_is_told_by_content_not_name(tmp_path: Path) -> None:
    rows = dapo_rows(2)
    parquet_named_jsonl = write_parquet(tmp_path / "train.jsonl", rows)
    jsonl_named_parquet = write_jsonl(tmp_path / "train.parquet", rows)
    json_named_txt = write_json(tmp_path / "train.txt", rows)
    kinds = [
        FilePromptSource(p, answer_key="reward_model.ground_truth").rows.kind
        for p in (parquet_named_jsonl, jsonl_named_parquet, json_named_txt)
    ]
    assert kinds == ["parquet", "jsonl", "json"]


# --- bad records: one line naming where and the field, in every format -----------------------------------


@pytest.mark.parametrize("fmt", list(WRITERS))
def test_a_bad_record_is_named_with_its_field_in_every_format(tmp_path: Path, fmt: str) -> None:
    rows = dapo_rows(5)
    rows[1]["reward_model"] = {"ground_truth": None, "style": "rule"}
    rows[3]["reward_model"] = {"ground_truth": None, "style": "rule"}
    path = WRITERS[fmt](tmp_path, rows)
    with pytest.raises(DatasetError) as info:
        FilePromptSource(path, answer_key="reward_model.ground_truth")
    where = f"{path}:2" if fmt == "jsonl" else f"{path}: row 1"
    assert str(info.value) == (
        f"{where}: missing answer field 'reward_model.ground_truth' (it is null) (and 1 more bad records)"
    )
    generate = FilePromptSource(
        path, answer_key="reward_model.ground_truth", require_answer=False, shuffle=False
    )
    assert [generate.get(i).metadata.get("answer") for i in range(5)] == ["34", None, "36", None, "38"]


@pytest.mark.parametrize("fmt", list(WRITERS))
def test_a_missing_field_lists_the_fields_present(tmp_path: Path, fmt: str) -> None:
    path = WRITERS[fmt](tmp_path, [{"question": "q", "answer": "1"}, {"question": "r", "answer": "2"}])
    with pytest.raises(DatasetError) as info:
        FilePromptSource(path)
    where = f"{path}:1" if fmt == "jsonl" else f"{path}: row 0"
    assert str(info.value) == (
        f"{where}: missing prompt field 'prompt' (keys present: answer, question) (and 1 more bad records)"
    )


def test_a_missing_nested_field_names_the_object_that_lacks_it(tmp_path: Path) -> None:
    rows = dapo_rows(1)
    rows[0]["reward_model"] = {"style": "rule"}
    with pytest.raises(DatasetError, match=r"row 0: missing answer field 'reward_model.ground_truth' "
                       r"\(keys present in 'reward_model': style\)$"):  # fmt: skip
        FilePromptSource(write_parquet(tmp_path / "d.parquet", rows), answer_key="reward_model.ground_truth")


@pytest.mark.parametrize(
    ("content", "expected"),
    [
        (gzip.compress(b'{"prompt": "q"}\n'), "not a dataset file (it starts with b'\\x1f\\x8b"),
        (b"PAR1 but not really parquet", "cannot read Parquet"),
        (b"ARROW1 truncated", "cannot read Arrow"),
        (b'[{"prompt": "q", "answer": 1},\n {"prompt": ', ":2: invalid JSON"),
        (b'{"prompt": "q", "answer": 1}', None),  # fine: no final newline
        (b"\n\n", "dataset is empty"),
        (b"", "dataset is empty"),
        (b'{"a": 1}', "missing prompt field 'prompt'"),
    ],
)
def test_files_that_are_not_datasets(tmp_path: Path, content: bytes, expected: str | None) -> None:
    path = tmp_path / "data"
    path.write_bytes(content)
    if expected is None:
        assert FilePromptSource(path).get(0).metadata["answer"] == "1"
        return
    with pytest.raises(DatasetError) as info:
        FilePromptSource(path)
    assert str(info.value).startswith(str(path)) and expected in str(info.value)
    assert "\n" not in str(info.value)


def test_an_empty_parquet_file_and_a_directory_that_is_not_a_dataset(tmp_path: Path) -> None:
    empty = tmp_path / "empty.parquet"
    pq.write_table(
        pa.table({"prompt": pa.array([], pa.string()), "answer": pa.array([], pa.string())}), empty
    )
    with pytest.raises(DatasetError, match=r"empty\.parquet: dataset is empty"):
        FilePromptSource(empty)
    plain = tmp_path / "plain"
    (plain / "data").mkdir(parents=True)
    write_parquet(plain / "data" / "train-00000-of-00001.parquet", dapo_rows(1))
    with pytest.raises(DatasetError) as info:
        FilePromptSource(plain)
    message = str(info.value)
    assert message.startswith(f"{plain}: a directory that is not a saved dataset")
    assert f"it holds {plain}/data/train-00000-of-00001.parquet: name that file" in message
    with pytest.raises(DatasetError, match="cannot read dataset file"):
        FilePromptSource(tmp_path / "missing.parquet")


# --- save_to_disk directories ----------------------------------------------------------------------------


def test_a_dataset_dict_is_read_by_its_split_directory(tmp_path: Path) -> None:
    train, test = dapo_rows(4), dapo_rows(6)[4:]
    saved = save_splits(tmp_path / "dapo", {"train": train, "test": test})
    with pytest.raises(DatasetError) as info:
        FilePromptSource(saved, answer_key="reward_model.ground_truth")
    assert str(info.value) == (
        f"{saved}: a DatasetDict with 2 splits: name one's directory, {saved}/train or {saved}/test"
    )
    source = FilePromptSource(saved / "test", answer_key="reward_model.ground_truth", shuffle=False)
    assert [source.get(i).metadata["answer"] for i in range(2)] == ["38", "39"]
    assert source.rows.kind == "hf-dataset"
    one = save_splits(tmp_path / "one", {"train": train})  # one split: no need to name it
    assert len(FilePromptSource(one, answer_key="reward_model.ground_truth")) == 4


def test_a_saved_dataset_with_a_data_file_missing(tmp_path: Path) -> None:
    saved = save_to_disk(tmp_path / "saved", dapo_rows(4), num_shards=2)
    (saved / "data-00001-of-00002.arrow").unlink()
    with pytest.raises(DatasetError, match=r"data-00001-of-00002\.arrow: cannot read Arrow"):
        FilePromptSource(saved, answer_key="reward_model.ground_truth")


# --- the published datasets, end to end: prompt text, the answer the reward gets, the reward ---------------


def test_dapo_math_17k_as_published(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "dapo-math-17k.parquet", dapo_rows(3))
    config = DataConfig(source=str(path), answer_key="reward_model.ground_truth", shuffle=False)
    record = open_source(config, seed=0).get(1)
    assert record.text == f"{DAPO_INSTRUCTION}What is 1 + 34?{DAPO_REMINDER}"
    assert json.loads(record.metadata["messages"]) == [{"content": record.text, "role": "user"}]
    assert record.metadata["answer"] == "35"
    assert (record.metadata["data_source"], record.metadata["ability"]) == ("math_dapo", "MATH")
    assert exact_reward("Thinking...\nAnswer: 35", record.metadata["answer"], record.metadata) == 1.0
    assert math_reward("So\nAnswer: $35$", record.metadata["answer"], record.metadata) == 1.0


@pytest.mark.parametrize("fmt", ["parquet", "jsonl"])
def test_gsm8k_as_published_needs_answer_format_gsm8k(tmp_path: Path, fmt: str) -> None:
    path = WRITERS[fmt](tmp_path, GSM8K_ROWS)
    config = DataConfig(
        source=str(path), prompt_key="question", answer_format=AnswerFormat.GSM8K, shuffle=False
    )
    source = open_source(config, seed=0)
    first, second = source.get(0), source.get(1)
    assert first.text == GSM8K_ROWS[0]["question"] and "messages" not in first.metadata
    assert (first.metadata["answer"], second.metadata["answer"]) == ("72", "1000")
    assert exact_reward("48 + 24 = 72\nAnswer: 72", first.metadata["answer"], first.metadata) == 1.0
    raw = open_source(DataConfig(source=str(path), prompt_key="question", shuffle=False), seed=0).get(0)
    assert raw.metadata["answer"] == GSM8K_ROWS[0]["answer"]  # the whole worked solution: exact can't match
    assert exact_reward("48 + 24 = 72\nAnswer: 72", raw.metadata["answer"], raw.metadata) == 0.0


def test_gsm8k_without_a_final_answer_is_a_bad_record(tmp_path: Path) -> None:
    rows = [GSM8K_ROWS[0], {"question": "q", "answer": "no mark here"}]
    path = write_parquet(tmp_path / "gsm8k.parquet", rows)
    with pytest.raises(DatasetError) as info:
        FilePromptSource(path, prompt_key="question", answer_format=AnswerFormat.GSM8K)
    assert str(info.value) == (
        f"{path}: row 1: answer 'answer' has no final answer after '####' (data.answer_format = 'gsm8k'), "
        "got 'no mark here'"
    )


def test_gsm8k_as_verl_preprocesses_it(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "train.parquet", gsm8k_verl_rows())
    source = FilePromptSource(path, answer_key="reward_model.ground_truth", shuffle=False)
    record = source.get(1)
    assert record.text == GSM8K_ROWS[1]["question"] + " " + GSM8K_INSTRUCTION
    assert record.metadata["answer"] == "1000" and record.metadata["data_source"] == "openai/gsm8k"
    # its prompts ask for the answer after "####": the default reward reads it there (found scoring 0)
    assert exact_reward("250 * 4 = 1,000\n#### 1,000", record.metadata["answer"], record.metadata) == 1.0


def test_math_as_verl_preprocesses_it(tmp_path: Path) -> None:
    """MATH as verl's examples/data_preprocess/math_dataset.py writes it: the problem and an instruction
    to box the answer as one user message, the boxed answer alone as the ground truth; scored by `math`."""
    rows = [
        {
            "data_source": "DigitalLearningGmbH/MATH-lighteval",
            "prompt": [{"role": "user", "content": MATH_ROWS[0]["problem"] + " " + MATH_INSTRUCTION}],
            "ability": "math",
            "reward_model": {"style": "rule", "ground_truth": "\\frac{1}{2}"},
            "extra_info": {"split": "train", "index": 0},
        }
    ]
    record = FilePromptSource(
        write_parquet(tmp_path / "train.parquet", rows), answer_key="reward_model.ground_truth"
    ).get(0)
    assert record.metadata["answer"] == "\\frac{1}{2}" and record.text.endswith(MATH_INSTRUCTION)
    assert math_reward("so it is \\boxed{0.5}", record.metadata["answer"], record.metadata) == 1.0
    assert exact_reward("so it is \\boxed{0.5}", record.metadata["answer"], record.metadata) == 0.0


def test_every_recipe_in_docs_data_md_is_a_config(tmp_path: Path) -> None:
    text = (REPO / "docs" / "data.md").read_text()
    recipes = re.findall(r"```toml\n(.*?)```", text, re.DOTALL)
    assert len(recipes) >= 6
    for i, recipe in enumerate(recipes):
        path = tmp_path / f"recipe{i}.toml"
        path.write_text(recipe)
        config = load_config(path)
        assert config.data.source != DataConfig().source, recipe


def test_math_as_verl_reads_it_scores_the_boxed_answer_of_the_solution(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "math.parquet", MATH_ROWS)
    record = FilePromptSource(path, prompt_key="problem", answer_key="solution").get(0)
    assert record.metadata["level"] == "Level 1" and record.text == MATH_ROWS[0]["problem"]
    assert math_reward("It is \\boxed{0.5}", record.metadata["answer"], record.metadata) == 1.0
    assert math_reward("It is \\boxed{1/3}", record.metadata["answer"], record.metadata) == 0.0


def test_deepscaler_as_published(tmp_path: Path) -> None:
    path = write_json(tmp_path / "deepscaler.json", DEEPSCALER_ROWS)
    config = DataConfig(source=str(path), prompt_key="problem", shuffle=False)
    source = open_source(config, seed=0)
    assert isinstance(source, FilePromptSource) and source.rows.kind == "json" and len(source) == 2
    record = source.get(0)
    assert record.text == DEEPSCALER_ROWS[0]["problem"] and record.metadata["answer"] == "35"
    assert record.metadata["solution"] == DEEPSCALER_ROWS[0]["solution"]
    assert math_reward("so \\boxed{35}", record.metadata["answer"], record.metadata) == 1.0


# --- chat prompts reach the model through its chat template, or as the last user message -------------------

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)


def make_chat_model(directory: Path) -> Path:
    """The tiny model with a chat template added to its tokenizer_config.json, in `directory`/model."""
    model = directory / "model"
    model.mkdir()
    for item in TINY.iterdir():
        (model / item.name).write_bytes(item.read_bytes())
    config = json.loads((model / "tokenizer_config.json").read_text())
    (model / "tokenizer_config.json").write_text(json.dumps({**config, "chat_template": CHAT_TEMPLATE}))
    return model


@pytest.fixture(scope="module")
def chat_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_chat_model(tmp_path_factory.mktemp("chat"))


def test_chat_prompts_go_through_the_models_chat_template(tmp_path: Path, chat_model: Path) -> None:
    rows = dapo_rows(1)
    rows[0]["prompt"].insert(0, {"content": "Think first.", "role": "system"})
    record = FilePromptSource(
        write_parquet(tmp_path / "d.parquet", rows), answer_key="reward_model.ground_truth"
    ).get(0)
    tokenizer = HFTokenizer(chat_model)
    ids = tokenizer.encode_prompt(record.text, record.metadata)
    messages = [{"content": "Think first.", "role": "system"}, {"content": record.text, "role": "user"}]
    expected = tokenizer.tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert (
        tokenizer.render(ids) == expected == f"<|system|>Think first.\n<|user|>{record.text}\n<|assistant|>"
    )
    assert ids.tolist() == tokenizer.tok(expected, add_special_tokens=False)["input_ids"]


def test_without_a_chat_template_the_last_user_message_is_given_and_said_once(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    source = FilePromptSource(
        write_parquet(tmp_path / "d.parquet", dapo_rows(2)), answer_key="reward_model.ground_truth"
    )
    tokenizer = HFTokenizer(TINY)
    assert not tokenizer.has_chat_template
    with caplog.at_level(logging.WARNING, logger="april.tokenizer"):
        for cursor in range(2):
            record = source.get(cursor)
            ids = tokenizer.encode_prompt(record.text, record.metadata)
            assert ids.tolist() == tokenizer.tok(record.text, add_special_tokens=True)["input_ids"]
    assert [r.getMessage() for r in caplog.records] == [no_chat_template(TINY)]


# --- chat prompts a template would mangle, or that hold their own answer ---------------------------------


def test_a_chat_message_with_an_unknown_role_is_one_line_naming_the_record(tmp_path: Path) -> None:
    """Found by a user: a `narrator` message was accepted, and Qwen2.5's chat template (as shipped,
    tests/chat_templates) dropped it silently and put its default system prompt in its place."""
    rows = [
        {"prompt": [{"role": "user", "content": "Hi"}], "answer": "1"},
        {
            "prompt": [{"role": "narrator", "content": "Once"}, {"role": "user", "content": "Go"}],
            "answer": "2",
        },
    ]
    path = write_jsonl(tmp_path / "chat.jsonl", rows)
    with pytest.raises(DatasetError) as info:
        FilePromptSource(path)
    assert str(info.value) == (
        f"{path}:2: chat prompt 'prompt' message 0: role 'narrator' is not one of system, user, "
        "assistant, tool"
    )
    template = (REPO / "tests" / "chat_templates" / "qwen2_5_instruct.jinja").read_text()
    tok = HFTokenizer(TINY).tok
    shown = tok.apply_chat_template(rows[1]["prompt"], chat_template=template, tokenize=False)
    assert "Once" not in shown and "You are Qwen" in shown  # what the check keeps from happening


def test_a_prompt_ending_with_the_assistants_answer_is_refused_unless_it_is_to_be_continued(
    tmp_path: Path, chat_model: Path
) -> None:
    """Found by a user: OpenR1-Math's `messages` column ends with the reference solution, so a run on it
    had the answer in every prompt. Refused; `data.continue_final_message` makes it a prefill the model
    continues (HF's continue_final_message: no new assistant turn is opened)."""
    messages = [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "It is"}]
    path = write_jsonl(tmp_path / "openr1.jsonl", [{"messages": messages, "answer": "4"}])
    with pytest.raises(DatasetError) as info:
        open_source(DataConfig(source=str(path), prompt_key="messages"), seed=0)
    assert str(info.value) == (
        f"{path}:1: chat prompt 'messages' ends with an assistant message (its answer would be in the "
        "prompt): drop it, or set data.continue_final_message = true to have the model continue it"
    )
    config = DataConfig(source=str(path), prompt_key="messages", continue_final_message=True)
    record = open_source(config, seed=0).get(0)
    tokenizer = HFTokenizer(chat_model)
    ids = tokenizer.encode_prompt(record.text, record.metadata)
    assert tokenizer.render(ids) == "<|user|>What is 2 + 2?\n<|assistant|>It is"
