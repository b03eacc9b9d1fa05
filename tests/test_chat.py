"""april.chat: prompt + model turns + observations, tokenized piecewise, equal the whole conversation as the
model's chat template renders it and its tokenizer tokenizes it (Qwen2.5 and Qwen3 templates, multi-turn
tool conversations); the plain format for the tiny model; Hermes tool-call parsing that never raises."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest
from qwen_tokenizer import TEMPLATES, qwen_tokenizer

from april.chat import ChatError, PlainChat, TemplateChat, chat_format, parse_turn
from april.episode import Message, Role, Tool, ToolCall
from april.hf import load_tokenizer

ADD = Tool("add", "Add two integers.", {"type": "object", "properties": {"a": {"type": "integer"}}})
LOOKUP = Tool("lookup", "Look a word up.", {"type": "object", "properties": {"word": {"type": "string"}}})


def call(i: int, name: str, **arguments: Any) -> ToolCall:
    return ToolCall(f"call_{i}", name, arguments)


def tool(i: int, name: str, content: str) -> Message:
    return Message(Role.TOOL, content, tool_call_id=f"call_{i}", name=name)


def encode(tok: Any, text: str) -> list[int]:
    return list(tok(text, add_special_tokens=False)["input_ids"])


# Each round: (what the model emits, exactly as a Qwen model writes it, its stop token included; the
# observation that follows, or None after the last turn). The model's text is written out by hand here,
# from the format the templates' system prompt asks for, not produced by the code under test.
QWEN25_ROUNDS = [
    (
        '<tool_call>\n{"name": "add", "arguments": {"a": 12, "b": 7}}\n</tool_call>\n'
        '<tool_call>\n{"name": "lookup", "arguments": {"word": "sum"}}\n</tool_call><|im_end|>',
        [tool(0, "add", "19"), tool(1, "lookup", '{"definition": "the total", "lang": "en"}')],
    ),
    (
        "Now the third number.\n"
        '<tool_call>\n{"name": "add", "arguments": {"a": 19, "b": 30}}\n</tool_call><|im_end|>',
        [tool(0, "add", "49\n")],
    ),
    ("The sum is 49.\n\nAnswer: 49<|im_end|>", None),
]
QWEN3_ROUNDS = [
    (
        "<think>\nAdd the first two.\n</think>\n\n"
        '<tool_call>\n{"name": "add", "arguments": {"a": 12, "b": 7}}\n</tool_call><|im_end|>',
        [tool(0, "add", "19")],
    ),
    (
        "<think>\nThen 30, and look a word up.\n</think>\n\nTwo calls.\n"
        '<tool_call>\n{"name": "add", "arguments": {"a": 19, "b": 30}}\n</tool_call>\n'
        '<tool_call>\n{"name": "lookup", "arguments": {"word": "total"}}\n</tool_call><|im_end|>',
        [tool(0, "add", "49"), tool(1, "lookup", "the whole")],
    ),
    ("<think>\nDone.\n</think>\n\nAnswer: 49<|im_end|>", None),
]


def play(
    tok: Any, prompt: list[Message], tools: list[Tool], rounds: list[tuple[str, list[Message] | None]]
) -> tuple[list[int], list[Message]]:
    """The episode tokenized piecewise as the worker builds it, and the conversation as messages."""
    chat = chat_format(tok)
    assert isinstance(chat, TemplateChat)
    ids = chat.prompt_ids(prompt, tools)
    messages = list(prompt)
    for text, observation in rounds:
        turn_ids = encode(tok, text)  # the model's own tokens
        assert turn_ids[-1] in chat.stop_ids
        ids += turn_ids
        turn = chat.parse_turn(chat.turn_text(turn_ids))
        assert chat.turn_ids(turn) == turn_ids  # rendering the parsed turn gives back the model's tokens
        messages.append(turn)
        if observation is not None:
            ids += chat.observation_ids(observation)
            messages += observation
    return ids + chat.observation_ids([]), messages


@pytest.mark.parametrize(
    ("template", "rounds", "system"),
    [
        ("qwen2_5_instruct", QWEN25_ROUNDS, True),
        ("qwen2_5_instruct", QWEN25_ROUNDS, False),  # the template inserts its default system prompt
        ("qwen3", QWEN3_ROUNDS, True),
        ("qwen3", QWEN3_ROUNDS, False),
    ],
)
def test_pieces_equal_the_whole_conversation_rendered_and_tokenized(
    template: str, rounds: list[tuple[str, list[Message] | None]], system: bool
) -> None:
    tok = qwen_tokenizer(template)
    prompt = [Message(Role.SYSTEM, "You add numbers.")] if system else []
    prompt.append(Message(Role.USER, "Sum: 12 7 30"))
    for tools in ([ADD, LOOKUP], []):
        ids, messages = play(tok, prompt, tools, rounds)
        whole = tok.apply_chat_template(
            [m.to_openai() for m in messages],
            tools=[t.to_openai() for t in tools] or None,
            add_generation_prompt=True,
            tokenize=True,
        )
        whole = list(whole["input_ids"] if hasattr(whole, "keys") else whole)
        assert ids == whole, tok.decode(ids) + "\n---\n" + tok.decode(whole)


def test_the_qwen25_template_renders_the_recorded_example() -> None:
    """Our copy of the template and transformers' renderer give the rendering huggingface.js records for
    Qwen2.5's tool-calling example; and the pieces tokenize to the same ids as that text."""
    location = {
        "type": "string",
        "description": 'The location to get the temperature for, in the format "City, State, Country".',
    }
    unit = {
        "type": "string",
        "enum": ["celsius", "fahrenheit"],
        "description": 'The unit to return the temperature in. Defaults to "celsius".',
    }
    date = {
        "type": "string",
        "description": 'The date to get the temperature for, in the format "Year-Month-Day".',
    }
    tools = [
        Tool(
            "get_current_temperature",
            "Get current temperature at a location.",
            {"type": "object", "properties": {"location": location, "unit": unit}, "required": ["location"]},
        ),
        Tool(
            "get_temperature_date",
            "Get temperature at a location and date.",
            {
                "type": "object",
                "properties": {"location": location, "date": date, "unit": unit},
                "required": ["location", "date"],
            },
        ),
    ]
    prompt = [
        Message(
            Role.SYSTEM,
            "You are Qwen, created by Alibaba Cloud. You are a helpful assistant."
            "\n\nCurrent Date: 2024-09-30",
        ),
        Message(Role.USER, "What's the temperature in San Francisco now? How about tomorrow?"),
    ]
    turn = Message(
        Role.ASSISTANT,
        "",
        (
            call(0, "get_current_temperature", location="San Francisco, CA, USA"),
            call(1, "get_temperature_date", location="San Francisco, CA, USA", date="2024-10-01"),
        ),
    )
    observation = [
        tool(
            0,
            "get_current_temperature",
            '{"temperature": 26.1, "location": "San Francisco, CA, USA", "unit": "celsius"}',
        ),
        tool(
            1,
            "get_temperature_date",
            '{"temperature": 25.9, "location": "San Francisco, CA, USA", '
            '"date": "2024-10-01", "unit": "celsius"}',
        ),
    ]
    tok = qwen_tokenizer("qwen2_5_instruct")
    recorded = (TEMPLATES / "qwen2_5_tool_example.txt").read_text(encoding="utf-8")
    rendered = tok.apply_chat_template(
        [m.to_openai() for m in [*prompt, turn, *observation]],
        tools=[t.to_openai() for t in tools],
        tokenize=False,
    )
    assert rendered == recorded
    chat = chat_format(tok)
    pieces = chat.prompt_ids(prompt, tools) + chat.turn_ids(turn) + chat.observation_ids(observation)
    # the recorded text stops after the observation, before the next generation prompt
    assert pieces == encode(tok, recorded + "<|im_start|>assistant\n")


