"""The torch engine's decode step as CUDA graphs (`actors.engines.cuda_graphs`).

On CPU, with the decode shapes bucketed as on CUDA and the capture replaced: every step shape is captured
at the engine's start and serving only replays, over buffers that never move; a capture that fails leaves
the engine decoding eagerly from its start, says so once (log and `placement`) and gives the recorded
outputs (tests/data/torch_engine_golden.json); a stand-in graph that re-runs the step it captured gives the
recorded outputs too and is not replayed for a step wider than the one it was captured for. With torch's
stream and graph calls recorded (no CUDA here): a step that fails mid-capture leaves the stream as it was
and is reported by its own error, and graphs captured after `clear` go into a new memory pool.
Marked `gpu` (deselected by default; they skip without CUDA): on CUDA, graph replay gives the same
tokens and log-probs as the eager step for every scripted case, and a replayed step synchronises with
the host exactly once (reading its tokens).
"""

from __future__ import annotations

import contextlib
import logging
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from engine_script import CASES, REPO, Case, assert_same, build, golden, prompt, replay  # noqa: E402

from actors.engine import GenerationRequest, SamplingParams, run_to_completion  # noqa: E402
from actors.engines import cuda_graphs  # noqa: E402
from actors.engines.torch_engine import TorchEngine  # noqa: E402

LOGPROB_ATOL = 1e-5
BY_NAME = {c.name: c for c in CASES}


def need_cuda() -> None:
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device (torch.cuda.is_available() is False)")


def buffer_addresses(engine: TorchEngine) -> list[int]:
    """Where every buffer a decode step reads or writes lives: what a captured graph has baked in."""
    kv = engine._kv
    tensors = [kv.kv, kv.pos, kv._mask, kv._cols, engine._next, engine._live, engine._greedy_rows,
               engine._noise, engine._out]  # fmt: skip
    return [t.data_ptr() if t is not None else 0 for t in tensors]


def test_a_failed_capture_goes_eager_from_the_start_says_so_once_and_keeps_the_outputs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Every shape is captured at start, so a capture that fails does so before the engine serves: its
    placement (what the worker reports once, when the engine is built) already says eager, and why."""
    tries: list[int] = []

    def fail(step: Callable[[], None], pool: Any, stream: Any) -> Any:
        tries.append(1)
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing\nCUDA kernel errors")

    monkeypatch.setattr(cuda_graphs, "graphs_supported", lambda device: True)
    monkeypatch.setattr(cuda_graphs, "capture", fail)
    case = BY_NAME["qwen3-sampled"]
    with caplog.at_level(logging.WARNING, logger=cuda_graphs.__name__):
        engine, weights = build(case, tmp_path, bucketed=True)
        reason = "RuntimeError: CUDA error: operation not permitted when stream is capturing"
        assert engine.placement == f"cpu, eager (graph capture failed: {reason})"  # before any step
        outputs = replay(engine, case.script, weights)
    assert_same(outputs, golden()[case.name], LOGPROB_ATOL)
    assert tries == [1]  # never tried again
    assert engine.placement == f"cpu, eager (graph capture failed: {reason})"
    assert engine.captured_graphs == 0
    said = [r.getMessage() for r in caplog.records if "capture failed" in r.getMessage()]
    assert len(said) == 1 and reason in said[0], said


class StandInGraph:
    """On CPU, what a CUDA graph does: replay the step it captured (its shape fixed at capture), over the
    buffers it was captured on: a replay over reallocated buffers fails the test."""

    replays = 0
    captures = 0

    def __init__(self, step: Callable[[], None], engine: TorchEngine) -> None:
        StandInGraph.captures += 1
        self.step, self.engine, self.addresses = step, engine, buffer_addresses(engine)

    def replay(self) -> None:
        assert buffer_addresses(self.engine) == self.addresses, "a graph replayed over reallocated buffers"
        StandInGraph.replays += 1
        self.step()


def stand_in_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Graphs "supported" on the CPU and captured as stand-ins of the engine whose steps they are (the
    engine's `_step_of`, handed to `capture_all` in its constructor)."""
    monkeypatch.setattr(cuda_graphs, "graphs_supported", lambda device: True)
    monkeypatch.setattr(StandInGraph, "replays", 0)
    monkeypatch.setattr(StandInGraph, "captures", 0)
    capture_all = cuda_graphs.StepGraphs.capture_all

    def with_stand_ins(graphs: Any, keys: Any, step_for: Any) -> None:
        engine = step_for.__self__
        monkeypatch.setattr(cuda_graphs, "capture", lambda step, pool, stream: StandInGraph(step, engine))
        capture_all(graphs, keys, step_for)

    monkeypatch.setattr(cuda_graphs.StepGraphs, "capture_all", with_stand_ins)


