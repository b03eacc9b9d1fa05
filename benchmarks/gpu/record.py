"""What one phase of the GPU check has measured so far, kept on disk as it goes.

A phase runs in a child process that the check may kill at its timeout; every `put` rewrites the phase's
result file (atomically), so what was measured before the kill survives it. `error` records a part that
failed while the phase goes on; `skip` says why the phase measured nothing (a variant the code does not
have yet). The parent reads the file whatever the child's fate. Knows nothing of what is measured.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


class PhaseSkipped(Exception):
    """The phase cannot run here, for a reason that is not a fault (e.g. a variant not in this code)."""


class PhaseRecord:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.result: dict[str, Any] = {}
        self.errors: list[str] = []
        self.skipped = ""
        self.save()

    def put(self, key: str, value: Any) -> None:
        self.result[key] = value
        self.save()

    def error(self, what: str, exc: BaseException) -> None:
        text = str(exc).strip().splitlines()
        self.errors.append(f"{what}: {type(exc).__name__}: {text[0] if text else ''}".rstrip(": "))
        self.save()

    def skip(self, reason: str) -> None:
        self.skipped = reason
        self.save()

    def save(self) -> None:
        doc = {"result": self.result, "errors": self.errors, "skipped": self.skipped}
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
        os.replace(tmp, self.path)


def read_record(path: Path) -> dict[str, Any]:
    """The last state a phase saved (an empty record if it never started writing)."""
    try:
        doc: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {"result": {}, "errors": [], "skipped": ""}
    return doc
