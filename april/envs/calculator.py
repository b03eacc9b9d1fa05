"""The built-in multi-turn task: summing numbers with a calculator tool that keeps a running total.

One example with four numbers (the model's turns end with its stop token; plain format shown):

    prompt   "Sum: 12 7 30 5\nnext 7\n"
    turn 1   <tool_call>{"name":"add","arguments":{"n":7}}</tool_call>      observation 19, next 30
    turn 2   <tool_call>{"name":"add","arguments":{"n":30}}</tool_call>     observation 49, next 5
    turn 3   <tool_call>{"name":"add","arguments":{"n":5}}</tool_call>      observation 54, all added
    turn 4   "Answer: 54"                                                    reward 1.0

k numbers take k-1 calls and k turns; k is drawn from a discretised log-normal clipped to [2, 10], so most
episodes are two or three turns and a few run to ten. The reward is 1.0 when the final turn's last
"Answer: N" is the true sum, else 0.0. The calculator's register (part of the environment's state, so it
travels with a partial episode) starts at the first number; `add` adds its argument to it and answers the
new total. After the prompt and after each step's results the environment says which number is next (a
user message, `next N` or `all added`): each call copies the number just named, and the answer copies
the last result, so what the model must get right is always a few tokens back, never a search through
the prompt (which the tiny model, trained by SFT, did not learn).

Owns the seeded example generator (example `index` under `seed` comes from `numpy.random.default_rng((seed,
index))` alone), `CalculatorEnvironment` (the `calculator` env spec), `CalculatorPromptSource` (a
PromptSource, like `april.task.TaskPromptSource`) and `transcript`: a demonstrator's episode with the
occasional slip, as token ids and a loss mask over the model's tokens, for `april sft`. Does not train.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from april.chat import (
    TOOL_CALL_CLOSE,
    TOOL_CALL_OPEN,
    TOOL_RESPONSE_CLOSE,
    TOOL_RESPONSE_OPEN,
    ChatFormat,
)
from april.data import PromptRecord, SeededPromptSource
from april.episode import (
    EnvStep,
    EpisodeError,
    Message,
    Role,
    Tool,
    ToolCall,
    ToolError,
    call_tools,
    prompt_messages,
)
from april.task import SLIPS

CALCULATOR_NAME = "calculator"
DEFAULT_SIZE = 1_000_000  # prompts in the source before it wraps around (they are i.i.d. anyway)
DEFAULT_SLIP_RATE = 0.25  # chance that a demonstrated call adds a wrong number (see `transcript`)
CONTEXT = 1024  # positions a model needs: a ten-number episode fits, byte-level or with digit groups
_ANSWER = re.compile(r"answer\s*:\s*(-?\d+)", re.IGNORECASE)
_PROMPT = re.compile(r"Sum: (\d+(?: \d+)*)")

# The task's fixed strings as the plain chat format renders them: whole tokens of the calculator model's
# tokenizer (`april sft --task calculator`), with digit groups, so that a call is five tokens.
WORDS = (
    TOOL_CALL_OPEN,
    TOOL_CALL_CLOSE,
    TOOL_RESPONSE_OPEN,
    TOOL_RESPONSE_CLOSE,
    '{"name":"add","arguments":{"n":',
    "}}",
    "next ",
    "all added",
    "Answer: ",
    "Sum: ",
)

ADD = Tool(
    name="add",
    description="Add an integer to the running total and return the new total.",
    parameters={
        "type": "object",
        "properties": {"n": {"type": "integer"}},
        "required": ["n"],
    },
    repeatable=True,
    timeout_s=2.0,
)


@dataclass(frozen=True, slots=True)
class CalculatorSpec:
    """The shape of the task. The defaults are the built-in task; tests may change them."""

    median_numbers: float = 3.0  # median count of numbers to sum (turns = numbers)
    sigma: float = 0.7  # log-normal shape of the count: the heaviness of the tail
    min_numbers: int = 2
    max_numbers: int = 10
    number_max: int = 99  # each number is drawn from [1, number_max]

    def __post_init__(self) -> None:
        if not 2 <= self.min_numbers <= self.max_numbers:
            raise ValueError(
                f"CalculatorSpec: count in [{self.min_numbers}, {self.max_numbers}], expected 2 <= min <= max"
            )
        if not self.median_numbers >= 1 or not self.sigma >= 0 or self.number_max < 1:
            raise ValueError(f"CalculatorSpec: got {self}, expected median >= 1, sigma >= 0, number_max >= 1")


@dataclass(frozen=True, slots=True)
class CalculatorExample:
    index: int
    numbers: tuple[int, ...]
    prompt: str
    answer: str

    def record(self) -> PromptRecord:
        """The example as the prompt source serves it: text only, the answer in the metadata."""
        ids = np.zeros(0, dtype=np.int32)
        ids.flags.writeable = False
        return PromptRecord(
            self.index, ids, self.prompt, {"prompt_index": str(self.index), "answer": self.answer}
        )


def render_prompt(numbers: tuple[int, ...]) -> str:
    return "Sum: " + " ".join(str(n) for n in numbers)


def make_example(seed: int, index: int, spec: CalculatorSpec = CalculatorSpec()) -> CalculatorExample:
    """Example `index` under `seed`, a pure function of (seed, index, spec): the count first, then the
    numbers."""
    if index < 0:
        raise ValueError(f"calculator example index must be >= 0, got {index}")
    rng = np.random.default_rng((seed, index))
    raw = math.exp(math.log(spec.median_numbers) + spec.sigma * float(rng.standard_normal()))
    count = min(max(round(raw), spec.min_numbers), spec.max_numbers)
    numbers = tuple(int(n) for n in rng.integers(1, spec.number_max + 1, size=count))
    return CalculatorExample(index, numbers, render_prompt(numbers), str(sum(numbers)))


def final_answer(text: str) -> int | None:
    """The number after the last "Answer:" in `text` (case-insensitive), or None."""
    matches = _ANSWER.findall(text)
    return int(matches[-1]) if matches else None


def parse_numbers(text: str) -> list[int] | None:
    """The numbers of a prompt "Sum: 12 7 30", or None if `text` is not one."""
    match = _PROMPT.fullmatch(text.strip())
    return [int(n) for n in match.group(1).split()] if match else None


def _pointer(numbers: list[int], used: int) -> Message:
    return Message(Role.USER, f"next {numbers[used]}" if used < len(numbers) else "all added")


def _number(arguments: Mapping[str, Any]) -> int:
    n = arguments.get("n")
    if type(n) is not int or set(arguments) != {"n"}:
        raise ToolError(f"add takes one integer argument n, got {json.dumps(dict(arguments))[:80]}")
    return n


class CalculatorEnvironment:
    """The `calculator` env: the first observation is the prompt and `next N` (the second number: the
    register holds the first); a turn with tool calls is answered with their results and the next pointer
    (each call that adds moves it on by one); a turn without any ends the episode, scored by its final
    answer. The state: the gold answer, the numbers, how many are used, and the register (`total`)."""

    tools: tuple[Tool, ...] = (ADD,)

    def reset(self, prompt: PromptRecord) -> EnvStep:
        answer, numbers = prompt.metadata.get("answer"), parse_numbers(prompt.text)
        if answer is None or not re.fullmatch(r"-?\d+", answer) or numbers is None:
            raise EpisodeError(
                f"calculator prompt {prompt.prompt_index}: text {prompt.text[:40]!r} and answer {answer!r}, "
                "expected 'Sum: N N ...' and an integer"
            )
        state = {"answer": int(answer), "numbers": numbers, "used": 1, "total": numbers[0]}
        return EnvStep((*prompt_messages(prompt), _pointer(numbers, 1)), json.dumps(state))

    def step(self, state: str, turn: Message) -> EnvStep:
        s = json.loads(state)
        if not turn.tool_calls:
            return EnvStep((), state, done=True, reward=float(final_answer(turn.content) == s["answer"]))

        def add(arguments: Mapping[str, Any]) -> str:
            """The tool: the register plus `n` (a bad argument changes nothing); the pointer moves on."""
            s["total"] += _number(arguments)
            s["used"] = min(s["used"] + 1, len(s["numbers"]))
            return str(s["total"])

        results = call_tools(turn, {ADD.name: add})
        return EnvStep((*results, _pointer(s["numbers"], s["used"])), json.dumps(s))


class CalculatorPromptSource(SeededPromptSource):
    """The task as a `PromptSource`: cursor -> example (cursor % size) under the run's seed; records are
    text-only (the worker tokenizes through the chat format)."""

    kind = CALCULATOR_NAME

    def __init__(
        self, size: int = DEFAULT_SIZE, *, seed: int = 0, spec: CalculatorSpec = CalculatorSpec()
    ) -> None:
        super().__init__(size, seed)
        self.spec = spec

    def example(self, index: int) -> PromptRecord:
        return make_example(self.seed, index, self.spec).record()

    def describe(self) -> str:
        return f"{CALCULATOR_NAME}(size={self.size}, seed={self.seed})"


@dataclass(frozen=True, slots=True)
class Transcript:
    """A whole episode as the model sees it: prompt, turns and observations as token ids, `loss_mask` True
    on the model's own tokens (its turns, stop tokens included) only."""

    ids: list[int]
    loss_mask: list[bool]
    turns: int
    reward: float  # the environment's reward for the demonstrated answer


