"""The `gpu-tests` phase: the suite's `gpu`-marked tests (`pytest -m gpu`), one outcome a test.

Only the test files that mark a test `gpu` are collected: the GPU image lacks packages that other test
files import at the top (uvicorn, ...), and collecting them would fail the run for nothing. Outcomes and
skip reasons come from pytest's JUnit XML. A failing or erroring test is this phase's error; skipped
tests are not (each says why: no second GPU, no SGLang, ...).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

from gpu.record import PhaseRecord

REPO = Path(__file__).resolve().parents[2]


def gpu_test_files() -> list[Path]:
    return [p for p in sorted((REPO / "tests").glob("test_*.py")) if "pytest.mark.gpu" in p.read_text()]


def outcomes(junit: Path) -> list[dict[str, str]]:
    rows = []
    for case in ET.parse(junit).getroot().iter("testcase"):
        test = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome, message = "passed", ""
        for kind in ("failure", "error", "skipped"):
            found = case.find(kind)
            if found is not None:
                outcome = {"failure": "failed"}.get(kind, kind)
                message = (
                    (found.get("message") or "").strip().splitlines()[0][:300] if found.get("message") else ""
                )
                break
        rows.append({"test": test, "outcome": outcome, "message": message})
    return rows


def run(params: dict[str, Any], record: PhaseRecord) -> None:
    files = gpu_test_files()
    record.put("files", [str(p.relative_to(REPO)) for p in files])
    with tempfile.TemporaryDirectory(prefix="april-gpu-tests-") as tmp:
        junit = Path(tmp) / "junit.xml"
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, (str(REPO), os.environ.get("PYTHONPATH")))),
        }
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-m",
                "gpu",
                "-q",
                "-rs",
                "-p",
                "no:cacheprovider",
                f"--junitxml={junit}",
                *map(str, files),
            ],
            cwd=REPO,
            env=env,
            check=False,
        )
        rows = outcomes(junit) if junit.exists() else []
    counts = {k: sum(r["outcome"] == k for r in rows) for k in ("passed", "failed", "error", "skipped")}
    record.put("pytest_exit_code", done.returncode)
    record.put("counts", counts)
    record.put("tests", rows)
    bad = [r["test"] for r in rows if r["outcome"] in ("failed", "error")]
    if bad or done.returncode not in (0, 5):  # 5: nothing collected
        raise RuntimeError(
            f"pytest -m gpu exited {done.returncode}; failed: {', '.join(bad) or 'none named'}"
        )
