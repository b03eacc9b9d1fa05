"""Where a measured figure came from: the command, the commit and the machine, stamped into its artifact.

Every artifact committed under docs/ (bench.json, accuracy.json, soak.json, ...) carries a `provenance`
object made here, so any number in README.md or docs/ can be traced to the command that produced it and
the code it ran: `{"command", "commit", "dirty", "date", "machine": {"cpus", "platform", "python",
"load_avg_1m"}}`. `dirty` says the code had uncommitted changes when it ran (such a figure is not
reproducible from the commit alone; edits to README.md and docs/ do not count). Knows nothing of what
was measured; never fails for lack of git.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import os
import platform
import shlex
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]


def _git(*args: str) -> str:
    try:
        out = subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def commit() -> tuple[str, bool]:
    """(HEAD's full hash or "unknown", whether tracked code differs from it). Documentation and the
    committed measurements (README.md, docs/) do not count: rerunning one measurement rewrites docs/,
    which says nothing about the code the next one runs."""
    head = _git("rev-parse", "HEAD") or "unknown"
    if head == "unknown":
        return head, False
    changed = _git("status", "--porcelain", "--untracked-files=no", "--", ".", ":!docs", ":!README.md")
    return head, bool(changed)


def package_version(name: str) -> str | None:
    """An installed package's version, read from its metadata (nothing is imported)."""
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def machine() -> dict[str, Any]:
    """Where it ran: cores, platform, Python, torch, and how busy the machine was (1-minute load)."""
    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "torch": package_version("torch"),
        "load_avg_1m": round(os.getloadavg()[0], 2),
    }


def own_command() -> list[str]:
    """This process's command line as a user would type it: `april ...` or `python benchmarks/x.py ...`."""
    program = Path(sys.argv[0])
    if program.name == "april":
        return ["april", *sys.argv[1:]]
    if program.suffix == ".py":
        shown = program.resolve()
        shown = shown.relative_to(REPO) if shown.is_relative_to(REPO) else shown
        return ["python", str(shown), *sys.argv[1:]]
    return [sys.argv[0], *sys.argv[1:]]


def provenance(command: Sequence[str] | str | None = None) -> dict[str, Any]:
    """The stamp for an artifact made now by `command` (default: this process's own command line)."""
    if command is None:
        command = own_command()
    text = command if isinstance(command, str) else shlex.join(command)
    head, dirty = commit()
    return {
        "command": text,
        "commit": head,
        "dirty": dirty,
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": machine(),
    }
