"""The torch engine's decode step as CUDA graphs (`actors.engines.cuda_graphs`).

On CPU, with the decode shapes bucketed as on CUDA and the capture replaced: a capture that fails leaves
the engine decoding eagerly, says so once (log and `placement`) and gives the recorded outputs
(tests/data/torch_engine_golden.json); a stand-in graph that re-runs the step it captured gives the
recorded outputs too, is never replayed over buffers reallocated after its capture, and is not replayed
for a step wider than the one it was captured for.
Marked `gpu` (deselected by default; they skip without CUDA): on CUDA, graph replay gives the same
tokens and log-probs as the eager step for every scripted case, and a replayed step synchronises with
the host exactly once (reading its tokens).
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
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


def test_a_failed_capture_goes_eager_says_so_once_and_keeps_the_outputs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    tries: list[int] = []

    def fail(step: Callable[[], None], pool: Any, stream: Any) -> Any:
        tries.append(1)
        raise RuntimeError("CUDA error: operation not permitted when stream is capturing\nCUDA kernel errors")

    monkeypatch.setattr(cuda_graphs, "graphs_supported", lambda device: True)
    monkeypatch.setattr(cuda_graphs, "capture", fail)
    case = BY_NAME["qwen3-sampled"]
    engine, weights = build(case, tmp_path, bucketed=True)
    assert engine.placement == "cpu, cuda graphs"  # asked for, nothing captured yet
    with caplog.at_level(logging.WARNING, logger=cuda_graphs.__name__):
        outputs = replay(engine, case.script, weights)
    assert_same(outputs, golden()[case.name], LOGPROB_ATOL)
    assert tries == [1]  # never tried again
    reason = "RuntimeError: CUDA error: operation not permitted when stream is capturing"
    assert engine.placement == f"cpu, eager (graph capture failed: {reason})"
    assert engine.captured_graphs == 0
    said = [r.getMessage() for r in caplog.records if "capture failed" in r.getMessage()]
    assert len(said) == 1 and reason in said[0], said


class StandInGraph:
    """On CPU, what a CUDA graph does: replay the step it captured (its shape fixed at capture), over the
    buffers it was captured on: a replay over reallocated buffers fails the test."""

    replays = 0

    def __init__(self, step: Callable[[], None], engine: TorchEngine) -> None:
        self.step, self.engine, self.addresses = step, engine, buffer_addresses(engine)

    def replay(self) -> None:
        assert buffer_addresses(self.engine) == self.addresses, "a graph replayed over reallocated buffers"
        StandInGraph.replays += 1
        self.step()


@pytest.mark.parametrize("name", ["tiny-sampled", "qwen3-topk"])
def test_replayed_steps_give_the_recorded_outputs_over_the_buffers_they_were_captured_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str
) -> None:
    case = BY_NAME[name]
    engine, weights = build(case, tmp_path, bucketed=True)
    assert engine.placement == "cpu" and engine.captured_graphs == 0  # graphs are for CUDA
    monkeypatch.setattr(cuda_graphs, "graphs_supported", lambda device: True)
    monkeypatch.setattr(cuda_graphs, "capture", lambda step, pool, stream: StandInGraph(step, engine))
    monkeypatch.setattr(StandInGraph, "replays", 0)
    engine, weights = build(case, tmp_path, bucketed=True)
    outputs = replay(engine, case.script, weights)
    assert_same(outputs, golden()[case.name], LOGPROB_ATOL)
    assert engine.placement == "cpu, cuda graphs" and engine.captured_graphs > 0
    assert StandInGraph.replays > 2 * engine.captured_graphs  # most steps were replays


def test_a_step_shape_that_grows_back_within_the_capacity_gets_its_own_graph(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A long row makes the cache 128 columns wide and leaves; the short row left is decoded over 64
    columns (a graph of that shape), then grows past 64 without a reallocation: a graph for 128 columns,
    not a replay of the 64-column one, which would not see its first tokens."""
    tiny, sampling = REPO / "models" / "tiny", SamplingParams(temperature=0.7)
    requests = [GenerationRequest(0, prompt(0, 100), 1), GenerationRequest(1, prompt(1, 50), 30)]
    eager = TorchEngine(tiny, slots=2, sampling=sampling, greedy=True, bucketed=True)
    want = {o.request_id: o for o in run_to_completion(eager, requests)}
    monkeypatch.setattr(cuda_graphs, "graphs_supported", lambda device: True)
    engine = TorchEngine(tiny, slots=2, sampling=sampling, greedy=True, bucketed=True)
    monkeypatch.setattr(cuda_graphs, "capture", lambda step, pool, stream: StandInGraph(step, engine))
    got = {o.request_id: o for o in run_to_completion(engine, requests)}
    assert engine.captured_graphs == 3  # (2 rows, 128 columns), (1, 64), (1, 128)
    assert got[1].token_ids.tolist() == want[1].token_ids.tolist()
    np.testing.assert_allclose(got[1].logprobs, want[1].logprobs, atol=LOGPROB_ATOL, rtol=0)


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
    assert engine.step() == [] and engine.step() == []  # prefill and a captured step, then a replay
    assert engine.placement.endswith(", cuda graphs") and engine.captured_graphs == 1, engine.placement
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
    assert engine.captured_graphs == 1
    outs = engine.abort()
    assert all(len(o.token_ids) == steps + 2 for o in outs)
    assert all(np.all(o.logprobs <= 0) for o in outs)
