"""Replaying the torch engine's decode step as CUDA graphs, one per step shape, or running it eagerly.

Owns the graphs, their shared memory pool and the side stream they are captured on. `capture_all` runs at
the engine's start, over every step shape the engine can take: each shape's step runs eagerly on the side
stream (the warm-up: cuBLAS handles and workspaces are made outside the capture), then is captured, which
records its kernels without running them; serving only replays. The step must therefore read and write
only tensors whose addresses stay fixed (the engine's buffers) and never synchronise with the host. A
capture that fails (an operation that cannot be captured, an old driver) ends that capture, restores the
stream, drops every graph and the pool, and turns graphs off for good, reporting its own error (not the
"capture invalidated" one that ending a broken capture raises); the engine then decodes eagerly with the
same results, and says so from its start. Does not know what the step computes.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Hashable, Iterable, Iterator
from typing import Any

import torch

log = logging.getLogger(__name__)


def graphs_supported(device: torch.device) -> bool:
    return device.type == "cuda"


def capture(step: Callable[[], None], pool: Any, stream: Any) -> Any:
    """A new graph of `step` (nothing runs), its memory from `pool`, captured on `stream`."""
    graph = torch.cuda.CUDAGraph()
    record(graph, step, pool, torch.cuda.stream(stream))
    return graph


def record(
    graph: Any, step: Callable[[], None], pool: Any, on_stream: contextlib.AbstractContextManager[Any]
) -> None:
    """Capture `step` into `graph` inside `on_stream` (the capture stream made current, restored on exit).

    `torch.cuda.graph` ends a capture in its `__exit__` before it restores the stream: when the step fails
    mid-capture, ending the broken capture raises ("operation failed due to a previous error during
    capture"), that error replaces the step's own, and the capture stream stays current. Here the stream
    is restored whatever happens and the step's own error is raised."""
    with on_stream:
        graph.capture_begin(pool=pool, capture_error_mode="thread_local")
        try:
            step()
        except BaseException:
            with contextlib.suppress(Exception):  # the stream must leave capture mode; its error is secondary
                graph.capture_end()
            raise
        graph.capture_end()


class StepGraphs:
    """Runs a step for a key: replays its graph, or runs it eagerly (no graph for it, or graphs off)."""

    def __init__(self, device: torch.device, enabled: bool) -> None:
        self.device = device
        self.enabled = enabled and graphs_supported(device)
        self.failure = ""  # why capture failed, one line; graphs are off once it is set
        self._graphs: dict[Hashable, Any] = {}
        self._pool: Any = None  # the memory pool every graph captures into (a new one after `clear`)
        self._stream: Any = None

    def capture_all(
        self, keys: Iterable[Hashable], step_for: Callable[[Hashable], Callable[[], None]]
    ) -> None:
        """Warm up and capture the step of every key (at start: serving then never captures). The first
        failure turns graphs off and drops what was captured."""
        if not self.enabled:
            return
        try:
            with self._on_capture_stream():
                for key in keys:
                    step = step_for(key)
                    step()  # the warm-up, eager
                    self._graphs[key] = capture(step, self._pool, self._stream)
        except Exception as exc:  # any failure to capture means: decode eagerly
            self._give_up(exc)

    def run(self, key: Hashable, step: Callable[[], None]) -> None:
        graph = self._graphs.get(key)
        if graph is not None:
            graph.replay()
        else:
            step()

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
        """Drop every graph and their pool: a later capture starts a new pool, with no blocks left over."""
        self._graphs.clear()
        self._pool = None

    @contextlib.contextmanager
    def _on_capture_stream(self) -> Iterator[None]:
        """Run on the stream captures are made on, ordered after the current stream's work and before it."""
        if self.device.type != "cuda":
            yield
            return
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self.device)  # type: ignore[no-untyped-call]
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        current = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(current)
        try:
            with torch.cuda.stream(self._stream):
                yield
        finally:
            current.wait_stream(self._stream)

    def _give_up(self, exc: BaseException) -> None:
        lines = str(exc).strip().splitlines()
        self.failure = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
        self.enabled = False
        self.clear()
        log.warning("torch engine: CUDA graph capture failed, decoding eagerly: %s", self.failure)
