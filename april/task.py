"""The built-in task: repeated addition with a worked chain, verifiable, with long-tailed response lengths.

Owns the seeded generator of task examples (prompt text, gold answer, reference worked response),
`demonstration` (the worked response with a demonstrator's occasional slips, what the SFT warm start
imitates) and `TaskPromptSource`, the prompt source that serves them to the broker
(`[data] source = "task"`).

One example: start 11, increment 3, three additions:

    prompt    "From 11, add 3 (3 times)\n"
    response  "3: 11+3=14\n2: 14+3=17\n1: 17+3=20\nAnswer: 20"      (the model then emits EOS)
    answer    "20"

The response spends one line per addition, counting the additions left down to 1, so its length grows
linearly with the number of additions, which is drawn from a discretised log-normal: most chains are
short (median ~40 byte tokens), a few run to dozens of lines, and about 2% of reference responses are
longer than `MAX_NEW_TOKENS`, so they are cut off and score 0, like reasoning traces that overrun their
budget. Every line is a small local step (copy, add a digit, decrement), so a tiny model can learn the
task; a slip anywhere in the chain makes the final answer wrong, so long chains are harder. The built-in
`exact` reward scores a response: `extract_final_answer` takes the text after the last "Answer:" and it
must equal the gold total.

Example `index` under `seed` is drawn from `numpy.random.default_rng((seed, index))` alone, so any example
is O(its length) to make and the same on every machine. Deliberately does not tokenize, train or import
torch: the SFT loop (`learner.sft`) and the worker tokenizers do that.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from april.data import PromptRecord, SeededPromptSource

TASK_NAME = "repeated-addition"
MAX_NEW_TOKENS = 256  # the generation budget the task is designed around (about 2% of references exceed it)
DEFAULT_SIZE = 1_000_000  # prompts in the task source before it wraps around (they are i.i.d. anyway)


@dataclass(frozen=True, slots=True)
class TaskSpec:
    """The shape of the task. The defaults are the built-in task; tests may shrink it."""

    median_steps: float = 2.5  # median number of additions
    sigma: float = 1.0  # log-normal shape of the number of additions: the heaviness of the tail
    max_steps: int = 63  # additions are clipped to [1, max_steps]
    start_max: int = 20  # the start is drawn from [1, start_max]
    increment_max: int = 9  # the increment is drawn from [1, increment_max]

    def __post_init__(self) -> None:
        if not self.median_steps >= 1:
            raise ValueError(f"TaskSpec.median_steps = {self.median_steps}, expected >= 1")
        if not self.sigma >= 0:
            raise ValueError(f"TaskSpec.sigma = {self.sigma}, expected >= 0")
        for name in ("max_steps", "start_max", "increment_max"):
            if getattr(self, name) < 1:
                raise ValueError(f"TaskSpec.{name} = {getattr(self, name)}, expected >= 1")


@dataclass(frozen=True, slots=True)
class TaskExample:
    index: int
    start: int
    increment: int
    steps: int  # additions: the response has one line per addition
    prompt: str
    answer: str
    response: str  # the reference worked response, without the EOS token


def render_prompt(start: int, increment: int, steps: int) -> str:
    return f"From {start}, add {increment} ({steps} time{'' if steps == 1 else 's'})\n"


def render_response(start: int, increment: int, steps: int) -> str:
    """One line `left: total+increment=new_total` per addition, `left` counting down from `steps` to 1,
    then the answer line."""
    lines, total = [], start
    for left in range(steps, 0, -1):
        lines.append(f"{left}: {total}+{increment}={total + increment}")
        total += increment
    lines.append(f"Answer: {total}")
    return "\n".join(lines)


SLIPS = (-10, -2, -1, 1, 2, 10)  # how far a slipped sum lands from the right one


def demonstration(example: TaskExample, slip_rate: float, rng: np.random.Generator) -> str:
    """A worked response as an imperfect demonstrator writes it: each sum is, with probability
    `slip_rate`, off by one of `SLIPS` (never below 0), and the chain carries on from the slipped total,
    so the answer line is wrong too. With `slip_rate` 0 this is `example.response`."""
    if not 0 <= slip_rate < 1:
        raise ValueError(f"slip_rate = {slip_rate}, expected in [0, 1)")
    lines, total = [], example.start
    for left in range(example.steps, 0, -1):
        new_total = total + example.increment
        if slip_rate and rng.random() < slip_rate:
            new_total = max(0, new_total + int(rng.choice(SLIPS)))
        lines.append(f"{left}: {total}+{example.increment}={new_total}")
        total = new_total
    lines.append(f"Answer: {total}")
    return "\n".join(lines)


def make_example(seed: int, index: int, spec: TaskSpec = TaskSpec()) -> TaskExample:
    """Example `index` of the task under `seed`: a pure function of (seed, index, spec). The number of
    additions is drawn first (it sets the length), then the start and the increment."""
    if index < 0:
        raise ValueError(f"task example index must be >= 0, got {index}")
    rng = np.random.default_rng((seed, index))
    raw = math.exp(math.log(spec.median_steps) + spec.sigma * float(rng.standard_normal()))
    steps = min(max(round(raw), 1), spec.max_steps)
    start = int(rng.integers(1, spec.start_max + 1))
    increment = int(rng.integers(1, spec.increment_max + 1))
    return TaskExample(
        index,
        start,
        increment,
        steps,
        render_prompt(start, increment, steps),
        str(start + steps * increment),
        render_response(start, increment, steps),
    )


class TaskPromptSource(SeededPromptSource):
    """The task as a `PromptSource`: cursor -> example (cursor % size) under the run's seed. Records are
    text-only (empty `prompt_ids`); the worker tokenizes them with the model's tokenizer."""

    kind = "task"

    def __init__(self, size: int = DEFAULT_SIZE, *, seed: int = 0, spec: TaskSpec = TaskSpec()) -> None:
        super().__init__(size, seed)
        self.spec = spec

    def example(self, index: int) -> PromptRecord:
        ex = make_example(self.seed, index, self.spec)
        ids = np.zeros(0, dtype=np.int32)
        ids.flags.writeable = False
        return PromptRecord(index, ids, ex.prompt, {"prompt_index": str(index), "answer": ex.answer})

    def describe(self) -> str:
        return f"task({TASK_NAME}, size={self.size}, seed={self.seed})"
