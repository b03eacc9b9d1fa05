"""The SGLang adapter against the contract fixture (tests/sglang_fixture.py), and against a real server
when APRIL_SGLANG_URL names one (gpu-marked)."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from sglang_fixture import FakeSGLangServer, expected_tokens, token_logprob

from actors.engine import EngineError, GenerationOutput, GenerationRequest, SamplingParams, WeightLoadError
from actors.engines.sglang_engine import SGLangEngine, parse_version
from actors.engines.sglang_launch import server_command
from april.records import FinishReason, Sample

PROMPT = [11, 12, 13]


def req(rid: int, input_ids: list[int], budget: int) -> GenerationRequest:
    return GenerationRequest(rid, np.asarray(input_ids, dtype=np.int32), budget)


def drain(engine: SGLangEngine, timeout: float = 60.0) -> dict[int, GenerationOutput]:
    done: dict[int, GenerationOutput] = {}
    deadline = time.monotonic() + timeout
    while engine.active:
        assert time.monotonic() < deadline, "requests did not finish"
        done.update((o.request_id, o) for o in engine.step())
    return done


def wait_until(predicate: object, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)


@pytest.fixture
def server() -> Iterator[FakeSGLangServer]:
    with FakeSGLangServer() as s:
        yield s


@pytest.fixture
def engine(server: FakeSGLangServer) -> Iterator[SGLangEngine]:
    e = SGLangEngine([server.url], slots=4, sampling=SamplingParams(temperature=0.7, stop_token_ids=(2,)))
    yield e
    e.close()


def test_generate_round_trip(server: FakeSGLangServer, engine: SGLangEngine) -> None:
    stop_at = expected_tokens(PROMPT, 10)[4]
    engine.sampling = SamplingParams(stop_token_ids=(stop_at,), seed=5)
    engine.add([req(1, PROMPT, 8), req(2, [7, *PROMPT], 3), req(3, PROMPT, 0)])
    done = drain(engine)
    assert done[1].finish_reason == FinishReason.STOP
    assert done[1].token_ids.tolist() == expected_tokens(PROMPT, 5) and done[1].token_ids[-1] == stop_at
    assert done[2].finish_reason == FinishReason.LENGTH and len(done[2].token_ids) == 3
    assert done[3].finish_reason == FinishReason.LENGTH and len(done[3].token_ids) == 0
    o = done[1]
    assert o.token_ids.dtype == np.int32 and o.logprobs.dtype == np.float32 and o.versions.dtype == np.int32
    assert np.allclose(o.logprobs, [token_logprob(t) for t in o.token_ids]) and np.all(o.versions == 0)
    bodies = sorted(server.posts("/generate"), key=lambda b: -b["sampling_params"]["max_new_tokens"])
    assert len(bodies) == 2  # budget 0 never reaches the server
    b = bodies[0]
    assert len(b["rid"]) == 32 and int(b["rid"], 16) >= 0 and b["rid"] != bodies[1]["rid"]
    assert b["return_logprob"] is True and b["logprob_start_len"] == -1 and b["stream"] is False
    sp = b["sampling_params"]
    assert sp["max_new_tokens"] == 8 and sp["stop_token_ids"] == [stop_at] and sp["top_k"] == -1
    assert "seed" not in sp and sp["sampling_seed"] != bodies[1]["sampling_params"]["sampling_seed"]


def test_greedy_request_asks_for_top_k_1_without_a_seed(
    server: FakeSGLangServer, engine: SGLangEngine
) -> None:
    engine.sampling = SamplingParams(temperature=0.7, top_k=50, seed=5)
    sampled = req(1, PROMPT, 4)
    engine.add([sampled, GenerationRequest(2, sampled.input_ids, 4, greedy=True)])
    drain(engine)
    params = {b["sampling_params"]["top_k"]: b["sampling_params"] for b in server.posts("/generate")}
    assert set(params) == {50, 1}  # the sampled request keeps the run's top_k, the greedy one gets 1
    assert "sampling_seed" in params[50] and "sampling_seed" not in params[1]
    assert params[1]["temperature"] == 0.7  # log-probs stay on the run's temperature scale


def test_abort_returns_running_partials_and_queued_empties() -> None:
    with FakeSGLangServer(max_running=2, token_delay_s=0.003, stall_at=3) as server:
        engine = SGLangEngine([server.url], slots=4)
        engine.add([req(i, PROMPT, 1000) for i in range(4)])
        wait_until(lambda: server.loads()["loads"][0]["num_waiting_reqs"] == 2)
        wait_until(lambda: server.running_tokens() == [3, 3])  # both running ones mid-generation
        outs = {o.request_id: o for o in engine.abort()}
        assert engine.active == 0 and server.loads()["loads"][0]["num_running_reqs"] == 0
        assert all(o.finish_reason == FinishReason.ABORT for o in outs.values())
        lengths = sorted(len(o.token_ids) for o in outs.values())
        assert lengths[:2] == [0, 0] and lengths[2] > 0  # two queued, two running
        for o in outs.values():
            assert o.token_ids.tolist() == expected_tokens(PROMPT, len(o.token_ids))
        engine.close()


def test_abort_lost_before_scheduling_is_retried_until_idle() -> None:
    with FakeSGLangServer(lose_aborts=2, token_delay_s=0.002) as server:
        engine = SGLangEngine([server.url], slots=4, poll_s=0.01)
        engine.add([req(1, PROMPT, 1000), req(2, PROMPT, 1000)])
        wait_until(lambda: len(server.posts("/generate")) == 2)
        outs = engine.abort()  # the first abort_all reaches the server before the scheduler has them
        assert server.lost_aborts >= 2 and len(server.posts("/abort_request")) > 1
        assert {o.request_id for o in outs} == {1, 2} and engine.active == 0
        assert all(o.finish_reason == FinishReason.ABORT for o in outs)
        load = server.loads()["loads"][0]
        assert load["num_running_reqs"] == load["num_waiting_reqs"] == 0
        engine.close()


def test_abort_without_loads_endpoint_waits_for_calls() -> None:
    with FakeSGLangServer(version="0.5.6", has_loads=False, schedule_delay_s=0.05) as server:
        engine = SGLangEngine([server.url], slots=2, poll_s=0.01)
        engine.add([req(1, PROMPT, 1000)])
        (out,) = engine.abort()
        assert out.finish_reason == FinishReason.ABORT and engine.active == 0
        engine.close()


def test_resume_by_token_ids_with_reduced_budget(server: FakeSGLangServer, engine: SGLangEngine) -> None:
    max_new = 200
    sample = Sample(group_id=0, index=0, prompt_ids=np.asarray(PROMPT, dtype=np.int32))
    server.stall_at = 5
    engine.add([req(1, PROMPT, max_new)])
    wait_until(lambda: server.running_tokens() == [5])  # mid-generation
    (part,) = engine.abort()
    assert part.finish_reason == FinishReason.ABORT and 0 < len(part.token_ids) < max_new
    sample = sample.extend(part.token_ids, part.logprobs, 0, part.finish_reason)
    engine.add([req(2, sample.resume_input().tolist(), sample.budget(max_new))])
    last = drain(engine)[2]
    sample = sample.extend(last.token_ids, last.logprobs, 0, last.finish_reason)
    assert last.finish_reason == FinishReason.LENGTH and sample.response_len == max_new
    assert sample.response_ids.tolist() == expected_tokens(PROMPT, max_new)
    resumed = server.posts("/generate")[-1]
    assert resumed["input_ids"] == sample.resume_input().tolist()[: len(PROMPT) + len(part.token_ids)]
    assert resumed["sampling_params"]["max_new_tokens"] == max_new - len(part.token_ids)


def test_bad_requests_surface_as_clear_engine_errors(server: FakeSGLangServer) -> None:
    engine = SGLangEngine([server.url], slots=2, extra_sampling_params={"seed": 3})
    engine.add([req(1, PROMPT, 5)])
    with pytest.raises(EngineError, match="HTTP 400: sampling_params: unknown field 'seed'"):
        drain(engine)
    engine.close()
    engine = SGLangEngine([server.url], slots=2)
    engine.add([req(1, PROMPT, 5), req(2, [1] * 4000, 200)])
    with pytest.raises(EngineError, match=r"request 2: .*maximum context length") as err:
        drain(engine)
    assert "\n" not in str(err.value)
    assert [o.request_id for o in drain(engine).values()] == [1]  # the good one is kept
    engine.close()


def test_weights_update_sets_version_of_later_tokens(
    server: FakeSGLangServer, engine: SGLangEngine, tmp_path: Path
) -> None:
    engine.load_weights(tmp_path, 1)
    assert engine.version == 1 and server.weight_version == "1"
    (call,) = server.posts("/update_weights_from_disk")
    assert call == {"model_path": str(tmp_path), "weight_version": "1", "flush_cache": True}
    engine.add([req(1, PROMPT, 4)])
    assert drain(engine)[1].versions.tolist() == [1, 1, 1, 1]
    # with a request in flight: parked, loaded, resumed; its response spans two versions
    server.stall_at = 5
    engine.add([req(2, PROMPT, 300)])
    wait_until(lambda: server.running_tokens() == [5])  # mid-generation
    engine.load_weights(tmp_path, 2)
    out = drain(engine)[2]
    assert out.finish_reason == FinishReason.LENGTH and out.token_ids.tolist() == expected_tokens(PROMPT, 300)
    k = int((out.versions == 1).sum())
    assert 0 < k < 300 and out.versions.tolist() == [1] * k + [2] * (300 - k)


def test_failed_weights_update_keeps_old_version(
    server: FakeSGLangServer, engine: SGLangEngine, tmp_path: Path
) -> None:
    server.stall_at = 5
    engine.add([req(1, PROMPT, 200)])
    wait_until(lambda: server.running_tokens() == [5])  # mid-generation: parked by the load
    with pytest.raises(WeightLoadError, match="repository not found"):
        engine.load_weights(tmp_path / "missing", 1)
    assert engine.version == 0 and server.weight_version == "0"
    out = drain(engine)[1]  # the parked request was resumed on the old weights
    assert out.token_ids.tolist() == expected_tokens(PROMPT, 200) and np.all(out.versions == 0)


@pytest.mark.parametrize(("version", "bracket"), [("0.5.23", True), ("0.5.6", False)])
def test_nccl_weights_path(version: str, bracket: bool) -> None:
    with FakeSGLangServer(version=version) as server:
        engine = SGLangEngine([server.url], slots=2)
        engine.init_weight_group("10.0.0.1", 29500, world_size=2)
        (init,) = server.posts("/init_weights_update_group")
        assert init["rank_offset"] == 1 and init["world_size"] == 2 and init["backend"] == "nccl"
        engine.load_weights_distributed(["w"], ["bfloat16"], [[4, 4]], version=3)
        paths = [p for p, _ in server.calls if p != "/init_weights_update_group"]
        middle = ["/update_weights_from_distributed"]
        expected = ["/begin_weight_update", *middle, "/end_weight_update"] if bracket else middle
        assert paths == [*expected, "/flush_cache"] and engine.version == 3
        engine.close()


def test_flush_refused_while_busy(server: FakeSGLangServer, engine: SGLangEngine) -> None:
    server.stall_at = 1  # running until the abort below, however long the machine takes
    engine.add([req(1, PROMPT, 500)])
    wait_until(lambda: server.loads()["loads"][0]["num_running_reqs"] == 1)
    with pytest.raises(EngineError, match="HTTP 400: Cache not flushed"):
        engine._call(server.url, "POST", "/flush_cache", {})
    engine.abort()
    engine._call(server.url, "POST", "/flush_cache", {})


def test_requests_spread_round_robin_over_servers() -> None:
    with FakeSGLangServer() as a, FakeSGLangServer() as b:
        engine = SGLangEngine([a.url, b.url + "/"], slots=4)
        engine.add([req(i, PROMPT, 3) for i in range(4)])
        assert len(drain(engine)) == 4
        assert len(a.posts("/generate")) == len(b.posts("/generate")) == 2
        engine.close()


def test_start_up_checks() -> None:
    with FakeSGLangServer(version="0.4.9") as old, pytest.raises(EngineError, match=r"expected >= 0\.5\.6"):
        SGLangEngine([old.url])
    with FakeSGLangServer() as s:
        url = s.url
    with pytest.raises(EngineError, match="ConnectionRefusedError"):
        SGLangEngine([url], control_timeout_s=1.0)
    assert parse_version("0.5.6.post1") == (0, 5, 6) and parse_version("v0.5.23rc0") == (0, 5, 23)
    cmd = server_command("/m", port=31000, slots=16)
    assert cmd[1:3] == ["-m", "sglang.launch_server"] and "--skip-tokenizer-init" in cmd
    assert cmd[cmd.index("--max-running-requests") + 1] == "16"


@pytest.mark.gpu
def test_real_server() -> None:
    """Against a real SGLang server (started with --skip-tokenizer-init). APRIL_SGLANG_MODEL, if set,
    is a model directory the server can reload for the weights check."""
    url = os.environ.get("APRIL_SGLANG_URL")
    if not url:
        pytest.skip("APRIL_SGLANG_URL is not set")
    engine = SGLangEngine([url], slots=4, sampling=SamplingParams(temperature=1.0, seed=1))
    try:
        engine.add([req(1, PROMPT, 16), req(2, PROMPT, 4000)])
        time.sleep(1.0)
        outs = {o.request_id: o for o in engine.step() + engine.abort()}
        assert engine.active == 0 and engine._load() == 0
        assert outs[1].finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
        assert 0 < len(outs[1].token_ids) <= 16 and np.all(outs[1].logprobs <= 0)
        assert outs[2].finish_reason == FinishReason.ABORT and len(outs[2].token_ids) > 0
        sample = Sample(group_id=0, index=0, prompt_ids=np.asarray(PROMPT, dtype=np.int32))
        sample = sample.extend(outs[2].token_ids, outs[2].logprobs, 0, FinishReason.ABORT)
        model = os.environ.get("APRIL_SGLANG_MODEL")
        version = engine.version + 1 if model else engine.version
        if model:
            engine.load_weights(Path(model), version)
        engine.add([req(3, sample.resume_input().tolist(), 8)])
        last = drain(engine, timeout=60)[3]
        assert 0 < len(last.token_ids) <= 8 and last.finish_reason != FinishReason.ABORT
        assert np.all(last.versions == version)
        with pytest.raises(WeightLoadError):
            engine.load_weights(Path("/nonexistent/april-model"), version + 1)
        assert engine.version == version
    finally:
        engine.close()
