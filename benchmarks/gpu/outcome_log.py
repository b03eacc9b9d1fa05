"""A pytest plugin (`-p gpu.outcome_log --outcome-log FILE`): each test's outcome appended to FILE as a
JSON line the moment pytest knows it, flushed, so a run killed halfway leaves every outcome it had.

Lines: {"collected": [node ids]} once collection is done (after `-m` and `--deselect`); then, per report
that settles a test, {"test", "when" (collect, setup, call, teardown), "outcome" (passed, failed, skipped,
error), "message" (one line), "duration_s"}. A file that fails to collect is one "error" line of its own.
Judges nothing: the `gpu-tests` phase reads the file.
"""

from __future__ import annotations

import json
from typing import Any

import pytest


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--outcome-log", default="", help="append each test's outcome to this file (JSON lines)")


def pytest_configure(config: pytest.Config) -> None:
    path = config.getoption("--outcome-log")
    if path:
        config.pluginmanager.register(OutcomeLog(path), "outcome-log")


def _message(report: pytest.CollectReport | pytest.TestReport) -> str:
    """The report's reason in one line: a skip's reason, or the last `E ` line of a failure's text."""
    if report.skipped and isinstance(report.longrepr, tuple):
        return str(report.longrepr[2]).removeprefix("Skipped: ")[:300]
    text = str(report.longrepr or "")
    errors = [line[1:].strip() for line in text.splitlines() if line.startswith("E ")]
    lines = errors or [line.strip() for line in text.splitlines() if line.strip()]
    return lines[-1][:300] if lines else ""


class OutcomeLog:
    def __init__(self, path: str) -> None:
        self.path = path

    def write(self, line: dict[str, Any]) -> None:
        with open(self.path, "a", encoding="utf-8") as sink:
            sink.write(json.dumps(line) + "\n")

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.failed:
            self.write(
                {"test": report.nodeid, "when": "collect", "outcome": "error", "message": _message(report)}
            )

    def pytest_collection_finish(self, session: pytest.Session) -> None:
        self.write({"collected": [item.nodeid for item in session.items]})

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if not (report.when == "call" or report.failed or report.skipped):
            return  # a setup or teardown that passed settles nothing
        outcome = report.outcome if report.when == "call" or report.skipped else "error"
        self.write(
            {
                "test": report.nodeid,
                "when": report.when,
                "outcome": outcome,
                "message": _message(report) if outcome != "passed" else "",
                "duration_s": round(report.duration, 3),
            }
        )
