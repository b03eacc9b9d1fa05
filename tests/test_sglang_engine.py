"""The SGLang adapter against the fake rebuilt from SGLang's source (tests/sglang_server.py: uvicorn + h11,
like a plain `pip install sglang`), and against a real server when APRIL_SGLANG_URL names one (gpu-marked).

Each breakage found by reading SGLang's source has a test here that fails on the adapter before the fix:
the absolute-form request target, a weights file passed as model_path, the unclipped budget, an abort
that hides a stop or a full budget, an update session left open, seeds, shared-server aborts, the
0.5.23 error bodies; and one test per case of the engine failure contract (actors/engine.py)."""

from __future__ import annotations

import http.client
import json
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from sglang_runtime import ToyModel
from sglang_server import FakeSGLangServer

from actors.engine import (
    EngineError,
    EngineUnavailable,
    GenerationOutput,
    GenerationRequest,
    SamplingParams,
    WeightLoadError,
)
from actors.engines.sglang_engine import SGLangEngine
from april.records import FinishReason, Sample

PROMPT = [11, 12, 13]
DEADLINE_S = 60.0
EOS = 2  # the toy model's EOS id


def req(rid: int, input_ids: list[int], budget: int, greedy: bool = False) -> GenerationRequest:
    return GenerationRequest(rid, np.asarray(input_ids, dtype=np.int32), budget, greedy)


def drain(engine: SGLangEngine) -> dict[int, GenerationOutput]:
    done: dict[int, GenerationOutput] = {}
    deadline = time.monotonic() + DEADLINE_S
    while engine.active:
        assert time.monotonic() < deadline, "requests did not finish"
        done.update((o.request_id, o) for o in engine.step())
    return done


