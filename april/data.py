"""Prompt sources: where the broker draws each new group's prompt from.

Owns the mapping from a prompt *cursor* (a count of prompts drawn so far: 0, 1, 2, ... forever) to a
`PromptRecord`. Epoch = cursor // len, position = cursor % len; with shuffle on, each epoch is a fresh
permutation seeded by (seed, epoch), so the whole sequence is deterministic and a run resumes from its
saved cursor alone. Same cursor -> same record, always.

Deliberately does not: keep or persist the cursor (the broker does), tokenize (records from text-only
datasets carry empty `prompt_ids`; the worker tokenizes and applies chat templates), touch sockets or torch.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

if TYPE_CHECKING:
    from april.config import DataConfig

FIRST_TOKEN_ID = 3  # ids 0, 1, 2 are reserved for pad / bos / eos in synthetic prompts
_INT32_MAX = 2**31 - 1
# Synthetic records are kept once built, the oldest dropped past this many bytes (by the estimate below,
# measured with tracemalloc: about 1.1 kB a record and 7 bytes a token, its array and text). The default
# dataset (10,000 prompts of 8-64 tokens) takes about 14 MB and is built once a run: building a prompt costs
# the broker about 27 us (mostly seeding its generator), looking it up a dict access, as a JSONL dataset's.
KEPT_PROMPT_BYTES = 32 << 20


def _record_bytes(tokens: int) -> int:
    return 1024 + 8 * tokens


_TOKEN_TEXT_MAX = 1 << 16  # vocabularies up to this size get a table of token texts (~60 bytes an entry)


class DatasetError(ValueError):
    """A dataset that cannot be read; the message is one line naming the file (and line) and the problem."""


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


class _CursorMap:
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


class SyntheticPromptSource:
    """Seeded random token-id prompts; each one derived from (seed, index), so get() is O(length)."""

    def __init__(
        self,
        size: int = 10000,
        *,
        seed: int = 0,
        prompt_len_min: int = 8,
        prompt_len_max: int = 64,
        vocab_size: int = 1000,
        shuffle: bool = True,
    ) -> None:
        if size <= 0:
            raise ValueError(f"synthetic size must be > 0, got {size}")
        if not 0 < prompt_len_min <= prompt_len_max:
            raise ValueError(
                f"need 0 < prompt_len_min <= prompt_len_max, got {prompt_len_min}, {prompt_len_max}"
            )
        if not FIRST_TOKEN_ID < vocab_size <= _INT32_MAX:
            raise ValueError(f"synthetic vocab_size must be > {FIRST_TOKEN_ID}, got {vocab_size}")
        self.seed, self.len_min, self.len_max, self.vocab_size = (
            seed,
            prompt_len_min,
            prompt_len_max,
            vocab_size,
        )
        self._map = _CursorMap(size, seed, shuffle)
        # each token id's text, for the prompt text (a join of table entries, not one str() per token)
        self._token_text = [str(i) for i in range(vocab_size)] if vocab_size <= _TOKEN_TEXT_MAX else None
        # the records built, by dataset index (insertion order: the oldest is dropped first), within
        # KEPT_PROMPT_BYTES: later epochs look them up, and with `algo.prompt_order` other than issue the
        # broker gets each prompt twice (drawn into the window, then issued up to `prompt_window` later)
        self._kept: dict[int, PromptRecord] = {}
        self._kept_bytes = 0

    def __len__(self) -> int:
        return self._map.size

    def get(self, cursor: int) -> PromptRecord:
        """The record at `cursor`: built from (seed, index), or the same record again while it is kept
        (see KEPT_PROMPT_BYTES; records are shared, callers do not mutate them)."""
        index = self._map.index(cursor)
        record = self._kept.get(index)
        if record is None:
            record = self._build(index)
            self._kept[index] = record
            self._kept_bytes += _record_bytes(len(record.prompt_ids))
            while self._kept_bytes > KEPT_PROMPT_BYTES:
                oldest = self._kept.pop(next(iter(self._kept)))
                self._kept_bytes -= _record_bytes(len(oldest.prompt_ids))
        return record

    def _build(self, index: int) -> PromptRecord:
        rng = np.random.default_rng((self.seed, index))
        length = int(rng.integers(self.len_min, self.len_max + 1))
        ids = rng.integers(FIRST_TOKEN_ID, self.vocab_size, size=length, dtype=np.int32)
        ids.flags.writeable = False
        tokens = ids.tolist()
        answer = str(sum(tokens) % 10)  # Python ints: exact, as the int64 sum it replaces
        table = self._token_text
        text = " ".join([table[t] for t in tokens] if table is not None else map(str, tokens))
        return PromptRecord(index, ids, text, {"prompt_index": str(index), "answer": answer})

    def describe(self) -> str:
        return (
            f"synthetic(size={len(self)}, seed={self.seed}, len=[{self.len_min},{self.len_max}], "
            f"vocab={self.vocab_size}, shuffle={self._map.shuffle})"
        )


def _lookup(obj: dict[str, Any], dotted_key: str) -> tuple[bool, Any]:
    """Follow "a.b.c" through nested objects; (False, None) when any step is missing."""
    value: Any = obj
    for part in dotted_key.split("."):
        if not isinstance(value, dict) or part not in value:
            return False, None
        value = value[part]
    return True, value


def _put(obj: dict[str, Any], dotted_key: str, value: Any) -> None:
    *parents, leaf = dotted_key.split(".")
    for part in parents:
        obj = obj.setdefault(part, {})
    obj[leaf] = value


class JsonlPromptSource:
    """A JSONL file read whole at construction; one prompt per non-blank line.

    Every line needs its `answer_key` field when `require_answer` is set (training: the reward needs it);
    otherwise (`april generate`) a line without one gives a record without "answer" in its metadata."""

    def __init__(
        self,
        path: str | Path,
        *,
        prompt_key: str = "prompt",
        answer_key: str = "answer",
        seed: int = 0,
        shuffle: bool = True,
        require_answer: bool = True,
    ) -> None:
        self.path, self.prompt_key, self.answer_key = Path(path), prompt_key, answer_key
        self.require_answer = require_answer
        try:
            raw = self.path.read_bytes()
        except OSError as exc:
            raise DatasetError(f"{self.path}: cannot read dataset file ({exc.strerror or exc})") from None
        self._records: list[PromptRecord] = []
        for lineno, line in enumerate(raw.split(b"\n"), start=1):
            try:
                decoded = line.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise DatasetError(f"{self.path}:{lineno}: not valid UTF-8 ({exc.reason})") from None
            if decoded.strip():
                self._records.append(self._parse(decoded, lineno, len(self._records)))
        if not self._records:
            raise DatasetError(f"{self.path}: dataset is empty (no non-blank lines)")
        self._map = _CursorMap(len(self._records), seed, shuffle)

    def _parse(self, line: str, lineno: int, index: int) -> PromptRecord:
        def fail(problem: str) -> DatasetError:
            return DatasetError(f"{self.path}:{lineno}: {problem}")

        try:
            obj = json.loads(line)
        except json.JSONDecodeError as exc:
            raise fail(f"invalid JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(obj, dict):
            raise fail(f"expected a JSON object, got {type(obj).__name__}")
        keys = ", ".join(sorted(obj)) or "none"
        top_keys = {self.prompt_key.split(".")[0], self.answer_key.split(".")[0]}
        metadata = {
            k: str(v)
            for k, v in obj.items()
            if k not in top_keys and not isinstance(v, dict | list) and v is not None
        }
        found, prompt = _lookup(obj, self.prompt_key)
        if not found:
            raise fail(f"missing prompt field {self.prompt_key!r} (keys present: {keys})")
        ids, text = np.zeros(0, dtype=np.int32), ""
        if isinstance(prompt, str):
            if not prompt.strip():
                raise fail(f"empty prompt in field {self.prompt_key!r}")
            text = prompt
        elif isinstance(prompt, list) and prompt and all(isinstance(m, dict) for m in prompt):
            users = [m.get("content") for m in prompt if m.get("role") == "user"]
            if not users or not isinstance(users[-1], str) or not users[-1].strip():
                raise fail(f"chat prompt {self.prompt_key!r} has no non-empty user message content")
            text, metadata["messages"] = users[-1], json.dumps(prompt, ensure_ascii=False)
        elif isinstance(prompt, list) and prompt:
            if not all(type(i) is int and 0 <= i <= _INT32_MAX for i in prompt):
                raise fail(
                    f"prompt {self.prompt_key!r} must be a string, chat messages or non-negative int ids"
                )
            ids = np.asarray(prompt, dtype=np.int32)
        elif isinstance(prompt, list):
            raise fail(f"empty prompt in field {self.prompt_key!r}")
        else:
            raise fail(f"prompt {self.prompt_key!r} must be a string or a list, got {type(prompt).__name__}")
        ids.flags.writeable = False
        found, answer = _lookup(obj, self.answer_key) if self.answer_key else (False, None)
        if self.answer_key and self.require_answer and (not found or answer is None):
            raise fail(f"missing answer field {self.answer_key!r} (keys present: {keys})")
        if found and answer is not None:
            if not isinstance(answer, str | int | float) or isinstance(answer, bool):
                raise fail(
                    f"answer {self.answer_key!r} must be a string or number, got {type(answer).__name__}"
                )
            metadata["answer"] = str(answer)
        metadata["prompt_index"] = str(index)
        return PromptRecord(index, ids, text, metadata)

    def __len__(self) -> int:
        return len(self._records)

    def get(self, cursor: int) -> PromptRecord:
        return self._records[self._map.index(cursor)]

    def describe(self) -> str:
        return (
            f"jsonl({self.path}, {len(self)} prompts, prompt_key={self.prompt_key!r}, "
            f"answer_key={self.answer_key!r}, shuffle={self._map.shuffle})"
        )


def open_source(data_config: DataConfig, seed: int) -> PromptSource:
    """The source named by `[data] source`: "synthetic", "task" (the built-in task) or a JSONL path."""
    if data_config.source == "task":
        from april.task import TaskPromptSource  # april.task imports this module

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
    return JsonlPromptSource(
        data_config.source,
        prompt_key=data_config.prompt_key,
        answer_key=data_config.answer_key,
        seed=seed,
        shuffle=data_config.shuffle,
    )


def export_jsonl(
    source: PromptSource,
    path: str | Path,
    count: int,
    *,
    prompt_key: str = "prompt",
    answer_key: str = "answer",
) -> None:
    """Write the records at cursors 0..count-1 (draw order) as JSONL that `JsonlPromptSource` reads back.

    The prompt is written as chat messages if the record has them, else as token ids if it has any, else
    as text; the answer goes under `answer_key` (nested for a dotted key); other metadata stays top-level.
    """
    if not 0 <= count <= len(source):
        raise ValueError(f"export count must be in [0, {len(source)}] (the source size), got {count}")
    with Path(path).open("w", encoding="utf-8") as out:
        for cursor in range(count):
            record = source.get(cursor)
            meta = dict(record.metadata)
            meta.pop("prompt_index", None)
            messages, answer = meta.pop("messages", None), meta.pop("answer", None)
            prompt: Any = json.loads(messages) if messages else record.prompt_ids.tolist() or record.text
            obj: dict[str, Any] = dict(meta)
            _put(obj, prompt_key, prompt)
            if answer is not None and answer_key:
                _put(obj, answer_key, answer)
            out.write(json.dumps(obj, ensure_ascii=False) + "\n")