def transcript(
    example: CalculatorExample, chat: ChatFormat, slip_rate: float, rng: np.random.Generator
) -> Transcript:
    """The episode an imperfect demonstrator plays: each call adds the number the environment says is
    next, which with probability `slip_rate` is off by one of `april.task.SLIPS` (never below 0); the
    final turn, after `all added`, answers the last tool result. Every turn is tokenized by `chat`,
    parsed back from its tokens as the worker parses the model's, and answered by the real environment,
    so the observations are exactly those RL episodes see."""
    if not 0 <= slip_rate < 1:
        raise ValueError(f"slip_rate = {slip_rate}, expected in [0, 1)")
    env = CalculatorEnvironment()
    first = env.reset(example.record())
    ids = chat.prompt_ids(first.observation, env.tools)
    mask = [False] * len(ids)
    state, total = first.state, example.numbers[0]
    for number in example.numbers[1:]:
        if slip_rate and rng.random() < slip_rate:
            number = max(0, number + int(rng.choice(SLIPS)))
        step = _play(
            env,
            chat,
            state,
            Message(Role.ASSISTANT, "", (ToolCall("call_0", ADD.name, {"n": number}),)),
            ids,
            mask,
        )
        obs = chat.observation_ids(step.observation)
        ids += obs
        mask += [False] * len(obs)
        state, total = step.state, int(step.observation[0].content)
    last = _play(env, chat, state, Message(Role.ASSISTANT, f"Answer: {total}"), ids, mask)
    assert last.done and last.reward is not None
    return Transcript(ids, mask, len(example.numbers), last.reward)


def _play(
    env: CalculatorEnvironment, chat: ChatFormat, state: str, turn: Message, ids: list[int], mask: list[bool]
) -> EnvStep:
    """Append the turn's tokens (trained) and step the environment on the turn parsed back from them."""
    turn_ids = chat.turn_ids(turn)
    ids += turn_ids
    mask += [True] * len(turn_ids)
    return env.step(state, chat.parse_turn(chat.turn_text(turn_ids)))
