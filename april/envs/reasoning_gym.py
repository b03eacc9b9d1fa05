"""reasoning-gym tasks as a prompt source (`data.source = "reasoning_gym:TASK[,TASK...]"`) and a reward.

`ReasoningGymSource` serves the questions of one or more reasoning-gym generators, as the package makes
them (`reasoning_gym.create_dataset(task, seed=, size=, **options)`): index i is task i % k's entry
i // k, so several tasks interleave evenly. Every record carries its entry's coordinates (task, seed,
index, size, options) in its metadata, and `score` regenerates that exact entry and calls the task's own
`score_answer` on it, so the reward sees the entry's metadata as the generator made it, never a JSON copy.
The held-out source (`held_out`) draws from generator seeds no training entry uses: an entry's questions
come from `Random(seed + index)`, so training uses seeds [seed, seed + n) and the held-out set
[seed + n, ...), n the training entries per task.

Imports `reasoning_gym` only when a source or the reward is opened (one line naming the extra when it is
missing). Knows nothing of tokenizers, workers or the broker.
"""

from __future__ import annotations

import functools
import importlib
import json
from dataclasses import dataclass
from typing import Any

import numpy as np

from april.data.records import DatasetError, PromptRecord

PREFIX = "reasoning_gym:"
REWARD_NAME = "reasoning_gym"
KEY = "reasoning_gym"  # the metadata key holding an entry's coordinates (JSON)
INSTALL = "pip install 'april-rl[reasoning-gym]' (or: pip install reasoning-gym)"


class ReasoningGymError(DatasetError):
    """A task spec, option or package problem; one line naming the field."""


def is_reasoning_gym(source: str) -> bool:
    return source.startswith(PREFIX)


def package() -> Any:
    """The `reasoning_gym` module, or a one-line error naming the extra to install."""
    try:
        return importlib.import_module("reasoning_gym")
    except ImportError as exc:
        raise ReasoningGymError(f"reasoning-gym is not installed ({exc}); install it: {INSTALL}") from None


@dataclass(frozen=True, slots=True)
class Coordinates:
    """Where an entry comes from: `create_dataset(task, seed=seed, size=size, **options)[index]`."""

    task: str
    seed: int
    size: int
    index: int
    options: dict[str, Any]

    def to_json(self) -> str:
        return json.dumps(
            {
                "task": self.task,
                "seed": self.seed,
                "size": self.size,
                "index": self.index,
                "options": self.options,
            },
            sort_keys=True,
            separators=(",", ":"),
        )

    @classmethod
    def from_json(cls, text: str) -> Coordinates:
        try:
            obj = json.loads(text)
            return cls(
                str(obj["task"]), int(obj["seed"]), int(obj["size"]), int(obj["index"]), dict(obj["options"])
            )
        except (ValueError, KeyError, TypeError):
            raise ValueError(f"metadata {KEY}: got {text[:80]!r}, expected an entry's coordinates") from None


def parse_tasks(source: str) -> tuple[str, ...]:
    """The task names of `reasoning_gym:TASK[,TASK...]`, checked against the package's registry."""
    names = tuple(t.strip() for t in source.removeprefix(PREFIX).split(","))
    if not names or not all(names) or len(set(names)) != len(names):
        raise ReasoningGymError(
            f"data.source = {source!r}: expected 'reasoning_gym:TASK[,TASK...]' with distinct task names"
        )
    known = package().factory.DATASETS
    for name in names:
        if name not in known:
            raise ReasoningGymError(
                f"data.source = {source!r}: no reasoning-gym task {name!r} ({len(known)} known, e.g. "
                f"{', '.join(sorted(known)[:4])}; reasoning_gym.factory.DATASETS lists them)"
            )
    return names