@pytest.mark.parametrize("name", ["tiny-sampled", "qwen3-topk"])
def test_every_shape_is_captured_at_start_and_serving_only_replays_over_the_same_buffers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    case = BY_NAME[name]
    engine, weights = build(case, tmp_path, bucketed=True)
    assert engine.placement == "cpu" and engine.captured_graphs == 0 and engine.cache_plan is None
    stand_in_graphs(monkeypatch)
    engine, weights = build(case, tmp_path, bucketed=True)
    shapes = engine._step_shapes()
    assert engine.captured_graphs == StandInGraph.captures == len(shapes)
    assert engine.cache_plan is not None and engine.cache_plan.columns == engine.context
    assert sorted({r for r, _ in shapes}) == {4: [1, 2, 4], 5: [1, 2, 4, 5]}[case.slots]
    assert max(c for _, c in shapes) == engine.context and min(c for _, c in shapes) == 64
    addresses = buffer_addresses(engine)
    outputs = replay(engine, case.script, weights)
    assert_same(outputs, golden()[case.name], LOGPROB_ATOL)
    assert engine.placement == "cpu, cuda graphs" and engine.captured_graphs == len(shapes)
    assert StandInGraph.captures == len(shapes)  # none while serving
    assert StandInGraph.replays > 20 and buffer_addresses(engine) == addresses  # never reallocated


