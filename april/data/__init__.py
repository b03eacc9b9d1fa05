"""Prompt sources: where the broker draws each new group's prompt from (`[data] source`).

A source maps a prompt *cursor* (a count of prompts drawn so far: 0, 1, 2, ... forever) to a
`PromptRecord`: epoch = cursor // len, position = cursor % len; with shuffle on, each epoch is a fresh
permutation seeded by (seed, epoch), so the whole sequence is deterministic and a run resumes from its
saved cursor alone. This package holds the records, the synthetic source and the dataset files (JSON Lines,
a JSON array, Parquet, Arrow, a `datasets` save_to_disk directory: docs/data.md); `april.sources` picks the
source a config names, the generated tasks' sources included (they import this package, never the reverse).

Deliberately does not: keep or persist the cursor (the broker does), tokenize (records from text datasets
carry empty `prompt_ids`; the worker tokenizes them and applies chat templates), touch sockets or torch.
"""

from __future__ import annotations

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

__all__ = [
    "KEPT_PROMPT_BYTES",
    "DatasetError",
    "FilePromptSource",
    "PromptRecord",
    "PromptSource",
    "RecordError",
    "SeededPromptSource",
    "SyntheticPromptSource",
    "export_jsonl",
]
