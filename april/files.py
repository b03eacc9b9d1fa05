"""Small file helpers shared by roles and benchmarks: content hashes, atomic replacement (of text and of
JSON documents), durable renames and reading JSON-lines files (metrics.jsonl, eval.jsonl)."""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's bytes, read in 1 MiB chunks."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def fsync_dir(directory: Path) -> None:
    """Make a rename or a new file in `directory` survive a power loss."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_text_atomic(path: Path, text: str) -> None:
    """Replace `path` with `text` (UTF-8) atomically: a temp file in the same folder, then os.replace, so
    a reader (or a crash) sees the old file or the new one, never half of one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_json(path: Path, doc: Any, indent: int = 2) -> None:
    """Replace `path` with `doc` as indented JSON and a final newline, atomically (`write_text_atomic`)."""
    write_text_atomic(path, json.dumps(doc, indent=indent) + "\n")


def read_jsonl(path: Path, growing: bool = False) -> list[dict[str, Any]]:
    """The JSON lines of a file ([] when it does not exist). `growing`: the file may still be written, so
    a line that does not parse (a torn last line) is skipped instead of raising."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.strip():
            continue
        try:
            out.append(json.loads(line))
        except ValueError:
            if not growing:
                raise
    return out
