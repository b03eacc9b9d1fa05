"""The fake SGLang server (tests/sglang_server.py) behaves as SGLang's source says, over real HTTP.

Every exchange goes through http.client with origin-form targets, as a correct client sends them; one
test sends the absolute form to show the stack routes like uvicorn + h11. The last tests judge request
bodies with SGLang's own code, run in a separate virtualenv (APRIL_SGLANG_PYTHON, default
.venv-sglang/bin/python at the repository root); they are skipped when it is absent.
"""

from __future__ import annotations

import http.client
import json
import os
import socket
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from sglang_runtime import ToyModel
from sglang_server import FakeSGLangServer

DEADLINE_S = 60.0
PROMPT = [11, 12, 13]


@pytest.fixture
def make_server() -> Iterator[Callable[..., FakeSGLangServer]]:
    made: list[FakeSGLangServer] = []

    def make(**kw: Any) -> FakeSGLangServer:
        kw.setdefault("health_poll_s", 0.01)
        server = FakeSGLangServer(**kw)
        server.start()
        made.append(server)
        return server

    yield make
    for server in made:
        server.stop()


def call(server: FakeSGLangServer, method: str, target: str, body: Any = None) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=DEADLINE_S)
    try:
        data = None if body is None else json.dumps(body).encode()
        conn.request(method, target, body=data, headers={"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


def post(server: FakeSGLangServer, target: str, body: Any = None) -> tuple[int, Any]:
    status, raw = call(server, "POST", target, {} if body is None else body)
    return status, _decode(raw)


def get(server: FakeSGLangServer, target: str) -> tuple[int, Any]:
    status, raw = call(server, "GET", target)
    return status, _decode(raw)


def _decode(raw: bytes) -> Any:
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw.decode()


def gen_body(input_ids: list[int], rid: str | None = None, stream: bool = False, **sp: Any) -> dict[str, Any]:
    """A body shaped like the adapter's (actors/engines/sglang_engine.py: _payload)."""
    sp.setdefault("max_new_tokens", 8)
    return {
        "rid": rid or uuid.uuid4().hex,
        "input_ids": input_ids,
        "sampling_params": sp,
        "return_logprob": True,
        "logprob_start_len": -1,
        "stream": stream,
    }


class Background:
    """A /generate in a thread: `.result()` is (status, decoded body)."""

    def __init__(self, server: FakeSGLangServer, body: dict[str, Any]) -> None:
        self.rid = body["rid"]
        self.answer: tuple[int, Any] | None = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(server, body), daemon=True)
        self.thread.start()

    def _run(self, server: FakeSGLangServer, body: dict[str, Any]) -> None:
        try:
            self.answer = post(server, "/generate", body)
        except BaseException as e:
            self.error = e

    def result(self) -> tuple[int, Any]:
        self.thread.join(DEADLINE_S)
        assert not self.thread.is_alive(), "/generate did not return"
        if self.error is not None:
            raise self.error
        assert self.answer is not None
        return self.answer


def wait_for(predicate: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + DEADLINE_S
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


def running(server: FakeSGLangServer) -> int:
    return len(server.rt.running)


def generating(server: FakeSGLangServer, n: int) -> bool:
    """`n` requests running, each with a few tokens out."""
    reqs = list(server.rt.running)
    return len(reqs) == n and min(len(r.output_ids) for r in reqs) >= 2


def finish(answer: Any) -> dict[str, Any]:
    fr: dict[str, Any] = answer["meta_info"]["finish_reason"]
    return fr


# -- the HTTP stack -----------------------------------------------------------------------------------


def test_origin_form_is_routed_and_absolute_form_is_404_as_with_uvicorn_h11(make_server: Any) -> None:
    server = make_server()
    assert get(server, "/server_info")[0] == 200
    status, body = call(server, "GET", f"http://127.0.0.1:{server.port}/server_info")
    assert (status, _decode(body)) == (404, {"detail": "Not Found"})
    status, body = call(server, "POST", f"{server.url}/generate", gen_body(PROMPT))
    assert (status, _decode(body)) == (404, {"detail": "Not Found"})
    assert ("POST", f"{server.url}/generate") in server.calls  # h11 hands the whole target over as the path
    assert get(server, "/generate")[0] == 405


def test_killed_server_refuses_then_restarts_on_the_same_port_with_its_launch_state(
    make_server: Any, tmp_path: Path
) -> None:
    server = make_server(token_delay_s=0.01, weight_version="3")
    port = server.port
    (tmp_path / "model.safetensors").write_bytes(b"")
    assert (
        post(server, "/update_weights_from_disk", {"model_path": str(tmp_path), "weight_version": "4"})[0]
        == 200
    )
    long = Background(server, gen_body(PROMPT, max_new_tokens=4000, ignore_eos=True))
    wait_for(lambda: running(server) == 1, "the request to run")
    server.stop()
    with pytest.raises((ConnectionError, http.client.HTTPException)):
        long.result()
    with pytest.raises(ConnectionRefusedError):
        get(server, "/server_info")
    server.start()
    assert server.port == port
    assert get(server, "/model_info")[1]["weight_version"] == "3"  # a restarted server forgets /update_*


# -- /generate: schema, validation, finish reasons ----------------------------------------------------


def test_generate_answer_schema_and_logprob_triples(make_server: Any) -> None:
    server = make_server(weight_version="5")
    body = gen_body(PROMPT, max_new_tokens=6, temperature=0.0)
    status, answer = post(server, "/generate", body)
    assert status == 200
    assert set(answer) == {"output_ids", "meta_info"}  # no "text" with --skip-tokenizer-init
    meta = answer["meta_info"]
    assert meta["id"] == body["rid"]
    assert meta["finish_reason"] == {"type": "length", "length": 6}
    assert meta["prompt_tokens"] == 3 and meta["completion_tokens"] == 6 and meta["cached_tokens"] == 0
    assert meta["weight_version"] == "5" and meta["num_retractions"] == 0
    assert meta["weight_versions"] == [{"version": "5", "start": 0, "end": 6}]
    assert isinstance(meta["e2e_latency"], float)
    triples = meta["output_token_logprobs"]
    assert [t[1] for t in triples] == answer["output_ids"] == server.model.greedy("5", PROMPT, 6)
    assert all(len(t) == 3 and t[2] is None and t[0] < 0 for t in triples)
    assert meta["output_token_logprobs_length"] == 6


@pytest.mark.parametrize(
    ("version", "status", "body"),
    [
        ("0.5.23", 400, None),  # the contract gate: serde's text
        ("0.5.21", 500, "Internal Server Error"),  # SamplingParams(**kw) raises TypeError, uncaught
        ("0.5.6", 500, "Internal Server Error"),
    ],
)
def test_unknown_sampling_key(make_server: Any, version: str, status: int, body: Any) -> None:
    server = make_server(version=version)
    got_status, got = post(server, "/generate", gen_body(PROMPT, seed=7))
    assert got_status == status
    if body is None:
        assert got["error"].startswith("unknown field `seed`, expected one of `max_new_tokens`, `stop`,")
    else:
        assert got == body


def test_sampling_params_are_verified_and_typed(make_server: Any) -> None:
    server = make_server()
    assert post(server, "/generate", gen_body(PROMPT, top_p=0.0)) == (
        400,
        {"error": {"message": "top_p must be in (0, 1], got 0.0."}},
    )
    assert post(server, "/generate", gen_body(PROMPT, max_new_tokens=3.0)) == (
        400,
        {"error": "invalid type: floating point `3.0`, expected i64"},
    )
    status, answer = post(server, "/generate", gen_body(PROMPT, min_new_tokens=2))
    assert status == 400 and "unavailable when skip_tokenizer_init=True" in answer["error"]["message"]


def test_prompt_plus_budget_over_the_context_is_400_and_the_scheduler_clips_two_more(
    make_server: Any,
) -> None:
    server = make_server(context_length=32)
    status, answer = post(server, "/generate", gen_body(PROMPT * 3, max_new_tokens=24))
    assert status == 400
    assert answer["error"]["message"] == (
        "Requested token count exceeds the model's maximum context length of 32 tokens. You requested a "
        "total of 33 tokens: 9 tokens from the input messages and 24 tokens for the completion. Please "
        "reduce the number of tokens in the input messages or the completion to fit within the limit."
    )
    # exactly the context: accepted, but scheduler.py clips the budget to max_req_len - input - 1
    status, answer = post(server, "/generate", gen_body(PROMPT * 3, max_new_tokens=23, ignore_eos=True))
    assert status == 200
    assert finish(answer) == {"type": "length", "length": 21} and len(answer["output_ids"]) == 21


def test_an_input_within_six_tokens_of_the_context_is_refused_by_the_scheduler(make_server: Any) -> None:
    server = make_server(context_length=32)
    status, answer = post(server, "/generate", gen_body(list(range(3, 29)), max_new_tokens=1))
    assert (status, answer) == (
        400,
        {
            "error": {
                "message": "Input length (26 tokens) exceeds the maximum allowed length (26 tokens). Use a "
                "shorter input or enable --allow-auto-truncate."
            }
        },
    )
    assert post(server, "/generate", gen_body(list(range(3, 28)), max_new_tokens=1))[0] == 200


def test_0_5_6_rejects_a_budget_that_exactly_fills_the_context(make_server: Any) -> None:
    server = make_server(version="0.5.6", context_length=32)
    assert post(server, "/generate", gen_body(PROMPT * 3, max_new_tokens=23))[0] == 400


def test_stop_token_ends_with_matched_and_is_kept(make_server: Any) -> None:
    server = make_server(model=ToyModel(eos_at=4))
    status, answer = post(server, "/generate", gen_body(PROMPT, max_new_tokens=10))
    assert status == 200
    assert finish(answer) == {"type": "stop", "matched": 2}
    assert len(answer["output_ids"]) == 4 and answer["output_ids"][-1] == 2
    stop_id = server.model.greedy("default", PROMPT, 1)[0]
    status, answer = post(
        server, "/generate", gen_body(PROMPT, max_new_tokens=10, temperature=0.0, stop_token_ids=[stop_id])
    )
    assert finish(answer) == {"type": "stop", "matched": stop_id} and answer["output_ids"] == [stop_id]
    status, answer = post(server, "/generate", gen_body(PROMPT, max_new_tokens=6, ignore_eos=True))
    assert finish(answer) == {"type": "length", "length": 6}  # ignore_eos: past the EOS at 4


# -- aborts ---------------------------------------------------------------------------------------------


def test_abort_of_a_running_request_returns_its_partial_after_one_more_step(make_server: Any) -> None:
    server = make_server(token_delay_s=0.005)
    bg = Background(server, gen_body(PROMPT, max_new_tokens=4000, ignore_eos=True))
    wait_for(lambda: running(server) == 1 and len(server.rt.running[0].output_ids) >= 3, "some tokens")
    assert post(server, "/abort_request", {"rid": bg.rid}) == (200, "")
    status, answer = bg.result()
    assert status == 200
    assert finish(answer) == {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
    assert 3 < len(answer["output_ids"]) < 4000
    assert len(answer["meta_info"]["output_token_logprobs"]) == len(answer["output_ids"])
    assert answer["meta_info"]["prompt_tokens"] == 3


def test_an_abort_landing_in_the_eos_step_reports_abort_with_the_eos_last(make_server: Any) -> None:
    server = make_server(model=ToyModel(eos_at=3))
    server.inject_abort(after_tokens=2)
    status, answer = post(server, "/generate", gen_body(PROMPT, max_new_tokens=10))
    assert status == 200
    assert finish(answer)["type"] == "abort"
    assert len(answer["output_ids"]) == 3 and answer["output_ids"][-1] == 2


def test_an_abort_landing_in_the_last_budget_step_reports_abort_at_full_budget(make_server: Any) -> None:
    server = make_server()
    server.inject_abort(after_tokens=4)
    _, answer = post(server, "/generate", gen_body(PROMPT, max_new_tokens=5, ignore_eos=True))
    assert finish(answer)["type"] == "abort" and len(answer["output_ids"]) == 5


def test_abort_in_the_waiting_queue(make_server: Any) -> None:
    server = make_server(max_running_requests=1, token_delay_s=0.005)
    first = Background(server, gen_body(PROMPT, max_new_tokens=4000, ignore_eos=True))
    wait_for(lambda: running(server) == 1, "the first request to run")
    second = Background(server, gen_body([7, 8], max_new_tokens=5))
    wait_for(lambda: len(server.rt.waiting) == 1, "the second request to wait")
    assert post(server, "/abort_request", {"rid": second.rid})[0] == 200
    status, answer = second.result()
    assert status == 200
    meta = answer["meta_info"]
    assert meta["finish_reason"] == {"type": "abort", "message": "Abort in waiting queue"}
    assert (
        answer["output_ids"] == [] and meta["output_token_logprobs"] == [] and meta["completion_tokens"] == 0
    )
    assert "prompt_tokens" not in meta
    post(server, "/abort_request", {"abort_all": True})
    assert finish(first.result()[1])["type"] == "abort"


@pytest.mark.parametrize(
    ("version", "ignored_repeat"), [("0.5.23", True), ("0.5.20", True), ("0.5.6", False)]
)
def test_an_abort_before_the_request_reaches_the_scheduler_is_lost(
    make_server: Any, version: str, ignored_repeat: bool
) -> None:
    server = make_server(version=version, dispatch_delay_s=0.3)
    bg = Background(server, gen_body(PROMPT, max_new_tokens=5, ignore_eos=True))
    wait_for(lambda: bg.rid in server.rt.rid_to_state, "the tokenizer manager to hold the rid")
    assert post(server, "/abort_request", {"rid": bg.rid})[0] == 200
    assert post(server, "/abort_request", {"rid": bg.rid})[0] == 200
    status, answer = bg.result()
    assert status == 200 and finish(answer) == {"type": "length", "length": 5}
    assert server.rt.aborts_lost == (1 if ignored_repeat else 2)
    assert server.rt.aborts_ignored == (1 if ignored_repeat else 0)


def test_an_abort_by_rid_prefix_is_dropped_by_the_tokenizer_manager(make_server: Any) -> None:
    server = make_server(token_delay_s=0.005)
    bg = Background(server, gen_body(PROMPT, max_new_tokens=40, ignore_eos=True))
    wait_for(lambda: running(server) == 1, "the request to run")
    assert post(server, "/abort_request", {"rid": bg.rid[:8]})[0] == 200
    assert finish(bg.result()[1]) == {"type": "length", "length": 40}
    assert server.rt.aborts_ignored == 1


def test_abort_all_aborts_every_client(make_server: Any) -> None:
    server = make_server(token_delay_s=0.005)
    mine = Background(server, gen_body(PROMPT, max_new_tokens=4000, ignore_eos=True))
    theirs = Background(server, gen_body([5, 6], max_new_tokens=4000, ignore_eos=True))
    wait_for(lambda: running(server) == 2, "both requests to run")
    assert post(server, "/abort_request", {"abort_all": True})[0] == 200
    assert finish(mine.result()[1])["type"] == finish(theirs.result()[1])["type"] == "abort"


@pytest.mark.parametrize(
    ("version", "code", "status", "body"),
    [
        ("0.5.23", 503, 503, {"object": "error", "message": "m", "type": "503", "param": None, "code": 503}),
        ("0.5.23", 500, 500, {"object": "error", "message": "m", "type": "500", "param": None, "code": 500}),
        ("0.5.23", 400, 400, {"error": {"message": "m"}}),
        ("0.5.23", 429, 429, {"object": "error", "message": "m", "type": "429", "param": None, "code": 429}),
        ("0.5.6", 429, 200, None),  # 0.5.6 maps only 400, 500 and 503 to errors
    ],
)
def test_status_coded_aborts_become_http_errors_and_lose_the_partial(
    make_server: Any, version: str, code: int, status: int, body: Any
) -> None:
    server = make_server(version=version)
    server.inject_abort(after_tokens=2, status_code=code, message="m")
    got_status, got = post(server, "/generate", gen_body(PROMPT, max_new_tokens=10, ignore_eos=True))
    assert got_status == status
    if body is not None:
        assert got == body
    else:
        assert finish(got)["status_code"] == code and len(got["output_ids"]) == 3


def test_retraction_under_memory_pressure_is_invisible_but_counted(make_server: Any) -> None:
    server = make_server(kv_capacity=40, token_delay_s=0.002)
    bodies = [gen_body([i, i + 1], max_new_tokens=30, temperature=0.0, ignore_eos=True) for i in (20, 30)]
    bgs = [Background(server, b) for b in bodies]
    answers = [bg.result() for bg in bgs]
    assert all(status == 200 for status, _ in answers)
    for (_, answer), body in zip(answers, bodies, strict=True):
        assert finish(answer) == {"type": "length", "length": 30}
        assert answer["output_ids"] == server.model.greedy("default", body["input_ids"], 30)
    assert sum(answer["meta_info"]["num_retractions"] for _, answer in answers) >= 1


def test_a_client_that_disconnects_aborts_its_request(make_server: Any) -> None:
    server = make_server(token_delay_s=0.005)
    body = gen_body(PROMPT, max_new_tokens=4000, ignore_eos=True)
    with socket.create_connection(("127.0.0.1", server.port), timeout=DEADLINE_S) as sock:
        data = json.dumps(body).encode()
        head = (
            "POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(data)}\r\n\r\n"
        )
        sock.sendall(head.encode() + data)
        wait_for(lambda: running(server) == 1, "the request to run")
    wait_for(lambda: running(server) == 0 and not server.rt.rid_to_state, "the server to drop the request")


# -- pause, flush, loads -------------------------------------------------------------------------------


def test_pause_abort_returns_partials_and_holds_new_requests_until_continue(make_server: Any) -> None:
    server = make_server(token_delay_s=0.005)
    old = Background(server, gen_body(PROMPT, max_new_tokens=4000, ignore_eos=True))
    wait_for(lambda: running(server) == 1, "the request to run")
    assert post(server, "/pause_generation", {"mode": "abort"}) == (
        200,
        {"message": "Generation paused successfully.", "status": "ok"},
    )
    # pause returned only after the in-flight /generate had been answered (on the server: its client thread
    # may still be reading the answer)
    assert running(server) == 0 and old.rid not in server.rt.rid_to_state
    assert finish(old.result()[1])["type"] == "abort"
    new = Background(server, gen_body([4, 5], max_new_tokens=3))
    wait_for(lambda: new.rid in server.rt.rid_to_state, "the new request to arrive")
    time.sleep(0.1)
    assert new.thread.is_alive() and running(server) == 0
    assert post(server, "/continue_generation", {})[0] == 200
    assert finish(new.result()[1]) == {"type": "length", "length": 3}


def test_pause_retract_keeps_requests_and_allows_a_flush(make_server: Any) -> None:
    server = make_server(token_delay_s=0.005)
    bg = Background(server, gen_body(PROMPT, max_new_tokens=60, temperature=0.0, ignore_eos=True))
    wait_for(lambda: running(server) == 1, "the request to run")
    assert post(server, "/pause_generation", {"mode": "retract"})[0] == 200
    assert running(server) == 0 and len(server.rt.waiting) == 1
    assert call(server, "POST", "/flush_cache")[0] == 200
    assert post(server, "/continue_generation", {})[0] == 200
    status, answer = bg.result()
    assert status == 200
    assert finish(answer) == {"type": "length", "length": 60} and answer["meta_info"]["num_retractions"] == 1
    assert answer["output_ids"] == server.model.greedy("default", PROMPT, 60)


def test_flush_cache_is_refused_while_requests_run(make_server: Any) -> None:
    server = make_server(token_delay_s=0.005)
    bg = Background(server, gen_body(PROMPT, max_new_tokens=4000, ignore_eos=True))
    wait_for(lambda: running(server) == 1, "the request to run")
    assert call(server, "POST", "/flush_cache") == (400, b"Flush cache failed.\n")
    post(server, "/abort_request", {"abort_all": True})
    bg.result()
    status, text = call(server, "POST", "/flush_cache")
    assert status == 200 and text.startswith(b"Cache flushed.")


@pytest.mark.parametrize("version", ["0.5.6", "0.5.20", "0.5.21", "0.5.23"])
def test_server_info_version_and_the_load_endpoints(make_server: Any, version: str) -> None:
    server = make_server(version=version, context_length=512)
    info = get(server, "/server_info")[1]
    assert info["version"] == version and info["max_req_input_len"] == 512 - 1 - 5
    status, loads = get(server, "/v1/loads?include=core")
    if version == "0.5.6":
        assert (status, loads) == (404, {"detail": "Not Found"})
        assert get(server, "/get_load")[0] == 200
    else:
        assert status == 200 and loads["version"] == version
        assert loads["loads"][0]["num_running_reqs"] == loads["loads"][0]["num_waiting_reqs"] == 0
    assert (get(server, "/get_load")[0] == 200) == (version in ("0.5.6", "0.5.20"))


def test_v1_loads_counts_running_and_waiting(make_server: Any) -> None:
    server = make_server(max_running_requests=1, token_delay_s=0.005)
    bgs = [Background(server, gen_body([i], max_new_tokens=4000, ignore_eos=True)) for i in (3, 4)]

    def core() -> dict[str, Any]:
        loads: dict[str, Any] = get(server, "/v1/loads?include=core")[1]["loads"][0]
        return loads

    wait_for(
        lambda: (core()["num_running_reqs"], core()["num_waiting_reqs"]) == (1, 1), "one running, one waiting"
    )
    post(server, "/abort_request", {"abort_all": True})
    for bg in bgs:
        bg.result()
    wait_for(lambda: core()["num_running_reqs"] + core()["num_waiting_reqs"] == 0, "an idle snapshot")
    assert get(server, "/v1/loads?include=bogus")[0] == 500


def test_health_is_a_probe_that_fails_while_paused(make_server: Any) -> None:
    server = make_server(health_timeout_s=0.2)
    assert call(server, "GET", "/health") == (200, b"")
    post(server, "/pause_generation", {"mode": "in_place"})
    assert call(server, "GET", "/health_generate")[0] == 503
    post(server, "/continue_generation", {})
    assert call(server, "GET", "/health")[0] == 200


# -- weights ------------------------------------------------------------------------------------------


def test_update_weights_from_disk_takes_a_directory_only(make_server: Any, tmp_path: Path) -> None:
    server = make_server()
    weights_file = tmp_path / "v000001.safetensors"
    weights_file.write_bytes(b"")
    status, answer = post(
        server, "/update_weights_from_disk", {"model_path": str(weights_file), "weight_version": "1"}
    )
    assert status == 400 and answer["success"] is False and answer["num_paused_requests"] == 0
    assert answer["message"] == (
        f"Failed to get weights iterator: Repo id must be in the form 'repo_name' or 'namespace/repo_name': "
        f"'{weights_file}'. Use `repo_type` argument if needed.."
    )
    empty = tmp_path / "empty"
    empty.mkdir()
    status, answer = post(server, "/update_weights_from_disk", {"model_path": str(empty)})
    assert (
        answer["message"] == f"Failed to get weights iterator: Cannot find any model weights with `{empty}`."
    )
    before = post(server, "/generate", gen_body(PROMPT, max_new_tokens=5, temperature=0.0))[1]
    status, answer = post(
        server,
        "/update_weights_from_disk",
        {"model_path": str(tmp_path), "weight_version": "1", "flush_cache": True},
    )
    assert (status, answer["success"]) == (200, True)
    assert answer["message"] == "Succeeded to update model weights. Weight version updated to 1."
    info = get(server, "/model_info")[1]
    assert info["weight_version"] == "1" and info["model_path"] == str(tmp_path)
    assert server.rt.loaded_weight_files == [[str(weights_file)]]
    (tmp_path / "v000002.safetensors").write_bytes(b"")
    assert post(server, "/update_weights_from_disk", {"model_path": str(tmp_path)})[0] == 200
    assert server.rt.loaded_weight_files[-1] == [str(weights_file), str(tmp_path / "v000002.safetensors")]
    after = post(server, "/generate", gen_body(PROMPT, max_new_tokens=5, temperature=0.0))[1]
    assert after["meta_info"]["weight_version"] == "1"
    assert before["output_ids"] != after["output_ids"]  # new weights, new tokens


def test_update_weights_from_disk_waits_for_running_requests(make_server: Any, tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(b"")
    server = make_server(token_delay_s=0.005)
    bg = Background(server, gen_body(PROMPT, max_new_tokens=40, ignore_eos=True))
    wait_for(lambda: running(server) == 1, "the request to run")
    status, _ = post(
        server, "/update_weights_from_disk", {"model_path": str(tmp_path), "weight_version": "2"}
    )
    assert status == 200
    # the writer lock waited for the running /generate: it had finished, under the weights it started with,
    # before the update answered (its client thread may still be reading the answer)
    assert running(server) == 0
    answer = bg.result()[1]
    assert finish(answer) == {"type": "length", "length": 40}
    assert answer["meta_info"]["weight_version"] == "default"


@pytest.mark.parametrize("version", ["0.5.21", "0.5.23"])
def test_a_refused_flush_after_a_weight_update(make_server: Any, version: str, tmp_path: Path) -> None:
    """Paused in place with a request running, the update loads but the cache cannot be flushed: 0.5.23
    answers 400 (the weights did change); before, an assert kills the scheduler and the server with it."""
    (tmp_path / "model.safetensors").write_bytes(b"")
    server = make_server(version=version, token_delay_s=0.005)
    bg = Background(server, gen_body(PROMPT, max_new_tokens=4000, ignore_eos=True))
    wait_for(lambda: running(server) == 1, "the request to run")
    assert post(server, "/pause_generation", {"mode": "in_place"})[0] == 200
    body = {"model_path": str(tmp_path), "weight_version": "2", "flush_cache": True}
    if version == "0.5.23":
        status, answer = post(server, "/update_weights_from_disk", body)
        assert status == 400 and answer["message"].startswith(
            "Weights were updated, but the cache was not flushed"
        )
        assert get(server, "/model_info")[1]["weight_version"] == "default"
        post(server, "/continue_generation", {})
        post(server, "/abort_request", {"abort_all": True})
        assert bg.result()[1]["meta_info"]["weight_versions"][-1]["version"] == "2"
    else:
        with pytest.raises((ConnectionError, http.client.HTTPException)):
            post(server, "/update_weights_from_disk", body)
        with pytest.raises((ConnectionError, http.client.HTTPException)):
            bg.result()
        wait_for(lambda: not server.running, "the server to die")


class RankZero:
    """The trainer's side of a weights-update group (rank 0), formed as april's hub forms it
    (april.broadcast_group): a TCPStore it hosts, its own rank of the group on a thread."""

    def __init__(self, world_size: int = 2, group: str = "g") -> None:
        from april.broadcast_group import open_store
        from april.ports import free_ports

        self.port = free_ports(1)[0]
        self.world_size, self.group_name = world_size, group
        self.store = open_store("127.0.0.1", self.port, DEADLINE_S, bind=True)
        self.group: Any = None
        self._thread = threading.Thread(target=self._form, daemon=True)
        self._thread.start()

    def _form(self) -> None:
        from april.broadcast_group import open_group

        self.group = open_group(self.store, self.group_name, 0, self.world_size, "127.0.0.1", DEADLINE_S)

    def body(self, rank: int = 1) -> dict[str, Any]:
        """An /init_weights_update_group body joining this group at `rank`."""
        return {
            "master_address": "127.0.0.1", "master_port": self.port, "rank_offset": rank,
            "world_size": self.world_size, "group_name": self.group_name, "backend": "gloo",
        }  # fmt: skip

    def formed(self) -> None:
        self._thread.join(DEADLINE_S)
        assert self.group is not None, "rank 0 did not form its group"

    def send(self, *tensors: Any) -> threading.Thread:
        """Broadcast `tensors` in turn, on a thread (a receiving server blocks until they come)."""
        from april.broadcast_group import await_work, start_broadcast

        def run() -> None:
            for tensor in tensors:
                await_work(start_broadcast(self.group, tensor), DEADLINE_S)

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        return thread


def test_weight_update_group_session_and_a_real_broadcast(make_server: Any) -> None:
    """0.5.21+: updates only inside begin/end; the group must have been joined (a real gloo group with the
    trainer's rank 0); a per-tensor update receives each tensor by its own broadcast."""
    import torch

    server = make_server(version="0.5.23")
    dist = {"names": ["w"], "dtypes": ["bfloat16"], "shapes": [[2]], "group_name": "g",
            "flush_cache": False, "weight_version": "9"}  # fmt: skip
    status, answer = post(server, "/update_weights_from_distributed", dist)
    assert (
        status == 400
        and "must run between begin_weight_update() and end_weight_update()" in answer["message"]
    )
    assert post(server, "/begin_weight_update", {"selector": "all"}) == (
        200,
        {"success": True, "message": "Success"},
    )
    status, answer = post(server, "/begin_weight_update", {"selector": "all"})
    assert (status, answer["message"]) == (
        400,
        "a weight-update session is already open; call end_weight_update() first",
    )
    status, answer = post(server, "/update_weights_from_distributed", dist)
    assert status == 400 and answer["message"].startswith("Failed to receive weights: Group g not in")

    root = RankZero()
    assert post(server, "/init_weights_update_group", root.body()) == (
        200, {"success": True, "message": "Succeeded to initialize custom process group."}
    )  # fmt: skip
    root.formed()
    status, answer = post(server, "/init_weights_update_group", root.body())
    assert status == 400 and "already been created" in answer["message"]  # one group per name
    sending = root.send(torch.tensor([1.5, -2.0], dtype=torch.bfloat16))
    status, answer = post(server, "/update_weights_from_distributed", dist)
    sending.join(DEADLINE_S)
    assert status == 200 and answer["message"].endswith("Weight version updated to 9.")
    assert server.rt.distributed_updates == [["w"]]
    assert post(server, "/end_weight_update", {})[0] == 200
    status, answer = post(server, "/end_weight_update", {})
    assert (status, answer["message"]) == (
        400,
        "no weight-update session is open; call begin_weight_update() first",
    )
    assert get(server, "/model_info")[1]["weight_version"] == "9"
    assert post(server, "/destroy_weights_update_group", {"group_name": "g"})[0] == 200
    status, answer = post(server, "/destroy_weights_update_group", {"group_name": "g"})
    assert (status, answer["message"]) == (400, "The group to be destroyed does not exist.")


def test_no_weight_update_session_before_0_5_21(make_server: Any) -> None:
    import torch

    server = make_server(version="0.5.20")
    assert post(server, "/begin_weight_update", {"selector": "all"}) == (404, {"detail": "Not Found"})
    root = RankZero(group="weight_update_group")  # the request's default group name
    body = {k: v for k, v in root.body().items() if k != "group_name"}
    assert post(server, "/init_weights_update_group", body)[0] == 200
    root.formed()
    sending = root.send(torch.zeros(2, dtype=torch.bfloat16))
    dist = {"names": ["w"], "dtypes": ["bfloat16"], "shapes": [[2]], "weight_version": "3"}
    assert post(server, "/update_weights_from_distributed", dist)[0] == 200
    sending.join(DEADLINE_S)


def test_a_flattened_bucket_is_one_broadcast_of_aligned_tensors(make_server: Any, tmp_path: Path) -> None:
    """load_format "flattened_bucket": the tensors back to back as one uint8 broadcast, each at a multiple
    of its element size (tensor_bucket.py: FlattenedTensorBucket.empty), rebuilt and loaded by name."""
    import torch
    from safetensors.torch import load_file

    from april.hf import make_tiny_model

    model_dir = make_tiny_model(tmp_path / "m", seed=0)
    server = make_server(model_dir=str(model_dir))
    root = RankZero()
    assert post(server, "/init_weights_update_group", root.body())[0] == 200
    root.formed()
    launch = load_file(str(model_dir / "model.safetensors"))
    norm, q = "model.norm.weight", "model.layers.0.self_attn.q_proj.weight"
    new = {norm: torch.full_like(launch[norm], 0.5), q: torch.full_like(launch[q], -0.25)}
    flat = torch.cat([new[norm].reshape(-1).view(torch.uint8), new[q].reshape(-1).view(torch.uint8)])
    names, shapes = [norm, q], [list(new[norm].shape), list(new[q].shape)]
    dtypes = [str(new[norm].dtype).removeprefix("torch."), str(new[q].dtype).removeprefix("torch.")]
    bucket = {"names": names, "dtypes": dtypes, "shapes": shapes, "group_name": "g",
              "load_format": "flattened_bucket", "flush_cache": False}  # fmt: skip
    assert post(server, "/begin_weight_update", {"selector": "all"})[0] == 200
    sending = root.send(flat)
    status, answer = post(server, "/update_weights_from_distributed", bucket)
    sending.join(DEADLINE_S)
    assert status == 200, answer
    for name in (norm, q):
        status, got = post(server, "/get_weights_by_name", {"name": name, "truncate_size": 1 << 20})
        assert status == 200 and torch.equal(torch.tensor(got), new[name].float())
    unaligned = {**bucket, "names": ["a", "b"], "dtypes": ["bfloat16", "float32"], "shapes": [[3], [2]]}
    status, answer = post(server, "/update_weights_from_distributed", unaligned)  # refused before receiving
    assert (
        status == 400
        and "Unaligned received tensor b: byte offset 6, dtype torch.float32" in answer["message"]
    )
    assert post(server, "/end_weight_update", {})[0] == 200


@pytest.mark.parametrize(("architecture", "readable"), [("llama", True), ("qwen2", False), ("qwen3", False)])
def test_get_weights_by_name_reads_as_sglangs_model_classes_do(
    make_server: Any, tmp_path: Path, architecture: str, readable: bool
) -> None:
    """models/llama.py answers HF names from its stacked parameters (first `truncate_size` rows, k and v at
    offsets computed from hidden_size // num_attention_heads); qwen2.py and qwen3.py have no
    get_weights_by_name: "Get parameter by name failed" (http_server.py), as for an unknown name."""
    import torch
    from safetensors.torch import load_file

    from april.hf import make_tiny_model

    model_dir = make_tiny_model(tmp_path / "m", seed=0, kv_heads=2, architecture=architecture)
    server = make_server(model_dir=str(model_dir))
    launch = load_file(str(model_dir / "model.safetensors"))
    for name in (
        "model.layers.1.self_attn.k_proj.weight",
        "model.layers.0.mlp.up_proj.weight",
        "lm_head.weight",
    ):
        status, got = post(server, "/get_weights_by_name", {"name": name, "truncate_size": 3})
        if not readable:
            assert (status, got) == (400, {"error": {"message": "Get parameter by name failed"}})
            continue
        assert status == 200 and torch.equal(torch.tensor(got), launch[name][:3].float()), name
    status, got = post(server, "/get_weights_by_name", {"name": "model.nothing.weight"})
    assert (status, got) == (400, {"error": {"message": "Get parameter by name failed"}})


def test_disk_updates_load_the_files_and_tokens_follow_the_weights(make_server: Any, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    from april.hf import make_tiny_model

    model_dir = make_tiny_model(tmp_path / "m", seed=0)
    server = make_server(model_dir=str(model_dir))
    assert get(server, "/model_info")[1]["model_path"] == str(model_dir)  # model_path defaults to it
    first = post(server, "/generate", gen_body(PROMPT, max_new_tokens=6, top_k=1))[1]["output_ids"]
    version_dir = tmp_path / "v1"
    version_dir.mkdir()
    other = load_file(str(make_tiny_model(tmp_path / "other", seed=1) / "model.safetensors"))
    save_file(other, str(version_dir / "model.safetensors"))
    body = {"model_path": str(version_dir), "weight_version": "1", "flush_cache": True}
    assert post(server, "/update_weights_from_disk", body)[0] == 200
    name = "model.layers.0.self_attn.o_proj.weight"
    assert post(server, "/get_weights_by_name", {"name": name, "truncate_size": 1})[1] == [
        other[name][0].float().tolist()
    ]
    second = post(server, "/generate", gen_body(PROMPT, max_new_tokens=6, top_k=1))[1]["output_ids"]
    assert second != first  # what it holds, not its version label, makes the tokens
    (version_dir / "model.safetensors").write_bytes(b"not safetensors")
    status, answer = post(server, "/update_weights_from_disk", {**body, "weight_version": "2"})
    assert status == 400 and answer["message"].startswith("Failed to update weights:")
    assert get(server, "/model_info")[1]["weight_version"] == "1"  # the old weights serve


def test_a_weight_version_change_mid_request_shows_in_the_spans(make_server: Any) -> None:
    server = make_server(token_delay_s=0.005)
    bg = Background(server, gen_body(PROMPT, max_new_tokens=4000, ignore_eos=True))
    wait_for(lambda: running(server) == 1 and len(server.rt.running[0].output_ids) >= 2, "some tokens")
    post(server, "/pause_generation", {"mode": "in_place"})
    n = len(server.rt.running[0].output_ids)
    assert (
        post(server, "/update_weight_version", {"new_version": "v2", "abort_all_requests": False})[0] == 200
    )
    post(server, "/continue_generation", {})
    wait_for(lambda: running(server) == 1 and len(server.rt.running[0].output_ids) >= n + 2, "more tokens")
    post(server, "/abort_request", {"rid": bg.rid})
    meta = bg.result()[1]["meta_info"]
    spans = meta["weight_versions"]
    assert spans[0] == {"version": "default", "start": 0, "end": n} and spans[1]["version"] == "v2"
    assert meta["weight_version"] == "v2"


# -- streaming and sampling ----------------------------------------------------------------------------


def stream(server: FakeSGLangServer, body: dict[str, Any]) -> tuple[int, list[Any]]:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=DEADLINE_S)
    try:
        conn.request(
            "POST", "/generate", body=json.dumps(body).encode(), headers={"Content-Type": "application/json"}
        )
        resp = conn.getresponse()
        events = [line[len(b"data: ") :] for line in resp.read().split(b"\n\n") if line.startswith(b"data: ")]
        return resp.status, [e.decode() if e == b"[DONE]" else json.loads(e) for e in events]
    finally:
        conn.close()


def test_streaming_sends_cumulative_chunks_then_done(make_server: Any) -> None:
    server = make_server(token_delay_s=0.002)
    status, events = stream(server, gen_body(PROMPT, stream=True, max_new_tokens=6, temperature=0.0))
    assert status == 200 and events[-1] == "[DONE]"
    chunks = events[:-1]
    assert len(chunks) == 6
    for i, chunk in enumerate(chunks):
        assert chunk["output_ids"] == chunks[-1]["output_ids"][: i + 1]
        assert len(chunk["meta_info"]["output_token_logprobs"]) == i + 1
    assert [c["meta_info"]["finish_reason"] for c in chunks[:-1]] == [None] * 5
    assert chunks[-1]["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    status, events = stream(server, gen_body(PROMPT, stream=True, max_new_tokens=10**6))
    assert status == 200 and events[-1] == "[DONE]"
    assert events[0]["error"]["message"].startswith("Requested token count exceeds")


def test_sampling_seed_matters_only_with_deterministic_inference(make_server: Any) -> None:
    def two_samples(server: FakeSGLangServer, seed: int | None) -> list[list[int]]:
        extra = {} if seed is None else {"sampling_seed": seed}
        return [
            post(server, "/generate", gen_body(PROMPT, max_new_tokens=8, ignore_eos=True, **extra))[1][
                "output_ids"
            ]
            for _ in range(2)
        ]

    plain = make_server()
    a, b = two_samples(plain, 1)
    assert a != b  # no --enable-deterministic-inference: the seed is not used
    det = make_server(enable_deterministic_inference=True)
    a, b = two_samples(det, 1)
    assert a == b
    a, b = two_samples(det, None)
    assert a == b  # every unseeded request samples with seed 42


def test_greedy_alone_reports_log_probs_at_temperature_one(make_server: Any) -> None:
    server = make_server()
    hot = post(server, "/generate", gen_body(PROMPT, max_new_tokens=4, top_k=1, temperature=0.5))[1]
    cold = post(server, "/generate", gen_body(PROMPT, max_new_tokens=4, top_k=1, temperature=1.0))[1]
    assert hot["output_ids"] == cold["output_ids"]
    assert hot["meta_info"]["output_token_logprobs"] == cold["meta_info"]["output_token_logprobs"]


def test_scripted_http_failures(make_server: Any) -> None:
    server = make_server()
    server.fail_next("/generate", 503, {"error": "overloaded"})
    assert post(server, "/generate", gen_body(PROMPT)) == (503, {"error": "overloaded"})
    server.fail_next("/generate", None)
    with pytest.raises((ConnectionError, http.client.HTTPException)):
        post(server, "/generate", gen_body(PROMPT))
    assert post(server, "/generate", gen_body(PROMPT))[0] == 200


# -- SGLang's own validation --------------------------------------------------------------------------

ROOT = Path(__file__).resolve().parent.parent
SGLANG_PYTHON = Path(os.environ.get("APRIL_SGLANG_PYTHON", ROOT / ".venv-sglang" / "bin" / "python"))


def judge(items: list[dict[str, Any]], vocab_size: int = 1000) -> dict[str, Any]:
    """tests/sglang_validation.py's verdicts on `items`, from the SGLang virtualenv."""
    if not SGLANG_PYTHON.exists():
        pytest.skip(
            f"no SGLang virtualenv at {SGLANG_PYTHON} (set APRIL_SGLANG_PYTHON; see the module docstring)"
        )
    proc = subprocess.run(
        [str(SGLANG_PYTHON), str(ROOT / "tests" / "sglang_validation.py")],
        input=json.dumps({"vocab_size": vocab_size, "items": items}),
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    if proc.returncode != 0:
        if "No module named 'sglang'" in proc.stderr:
            pytest.skip(f"{SGLANG_PYTHON} has no sglang installed")
        raise AssertionError(f"sglang_validation.py failed:\n{proc.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def adapter_calls(
    make_server: Callable[..., FakeSGLangServer], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> tuple[list[tuple[str, dict[str, Any]]], list[dict[str, Any]]]:
    """Every POST body the adapter (actors/engines/sglang_engine.py, sglang_broadcast.py) sends in a
    session that uses each of its calls (generate sampled, greedy, seeded and not, abort by rid, a weights
    load from a directory with a resubmission, a broadcast version joined, received, read back and left),
    recorded on the wire; and the /generate bodies the fakes accepted."""
    import torch

    from actors.engine import GenerationRequest, SamplingParams
    from actors.engines import sglang_http
    from actors.engines.sglang_engine import SGLangEngine
    from actors.weight_receive import Invite, Offer
    from april.broadcast_group import plan
    from april.hf import make_tiny_model

    sent: list[tuple[str, dict[str, Any]]] = []
    send = sglang_http.Exchange.send

    def record(self: sglang_http.Exchange, method: str, path: str, body: Any, timeout_s: float) -> Any:
        if method == "POST":
            sent.append((path, body))
        return send(self, method, path, body, timeout_s)

    monkeypatch.setattr(sglang_http.Exchange, "send", record)
    model_dir = make_tiny_model(tmp_path / "m", seed=0)
    weights = tmp_path / "v000001.safetensors"
    weights.write_bytes(b"")
    accepted: list[dict[str, Any]] = []
    for deterministic, sampling in [
        (True, SamplingParams(temperature=0.7, top_p=0.9, top_k=20, seed=0, stop_token_ids=(2, 5))),
        (False, SamplingParams()),
    ]:
        server = make_server(enable_deterministic_inference=deterministic, token_delay_s=0.005)
        engine = SGLangEngine([server.url], slots=4, sampling=sampling)
        try:
            prompt = np.asarray(PROMPT, dtype=np.int32)
            engine.add([GenerationRequest(1, prompt, 4000), GenerationRequest(2, prompt, 4000, greedy=True)])
            wait_for(partial(generating, server, 2), "both requests to generate")
            engine.load_weights(weights, 1)  # parked by rid, loaded from a directory, resubmitted
            assert len(engine.abort()) == 2
        finally:
            engine.close()
        accepted += server.rt.generate_bodies
    server = make_server(model_dir=str(model_dir))
    engine = SGLangEngine([server.url], slots=1)
    root = RankZero(group="april-test-g1")
    try:
        assert engine.broadcast_servers.ranks() == 1
        engine.broadcast_servers.join(Invite("127.0.0.1", root.port, 1, 2, root.group_name, "gloo"))
        root.formed()
        state = {"model.norm.weight": torch.full((64,), 0.5), "lm_head.weight": torch.zeros(320, 64)}
        specs = [(n, "float32", tuple(t.shape)) for n, t in state.items()]
        manifest = plan(2, specs, 1 << 20, lambda n: tuple(state[n].reshape(-1)[:32].tolist()))
        flat = torch.cat([state[e.name].reshape(-1).view(torch.uint8) for e in manifest.buckets[0].entries])
        sending = root.send(flat)
        engine.load_broadcast(Offer(manifest, root.group_name, 0.0))
        sending.join(DEADLINE_S)
        engine.broadcast_servers.leave(root.group_name)
    finally:
        engine.close()
    return sent, accepted


CONTROL_BODIES = [
    ("/update_weights_from_disk", {"model_path": "/w", "weight_version": "1", "flush_cache": True}),
    ("/abort_request", {"abort_all": True}),
    ("/begin_weight_update", {"selector": "all"}),
    ("/update_weights_from_distributed",
     {"names": ["w"], "dtypes": ["bfloat16"], "shapes": [[2]], "group_name": "april", "flush_cache": False,
      "load_format": "flattened_bucket", "weight_version": "1"}),
    ("/end_weight_update", {}),
    ("/pause_generation", {"mode": "abort"}),
    ("/continue_generation", {}),
]  # fmt: skip

REJECTED_BODIES = [
    gen_body(PROMPT, seed=1),
    gen_body(PROMPT, max_new_tokens=2.5),
    gen_body(PROMPT, top_p=0.0),
    gen_body(PROMPT, top_k=0),
    gen_body(PROMPT, temperature=-1.0),
    gen_body(PROMPT, min_new_tokens=1),
    gen_body(PROMPT, stop="x"),
    {**gen_body(PROMPT), "stream": "yes"},
]


@pytest.mark.sglang
def test_bodies_the_fake_accepts_pass_sglangs_own_validation(
    make_server: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from sglang_validation import CONTROL_TYPES

    sent, accepted = adapter_calls(make_server, tmp_path, monkeypatch)
    generated = [b for p, b in sent if p == "/generate"]
    assert generated and all(b in accepted for b in generated)  # the fake took every one
    assert any("sampling_seed" in b["sampling_params"] for b in generated)  # seeded where honoured
    assert any(b["sampling_params"]["top_k"] == 1 for b in generated)  # greedy
    assert {p for p, _ in sent} >= {"/abort_request", "/update_weights_from_disk", "/begin_weight_update",
                                    "/update_weights_from_distributed", "/end_weight_update",
                                    "/init_weights_update_group", "/get_weights_by_name",
                                    "/destroy_weights_update_group"}  # fmt: skip
    server = make_server()
    extra = gen_body(PROMPT, temperature=0.0, stop_token_ids=[2], ignore_eos=False)
    assert post(server, "/generate", extra)[0] == 200
    for path, body in CONTROL_BODIES:
        if path not in (
            "/update_weights_from_disk",
            "/update_weights_from_distributed",
        ):  # need files, a group
            assert post(server, path, body)[0] == 200, path
    items = [{"path": p, "body": b} for p, b in sent if p == "/generate" or p in CONTROL_TYPES]
    items += [{"path": "/generate", "body": extra}] + [{"path": p, "body": b} for p, b in CONTROL_BODIES]
    result = judge(items)
    print("sglang", result["sglang_version"], "unavailable:", result["unavailable"])
    assert "sampling_params" in result["verdicts"][0], result["unavailable"]
    for item, verdict in zip(items, result["verdicts"], strict=True):
        assert verdict.get("ignored_keys", []) == [], item
        assert [v for k, v in verdict.items() if k != "ignored_keys" and v is not None] == [], (item, verdict)


@pytest.mark.sglang
def test_bodies_the_fake_rejects_are_rejected_by_sglang_with_the_same_contract_text(make_server: Any) -> None:
    server = make_server()
    answers = [post(server, "/generate", body) for body in REJECTED_BODIES]
    assert all(status == 400 for status, _ in answers), answers
    result = judge([{"path": "/generate", "body": b} for b in REJECTED_BODIES])
    assert "sampling_params" in result["verdicts"][0], result["unavailable"]
    for (_, answer), verdict, body in zip(answers, result["verdicts"], REJECTED_BODIES, strict=True):
        assert any(v is not None for v in verdict.values()), (body, verdict)
        if isinstance(answer.get("error"), str):  # the fake's contract gate: SGLang's decoder agrees verbatim
            if "contract" in verdict:
                assert verdict["contract"] == f"JsonContractError: {answer['error']}", verdict
        elif verdict.get("sampling_params") is not None:
            message = answer["error"]["message"]
            assert verdict["sampling_params"].split(": ", 1)[1] == message, (verdict, message)
