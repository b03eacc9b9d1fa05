"""Replaying the torch engine's decode step as CUDA graphs, one per step shape, or running it eagerly.

Owns the graphs and their shared memory pool. A step shape (its key) is seen first: the step runs
eagerly on the capture stream (the real step, and the warm-up of its capture: cuBLAS handles and
workspaces are made outside the capture), then the same step is captured, which records its kernels
without running them. Later steps of that shape replay the graph. The step must therefore read and write
only tensors whose addresses stay fixed (the engine's buffers) and never synchronise with the host.
A capture that fails (an operation that cannot be captured, an old driver) turns graphs off for good:
the runner logs it once and steps run eagerly from then on, giving the same results. `clear` drops the
graphs when the buffers they read are reallocated. Does not know what the step computes.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Hashable, Iterator
from typing import Any

import torch

log = logging.getLogger(__name__)


def graphs_supported(device: torch.device) -> bool:
    return device.type == "cuda"


def capture(step: Callable[[], None], pool: Any, stream: torch.cuda.Stream) -> torch.cuda.CUDAGraph:
    """Record `step` into a new graph (nothing runs): memory from `pool`, on `stream`."""
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, pool=pool, stream=stream, capture_error_mode="thread_local"):
        step()
    return graph


class StepGraphs:
    """Runs a step for a key: replays its graph, or runs it eagerly (and captures it if graphs are on)."""

    def __init__(self, device: torch.device, enabled: bool) -> None:
        self.device = device
        self.enabled = enabled and graphs_supported(device)
        self.failure = ""  # why capture failed, one line; graphs are off once it is set
        self._graphs: dict[Hashable, torch.cuda.CUDAGraph] = {}
        self._pool: Any = None  # the memory pool every graph captures into
        self._stream: torch.cuda.Stream | None = None

    def run(self, key: Hashable, step: Callable[[], None]) -> None:
        graph = self._graphs.get(key)
        if graph is not None:
            graph.replay()
            return
        if not self.enabled:
            step()
            return
        with self._on_capture_stream():
            step()
        try:
            self._graphs[key] = capture(step, self._pool, self._stream)  # type: ignore[arg-type]
        except Exception as exc:  # any failure to capture means: decode eagerly
            self._give_up(exc)

    @property
    def count(self) -> int:
        """Graphs captured and in use."""
        return len(self._graphs)

    def describe(self) -> str:
        """How steps run: "cuda graphs", "eager (...)", or "" where graphs are not asked or not possible."""
        if self.failure:
            return f"eager (graph capture failed: {self.failure})"
        if self.enabled:
            return "cuda graphs"
        if graphs_supported(self.device):
            return "eager (cuda graphs off)"
        return ""

    def clear(self) -> None:
        """Drop every graph (the buffers they read were reallocated)."""
        self._graphs.clear()

    @contextlib.contextmanager
    def _on_capture_stream(self) -> Iterator[None]:
        """Run on the stream captures are made on, ordered after the current stream's work and before it."""
        if self.device.type != "cuda":
            yield
            return
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self.device)  # type: ignore[no-untyped-call]
            self._pool = torch.cuda.graph_pool_handle()
        current = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(current)
        with torch.cuda.stream(self._stream):
            yield
        current.wait_stream(self._stream)

    def _give_up(self, exc: BaseException) -> None:
        lines = str(exc).strip().splitlines()
        self.failure = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
        self.enabled = False
        self._graphs.clear()
        log.warning("torch engine: CUDA graph capture failed, decoding eagerly from now on: %s", self.failure)