def wait_until(predicate: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def tokens_running(server: FakeSGLangServer) -> list[int]:
    return [len(r.output_ids) for r in list(server.rt.running)]


def bodies(server: FakeSGLangServer) -> list[dict[str, Any]]:
    return list(server.rt.generate_bodies)


def weights_dir(parent: Path, version: int) -> Path:
    """A model directory holding one version's weights (what the server loads)."""
    return weights_file(parent / f"dir{version}", version).parent


def weights_file(directory: Path, version: int) -> Path:
    """A weights file as the learner publishes it (the fake does not read its bytes)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"v{version:06d}.safetensors"
    path.write_bytes(f"weights {version}".encode())
    return path


@pytest.fixture
def make_server() -> Iterator[Callable[..., FakeSGLangServer]]:
    made: list[FakeSGLangServer] = []

    def make(**kw: Any) -> FakeSGLangServer:
        server = FakeSGLangServer(**kw)
        server.start()
        made.append(server)
        return server

    yield make
    for server in made:
        server.stop()


@pytest.fixture
def make_engine() -> Iterator[Callable[..., SGLangEngine]]:
    made: list[SGLangEngine] = []

    def make(*servers: FakeSGLangServer, **kw: Any) -> SGLangEngine:
        kw.setdefault("slots", 4)
        kw.setdefault("sampling", SamplingParams(temperature=0.7, stop_token_ids=(EOS,)))
        kw.setdefault("control_timeout_s", 10.0)
        engine = SGLangEngine([s.url for s in servers], **kw)
        made.append(engine)
        return engine

    yield make
    for engine in made:
        engine.close()


# -- the HTTP contract ----------------------------------------------------------------------------------


def test_every_call_uses_an_origin_form_target(make_server: Any, make_engine: Any) -> None:
    """uvicorn + h11 routes an absolute-form target as a path: the old adapter got 404 on every call."""
    server = make_server()
    engine = make_engine(server)
    engine.add([req(1, PROMPT, 4, greedy=True)])
    assert drain(engine)[1].finish_reason == FinishReason.LENGTH
    assert server.calls and all(path.startswith("/") for _, path in server.calls)


def test_its_placement_is_its_servers(make_server: Any, make_engine: Any) -> None:
    """What the status shows as where the engine runs: the servers' URLs; past two, the first and a count."""
    one, two, three = make_server(), make_server(), make_server()
    assert make_engine(one).placement == one.url
    assert make_engine(one, two).placement == f"{one.url}, {two.url}"
    assert make_engine(one, two, three).placement == f"{one.url} and 2 more servers"


def test_generate_round_trip(make_server: Any, make_engine: Any) -> None:
    server = make_server(model=ToyModel(eos_at=5))
    engine = make_engine(server)
    engine.add([req(1, PROMPT, 8, greedy=True), req(2, [7, *PROMPT], 3, greedy=True), req(3, PROMPT, 0)])
    done = drain(engine)
    assert done[1].finish_reason == FinishReason.STOP and done[1].token_ids[-1] == EOS
    assert done[1].token_ids.tolist() == [*server.model.greedy("default", PROMPT, 4), EOS]
    assert done[2].finish_reason == FinishReason.LENGTH
    assert done[2].token_ids.tolist() == server.model.greedy("default", [7, *PROMPT], 3)
    assert done[3].finish_reason == FinishReason.LENGTH and len(done[3].token_ids) == 0
    o = done[2]
    assert o.token_ids.dtype == np.int32 and o.logprobs.dtype == np.float32 and o.versions.dtype == np.int32
    assert len(o.logprobs) == 3 and np.all(o.logprobs < 0) and np.all(o.versions == 0) and o.error == ""
    sent = sorted(bodies(server), key=lambda b: -b["sampling_params"]["max_new_tokens"])
    assert len(sent) == 2  # budget 0 never reaches the server
    b = sent[0]
    assert len(b["rid"]) == 32 and int(b["rid"], 16) >= 0 and b["rid"] != sent[1]["rid"]
    assert b["return_logprob"] is True and b["logprob_start_len"] == -1 and b["stream"] is False
    assert b["sampling_params"]["max_new_tokens"] == 8 and b["sampling_params"]["stop_token_ids"] == [EOS]


def test_a_0_5_23_error_body_reads_as_its_message(make_server: Any, make_engine: Any) -> None:
    """0.5.23's contract gate answers {"error": "<string>"}: the request fails (NONE) with that text."""
    server = make_server(version="0.5.23")
    engine = make_engine(server, extra_sampling_params={"seed": 3})
    engine.add([req(1, PROMPT, 5)])
    out = drain(engine)[1]
    assert out.finish_reason == FinishReason.NONE
    assert "HTTP 400: unknown field `seed`, expected one of" in out.error and "{" not in out.error
    assert out.error.startswith("sglang: request 1: ") and "\n" not in out.error


# -- weights ----------------------------------------------------------------------------------------------


def test_weights_load_from_a_directory_holding_only_that_version(
    make_server: Any, make_engine: Any, tmp_path: Path
) -> None:
    """SGLang takes a file for a Hugging Face repo id (400) and loads every *.safetensors of a directory:
    each version goes in a directory of its own, a hard link on the same filesystem."""
    server = make_server()
    published = tmp_path / "weights"
    v1, v2 = weights_file(published, 1), weights_file(published, 2)  # both in the learner's directory
    cache = tmp_path / "cache"
    engine = make_engine(server, weights_dir=cache)
    engine.load_weights(v1, 1)
    assert engine.version == 1 and server.rt.weight_version == "1"
    (loaded,) = server.rt.loaded_weight_files
    assert len(loaded) == 1 and Path(loaded[0]).name == v1.name and Path(loaded[0]).parent != published
    assert os.path.samefile(loaded[0], v1)  # a hard link, not a copy
    engine.add([req(1, PROMPT, 4, greedy=True)])
    out = drain(engine)[1]
    assert out.versions.tolist() == [1] * 4 and out.token_ids.tolist() == server.model.greedy("1", PROMPT, 4)
    engine.load_weights(v2, 2)
    assert [Path(f).name for f in server.rt.loaded_weight_files[-1]] == [v2.name]
    assert not Path(loaded[0]).parent.exists()  # the older version's directory is gone
    assert [p.name for p in cache.iterdir()] == [Path(server.rt.loaded_weight_files[-1][0]).parent.name]
    engine.close()
    assert list(cache.iterdir()) == [] and v1.exists() and v2.exists()


def test_weights_are_copied_where_a_link_cannot_be_made(
    make_server: Any, make_engine: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = make_server()
    v1 = weights_file(tmp_path / "weights", 1)

    def no_link(src: Any, dst: Any) -> None:
        raise OSError(18, "Invalid cross-device link")

    monkeypatch.setattr(os, "link", no_link)
    engine = make_engine(server)  # its own temporary directory
    engine.load_weights(v1, 1)
    (loaded,) = server.rt.loaded_weight_files[-1:]
    assert Path(loaded[0]).read_bytes() == v1.read_bytes() and not os.path.samefile(loaded[0], v1)
    engine.close()
    assert not Path(loaded[0]).parent.parent.exists()  # the temporary directory is removed


def test_a_weights_load_mid_request_splits_the_response_into_versions(
    make_server: Any, make_engine: Any, tmp_path: Path
) -> None:
    server = make_server(token_delay_s=0.005)
    engine = make_engine(server)
    engine.add([req(1, PROMPT, 300, greedy=True)])
    wait_until(lambda: tokens_running(server) and tokens_running(server)[0] >= 5, "some tokens")
    engine.load_weights(weights_file(tmp_path, 1), 1)  # parked (aborted by rid), loaded, resubmitted
    out = drain(engine)[1]
    k = int((out.versions == 0).sum())
    assert out.finish_reason == FinishReason.LENGTH and 0 < k < 300
    assert out.versions.tolist() == [0] * k + [1] * (300 - k)
    head = server.model.greedy("default", PROMPT, k)
    assert out.token_ids.tolist() == head + server.model.greedy("1", PROMPT + head, 300 - k)
    resumed = bodies(server)[-1]
    assert resumed["input_ids"] == PROMPT + head and resumed["sampling_params"]["max_new_tokens"] == 300 - k


def test_a_failed_weights_load_keeps_the_old_version_and_the_request(
    make_server: Any, make_engine: Any, tmp_path: Path
) -> None:
    server = make_server(token_delay_s=0.005)
    engine = make_engine(server)
    engine.add([req(1, PROMPT, 200, greedy=True)])
    wait_until(lambda: tokens_running(server) and tokens_running(server)[0] >= 5, "some tokens")
    empty = tmp_path / "empty"
    empty.mkdir()
    with pytest.raises(WeightLoadError, match="Cannot find any model weights"):
        engine.load_weights(empty, 1)
    assert engine.version == 0 and server.rt.weight_version == "default"
    out = drain(engine)[1]  # resumed on the old weights
    assert out.token_ids.tolist() == server.model.greedy("default", PROMPT, 200) and np.all(out.versions == 0)


# -- budgets ----------------------------------------------------------------------------------------------


def test_budgets_are_clipped_to_the_servers_context(make_server: Any, make_engine: Any) -> None:
    """context 64: the server refuses inputs of max_req_input_len = 58 tokens or more; the adapter keeps
    input + output within 57 so that every partial can be resumed there."""
    server = make_server(context_length=64)
    engine = make_engine(server)
    long, full, over = list(range(100, 157)), list(range(100, 157)), list(range(100, 158))
    engine.add([req(1, PROMPT * 3, 1000, greedy=True), req(2, long[:50], 100, greedy=True)])
    engine.add([req(3, full, 5), req(4, over, 5)])
    done = drain(engine)
    assert done[1].finish_reason == FinishReason.LENGTH and len(done[1].token_ids) == 57 - 9
    assert done[2].finish_reason == FinishReason.LENGTH and len(done[2].token_ids) == 7
    assert done[3].finish_reason == FinishReason.LENGTH and len(done[3].token_ids) == 0  # at the limit
    assert done[4].finish_reason == FinishReason.NONE and len(done[4].token_ids) == 0  # over it: fails
    assert "input of 58 tokens" in done[4].error
    assert sorted(b["sampling_params"]["max_new_tokens"] for b in bodies(server)) == [7, 48]
    assert engine.context == 57


def test_a_partial_near_the_context_end_can_be_resumed(make_server: Any, make_engine: Any) -> None:
    server = make_server(context_length=64, token_delay_s=0.05)
    engine = make_engine(server)
    prompt = list(range(100, 140))
    engine.add([req(1, prompt, 100, greedy=True)])
    wait_until(lambda: tokens_running(server) and tokens_running(server)[0] >= 3, "some tokens")
    (part,) = engine.abort()
    assert part.finish_reason == FinishReason.ABORT and 0 < len(part.token_ids) < 17
    sample = Sample(group_id=0, index=0, prompt_ids=np.asarray(prompt, dtype=np.int32))
    sample = sample.extend(part.token_ids, part.logprobs, 0, part.finish_reason)
    engine.add([req(2, sample.resume_input().tolist(), sample.budget(100), greedy=True)])
    last = drain(engine)[2]
    assert last.finish_reason == FinishReason.LENGTH and len(part.token_ids) + len(last.token_ids) == 17


# -- finish reasons -------------------------------------------------------------------------------------


def test_an_abort_landing_on_the_stop_token_is_stop(make_server: Any, make_engine: Any) -> None:
    """The scheduler lets an abort win over the EOS it samples in the same step (schedule_batch.py)."""
    server = make_server(model=ToyModel(eos_at=3))
    engine = make_engine(server)
    server.inject_abort(after_tokens=2)
    engine.add([req(1, PROMPT, 10)])
    out = drain(engine)[1]
    assert out.finish_reason == FinishReason.STOP and out.error == ""
    assert len(out.token_ids) == 3 and out.token_ids[-1] == EOS


def test_an_abort_landing_on_the_last_budget_token_is_length(make_server: Any, make_engine: Any) -> None:
    server = make_server()
    engine = make_engine(server)
    server.inject_abort(after_tokens=4)
    engine.add([req(1, PROMPT, 5, greedy=True)])
    out = drain(engine)[1]
    assert out.finish_reason == FinishReason.LENGTH and len(out.token_ids) == 5


# -- sampling ----------------------------------------------------------------------------------------------


def test_seeds_with_deterministic_inference_differ_per_request_even_for_seed_0(
    make_server: Any, make_engine: Any
) -> None:
    """With --enable-deterministic-inference an unseeded request samples with seed 42: a group whose
    requests carry no seed would be four copies of one sample."""
    server = make_server(enable_deterministic_inference=True)
    sampling = SamplingParams(temperature=1.0, seed=0, stop_token_ids=(EOS,))
    engine = make_engine(server, sampling=sampling)
    engine.add([req(i, PROMPT, 8) for i in range(4)])
    first = {i: o.token_ids.tolist() for i, o in drain(engine).items()}
    seeds = [b["sampling_params"].get("sampling_seed") for b in bodies(server)]
    assert None not in seeds and len(set(seeds)) == 4
    assert len({tuple(t) for t in first.values()}) == 4  # a group's samples differ
    again = make_engine(server, sampling=sampling)
    again.add([req(i, PROMPT, 8) for i in range(4)])
    assert {i: o.token_ids.tolist() for i, o in drain(again).items()} == first  # and are reproducible


def test_no_seed_is_sent_where_the_server_ignores_it(
    make_server: Any, make_engine: Any, caplog: pytest.LogCaptureFixture
) -> None:
    server = make_server()
    with caplog.at_level(logging.WARNING):
        engine = make_engine(server, sampling=SamplingParams(temperature=0.7, seed=5))
    assert "without --enable-deterministic-inference" in caplog.text
    assert "SGLANG_RETURN_ORIGINAL_LOGPROB" in caplog.text  # temperature != 1: the log-prob scale matters
    engine.add([req(1, PROMPT, 4)])
    drain(engine)
    assert "sampling_seed" not in bodies(server)[0]["sampling_params"]


def test_a_greedy_request_asks_for_top_k_1_without_a_seed(make_server: Any, make_engine: Any) -> None:
    server = make_server(enable_deterministic_inference=True)
    engine = make_engine(server, sampling=SamplingParams(temperature=0.7, top_k=50, seed=5))
    engine.add([req(1, PROMPT, 4), req(2, PROMPT, 4, greedy=True)])
    drain(engine)
    params = {b["sampling_params"]["top_k"]: b["sampling_params"] for b in bodies(server)}
    assert set(params) == {50, 1}  # the sampled request keeps the run's top_k, the greedy one gets 1
    assert "sampling_seed" in params[50] and "sampling_seed" not in params[1]
    assert params[1]["temperature"] == 0.7


def test_launch_refuses_an_environment_with_original_logprobs(monkeypatch: pytest.MonkeyPatch) -> None:
    from actors.engines.sglang_launch import server_command

    monkeypatch.setenv("SGLANG_RETURN_ORIGINAL_LOGPROB", "True")
    with pytest.raises(EngineError, match="SGLANG_RETURN_ORIGINAL_LOGPROB=True is set") as err:
        server_command("/m", port=31000)
    assert "\n" not in str(err.value)
    monkeypatch.setenv("SGLANG_RETURN_ORIGINAL_LOGPROB", "0")
    cmd = server_command("/m", port=31000, slots=16, deterministic=True)
    assert cmd[1:3] == ["-m", "sglang.launch_server"] and "--skip-tokenizer-init" in cmd
    assert cmd[cmd.index("--max-running-requests") + 1] == "16"
    assert "--enable-deterministic-inference" in cmd


# -- aborts -------------------------------------------------------------------------------------------------


class OtherClient:
    """Another client of a shared server: one /generate in a thread."""

    def __init__(self, server: FakeSGLangServer, budget: int) -> None:
        self.rid = uuid.uuid4().hex
        self.answer: dict[str, Any] = {}
        body = {"rid": self.rid, "input_ids": [5, 6], "sampling_params": {"max_new_tokens": budget}}
        self.thread = threading.Thread(target=self._run, args=(server, body), daemon=True)
        self.thread.start()

    def _run(self, server: FakeSGLangServer, body: dict[str, Any]) -> None:
        conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=DEADLINE_S)
        try:
            conn.request("POST", "/generate", json.dumps(body), {"Content-Type": "application/json"})
            self.answer = json.loads(conn.getresponse().read())
        finally:
            conn.close()


def test_abort_leaves_other_clients_of_a_shared_server_alone(make_server: Any, make_engine: Any) -> None:
    server = make_server(token_delay_s=0.005)
    theirs = OtherClient(server, budget=4000)
    engine = make_engine(server, abort_timeout_s=10.0)
    engine.add([req(1, PROMPT, 4000), req(2, PROMPT, 4000)])
    wait_until(lambda: len(tokens_running(server)) == 3 and min(tokens_running(server)) >= 3, "all running")
    outs = engine.abort()
    assert sorted(o.request_id for o in outs) == [1, 2] and engine.active == 0
    assert all(o.finish_reason == FinishReason.ABORT and len(o.token_ids) >= 3 for o in outs)
    assert theirs.rid in server.rt.rid_to_state and theirs.thread.is_alive()  # not aborted, not waited for
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=DEADLINE_S)
    conn.request(
        "POST", "/abort_request", json.dumps({"rid": theirs.rid}), {"Content-Type": "application/json"}
    )
    conn.getresponse().read()
    conn.close()
    theirs.thread.join(DEADLINE_S)
    assert theirs.answer["meta_info"]["finish_reason"]["type"] == "abort"


