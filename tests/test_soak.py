"""The soak of benchmarks/soak.py as a slow-marked test: a whole run (real broker, sim workers, the real
learner on the tiny model) under random SIGKILLs, then the books. `APRIL_SOAK_S` sets the duration
(default 1800 s: workers killed every minute, learner and broker every ten)."""

from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

SOAK = Path(__file__).resolve().parents[1] / "benchmarks" / "soak.py"


@pytest.mark.slow
@pytest.mark.timeout(0)  # as long as APRIL_SOAK_S asks (30 minutes unless told)
def test_soak_under_random_kills(tmp_path: Path) -> None:
    spec = importlib.util.spec_from_file_location("soak", SOAK)
    assert spec is not None and spec.loader is not None
    soak = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(soak)
    duration = os.environ.get("APRIL_SOAK_S", "1800")
    assert soak.main(["--duration-s", duration, "--out", str(tmp_path / "soak")]) == 0


@pytest.mark.slow
@pytest.mark.timeout(0)
def test_soak_of_episodes_under_random_kills(tmp_path: Path) -> None:
    """The same with episodes whose steps have effects (benchmarks/envs/step_ledger.py), the broker at the
    default snapshot interval and killed every minute: no step it had on disk when killed runs again."""
    spec = importlib.util.spec_from_file_location("soak", SOAK)
    assert spec is not None and spec.loader is not None
    soak = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(soak)
    duration = os.environ.get("APRIL_SOAK_S", "1800")
    args = ["--duration-s", duration, "--episodes", "--broker-every", "60", "--out", str(tmp_path / "soak")]
    assert soak.main(args) == 0
