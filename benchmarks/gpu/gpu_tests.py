"""The `gpu-tests` phase: the suite's `gpu`-marked tests (`pytest -m gpu`), each outcome kept as it comes.

One pytest run over the test files that mark a test `gpu`, the `april up` runs last (`LAST`); the
`gpu.outcome_log` plugin appends each outcome to a file the moment it is known and the phase copies them
into its record as they come, so a phase killed at its timeout keeps every outcome it had and names the
tests that did not get to run. A file that cannot be imported for want of a package the image lacks
(`gpu.image.NOT_CARRIED`: uvicorn, ...) is skipped with that reason, not an error; any other collection
error is one. `COVERED` tests are deselected: another phase of the check runs the same thing. A failing
or erroring test is this phase's error; skipped ones are not (each says why: no second GPU, no SGLang).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gpu.image import NOT_CARRIED
from gpu.record import PhaseRecord

REPO = Path(__file__).resolve().parents[2]
LAST = ("tests/test_gpu.py",)  # whole `april up` runs: after the quick tests
COVERED = {
    "tests/test_gpu.py::test_april_up_on_cuda_with_a_hopper_arch_list[torch]": (
        "the up phase runs april up on CUDA with the torch AdamW learner"
    ),
}
POLL_S = 1.0
RANK = {"passed": 0, "skipped": 1, "failed": 2, "error": 3}  # a test's outcome: the worst of its reports
MISSING = re.compile(r"No module named '([\w.]+)'")


def gpu_test_files() -> list[str]:
    """The test files that mark a test `gpu`, relative to the repository, the `LAST` ones at the end."""
    found = sorted(
        str(p.relative_to(REPO))
        for p in (REPO / "tests").glob("test_*.py")
        if "pytest.mark.gpu" in p.read_text()
    )
    return sorted(found, key=lambda f: f in LAST)


def outcomes(lines: list[dict[str, Any]]) -> tuple[list[dict[str, str]], list[str]]:
    """Per test, its outcome from the log's lines (a collection error for want of a package the image
    lacks is a skip); and the tests collected that have none yet."""
    by_test: dict[str, dict[str, str]] = {}
    collected: list[str] = []
    for line in lines:
        if "collected" in line:
            collected = line["collected"]
            continue
        outcome, message = line["outcome"], line["message"]
        missing = MISSING.search(message) if line["when"] == "collect" else None
        if missing and missing.group(1).split(".")[0] in NOT_CARRIED:
            outcome, message = (
                "skipped",
                f"not collected: it imports {missing.group(1)}, absent on the GPU image",
            )
        seen = by_test.get(line["test"])
        if seen is None or RANK[outcome] > RANK[seen["outcome"]]:
            by_test[line["test"]] = {"test": line["test"], "outcome": outcome, "message": message}
    return list(by_test.values()), [t for t in collected if t not in by_test]


def read_lines(path: Path) -> list[dict[str, Any]]:
    """The log's complete lines (one being written is left for the next read)."""
    if not path.exists():
        return []
    text = path.read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines(keepends=True) if line.endswith("\n")]


def put(record: PhaseRecord, lines: list[dict[str, Any]]) -> list[dict[str, str]]:
    rows, not_run = outcomes(lines)
    counts = {k: sum(r["outcome"] == k for r in rows) for k in ("passed", "failed", "error", "skipped")}
    record.put("counts", {**counts, "not_run": len(not_run)})
    record.put("tests", rows)
    record.put("not_run", not_run)
    return rows


def command(files: list[str], log: Path) -> list[str]:
    deselect = [arg for test in COVERED for arg in ("--deselect", test)]
    return [
        sys.executable,
        "-m",
        "pytest",
        "-m",
        "gpu",
        "-q",
        "-rs",
        "-p",
        "no:cacheprovider",
        "-p",
        "gpu.outcome_log",
        f"--outcome-log={log}",
        "--continue-on-collection-errors",
        *deselect,
        *files,
    ]


def run(params: dict[str, Any], record: PhaseRecord) -> None:
    files = params.get("files") or gpu_test_files()  # given: a test of this phase's own
    record.put("files", files)
    record.put("deselected", COVERED)
    with tempfile.TemporaryDirectory(prefix="april-gpu-tests-") as tmp:
        log = Path(tmp) / "outcomes.jsonl"
        path = (str(REPO), str(REPO / "benchmarks"), os.environ.get("PYTHONPATH"))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, path))}
        proc = subprocess.Popen(command(files, log), cwd=REPO, env=env)
        seen = 0
        while proc.poll() is None:  # the record follows the log, so a kill of this phase loses nothing
            time.sleep(POLL_S)
            lines = read_lines(log)
            if len(lines) != seen:
                seen = len(lines)
                put(record, lines)
        rows = put(record, read_lines(log))
    record.put("pytest_exit_code", proc.returncode)
    bad = [r["test"] for r in rows if r["outcome"] in ("failed", "error")]
    if bad or proc.returncode not in (0, 1, 5):  # 1: failures or collection errors (judged above); 5: none
        raise RuntimeError(
            f"pytest -m gpu exited {proc.returncode}; failed: {', '.join(bad) or 'none named'}"
        )