@pytest.mark.parametrize(("version", "falls_back"), [("0.5.23", True), ("0.5.20", True), ("0.5.6", False)])
def test_an_abort_lost_before_scheduling_is_retried(
    make_server: Any, make_engine: Any, caplog: pytest.LogCaptureFixture, version: str, falls_back: bool
) -> None:
    """An abort forwarded while its request is still on the way to the scheduler is lost; from 0.5.20 the
    rid is forwarded only once, so the adapter falls back to abort_all; 0.5.6 forwards every re-sent one."""
    server = make_server(version=version, dispatch_delay_s=0.5, token_delay_s=0.005)
    engine = make_engine(server, abort_all_after_s=1.0, abort_timeout_s=30.0)
    engine.add([req(1, PROMPT, 4000)])
    wait_until(lambda: bool(server.rt.rid_to_state), "the tokenizer manager to hold the rid")
    with caplog.at_level(logging.WARNING):
        (out,) = engine.abort()
    assert out.finish_reason == FinishReason.ABORT and engine.active == 0
    assert server.rt.aborts_lost >= 1 and not server.rt.rid_to_state
    assert ("aborting every request on that server" in caplog.text) == falls_back


def test_an_abort_that_cannot_stop_its_request_does_not_block(make_server: Any, make_engine: Any) -> None:
    server = make_server(version="0.5.23", dispatch_delay_s=0.5, token_delay_s=0.005)
    engine = make_engine(server, abort_all_after_s=1000.0, abort_timeout_s=1.0)
    engine.add([req(1, PROMPT, 1000)])
    wait_until(lambda: bool(server.rt.rid_to_state), "the tokenizer manager to hold the rid")
    with pytest.raises(EngineUnavailable, match="abort failed") as err:
        engine.abort()
    (part,) = err.value.partials
    assert part.request_id == 1 and part.finish_reason == FinishReason.ABORT and part.error
    assert engine.active == 0


