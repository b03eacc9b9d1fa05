"""Rows of Arrow datasets, read with pyarrow alone: a Parquet file, an Arrow IPC file or stream, and a
directory written by Hugging Face `datasets`' `save_to_disk` (its state.json lists the Arrow stream
files that hold the rows, in order).

Only the columns a record can use are read: the top-level fields the prompt and the answer come from,
and the scalar fields that become metadata (other nested or binary columns are left out). A Parquet file
is decoded once into memory (columnar, about the size of those columns uncompressed); Arrow files are
memory-mapped, not read. A row becomes Python values (structs as dicts, lists as lists) when it is
needed; whether it makes a record is `april.data.fields`' business. pyarrow is imported when a file is
opened, never at import time.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from april.data.fields import RecordFields
from april.data.records import DatasetError

BATCH_ROWS = 1024  # rows turned into Python values at a time when every row is read
STATE_FILE = "state.json"  # save_to_disk's list of data files (and format state)
INFO_FILE = "dataset_info.json"  # save_to_disk's features and description
DICT_FILE = "dataset_dict.json"  # DatasetDict.save_to_disk's list of splits, each in its own directory


def _pyarrow(path: Path) -> Any:
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError as exc:
        raise DatasetError(
            f"{path}: reading it needs pyarrow, which this Python lacks ({exc}); expected pyarrow installed "
            "(pip install pyarrow), or the rows as JSON Lines, which need nothing"
        ) from None
    return pyarrow


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class ArrowRows:
    """An Arrow table's rows; a row is named by its position (0-based)."""

    def __init__(self, path: Path, kind: str, table: Any, schema: Any) -> None:
        self.path, self.kind = path, kind
        self._table = table  # pyarrow.Table of the used columns
        self._columns = [(name, table.column(name)) for name in table.column_names]
        self._schema = schema  # the whole schema, for `fields` and `columns`
        self.columns: list[str] | None = list(schema.names)

    def __len__(self) -> int:
        return int(self._table.num_rows)

    def where(self, index: int) -> str:
        return f"{self.path}: row {index}"

    def row(self, index: int) -> Any:
        # one value a column: about half the cost of slicing a one-row table and converting it
        return {name: column[index].as_py() for name, column in self._columns}

    def scan(self) -> Iterator[tuple[int, Any]]:
        index = 0
        for batch in self._table.to_batches(max_chunksize=BATCH_ROWS):
            for row in batch.to_pylist():
                yield index, row
                index += 1

    def fields(self) -> list[tuple[str, str]]:
        return [(field.name, str(field.type)) for field in self._schema]


def used_columns(pa: Any, schema: Any, fields: RecordFields) -> list[str]:
    """The columns a record can use: the prompt's and the answer's, and the scalar ones (metadata)."""
    types = pa.types
    return [
        f.name
        for f in schema
        if f.name in fields.top_keys
        or not (types.is_nested(f.type) or types.is_binary(f.type) or types.is_large_binary(f.type))
    ]


def read_parquet(path: Path, fields: RecordFields) -> ArrowRows:
    pa = _pyarrow(path)
    try:
        parquet = pa.parquet.ParquetFile(path)
        schema = parquet.schema_arrow
        table = parquet.read(columns=used_columns(pa, schema, fields))
    except (pa.ArrowException, OSError) as exc:
        raise DatasetError(f"{path}: cannot read Parquet ({_first_line(exc)})") from None
    pa.default_memory_pool().release_unused()  # decoding's buffers: 50 MB more resident for 100k rows
    return ArrowRows(path, "parquet", table, schema)


def _read_ipc(pa: Any, path: Path, stream: bool) -> Any:
    """The table in an Arrow IPC stream or file, memory-mapped (zero-copy)."""
    try:
        source = pa.memory_map(str(path))
        reader = pa.ipc.open_stream(source) if stream else pa.ipc.open_file(source)
        return reader.read_all()
    except (pa.ArrowException, OSError) as exc:
        raise DatasetError(f"{path}: cannot read Arrow ({_first_line(exc)})") from None


def read_arrow(path: Path, fields: RecordFields, *, stream: bool) -> ArrowRows:
    pa = _pyarrow(path)
    table = _read_ipc(pa, path, stream)
    return ArrowRows(path, "arrow", table.select(used_columns(pa, table.schema, fields)), table.schema)


def read_saved_dataset(directory: Path, fields: RecordFields) -> ArrowRows:
    """A `Dataset.save_to_disk` directory: the Arrow stream files state.json lists, in its order."""
    state_path = directory / STATE_FILE
    try:
        state = json.loads(state_path.read_text(encoding="utf-8"))
        names = [entry["filename"] for entry in state["_data_files"]]
    except OSError as exc:
        raise DatasetError(f"{state_path}: cannot read ({exc.strerror or exc})") from None
    except (ValueError, TypeError, KeyError) as exc:
        raise DatasetError(
            f"{state_path}: expected save_to_disk's state with a '_data_files' list of {{'filename'}} "
            f"({type(exc).__name__}: {_first_line(exc)})"
        ) from None
    pa = _pyarrow(directory)
    tables = [_read_ipc(pa, directory / str(name), stream=True) for name in names]
    if not tables:
        raise DatasetError(f"{directory}: dataset is empty (state.json lists no data files)")
    try:
        table = pa.concat_tables(tables)
    except pa.ArrowException as exc:
        problem = _first_line(exc)
        raise DatasetError(f"{directory}: its data files do not share one schema ({problem})") from None
    used = table.select(used_columns(pa, table.schema, fields))
    return ArrowRows(directory, "hf-dataset", used, table.schema)


def saved_splits(directory: Path) -> list[str]:
    """The splits a `DatasetDict.save_to_disk` directory lists in dataset_dict.json."""
    path = directory / DICT_FILE
    try:
        splits = json.loads(path.read_text(encoding="utf-8"))["splits"]
    except OSError as exc:
        raise DatasetError(f"{path}: cannot read ({exc.strerror or exc})") from None
    except (ValueError, TypeError, KeyError) as exc:
        problem = f"{type(exc).__name__}: {_first_line(exc)}"
        raise DatasetError(f"{path}: expected a 'splits' list ({problem})") from None
    if not isinstance(splits, list) or not all(isinstance(s, str) for s in splits):
        raise DatasetError(f"{path}: expected 'splits' to be a list of names, got {splits!r}")
    return splits
