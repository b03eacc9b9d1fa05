"""The built-in task: examples are right and reproducible, lengths are long-tailed, the reward scores them,
the prompt source serves them, and a JSONL export reads back as a user dataset."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from actors.rewards import exact_reward
from april.config import DataConfig
from april.data import FilePromptSource, export_jsonl
from april.sources import open_source
from april.task import (
    MAX_NEW_TOKENS,
    TaskExample,
    TaskPromptSource,
    TaskSpec,
    demonstration,
    make_example,
)

LINE = re.compile(r"(\d+): (\d+)\+(\d+)=(\d+)")


def check_example(ex: TaskExample) -> None:
    """Recompute the example from its prompt alone, by a different route than the generator."""
    start, increment, steps = (int(x) for x in re.findall(r"\d+", ex.prompt))
    assert (ex.start, ex.increment, ex.steps) == (start, increment, steps)
    *lines, last = ex.response.split("\n")
    assert len(lines) == steps
    total = start
    for k, line in enumerate(lines):
        match = LINE.fullmatch(line)
        assert match is not None, line
        left, a, b, c = (int(g) for g in match.groups())
        assert (left, a, b, c) == (steps - k, total, increment, total + increment)
        total = c
    assert last == f"Answer: {total}"
    assert ex.answer == str(start + steps * increment)


def test_examples_are_correct_and_reproducible() -> None:
    for i in range(300):
        ex = make_example(7, i)
        check_example(ex)
        assert make_example(7, i) == ex
    assert [make_example(8, i) for i in range(20)] != [make_example(7, i) for i in range(20)]


def test_the_first_example_reads_as_documented() -> None:
    ex = make_example(0, 0)
    assert ex.prompt == "From 11, add 3 (3 times)\n"
    assert ex.response == "3: 11+3=14\n2: 14+3=17\n1: 17+3=20\nAnswer: 20"
    assert ex.answer == "20"


def test_response_lengths_are_long_tailed_and_some_overrun_the_budget() -> None:
    # the tiny model's tokenizer is byte-level: tokens = bytes, plus the EOS (checked in test_sft)
    lengths = np.array([len(make_example(0, i).response.encode()) + 1 for i in range(5000)])
    median, p99 = np.median(lengths), np.percentile(lengths, 99)
    assert median <= 50
    assert p99 >= 5 * median
    capped = np.minimum(lengths, MAX_NEW_TOKENS)  # what generation under the budget produces
    assert np.percentile(capped, 99) >= 5 * np.median(capped)
    assert 0.005 <= float(np.mean(lengths > MAX_NEW_TOKENS)) <= 0.05


def test_exact_reward_scores_the_reference_one_and_mistakes_zero() -> None:
    for i in range(50):
        ex = make_example(3, i)
        assert exact_reward(ex.response, ex.answer, {}) == 1.0
        wrong = ex.response.rsplit(" ", 1)[0] + f" {int(ex.answer) + 1}"
        assert exact_reward(wrong, ex.answer, {}) == 0.0
        cut = ex.response[: ex.response.rindex("\n")]  # truncated before the answer line
        assert exact_reward(cut, ex.answer, {}) == 0.0


def test_spec_validates_and_shapes_lengths() -> None:
    with pytest.raises(ValueError, match="median_steps"):
        TaskSpec(median_steps=0.5)
    with pytest.raises(ValueError, match="increment_max"):
        TaskSpec(increment_max=0)
    short = TaskSpec(median_steps=1, sigma=0.0)
    assert {make_example(0, i, short).steps for i in range(50)} == {1}
    capped = TaskSpec(median_steps=50, sigma=2.0, max_steps=5)
    assert max(make_example(0, i, capped).steps for i in range(50)) == 5
    with pytest.raises(ValueError, match="index"):
        make_example(0, -1)


def test_prompt_source_serves_the_examples() -> None:
    source = TaskPromptSource(100, seed=5)
    assert len(source) == 100
    for cursor in (0, 1, 99, 100, 250):
        record = source.get(cursor)
        ex = make_example(5, cursor % 100)
        assert record.prompt_index == cursor % 100
        assert (record.text, record.metadata["answer"]) == (ex.prompt, ex.answer)
        assert record.metadata["prompt_index"] == str(cursor % 100)
        assert record.prompt_ids.shape == (0,)
    assert "seed=5" in source.describe()
    with pytest.raises(ValueError, match="cursor"):
        source.get(-1)


def test_open_source_task() -> None:
    source = open_source(DataConfig(source="task"), seed=3)
    assert isinstance(source, TaskPromptSource)
    assert source.get(4).text == make_example(3, 4).prompt


def test_jsonl_export_reads_back_as_a_user_dataset(tmp_path: Path) -> None:
    source = TaskPromptSource(seed=2)
    path = tmp_path / "task.jsonl"
    export_jsonl(source, path, 40)
    loaded = FilePromptSource(path, shuffle=False)
    assert len(loaded) == 40
    for i in range(40):
        want, got = source.get(i), loaded.get(i)
        assert (got.text, got.metadata["answer"]) == (want.text, want.metadata["answer"])


def test_demonstrations_slip_at_the_given_rate_and_carry_the_slip() -> None:
    rng = np.random.default_rng(0)
    for i in range(20):
        ex = make_example(1, i)
        assert demonstration(ex, 0.0, rng) == ex.response
    lines = slipped = wrong = 0
    examples = [make_example(1, i) for i in range(2000)]
    for ex in examples:
        text = demonstration(ex, 0.25, rng)
        *steps, last = text.split("\n")
        total = ex.start
        for line in steps:
            match = LINE.fullmatch(line)
            assert match is not None, line
            _, a, b, c = (int(g) for g in match.groups())
            assert (a, b) == (total, ex.increment)  # the chain carries on from the written total
            slipped += c != a + b
            lines += 1
            total = c
        assert last == f"Answer: {total}"
        wrong += exact_reward(text, ex.answer, {}) == 0.0
    assert 0.22 < slipped / lines < 0.28
    assert wrong > 0.3 * len(examples)
    with pytest.raises(ValueError, match="slip_rate"):
        demonstration(examples[0], 1.0, rng)