# -- the failure contract ----------------------------------------------------------------------------------


def test_a_request_the_server_refuses_fails_alone(make_server: Any, make_engine: Any) -> None:
    server = make_server()
    engine = make_engine(server)
    server.fail_next("/generate", 400, {"error": {"message": "nope"}})
    engine.add([req(1, PROMPT, 4)])
    out = drain(engine)[1]
    assert out.finish_reason == FinishReason.NONE and out.error == "sglang: request 1: " + (
        f"sglang {server.url}/generate: HTTP 400: nope"
    )
    engine.add([req(2, PROMPT, 4)])
    assert drain(engine)[2].finish_reason == FinishReason.LENGTH


def test_a_5xx_comes_back_as_abort_with_the_earlier_tokens(
    make_server: Any, make_engine: Any, tmp_path: Path
) -> None:
    server = make_server(token_delay_s=0.005)
    engine = make_engine(server)
    engine.add([req(1, PROMPT, 4000, greedy=True)])
    wait_until(lambda: tokens_running(server) and tokens_running(server)[0] >= 5, "some tokens")
    server.fail_next("/generate", 503, {"error": "overloaded"})
    engine.load_weights(weights_dir(tmp_path, 1), 1)  # the resubmission gets the 503
    out = drain(engine)[1]
    assert out.finish_reason == FinishReason.ABORT and "HTTP 503: overloaded" in out.error
    k = len(out.token_ids)
    assert k >= 5 and out.token_ids.tolist() == server.model.greedy("default", PROMPT, k)
    assert out.versions.tolist() == [0] * k


