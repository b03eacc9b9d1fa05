"""What every prompt source gives the broker, and the two helpers the sources share.

Owns `PromptRecord`, the `PromptSource` contract (cursor -> record: a count of prompts drawn so far, 0, 1,
2, ... forever, maps to the same record always, so a run resumes from its saved cursor alone),
`DatasetError` (a dataset that cannot be used, one line) and `RecordError` (one record's problem, before
the source says where the record is), `CursorMap` (epochs and each epoch's seeded permutation) and
`KeptRecords` (records kept once built, within a byte budget), and `SeededPromptSource` (the frame of a
source generated from a seed, the built-in tasks').

Reads no file and knows no format: `april.data.json_rows` and `april.data.arrow_rows` read them,
`april.data.fields` turns a row into a record.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar, Protocol

import numpy as np

INT32_MAX = 2**31 - 1
# Records are kept once built, the oldest dropped past this many bytes (by each source's estimate of a
# record's size): the broker gets each prompt twice with `algo.prompt_order` other than issue (drawn into
# the window, then issued up to `prompt_window` later), and later epochs look small datasets up again.
KEPT_PROMPT_BYTES = 32 << 20


class DatasetError(ValueError):
    """A dataset that cannot be read; the message is one line naming the file (and record) and the problem."""


class RecordError(ValueError):
    """One record's problem (naming the field), without where the record is: its source adds that."""


@dataclass(frozen=True, slots=True)
class PromptRecord:
    prompt_index: int  # position in the dataset (not the cursor)
    prompt_ids: np.ndarray  # int32, shape (prompt_len,); empty when the dataset holds text only
    text: str
    metadata: dict[str, str]  # "prompt_index", "answer" when the record has one, other scalar fields


class PromptSource(Protocol):
    def __len__(self) -> int: ...
    def get(self, cursor: int) -> PromptRecord: ...
    def describe(self) -> str: ...


class CursorMap:
    """cursor -> dataset index; caches the current epoch's permutation (O(len) once per epoch)."""

    def __init__(self, size: int, seed: int, shuffle: bool) -> None:
        self.size, self.seed, self.shuffle = size, seed, shuffle
        self._cached: tuple[int, np.ndarray] | None = None

    def index(self, cursor: int) -> int:
        if cursor < 0:
            raise ValueError(f"prompt cursor must be >= 0, got {cursor}")
        epoch, position = divmod(cursor, self.size)
        if not self.shuffle:
            return position
        cached = self._cached
        if cached is None or cached[0] != epoch:
            cached = (epoch, np.random.default_rng((self.seed, epoch)).permutation(self.size))
            self._cached = cached
        return int(cached[1][position])


class KeptRecords:
    """Records by dataset index once built, in insertion order: past `budget` bytes (as `size_of`
    estimates them) the oldest are dropped. Kept records are shared; callers do not mutate them."""

    def __init__(self, budget: int, size_of: Callable[[PromptRecord], int]) -> None:
        self.budget, self.size_of = budget, size_of
        # an OrderedDict, not a dict: popping a dict's oldest entry again and again makes finding the next
        # oldest scan the holes left behind (a quarter of a JSONL dataset's opening, profiled)
        self._kept: OrderedDict[int, PromptRecord] = OrderedDict()
        self._bytes = 0

    def get(self, index: int) -> PromptRecord | None:
        return self._kept.get(index)

    def put(self, index: int, record: PromptRecord) -> None:
        if index in self._kept:
            return
        self._kept[index] = record
        self._bytes += self.size_of(record)
        while self._bytes > self.budget:
            self._bytes -= self.size_of(self._kept.popitem(last=False)[1])


class SeededPromptSource:
    """A source generated from a seed: cursor -> `example(cursor % size)`, each an i.i.d. draw under the
    run's seed, so the draw order is the index order (no shuffling). Subclasses name themselves (`kind`,
    for messages) and make the example."""

    kind: ClassVar[str]

    def __init__(self, size: int, seed: int) -> None:
        if size <= 0:
            raise ValueError(f"{self.kind} source size must be > 0, got {size}")
        self.size, self.seed = size, seed

    def __len__(self) -> int:
        return self.size

    def get(self, cursor: int) -> PromptRecord:
        if cursor < 0:
            raise ValueError(f"prompt cursor must be >= 0, got {cursor}")
        return self.example(cursor % self.size)

    def example(self, index: int) -> PromptRecord:
        raise NotImplementedError
