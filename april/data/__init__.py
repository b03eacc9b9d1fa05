"""Prompt sources: where the broker draws each new group's prompt from (`[data] source`).

A source maps a prompt *cursor* (a count of prompts drawn so far: 0, 1, 2, ... forever) to a
`PromptRecord`: epoch = cursor // len, position = cursor % len; with shuffle on, each epoch is a fresh
permutation seeded by (seed, epoch), so the whole sequence is deterministic and a run resumes from its
saved cursor alone. `open_source` picks the source a config names: synthetic prompts, the built-in task,
or a dataset file or directory (JSON Lines, a JSON array, Parquet, Arrow, a `datasets` save_to_disk
directory: docs/data.md).

Deliberately does not: keep or persist the cursor (the broker does), tokenize (records from text datasets
carry empty `prompt_ids`; the worker tokenizes them and applies chat templates), touch sockets or torch.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from april.data.export import export_jsonl
from april.data.file_source import FilePromptSource
from april.data.records import (
    KEPT_PROMPT_BYTES,
    DatasetError,
    PromptRecord,
    PromptSource,
    RecordError,
    SeededPromptSource,
)
from april.data.synthetic import SyntheticPromptSource

if TYPE_CHECKING:
    from april.config import DataConfig, EnvConfig

__all__ = [
    "GENERATED_SOURCES",
    "KEPT_PROMPT_BYTES",
    "DatasetError",
    "FilePromptSource",
    "PromptRecord",
    "PromptSource",
    "RecordError",
    "SeededPromptSource",
    "SyntheticPromptSource",
    "export_jsonl",
    "is_generated",
    "open_source",
]


GENERATED_SOURCES = (
    "synthetic",
    "task",
    "calculator",
    "verifiers",
)  # `data.source` names that are not dataset paths
GENERATED_PREFIXES = ("reasoning_gym:",)  # nor are these: a generator and its arguments


def is_generated(source: str) -> bool:
    """`source` names a generator, not a dataset path."""
    return source in GENERATED_SOURCES or source.startswith(GENERATED_PREFIXES)


def open_source(data_config: DataConfig, seed: int, env: EnvConfig | None = None) -> PromptSource:
    """The source named by `[data] source`: "synthetic", "task" (the built-in task), "calculator" (the
    built-in multi-turn task, `april.envs.calculator`), "reasoning_gym:TASK[,TASK...]" (the package's
    generators, `april.envs.reasoning_gym`, seeded by `data.seed` or else the run's), "verifiers" (the
    dataset of the verifiers environment `env` names, `april.envs.verifiers_adapter`) or a dataset path."""
    from april.envs.verifiers_adapter import VerifiersPromptSource, is_verifiers

    # a verifiers environment brings its dataset: the default source (synthetic token ids) gives way to it
    if data_config.source == "verifiers" or (
        data_config.source == "synthetic" and env is not None and is_verifiers(env.name)
    ):
        if env is None or not is_verifiers(env.name):
            got = "" if env is None else env.name
            raise DatasetError(f"data.source = 'verifiers' needs env.name = 'verifiers:MODULE', got {got!r}")
        return VerifiersPromptSource(env.name, env.args)
    if data_config.source.startswith("reasoning_gym:"):
        from april.envs.reasoning_gym import ReasoningGymSource

        data_seed = seed if data_config.seed == -1 else data_config.seed
        return ReasoningGymSource(data_config.source, data_config.size, data_seed, data_config.options)
    if data_config.source == "calculator":
        from april.envs.calculator import CalculatorPromptSource  # it imports this package

        return CalculatorPromptSource(seed=seed)
    if data_config.source == "task":
        from april.task import TaskPromptSource  # april.task imports this package

        return TaskPromptSource(seed=seed)
    if data_config.source == "synthetic":
        return SyntheticPromptSource(
            data_config.synthetic_size,
            seed=seed,
            prompt_len_min=data_config.synthetic_prompt_len_min,
            prompt_len_max=data_config.synthetic_prompt_len_max,
            vocab_size=data_config.synthetic_vocab_size,
            shuffle=data_config.shuffle,
        )
    return FilePromptSource(
        data_config.source,
        prompt_key=data_config.prompt_key,
        answer_key=data_config.answer_key,
        answer_format=data_config.answer_format,
        seed=seed,
        shuffle=data_config.shuffle,
        continue_final_message=data_config.continue_final_message,
    )
