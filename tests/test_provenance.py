"""The provenance stamp every committed measurement carries (april/provenance.py)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from april.provenance import own_command, provenance

REPO = Path(__file__).resolve().parents[1]


def test_a_stamp_names_the_command_the_commit_and_the_machine() -> None:
    stamp = provenance(["april", "bench", "--out", "my dir"])
    assert stamp["command"] == "april bench --out 'my dir'"  # as a shell would take it back
    assert re.fullmatch(r"[0-9a-f]{40}", stamp["commit"]) and isinstance(stamp["dirty"], bool)
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\dZ", stamp["date"])
    assert stamp["machine"]["cpus"] >= 1 and stamp["machine"]["load_avg_1m"] >= 0
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout
    assert stamp["commit"] == head.strip()


def test_a_script_names_itself_as_a_reader_would_type_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", [str(REPO / "benchmarks" / "soak.py"), "--duration-s", "60"])
    assert own_command() == ["python", "benchmarks/soak.py", "--duration-s", "60"]
    monkeypatch.setattr(sys, "argv", ["/somewhere/.venv/bin/april", "up", "--headless"])
    assert own_command() == ["april", "up", "--headless"]