def test_template_arguments_reach_the_template() -> None:
    """Qwen3 without thinking: the generation prompt, at the end of the prompt and of every observation,
    opens the model's turn with an empty think block."""
    tok = qwen_tokenizer("qwen3")
    chat = chat_format(tok, template_kwargs={"enable_thinking": False})
    empty_think = "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    assert tok.decode(chat.prompt_ids([Message(Role.USER, "hi")])).endswith(empty_think)
    assert tok.decode(chat.observation_ids([tool(0, "add", "19")])).endswith(
        "</tool_response><|im_end|>\n" + empty_think
    )
    assert not tok.decode(chat_format(tok).prompt_ids([Message(Role.USER, "hi")])).endswith(empty_think)


def test_a_turn_cut_off_before_its_stop_token_gets_it_from_the_observation() -> None:
    chat = chat_format(qwen_tokenizer("qwen2_5_instruct"))
    obs = [tool(0, "add", "19")]
    assert chat.observation_ids(obs, after_stop=False) == [chat.stop_ids[0], *chat.observation_ids(obs)]


STRICT_TEMPLATE = (  # ChatML that, like Mistral's and Llama 3.1's templates, checks tool messages' call ids
    "{% set ns = namespace(ids=[]) %}{% for m in messages %}"
    "{% if m['role'] == 'assistant' %}{% set ns.ids = [] %}"
    "{% for c in m['tool_calls'] or [] %}{% set ns.ids = ns.ids + [c['id']] %}{% endfor %}{% endif %}"
    "{% if m['role'] == 'tool' and m['tool_call_id'] not in ns.ids %}"
    "{{ raise_exception('tool message answers no call') }}{% endif %}"
    "{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def test_observations_are_rendered_after_the_calls_they_answer() -> None:
    tok = copy.deepcopy(qwen_tokenizer("qwen2_5_instruct"))
    tok.chat_template = STRICT_TEMPLATE
    chat = chat_format(tok)
    obs = [tool(0, "add", "19"), tool(1, "add", "20")]
    assert chat.observation_ids(obs) == encode(
        tok, "\n<|im_start|>tool\n19<|im_end|>\n<|im_start|>tool\n20<|im_end|>\n<|im_start|>assistant\n"
    )


def test_a_template_that_never_ends_a_turn_with_the_stop_token_is_refused() -> None:
    tok = copy.deepcopy(qwen_tokenizer("qwen2_5_instruct"))
    tok.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    with pytest.raises(ChatError, match=r"no stop token \('<\|im_end\|>'\) after an assistant turn"):
        chat_format(tok)


# ---------------------------------------------------------------------------------------------------
# the plain format (the tiny model's tokenizer has no template)


def test_the_tiny_model_gets_the_plain_format() -> None:
    tok = load_tokenizer("models/tiny")
    chat = chat_format(tok)
    assert isinstance(chat, PlainChat) and chat.stop_ids == (tok.eos_token_id,)
    prompt = chat.prompt_ids([Message(Role.SYSTEM, "Add."), Message(Role.USER, "Sum: 12 7")], [ADD])
    turn = Message(Role.ASSISTANT, "", (call(0, "add", a=12, b=7),))
    turn_ids = chat.turn_ids(turn)
    obs = chat.observation_ids([tool(0, "add", "19")])
    final = chat.turn_ids(Message(Role.ASSISTANT, "Answer: 19"))
    text = tok.decode(prompt + turn_ids + obs + final, skip_special_tokens=False)
    assert text == (
        "Add.\nSum: 12 7\n"
        '<tool_call>{"name":"add","arguments":{"a":12,"b":7}}</tool_call><|eos|>'
        "<tool_response>19</tool_response>\n"
        "Answer: 19<|eos|>"
    )
    assert prompt == list(tok("Add.\nSum: 12 7\n", add_special_tokens=True)["input_ids"])
    assert turn_ids[-1] == final[-1] == tok.eos_token_id
    assert chat.parse_turn(chat.turn_text(turn_ids)) == turn
    assert chat.turn_text(final) == "Answer: 19"
    assert chat.observation_ids([], after_stop=False) == [tok.eos_token_id]


# ---------------------------------------------------------------------------------------------------
# parsing


def test_parse_plain_text_and_calls() -> None:
    assert parse_turn("  Answer: 4\n") == Message(Role.ASSISTANT, "Answer: 4")
    text = (
        "First.\n<tool_call>\n"
        + json.dumps({"name": "add", "arguments": {"a": 1, "b": {"deep": [1, 2]}}})
        + "\n</tool_call>\nthen\n"
        + '<tool_call>{"name": "lookup", "arguments": "{\\"word\\": \\"x\\"}"}</tool_call>'
    )
    assert parse_turn(text) == Message(
        Role.ASSISTANT,
        "First.\n\nthen",
        (call(0, "add", a=1, b={"deep": [1, 2]}), call(1, "lookup", word="x")),
    )
    assert parse_turn('<tool_call>{"name": "ping"}</tool_call>').tool_calls == (call(0, "ping"),)


@pytest.mark.parametrize(
    ("body", "name", "error"),
    [
        (
            '{"name": "add", "arguments": {"a": 1,}}',
            "",
            "tool call is not valid JSON (Expecting property name",
        ),
        ("", "", "tool call is not valid JSON (Expecting value at column 1)"),
        ('["add"]', "", 'tool call has no "name" string'),
        ('{"arguments": {}}', "", 'tool call has no "name" string'),
        ('{"name": "add", "arguments": [1, 2]}', "add", "tool call 'add': \"arguments\" is not an object"),
        ('{"name": "add", "arguments": "{broken"}', "add", "tool call 'add': \"arguments\" is not an object"),
    ],
)
def test_malformed_calls_become_calls_with_an_error(body: str, name: str, error: str) -> None:
    turn = parse_turn(
        f'ok <tool_call>{body}</tool_call> <tool_call>{{"name": "add", "arguments": {{}}}}</tool_call>'
    )
    bad, good = turn.tool_calls
    assert (bad.id, bad.name) == ("call_0", name) and bad.error.startswith(error)
    assert good == call(1, "add")  # one bad call spoils nothing else
    assert turn.content == "ok"


def test_an_unterminated_call_is_a_call_with_an_error() -> None:
    turn = parse_turn('text <tool_call>{"name": "add", "argu')
    assert turn.content == "text"
    assert turn.tool_calls == (ToolCall("call_0", "", {}, "<tool_call> without </tool_call>"),)
