"""The torch engine's KV cache, sized once (`actors.engines.kv_budget`, `TorchEngine(max_seq_len=...)`).

The budget's arithmetic and its one-line refusals, against numbers worked by hand; a real engine on the
shipped tiny model (float32 here: 4 layers x keys and values x 4 heads x 32 x 4 B = 4 KiB a token, rows of
its 1,024-token context) given a GPU's memory figures in place of `torch.cuda.mem_get_info`, refusing or
allocating exactly `slots` rows; an engine with a cache sized at start that serves the recorded script
(tests/data/torch_engine_golden.json) without ever moving its buffers, and clips a request to its row.
"""

from __future__ import annotations

from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from engine_script import CASES, assert_same, build, golden, prompt, replay  # noqa: E402

from actors.engine import EngineError, GenerationRequest, SamplingParams, run_to_completion  # noqa: E402
from actors.engines import torch_engine  # noqa: E402
from actors.engines.kv_budget import DeviceMemory, plan_cache  # noqa: E402
from april.records import FinishReason  # noqa: E402

MIB = 2**20
GIB = 2**30
TINY = Path(__file__).resolve().parents[1] / "models" / "tiny"
TOKEN = 4 * 2 * 4 * 32 * 4  # the tiny model's keys and values of one token in float32, bytes


def test_a_budget_that_holds_every_slot_gives_the_cache_only_what_its_rows_need() -> None:
    memory = DeviceMemory(total=80 * GIB, free=70 * GIB, held=2 * GIB)
    plan = plan_cache(8, 4096, 114_688, 0.5, memory, "cuda:0")
    assert (plan.rows, plan.columns, plan.bytes) == (8, 4096, 8 * 4096 * 114_688)
    assert plan.budget == 40 * GIB - 2 * GIB
    assert plan.describe() == "8 rows x 4,096 tokens, 3.50 GiB of a 38.00 GiB budget"
    assert plan_cache(8, 4096, 10, 0.5, None, "cpu").describe() == "8 rows x 4,096 tokens, 0.00 GiB"


def test_a_budget_too_small_is_one_line_naming_what_to_change() -> None:
    # Qwen3-0.6B's shape (28 layers x 2 x 8 heads x 128 x 2 B) at its 40,960-token context: 4.38 GiB a row
    memory = DeviceMemory(total=80 * GIB, free=70 * GIB, held=2 * GIB)
    with pytest.raises(EngineError) as caught:
        plan_cache(64, 40_960, 114_688, 0.5, memory, "cuda:0")
    line = str(caught.value)
    assert "\n" not in line
    assert line.startswith("torch engine on cuda:0: worker.slots = 64 rows of 40,960 tokens x 114,688 B need")
    assert "280.00 GiB of KV cache" in line and "gives it 38.00 GiB (0.5 of 80.0 GiB, less 2.00 GiB" in line
    assert line.endswith("expected worker.slots <= 8, or a larger worker.gpu_memory_fraction")

    with pytest.raises(EngineError, match=r"one of its rows .* needs 4\.38 GiB .* gives it 0\.00 GiB"):
        plan_cache(1, 40_960, 114_688, 0.02, memory, "cuda:0")  # the weights alone take more than the share

    crowded = DeviceMemory(total=80 * GIB, free=10 * GIB, held=2 * GIB)  # a learner holds most of the GPU
    with pytest.raises(EngineError, match=r"GPU has 10\.00 GiB free .*expected worker\.slots <= 2,"):
        plan_cache(8, 40_960, 114_688, 0.5, crowded, "cuda:0")


def test_the_engine_refuses_a_budget_short_of_its_slots_and_sizes_the_cache_once_within_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    row = 1024 * TOKEN  # 4 MiB
    held: list[int] = []

    def gpu(device: torch.device) -> DeviceMemory:
        held.append(1)
        return DeviceMemory(total=100 * MIB, free=90 * MIB, held=10 * MIB)  # 0.2 x 100 - 10: two rows

    monkeypatch.setattr(torch_engine, "device_memory", gpu)
    sampling = SamplingParams(temperature=0.7)
    with pytest.raises(EngineError) as caught:
        torch_engine.TorchEngine(TINY, 4, sampling, dtype="float32", max_seq_len=1024, memory_fraction=0.2)
    assert "worker.slots = 4 rows of 1,024 tokens x 4,096 B need 0.02 GiB" in str(caught.value)
    assert str(caught.value).endswith("expected worker.slots <= 2, or a larger worker.gpu_memory_fraction")

    engine = torch_engine.TorchEngine(
        TINY, 2, sampling, dtype="float32", max_seq_len=1024, memory_fraction=0.2
    )
    assert engine.cache_plan is not None and engine.cache_plan.bytes == 2 * row and held == [1, 1]
    kv = engine._kv.kv
    assert kv is not None and tuple(kv.shape) == (4, 2, 2, 4, 1024, 32) and kv.dtype == torch.float32


def test_a_cache_sized_at_start_serves_the_recorded_script_without_moving(tmp_path: Path) -> None:
    (case,) = (c for c in CASES if c.name == "tiny-sampled")
    engine, weights = build(case, tmp_path, max_seq_len=1024)  # the model's context: the same clipping
    kv = engine._kv.kv
    assert kv is not None and engine._kv.cap == 1024
    outputs = replay(engine, case.script, weights)
    assert_same(outputs, golden()[case.name], 1e-5)
    assert engine._kv.kv is kv and engine._kv.cap == 1024
    with pytest.raises(EngineError, match="a step needs 2048 cache columns, the cache holds 1024"):
        engine._kv.reserve(2048)


def test_a_request_longer_than_a_row_is_clipped_to_it() -> None:
    engine = torch_engine.TorchEngine(TINY, 2, SamplingParams(temperature=0.7), greedy=True, max_seq_len=32)
    assert engine.context == 1024 and engine.row_tokens == 32
    outs = run_to_completion(
        engine, [GenerationRequest(0, prompt(0, 20), 30), GenerationRequest(1, prompt(1, 40), 5)]
    )
    by_id = {o.request_id: o for o in outs}
    assert len(by_id[0].token_ids) == 12 and by_id[0].finish_reason == FinishReason.LENGTH
    assert len(by_id[1].token_ids) == 0 and by_id[1].finish_reason == FinishReason.LENGTH