def parse_options(text: str, tasks: tuple[str, ...]) -> dict[str, dict[str, Any]]:
    """`data.options`: a JSON object of task name -> that task's config options ("" = none)."""
    if not text.strip():
        return {t: {} for t in tasks}
    try:
        obj = json.loads(text)
    except ValueError:
        raise ReasoningGymError(f"data.options = {text[:80]!r}: not JSON, expected an object") from None
    if not isinstance(obj, dict) or not all(isinstance(v, dict) for v in obj.values()):
        raise ReasoningGymError(
            f"data.options = {text[:80]!r}: expected an object of task name -> options object, "
            'e.g. {"basic_arithmetic": {"max_terms": 3}}'
        )
    for task, options in obj.items():
        for key in ("seed", "size"):
            if key in options:
                raise ReasoningGymError(
                    f"data.options: {task}.{key} is set by data.{key}, not in data.options"
                )
    unknown = sorted(set(obj) - set(tasks))
    if unknown:
        raise ReasoningGymError(
            f"data.options names {unknown[0]!r}, expected one of the tasks {', '.join(tasks)}"
        )
    return {t: dict(obj.get(t, {})) for t in tasks}


@functools.lru_cache(maxsize=64)
def _dataset(task: str, seed: int, size: int, options: str) -> Any:
    """The package's dataset for these coordinates (made once a process: some generators load word lists)."""
    try:
        return package().create_dataset(task, seed=seed, size=size, **json.loads(options))
    except ReasoningGymError:
        raise
    except Exception as exc:
        message = " ".join(str(exc).split())[:200]
        raise ReasoningGymError(
            f"data.options for {task!r}: {type(exc).__name__}: {message} (expected the fields of its config)"
        ) from None


def dataset(c: Coordinates) -> Any:
    return _dataset(c.task, c.seed, c.size, json.dumps(c.options, sort_keys=True))


def entry(c: Coordinates) -> dict[str, Any]:
    """The entry as the package makes it: {"question", "answer", "metadata"}."""
    return dict(dataset(c)[c.index])


class ReasoningGymSource:
    """A `PromptSource`: index -> task index % k, entry index // k of that task (i.i.d. generator draws,
    so no shuffling). `size` entries per task; `first_seed` is the generator seed of entry 0."""

    kind = "reasoning_gym"

    def __init__(self, source: str, size: int, seed: int, options: str = "") -> None:
        if size <= 0:
            raise ReasoningGymError(f"data.size = {size}: expected > 0 (questions per reasoning-gym task)")
        self.source, self.size, self.seed, self.options_text = source, size, seed, options
        self.tasks = parse_tasks(source)
        self.options = parse_options(options, self.tasks)
        for task in self.tasks:  # bad options fail at start-up, with the field named
            dataset(self._coordinates(task, 0))

    def __len__(self) -> int:
        return self.size * len(self.tasks)

    def get(self, cursor: int) -> PromptRecord:
        if cursor < 0:
            raise ValueError(f"prompt cursor must be >= 0, got {cursor}")
        index = cursor % len(self)
        c = self._coordinates(self.tasks[index % len(self.tasks)], index // len(self.tasks))
        e = entry(c)
        ids = np.zeros(0, dtype=np.int32)
        ids.flags.writeable = False
        metadata = {"prompt_index": str(index), "answer": str(e["answer"]), KEY: c.to_json()}
        return PromptRecord(index, ids, str(e["question"]), metadata)

    def held_out(self, size: int) -> ReasoningGymSource:
        """`size` questions per task from generator seeds past every training entry's."""
        return ReasoningGymSource(self.source, size, self.seed + self.size, self.options_text)

    def describe(self) -> str:
        return f"reasoning_gym({','.join(self.tasks)}, size={self.size} per task, seed={self.seed})"

    def _coordinates(self, task: str, index: int) -> Coordinates:
        return Coordinates(task, self.seed, self.size, index, self.options[task])


def tagged_answer(response_text: str) -> str | None:
    """The last `<answer>...</answer>` of a response (reasoning-gym's own `extract_answer`, as its system
    prompts ask for), or None."""
    tagged = package().utils.extract_answer(response_text)
    return None if tagged is None else str(tagged)


def score(answer: str, metadata: dict[str, str]) -> float:
    """The task's own `score_answer(answer, entry)` on the entry the prompt's metadata names, regenerated."""
    raw = metadata.get(KEY)
    if raw is None:
        raise ValueError(
            f"reward 'reasoning_gym': the prompt has no {KEY!r} metadata (data.source must be one)"
        )
    c = Coordinates.from_json(raw)
    return float(dataset(c).score_answer(answer, entry(c)))