def test_a_step_shape_that_grows_back_within_the_capacity_replays_its_own_graph(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A long row makes steps 128 columns wide and leaves; the short row left is decoded over 64 columns
    (that shape's graph), then grows past 64: the 128-column graph, not a replay of the 64-column one,
    which would not see its first tokens."""
    tiny, sampling = REPO / "models" / "tiny", SamplingParams(temperature=0.7)
    requests = [GenerationRequest(0, prompt(0, 100), 1), GenerationRequest(1, prompt(1, 50), 30)]
    eager = TorchEngine(tiny, slots=2, sampling=sampling, greedy=True, bucketed=True)
    want = {o.request_id: o for o in run_to_completion(eager, requests)}
    stand_in_graphs(monkeypatch)
    engine = TorchEngine(tiny, slots=2, sampling=sampling, greedy=True, bucketed=True)
    assert engine._step_shapes() == [(r, c) for r in (1, 2) for c in (64, 128, 256, 512, 1024)]
    got = {o.request_id: o for o in run_to_completion(engine, requests)}
    assert engine.captured_graphs == StandInGraph.captures == 10
    assert got[1].token_ids.tolist() == want[1].token_ids.tolist()
    np.testing.assert_allclose(got[1].logprobs, want[1].logprobs, atol=LOGPROB_ATOL, rtol=0)


class FakeGraph:
    """torch.cuda.CUDAGraph's capture calls as torch/cuda/graphs.py has them (`capture_begin(pool=...,
    capture_error_mode=...)`, `capture_end()`): ending a capture that an operation broke raises CUDA's
    secondary error, which is what torch.cuda.graph's __exit__ then reports instead of the cause."""

    def __init__(self, events: list[str]) -> None:
        self.events = events
        self.broken = False

    def capture_begin(self, pool: Any = None, capture_error_mode: str = "global") -> None:
        self.events.append(f"begin pool={pool} mode={capture_error_mode}")

    def capture_end(self) -> None:
        self.events.append("end")
        if self.broken:
            raise RuntimeError("CUDA error: operation failed due to a previous error during capture")

    def replay(self) -> None:
        self.events.append("replay")


class FakeStream:
    def __init__(self, events: list[str], name: str) -> None:
        self.events, self.name = events, name

    def wait_stream(self, other: FakeStream) -> None:
        self.events.append(f"{self.name} waits for {other.name}")


def fake_cuda(monkeypatch: pytest.MonkeyPatch, events: list[str]) -> list[str]:
    """torch.cuda's stream and graph calls that StepGraphs makes, recorded; returns the current-stream
    stack (what `torch.cuda.stream(s)` pushes on entry and pops on exit)."""
    current = ["default"]
    pools = iter(range(1, 100))

    @contextlib.contextmanager
    def stream(s: FakeStream) -> Iterator[None]:
        current.append(s.name)
        try:
            yield
        finally:
            current.pop()

    monkeypatch.setattr(torch.cuda, "Stream", lambda device: FakeStream(events, "side"))
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device: FakeStream(events, current[-1]))
    monkeypatch.setattr(torch.cuda, "stream", stream)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: f"pool{next(pools)}")
    monkeypatch.setattr(torch.cuda, "CUDAGraph", lambda: FakeGraph(events))
    return current


def test_a_step_that_fails_mid_capture_restores_the_stream_and_reports_its_own_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    events: list[str] = []
    current = fake_cuda(monkeypatch, events)
    graphs = cuda_graphs.StepGraphs(torch.device("cuda"), enabled=True)
    capturing: list[FakeGraph] = []
    real_begin = FakeGraph.capture_begin

    def begin(self: FakeGraph, pool: Any = None, capture_error_mode: str = "global") -> None:
        capturing.append(self)
        real_begin(self, pool, capture_error_mode)

    monkeypatch.setattr(FakeGraph, "capture_begin", begin)

    def step_for(key: Any) -> Callable[[], None]:
        def step() -> None:
            if key == "b" and capturing and capturing[-1].events[-1].startswith("begin"):
                capturing[-1].broken = True  # what CUDA does to a capture an operation broke
                raise RuntimeError("a host read while capturing: x.item()")

        return step

    graphs.capture_all(["a", "b", "c"], step_for)
    assert graphs.failure == "RuntimeError: a host read while capturing: x.item()"  # the cause
    assert current == ["default"]  # the side stream is no longer current
    assert graphs.count == 0 and not graphs.enabled and graphs._pool is None
    assert events.count("end") == 2  # the broken capture was ended too: its stream left capture mode
    assert graphs.describe() == f"eager (graph capture failed: {graphs.failure})"
    ran: list[str] = []
    graphs.run("a", lambda: ran.append("a"))  # eager from now on
    assert ran == ["a"] and "replay" not in events


def test_graphs_dropped_are_captured_again_into_a_new_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    """A pool keeps the blocks of the graphs captured into it; after `clear` nothing may capture into it
    again (torch's allocator asserts on a capture into a pool with surviving blocks): a new pool."""
    events: list[str] = []
    current = fake_cuda(monkeypatch, events)
    graphs = cuda_graphs.StepGraphs(torch.device("cuda"), enabled=True)
    graphs.capture_all(["a", "b"], lambda key: lambda: None)
    assert graphs.count == 2
    graphs.run("a", lambda: pytest.fail("a captured step runs as its graph"))
    assert events[-1] == "replay" and current == ["default"]
    graphs.clear()
    assert graphs.count == 0
    graphs.capture_all(["a"], lambda key: lambda: None)
    pools = [e.split()[1] for e in events if e.startswith("begin")]
    assert pools == ["pool=pool1", "pool=pool1", "pool=pool2"] and graphs.count == 1
    assert "side waits for default" in events and "default waits for side" in events


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES, ids=[c.name for c in CASES])
def test_graph_replay_equals_the_eager_step_on_cuda(case: Case, tmp_path: Path) -> None:
    need_cuda()
    graphs, weights = build(case, tmp_path, device="cuda")
    eager, _ = build(case, tmp_path, device="cuda", cuda_graphs=False)
    got = replay(graphs, case.script, weights)
    want = replay(eager, case.script, weights)
    assert graphs.placement.endswith(", cuda graphs") and graphs.captured_graphs > 0, graphs.placement
    assert eager.placement.endswith(", eager (cuda graphs off)") and eager.captured_graphs == 0
    assert_same(got, want, LOGPROB_ATOL)


@pytest.mark.gpu
def test_a_replayed_decode_step_syncs_with_the_host_once_on_cuda() -> None:
    """bf16 (the default on CUDA), top-k and top-p, a greedy row among sampled ones; no row finishes and
    the shape stays (5 rows in the 8-row bucket, positions under 64), so every step replays one graph."""
    need_cuda()
    sampling = SamplingParams(temperature=0.9, top_k=50, top_p=0.95, seed=1)
    engine = TorchEngine(REPO / "models" / "tiny", slots=8, sampling=sampling, device="cuda")
    engine.add([GenerationRequest(i, prompt(i, 20), 40, greedy=i == 0) for i in range(5)])
    shapes = len(engine._step_shapes())  # (1, 2, 4, 8 rows) x (64, ..., 1024 columns), captured at start
    assert engine.step() == [] and engine.step() == []  # prefill and a replayed step, then another
    assert engine.placement.endswith(", cuda graphs") and engine.captured_graphs == shapes, engine.placement
    steps = 10
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            for _ in range(steps):
                assert engine.step() == []
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [str(w.message) for w in caught if "synchroniz" in str(w.message)]
    assert len(syncs) == steps, syncs  # one a step: the read of its tokens and log-probs
    assert engine.captured_graphs == shapes
    outs = engine.abort()
    assert all(len(o.token_ids) == steps + 2 for o in outs)
    assert all(np.all(o.logprobs <= 0) for o in outs)
