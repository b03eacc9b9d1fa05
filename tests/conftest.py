"""Shared fixtures: a process cluster (broker + scripted peers) on free loopback ports."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from harness import Cluster


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
