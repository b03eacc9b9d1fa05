"""What a dataset path is, told by its content, not its name, and its rows opened accordingly.

A file starting with Parquet's magic bytes (PAR1) is Parquet; with Arrow's (ARROW1, or an IPC stream's
0xFFFFFFFF continuation marker, as in a `datasets` .arrow file) is Arrow; text whose first non-blank
character is "[" is a JSON array of objects; other text is JSON Lines. A directory with state.json and
dataset_info.json is one `Dataset.save_to_disk`; with dataset_dict.json it is a `DatasetDict`, whose
one split is read, or, with several, one of which must be named by its directory (DIR/train).
Anything else is a `DatasetError` saying what was expected.

`Rows` is what every format gives `april.data.file_source`: a count, the rows by position as Python
values, and where each row is (file:line, or "row N").
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, Protocol

from april.data.arrow_rows import (
    DICT_FILE,
    INFO_FILE,
    STATE_FILE,
    read_arrow,
    read_parquet,
    read_saved_dataset,
    saved_splits,
)
from april.data.fields import RecordFields
from april.data.json_rows import JsonArrayRows, JsonLinesRows
from april.data.records import DatasetError

HEAD_BYTES = 4096  # read to tell a file's format
PARQUET_MAGIC = b"PAR1"
ARROW_FILE_MAGIC = b"ARROW1"
ARROW_STREAM_MARKER = b"\xff\xff\xff\xff"  # an IPC stream's first message starts with it
BOM = b"\xef\xbb\xbf"
EXPECTED = "JSON Lines, a JSON array, Parquet, Arrow, or a `datasets` save_to_disk directory"
_CONTROL = bytes(range(9)) + bytes(range(14, 32))  # control bytes that no JSON text starts with


class Rows(Protocol):
    path: Path
    kind: str  # jsonl | json | parquet | arrow | hf-dataset
    columns: list[str] | None  # the top-level fields every row has (columnar formats); None for JSON

    def __len__(self) -> int: ...
    def where(self, index: int) -> str: ...
    def row(self, index: int) -> Any: ...  # RecordError when the row cannot be decoded
    def scan(self) -> Iterator[tuple[int, Any]]: ...  # (index, row or the RecordError decoding it)
    def fields(self) -> list[tuple[str, str]]: ...  # (field, type) for `april data inspect`


def open_rows(path: Path, fields: RecordFields) -> Rows:
    """The rows of the dataset at `path`, in the format its content says."""
    if path.is_dir():
        return _open_directory(path, fields)
    try:
        with path.open("rb") as f:
            head = f.read(HEAD_BYTES)
    except OSError as exc:
        raise DatasetError(f"{path}: cannot read dataset file ({exc.strerror or exc})") from None
    if head.startswith(PARQUET_MAGIC):
        return read_parquet(path, fields)
    if head.startswith(ARROW_FILE_MAGIC):
        return read_arrow(path, fields, stream=False)
    if head.startswith(ARROW_STREAM_MARKER):
        return read_arrow(path, fields, stream=True)
    text = head.removeprefix(BOM).lstrip()
    if text.startswith(b"["):
        return JsonArrayRows(path)
    first = text[:1]
    if b"\x00" in head or (first and first in _CONTROL):
        raise DatasetError(f"{path}: not a dataset file (it starts with {head[:8]!r}); expected {EXPECTED}")
    return JsonLinesRows(path)


def _open_directory(path: Path, fields: RecordFields) -> Rows:
    if (path / DICT_FILE).is_file():
        splits = saved_splits(path)
        if not splits:
            raise DatasetError(f"{path}: dataset is empty ({DICT_FILE} lists no splits)")
        if len(splits) == 1:
            return _open_directory(path / splits[0], fields)
        named = " or ".join(str(path / s) for s in splits)
        raise DatasetError(f"{path}: a DatasetDict with {len(splits)} splits: name one's directory, {named}")
    if (path / STATE_FILE).is_file() and (path / INFO_FILE).is_file():
        return read_saved_dataset(path, fields)
    hint = next((p for pattern in ("*.*", "*/*.*") for p in sorted(path.glob(pattern)) if _is_data(p)), None)
    where = f"; it holds {hint}: name that file" if hint else ""
    raise DatasetError(
        f"{path}: a directory that is not a saved dataset (no {STATE_FILE} and {INFO_FILE}, nor "
        f"{DICT_FILE}){where}; expected {EXPECTED}"
    )


def _is_data(path: Path) -> bool:
    return path.is_file() and path.suffix in {".parquet", ".jsonl", ".arrow"}