@pytest.mark.parametrize(
    ("version", "code", "reason", "tokens"),
    [
        ("0.5.23", 500, FinishReason.ABORT, 0),  # an HTTP 500: the partial is lost
        ("0.5.23", 503, FinishReason.ABORT, 0),
        ("0.5.23", 400, FinishReason.NONE, 0),  # the request is at fault
        ("0.5.6", 429, FinishReason.ABORT, 3),  # 0.5.6 answers 200 with the partial
    ],
)
def test_status_coded_aborts(
    make_server: Any, make_engine: Any, version: str, code: int, reason: FinishReason, tokens: int
) -> None:
    server = make_server(version=version)
    engine = make_engine(server)
    server.inject_abort(after_tokens=2, status_code=code, message="Out of memory")
    engine.add([req(1, PROMPT, 10)])
    out = drain(engine)[1]
    assert out.finish_reason == reason and "Out of memory" in out.error and len(out.token_ids) == tokens


def test_a_dropped_connection_while_the_server_answers_is_a_transient_abort(
    make_server: Any, make_engine: Any
) -> None:
    server = make_server()
    engine = make_engine(server)
    server.fail_next("/generate", None)
    engine.add([req(1, PROMPT, 4)])
    out = drain(engine)[1]
    assert out.finish_reason == FinishReason.ABORT and "the server still answers" in out.error
    engine.add([req(2, PROMPT, 4)])
    assert drain(engine)[2].finish_reason == FinishReason.LENGTH


