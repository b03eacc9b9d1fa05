"""Rows of JSON datasets: JSON Lines (one object a line) and a JSON array of objects (DeepScaleR's
deepscaler.json), with each field's JSON type for `april data inspect`.

A JSON Lines file is never held whole: opening it reads it once, line by line, keeping where each
non-blank line starts and its line number (16 bytes a row), and a row is read again from the file when
it is needed. A JSON array is one document, so it is parsed and held whole. A row that cannot be decoded
(bad UTF-8, bad JSON) is a `RecordError`; rows are not checked against the prompt and answer fields here
(`april.data.fields` does that).
"""

from __future__ import annotations

import json
import os
import weakref
from array import array
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from april.data.records import DatasetError, RecordError

TYPES_SHOWN = 3  # a field seen with more JSON types than this shows the commonest and "..."


def _decode(line: bytes) -> Any:
    try:
        return json.loads(line.decode("utf-8-sig"))  # a BOM may open the first line
    except UnicodeDecodeError as exc:
        raise RecordError(f"not valid UTF-8 ({exc.reason})") from None
    except json.JSONDecodeError as exc:
        raise RecordError(f"invalid JSON ({exc.msg} at column {exc.colno})") from None


def json_type(value: Any) -> str:
    """A JSON value's type, written as Arrow writes types: string, int64, list<...>, struct<k: ...>."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int64"
    if isinstance(value, float):
        return "double"
    if isinstance(value, str):
        return "string"
    if isinstance(value, list):
        return f"list<{' | '.join(dict.fromkeys(json_type(v) for v in value))}>"
    if isinstance(value, dict):
        return "struct<" + ", ".join(f"{k}: {json_type(v)}" for k, v in value.items()) + ">"
    return type(value).__name__


def field_types(rows: Iterator[Any], count: int) -> list[tuple[str, str]]:
    """(field, its types over `rows`, commonest first, and in how many rows it is missing, if any)."""
    seen: dict[str, Counter[str]] = {}
    for obj in rows:
        if isinstance(obj, dict):
            for key, value in obj.items():
                seen.setdefault(key, Counter())[json_type(value)] += 1
    out = []
    for key, types in seen.items():
        common = [t for t, _ in types.most_common(TYPES_SHOWN)]
        text = " | ".join(common) + (" | ..." if len(types) > TYPES_SHOWN else "")
        missing = count - sum(types.values())
        out.append((key, text + (f" (missing in {missing} rows)" if missing else "")))
    return out


class JsonLinesRows:
    """A JSON Lines file: one JSON object a line; blank lines are skipped; a row is named by its line."""

    kind = "jsonl"

    def __init__(self, path: Path) -> None:
        self.path = path
        self._starts, self._lengths, self._lines = array("q"), array("q"), array("q")
        try:
            # rows are read again from this descriptor, closed when the source is dropped
            self._fd = os.open(path, os.O_RDONLY)
            weakref.finalize(self, os.close, self._fd)
            offset = 0
            with open(self._fd, "rb", closefd=False) as lines:
                for lineno, line in enumerate(lines, start=1):
                    if line.strip():
                        self._starts.append(offset)
                        self._lengths.append(len(line))
                        self._lines.append(lineno)
                    offset += len(line)
        except OSError as exc:
            raise DatasetError(f"{path}: cannot read dataset file ({exc.strerror or exc})") from None
        self.columns: list[str] | None = None  # rows need not share fields

    def __len__(self) -> int:
        return len(self._starts)

    def where(self, index: int) -> str:
        return f"{self.path}:{self._lines[index]}"

    def row(self, index: int) -> Any:
        return _decode(os.pread(self._fd, self._lengths[index], self._starts[index]))

    def scan(self) -> Iterator[tuple[int, Any]]:
        for index in range(len(self)):
            try:
                yield index, self.row(index)
            except RecordError as exc:
                yield index, exc

    def fields(self) -> list[tuple[str, str]]:
        return field_types((row for _, row in self.scan()), len(self))


class JsonArrayRows:
    """A JSON document holding an array of objects; a row is named by its position in the array."""

    kind = "json"

    def __init__(self, path: Path) -> None:
        self.path = path
        try:
            raw = path.read_bytes()
        except OSError as exc:
            raise DatasetError(f"{path}: cannot read dataset file ({exc.strerror or exc})") from None
        try:
            document = json.loads(raw.decode("utf-8-sig"))
        except UnicodeDecodeError as exc:
            line = raw.count(b"\n", 0, exc.start) + 1
            raise DatasetError(f"{path}:{line}: not valid UTF-8 ({exc.reason})") from None
        except json.JSONDecodeError as exc:
            where = f"{path}:{exc.lineno}"
            raise DatasetError(f"{where}: invalid JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(document, list):
            raise DatasetError(f"{path}: expected a JSON array of objects, got {type(document).__name__}")
        self._rows: list[Any] = document
        self.columns: list[str] | None = None

    def __len__(self) -> int:
        return len(self._rows)

    def where(self, index: int) -> str:
        return f"{self.path}: row {index}"

    def row(self, index: int) -> Any:
        return self._rows[index]

    def scan(self) -> Iterator[tuple[int, Any]]:
        return enumerate(self._rows)

    def fields(self) -> list[tuple[str, str]]:
        return field_types(iter(self._rows), len(self))
