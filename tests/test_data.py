"""Prompt sources: cursor determinism and resume, synthetic bounds, JSONL formats and errors, export."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from april.config import DataConfig
from april.data import (
    KEPT_PROMPT_BYTES,
    DatasetError,
    FilePromptSource,
    PromptRecord,
    PromptSource,
    SyntheticPromptSource,
    export_jsonl,
    records,
    synthetic,
)
from april.sources import open_source


def same(a: PromptRecord, b: PromptRecord) -> bool:
    return (
        a.prompt_index == b.prompt_index
        and np.array_equal(a.prompt_ids, b.prompt_ids)
        and a.text == b.text
        and a.metadata == b.metadata
    )


def write_jsonl(path: Path, rows: list[Any]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def small_jsonl(tmp_path: Path, n: int = 7) -> Path:
    return write_jsonl(tmp_path / "d.jsonl", [{"prompt": f"q{i}", "answer": i} for i in range(n)])


# --- cursor: determinism, resume, per-epoch shuffle -------------------------------------------------


@pytest.mark.parametrize("kind", ["synthetic", "jsonl"])
@pytest.mark.parametrize("shuffle", [True, False])
def test_same_cursor_same_record_across_instances(tmp_path: Path, kind: str, shuffle: bool) -> None:
    def make() -> PromptSource:
        if kind == "synthetic":
            return SyntheticPromptSource(50, seed=3, shuffle=shuffle)
        return FilePromptSource(small_jsonl(tmp_path), seed=3, shuffle=shuffle)

    first, resumed = make(), make()
    cursors = list(range(120))
    seq = [first.get(c) for c in cursors]
    # A fresh instance that starts at a saved cursor (here: late, then going backwards) agrees.
    for c in reversed(cursors):
        assert same(resumed.get(c), seq[c])


@pytest.mark.parametrize("kind", ["synthetic", "jsonl"])
def test_shuffle_covers_each_index_once_per_epoch_and_epochs_differ(tmp_path: Path, kind: str) -> None:
    n = 40
    source: PromptSource
    if kind == "synthetic":
        source = SyntheticPromptSource(n, seed=1, shuffle=True)
    else:
        source = FilePromptSource(small_jsonl(tmp_path, n), seed=1, shuffle=True)
    epochs = [[source.get(e * n + p).prompt_index for p in range(n)] for e in range(3)]
    for order in epochs:
        assert sorted(order) == list(range(n))
    assert epochs[0] != epochs[1] != epochs[2]
    assert epochs[0] != list(range(n))


def test_no_shuffle_is_dataset_order_and_seed_changes_shuffle() -> None:
    plain = SyntheticPromptSource(10, seed=0, shuffle=False)
    assert [plain.get(c).prompt_index for c in range(25)] == [c % 10 for c in range(25)]
    a, b = SyntheticPromptSource(30, seed=0), SyntheticPromptSource(30, seed=1)
    assert [a.get(c).prompt_index for c in range(30)] != [b.get(c).prompt_index for c in range(30)]


def test_negative_cursor_is_rejected() -> None:
    with pytest.raises(ValueError, match="cursor"):
        SyntheticPromptSource(10).get(-1)


# --- synthetic ----------------------------------------------------------------------------------------


def test_synthetic_length_bounds_id_range_and_answer() -> None:
    source = SyntheticPromptSource(500, seed=7, prompt_len_min=4, prompt_len_max=9, vocab_size=20)
    lengths = set()
    for c in range(500):
        r = source.get(c)
        assert r.prompt_ids.dtype == np.int32 and r.prompt_ids.ndim == 1
        assert 4 <= len(r.prompt_ids) <= 9
        assert r.prompt_ids.min() >= 3 and r.prompt_ids.max() < 20
        assert r.text == " ".join(str(i) for i in r.prompt_ids.tolist())
        assert r.metadata == {
            "prompt_index": str(r.prompt_index),
            "answer": str(int(r.prompt_ids.sum()) % 10),
        }
        lengths.add(len(r.prompt_ids))
    assert lengths == set(range(4, 10))
    # A prompt depends on (seed, index) only: the same index has the same ids whatever the size/shuffle.
    other = SyntheticPromptSource(
        1000, seed=7, prompt_len_min=4, prompt_len_max=9, vocab_size=20, shuffle=False
    )
    r = source.get(0)
    assert np.array_equal(other.get(r.prompt_index).prompt_ids, r.prompt_ids)
    assert not r.prompt_ids.flags.writeable


def reference_synthetic(seed: int, index: int, len_min: int, len_max: int, vocab: int) -> PromptRecord:
    """The synthetic record at a dataset index, built the slow, obvious way (how the source was written
    before it kept records and a table of token texts)."""
    rng = np.random.default_rng((seed, index))
    length = int(rng.integers(len_min, len_max + 1))
    ids = rng.integers(3, vocab, size=length, dtype=np.int32)
    answer = str(int(ids.sum(dtype=np.int64)) % 10)
    text = " ".join(str(i) for i in ids.tolist())
    return PromptRecord(index, ids, text, {"prompt_index": str(index), "answer": answer})


@pytest.mark.parametrize("vocab", [50, 2**16, 2**16 + 1, 2**31 - 1])  # with and without the text table
def test_synthetic_records_match_the_reference_also_when_kept(
    vocab: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(records, "KEPT_PROMPT_BYTES", 256 * synthetic.record_bytes(6))  # about 256 records
    size = 256 * 2 + 7
    source = SyntheticPromptSource(size, seed=3, prompt_len_min=1, prompt_len_max=12, vocab_size=vocab)
    # draws that revisit recent cursors (kept records) and, past the budget, dropped ones (rebuilt)
    cursors = [*range(40), *range(20, 40), *range(40, size + 40), 0, 5, size - 1]
    for cursor in cursors:
        record = source.get(cursor)
        assert same(record, reference_synthetic(3, record.prompt_index, 1, 12, vocab)), cursor
        assert same(
            record,
            SyntheticPromptSource(size, seed=3, prompt_len_min=1, prompt_len_max=12, vocab_size=vocab).get(
                cursor
            ),
        ), cursor
        assert record.prompt_ids.dtype == np.int32 and not record.prompt_ids.flags.writeable


def test_synthetic_keeps_the_records_within_its_budget_and_only_those(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    kept = 50
    monkeypatch.setattr(records, "KEPT_PROMPT_BYTES", kept * synthetic.record_bytes(8))
    source = SyntheticPromptSource(kept * 4, seed=1, prompt_len_min=8, prompt_len_max=8, shuffle=False)
    first = source.get(0)
    assert source.get(0) is first  # built once: the broker gets a windowed prompt twice
    for cursor in range(1, kept):
        source.get(cursor)
    assert source.get(0) is first  # a whole epoch within the budget: every record is built once a run
    source.get(kept)  # one more than the budget holds: the oldest is dropped
    again = source.get(0)
    assert again is not first and same(again, first)


def test_the_default_synthetic_dataset_is_kept_whole() -> None:
    cfg = DataConfig()
    per_record = synthetic.record_bytes(cfg.synthetic_prompt_len_max)
    assert cfg.synthetic_size * per_record <= KEPT_PROMPT_BYTES


@pytest.mark.parametrize(
    "kwargs",
    [{"size": 0}, {"prompt_len_min": 0}, {"prompt_len_min": 5, "prompt_len_max": 4}, {"vocab_size": 3}],
)
def test_synthetic_rejects_bad_arguments(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        SyntheticPromptSource(**kwargs)


# --- JSONL formats ------------------------------------------------------------------------------------


def test_jsonl_text_prompts_with_metadata(tmp_path: Path) -> None:
    path = tmp_path / "d.jsonl"
    path.write_text(
        '{"prompt": "What is 2+2?", "answer": 4, "source": "gsm", "level": 3, "tags": ["x"], "n": null}\n'
        "\n   \n"
        '{"prompt": "Name a colour.", "answer": "red"}\n',
        encoding="utf-8",
    )
    source = FilePromptSource(path, shuffle=False)
    assert len(source) == 2
    r0, r1 = source.get(0), source.get(1)
    assert r0.text == "What is 2+2?" and r0.prompt_ids.size == 0 and r0.prompt_ids.dtype == np.int32
    assert r0.metadata == {"answer": "4", "source": "gsm", "level": "3", "prompt_index": "0"}
    assert (r1.prompt_index, r1.text, r1.metadata["answer"]) == (1, "Name a colour.", "red")
    assert "2 prompts" in source.describe()


def test_jsonl_token_id_prompts_and_custom_keys(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"input_ids": [5, 0, 17], "label": 1.5}])
    r = FilePromptSource(path, prompt_key="input_ids", answer_key="label").get(0)
    assert r.prompt_ids.dtype == np.int32 and r.prompt_ids.tolist() == [5, 0, 17]
    assert r.text == "" and r.metadata["answer"] == "1.5"


def test_jsonl_dapo_chat_messages_and_dotted_answer_key(tmp_path: Path) -> None:
    messages = [
        {"role": "system", "content": "Think step by step."},
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "ok"},
        {"role": "user", "content": "Solve x+1=3."},
    ]
    row = {
        "data_source": "math_dapo",
        "prompt": messages,
        "ability": "MATH",
        "reward_model": {"ground_truth": "2", "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": "abc"},
    }
    path = write_jsonl(tmp_path / "dapo.jsonl", [row])
    r = FilePromptSource(path, answer_key="reward_model.ground_truth").get(0)
    assert r.text == "Solve x+1=3." and r.prompt_ids.size == 0
    assert json.loads(r.metadata["messages"]) == messages
    assert r.metadata["answer"] == "2"
    assert r.metadata["data_source"] == "math_dapo" and r.metadata["ability"] == "MATH"
    assert "reward_model" not in r.metadata and "extra_info" not in r.metadata


def test_empty_answer_key_means_no_answers(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "hi"}])
    assert "answer" not in FilePromptSource(path, answer_key="").get(0).metadata


def test_answers_are_optional_only_when_not_required(tmp_path: Path) -> None:
    """`april generate` reads prompts with require_answer=False; training (the default) needs every answer."""
    rows = [{"prompt": "a"}, {"prompt": "b", "answer": 7}, {"prompt": "c", "answer": None}]
    path = write_jsonl(tmp_path / "d.jsonl", rows)
    src = FilePromptSource(path, shuffle=False, require_answer=False)
    assert [src.get(i).metadata.get("answer") for i in range(3)] == [None, "7", None]
    with pytest.raises(DatasetError, match=r"d\.jsonl:1: missing answer field 'answer'"):
        FilePromptSource(path)
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "a", "answer": [1]}])
    with pytest.raises(DatasetError, match=r"bad\.jsonl:1: answer 'answer' must be a string or number"):
        FilePromptSource(bad, require_answer=False)  # present answers are still checked


# --- JSONL errors: one line naming the file, the line and the problem ---------------------------------

GOOD = '{"prompt": "ok", "answer": "1"}'


@pytest.mark.parametrize(
    ("bad_line", "expected"),
    [
        ("{not json", "invalid JSON"),
        ("[1, 2]", "expected a JSON object, got list"),
        (
            '{"question": "q", "answer": "1"}',
            "missing prompt field 'prompt' (keys present: answer, question)",
        ),
        ('{"prompt": "  ", "answer": "1"}', "empty prompt"),
        ('{"prompt": [], "answer": "1"}', "empty prompt"),
        ('{"prompt": "q"}', "missing answer field 'answer' (keys present: prompt)"),
        ('{"prompt": "q", "answer": null}', "missing answer field"),
        ('{"prompt": "q", "answer": [1]}', "must be a string or number"),
        ('{"prompt": [1, -2], "answer": "1"}', "non-negative int ids"),
        ('{"prompt": [1, 2.5], "answer": "1"}', "non-negative int ids"),
        ('{"prompt": [1, true], "answer": "1"}', "non-negative int ids"),
        ('{"prompt": 12, "answer": "1"}', "must be a string or a list, got int"),
        ('{"prompt": [{"role": "system", "content": "s"}], "answer": "1"}', "no non-empty user message"),
    ],
)
def test_jsonl_errors_name_file_and_line(tmp_path: Path, bad_line: str, expected: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(f"{GOOD}\n\n{bad_line}\n{GOOD}\n", encoding="utf-8")
    with pytest.raises(DatasetError) as info:
        FilePromptSource(path)
    message = str(info.value)
    assert message.startswith(f"{path}:3: ") and expected in message and "\n" not in message


def test_jsonl_error_dotted_answer_key_missing(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "d.jsonl", [{"prompt": "q", "reward_model": {"style": "rule"}}])
    with pytest.raises(DatasetError, match=r":1: missing answer field 'reward_model.ground_truth'"):
        FilePromptSource(path, answer_key="reward_model.ground_truth")


def test_jsonl_error_not_utf8_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(GOOD.encode() + b"\n" + '{"prompt": "café", "answer": "1"}'.encode("latin-1") + b"\n")
    with pytest.raises(DatasetError, match=r"latin1\.jsonl:2: not valid UTF-8"):
        FilePromptSource(path)


def test_jsonl_error_missing_file_and_empty_dataset(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match=r"nope\.jsonl: cannot read dataset file"):
        FilePromptSource(tmp_path / "nope.jsonl")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n  \n", encoding="utf-8")
    with pytest.raises(DatasetError, match=r"empty\.jsonl: dataset is empty"):
        FilePromptSource(empty)
    assert issubclass(DatasetError, ValueError)


# --- open_source and export round trip ----------------------------------------------------------------


def test_open_source_picks_the_source(tmp_path: Path) -> None:
    synthetic = open_source(DataConfig(synthetic_prompt_len_min=2, synthetic_prompt_len_max=3), seed=5)
    assert isinstance(synthetic, SyntheticPromptSource) and 2 <= len(synthetic.get(0).prompt_ids) <= 3
    path = write_jsonl(tmp_path / "d.jsonl", [{"q": "hi", "gt": "x"}])
    jsonl = open_source(DataConfig(source=str(path), prompt_key="q", answer_key="gt", shuffle=False), seed=5)
    assert isinstance(jsonl, FilePromptSource) and jsonl.get(0).metadata["answer"] == "x"


def test_export_synthetic_round_trip(tmp_path: Path) -> None:
    source = SyntheticPromptSource(100, seed=11, shuffle=True)
    path = tmp_path / "export.jsonl"
    export_jsonl(source, path, 30)
    reread = FilePromptSource(path, shuffle=False)
    assert len(reread) == 30
    for c in range(30):
        original, copy = source.get(c), reread.get(c)
        assert np.array_equal(original.prompt_ids, copy.prompt_ids)
        assert copy.metadata["answer"] == original.metadata["answer"]
        assert copy.prompt_index == c


def test_export_chat_and_text_round_trip_with_dotted_key(tmp_path: Path) -> None:
    messages = [{"role": "user", "content": "Solve it."}]
    rows = [
        {"prompt": messages, "reward_model": {"ground_truth": "7"}, "ability": "MATH"},
        {"prompt": "plain text", "reward_model": {"ground_truth": "8"}},
    ]
    src = FilePromptSource(write_jsonl(tmp_path / "a.jsonl", rows), answer_key="reward_model.ground_truth")
    out = tmp_path / "b.jsonl"
    export_jsonl(src, out, 2, answer_key="reward_model.ground_truth")
    back = FilePromptSource(out, answer_key="reward_model.ground_truth", shuffle=False)
    by_text = {back.get(c).text: back.get(c) for c in range(2)}
    assert by_text.keys() == {"Solve it.", "plain text"}
    assert json.loads(by_text["Solve it."].metadata["messages"]) == messages
    assert by_text["Solve it."].metadata["ability"] == "MATH"
    assert {r.metadata["answer"] for r in by_text.values()} == {"7", "8"}


def test_export_count_out_of_range(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="export count"):
        export_jsonl(SyntheticPromptSource(5), tmp_path / "x.jsonl", 6)