def test_a_server_killed_and_restarted_mid_request(
    make_server: Any, make_engine: Any, tmp_path: Path
) -> None:
    """Killed: EngineUnavailable with every request's partial (earlier submissions' tokens kept); probe
    raises until the server is back; then it is reloaded with the adapter's version and serves."""
    server = make_server(token_delay_s=0.005)
    engine = make_engine(server)
    engine.load_weights(weights_dir(tmp_path, 1), 1)
    engine.add([req(1, PROMPT, 4000, greedy=True)])
    wait_until(lambda: tokens_running(server) and tokens_running(server)[0] >= 5, "some tokens")
    engine.load_weights(weights_dir(tmp_path, 2), 2)  # request 1: parked with its v1 tokens
    wait_until(lambda: tokens_running(server) and tokens_running(server)[0] >= 3, "more tokens")
    k = len(server.rt.generate_bodies[-1]["input_ids"]) - len(PROMPT)  # the resubmission's input
    assert k >= 5
    server.stop()
    with pytest.raises(EngineUnavailable, match="cannot be reached") as err:
        drain(engine)
    outs = {o.request_id: o for o in err.value.partials}
    assert engine.active == 0 and set(outs) == {1}
    assert outs[1].finish_reason == FinishReason.ABORT and outs[1].error
    assert outs[1].versions.tolist() == [1] * k and outs[1].token_ids.tolist() == server.model.greedy(
        "1", PROMPT, k
    )
    for _ in range(2):
        with pytest.raises(EngineUnavailable):
            engine.probe()
    server.start()
    assert server.rt.weight_version == "default"  # a restarted server has its launch weights
    engine.probe()
    assert server.rt.weight_version == "2" and engine.version == 2
    engine.add([req(3, PROMPT, 4, greedy=True)])
    out = drain(engine)[3]
    assert out.versions.tolist() == [2] * 4 and out.token_ids.tolist() == server.model.greedy("2", PROMPT, 4)


def test_a_server_restarted_between_requests_is_noticed_by_its_weight_version(
    make_server: Any, make_engine: Any, tmp_path: Path
) -> None:
    server = make_server()
    engine = make_engine(server)
    engine.load_weights(weights_dir(tmp_path, 1), 1)
    server.stop()
    server.start()
    engine.add([req(1, PROMPT, 4, greedy=True)])
    with pytest.raises(EngineUnavailable, match="weight_version default, expected 1") as err:
        drain(engine)
    (part,) = err.value.partials
    assert (
        part.finish_reason == FinishReason.ABORT and len(part.token_ids) == 0
    )  # launch-weight tokens dropped
    engine.probe()
    engine.add([req(2, PROMPT, 4, greedy=True)])
    assert drain(engine)[2].token_ids.tolist() == server.model.greedy("1", PROMPT, 4)


def test_abort_and_load_weights_on_a_server_that_is_down(
    make_server: Any, make_engine: Any, tmp_path: Path
) -> None:
    server = make_server(token_delay_s=0.005)
    engine = make_engine(server)
    engine.add([req(1, PROMPT, 4000)])
    wait_until(lambda: tokens_running(server) and tokens_running(server)[0] >= 3, "some tokens")
    server.stop()
    with pytest.raises(EngineUnavailable) as err:
        engine.abort()
    assert [o.request_id for o in err.value.partials] == [1] and engine.active == 0
    with pytest.raises(EngineUnavailable):
        engine.load_weights(weights_file(tmp_path / "w", 1), 1)
    assert engine.version == 0
    server.start()
    engine.probe()
    engine.add([req(2, PROMPT, 4)])
    assert drain(engine)[2].finish_reason == FinishReason.LENGTH


def test_requests_spread_round_robin_and_every_server_must_answer(make_server: Any, make_engine: Any) -> None:
    a, b = make_server(), make_server()
    engine = make_engine(a, b)
    engine.add([req(i, PROMPT, 3) for i in range(4)])
    assert len(drain(engine)) == 4
    assert len(a.rt.generate_bodies) == len(b.rt.generate_bodies) == 2
    b.stop()
    with pytest.raises(EngineUnavailable, match=b.url):
        engine.probe()
    b.start()
    engine.probe()


def test_start_up_checks(make_server: Any) -> None:
    old = make_server(version="0.4.9")
    with pytest.raises(EngineError, match=r"expected >= 0\.5\.6"):
        SGLangEngine([old.url])
    old.stop()
    with pytest.raises(EngineError, match="ConnectionRefusedError"):
        SGLangEngine([old.url], control_timeout_s=1.0)


@pytest.mark.gpu
def test_real_server() -> None:
    """Against a real SGLang server (started with --skip-tokenizer-init on this host).
    APRIL_SGLANG_WEIGHTS, if set, is a .safetensors file of the served model for the weights check."""
    url = os.environ.get("APRIL_SGLANG_URL")
    if not url:
        pytest.skip("APRIL_SGLANG_URL is not set")
    engine = SGLangEngine([url], slots=4, sampling=SamplingParams(temperature=1.0, seed=1))
    try:
        engine.add([req(1, PROMPT, 16), req(2, PROMPT, 4000)])
        time.sleep(1.0)
        outs = {o.request_id: o for o in engine.step() + engine.abort()}
        assert engine.active == 0
        assert outs[1].finish_reason in (FinishReason.STOP, FinishReason.LENGTH)
        assert 0 < len(outs[1].token_ids) <= 16 and np.all(outs[1].logprobs <= 0)
        assert outs[2].finish_reason == FinishReason.ABORT and len(outs[2].token_ids) > 0
        sample = Sample(group_id=0, index=0, prompt_ids=np.asarray(PROMPT, dtype=np.int32))
        sample = sample.extend(outs[2].token_ids, outs[2].logprobs, 0, FinishReason.ABORT)
        weights = os.environ.get("APRIL_SGLANG_WEIGHTS")
        version = engine.version + 1 if weights else engine.version
        if weights:
            engine.load_weights(Path(weights), version)
        engine.add([req(3, sample.resume_input().tolist(), 8)])
        last = drain(engine)[3]
        assert 0 < len(last.token_ids) <= 8 and last.finish_reason != FinishReason.ABORT
        assert np.all(last.versions == version)
        with pytest.raises(WeightLoadError):
            engine.load_weights(Path("/nonexistent/april-model"), version + 1)
        assert engine.version == version
    finally:
        engine.close()
