"""A fake SGLang server that behaves like the real one over HTTP, rebuilt from SGLang's source.

Served as SGLang serves (sglang/srt/entrypoints/http_server.py: _setup_and_run_http_server): an ASGI app
under uvicorn, here pinned to the h11 parser, which a plain `pip install sglang` gets (uvicorn without
httptools). So the request target is routed exactly as there: an absolute-form target
(`POST http://host:port/generate`) is taken as the path and answered 404 `{"detail":"Not Found"}` by the
router, like FastAPI's. The app is a plain ASGI callable (no FastAPI): it reproduces FastAPI's and SGLang's
answers by hand, each citing the SGLang function it imitates (paths inside the wheel, `sglang/srt/`
omitted). What happens behind the routes (validation, scheduling, aborts, weights) is
tests/sglang_runtime.py's.

Use: `with FakeSGLangServer(version="0.5.23", context_length=512) as server: ... server.url ...`.
`stop()` kills it like a crashed process (listening socket closed, open connections reset, state lost);
`start()` brings it back on the same port with its launch configuration (weight_version included), as a
restarted server would. Scripted failures: `fail_next` (an HTTP answer or a dropped connection before the
route runs), `inject_abort` (an abort landing at a chosen token), `ToyModel(eos_at=...)`,
`kv_capacity` (retraction and OOM aborts), `dispatch_delay_s` (the window in which aborts are lost),
`fault_next_update` (a distributed update received wrong, or not applied).

Weights (tests/sglang_weights.py): launched with `model_dir`, it holds that model's tensors under SGLang's
names and its tokens depend on them; /update_weights_from_disk loads the directory's safetensors,
/init_weights_update_group joins a real gloo group the way SGLang does and /update_weights_from_distributed
receives real broadcasts on it (flattened buckets or one per tensor), /get_weights_by_name reads them back.
Without `model_dir` it holds nothing: disk updates only record their files, distributed ones still receive.

Does not model: text prompts (token ids only, like --skip-tokenizer-init), batch requests, n > 1,
multimodal, LoRA, sessions, OpenAI routes, NCCL, tensor parallelism.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import torch
import uvicorn
from sglang_contract import Features, RequestError, check_contract, parse_version
from sglang_runtime import InjectedAbort, ReqState, Runtime, RuntimeConfig, ToyModel
from sglang_weights import weight_files

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]

JSON = "application/json"


@dataclass(frozen=True, slots=True)
class Answer:
    status: int
    body: bytes = b""
    content_type: str = JSON


def json_answer(status: int, data: Any) -> Answer:
    return Answer(status, json.dumps(data).encode(), JSON)


def error_answer(e: RequestError) -> Answer:
    """The body shapes of SGLang's error paths (http_server.py)."""
    if e.kind == "contract":  # generate_request: {"error": contract_error}
        return json_answer(e.status, {"error": e.message})
    if e.kind == "validation":  # the RequestValidationError handler: ErrorResponse with code 400
        return json_answer(400, error_response(e.message, "Bad Request", 400))
    if e.kind == "http_exception":  # the HTTPException handler: ErrorResponse with type str(status)
        return json_answer(e.status, error_response(e.message, str(e.status), e.status))
    if e.kind == "internal":  # an exception nothing catches: Starlette's ServerErrorMiddleware
        return Answer(500, b"Internal Server Error", "text/plain; charset=utf-8")
    return json_answer(e.status, {"error": {"message": e.message}})  # _create_error_response


def error_response(message: str, type_: str, code: int) -> dict[str, Any]:
    """entrypoints/openai/protocol.py: ErrorResponse.model_dump()."""
    return {"object": "error", "message": message, "type": type_, "param": None, "code": code}


@dataclass(slots=True)
class ScriptedFailure:
    path: str
    status: int | None  # None: drop the connection without an answer
    body: bytes
    times: int


class FakeSGLangServer:
    """See the module docstring. Keyword arguments other than host/port are RuntimeConfig fields."""

    def __init__(self, *, host: str = "127.0.0.1", port: int = 0, **config: Any) -> None:
        self.cfg = RuntimeConfig(**config)
        self.host = host
        self.port = port
        self.failures: list[ScriptedFailure] = []
        self.calls: list[tuple[str, str]] = []  # (method, target path) of every request, in order
        self.runtime: Runtime | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._uvicorn: uvicorn.Server | None = None
        self._routes: dict[str, tuple[frozenset[str], Callable[..., Awaitable[Answer | None]]]] = {}
        self._build_routes()

    # -- lifecycle ----------------------------------------------------------------------------------

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, timeout_s: float = 60.0) -> None:
        """Listen (on the same port as before, if it ran already) and serve in a background thread."""
        if self.running:
            raise RuntimeError("fake SGLang server already running")
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self.port))
        sock.listen(128)
        sock.setblocking(False)
        self.port = sock.getsockname()[1]
        config = uvicorn.Config(
            self._asgi,
            interface="asgi3",
            http="h11",  # the parser a plain `pip install sglang` gets (no httptools)
            loop="asyncio",
            lifespan="off",
            log_level="error",
            access_log=False,
            timeout_graceful_shutdown=1,
        )
        self._uvicorn = uvicorn.Server(config)
        ready = threading.Event()
        self._thread = threading.Thread(
            target=self._serve, args=(sock, ready), daemon=True, name="fake-sglang"
        )
        self._thread.start()
        if not ready.wait(timeout_s) or not self._uvicorn.started:
            self.stop()
            raise RuntimeError(f"fake SGLang server did not start within {timeout_s:g}s")

    def _serve(self, sock: socket.socket, ready: threading.Event) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        assert self._uvicorn is not None
        server = self._uvicorn

        async def main() -> None:
            self.runtime = Runtime(self.cfg)
            self.runtime.on_crash = self._kill  # called in the loop: reset the connections at once
            serve = asyncio.ensure_future(server.serve(sockets=[sock]))
            while not server.started and not serve.done():
                await asyncio.sleep(0.01)
            ready.set()
            await serve

        try:
            loop.run_until_complete(main())
        finally:
            ready.set()
            with contextlib.suppress(Exception):
                loop.run_until_complete(self.runtime.close()) if self.runtime else None
            loop.close()

    def _kill(self) -> None:
        """In the loop: what a killed process looks like to clients (resets, then refused connections)."""
        server = self._uvicorn
        if server is None:
            return
        server.should_exit = True
        server.force_exit = True
        # A dying process loses its listening socket with its connections (the kernel closes every fd at
        # exit); uvicorn would keep accepting until its next 0.1 s tick and answer from the dead state.
        for listener in getattr(server, "servers", []):
            listener.close()
        for conn in list(server.server_state.connections):
            transport = getattr(conn, "transport", None)
            if transport is not None:
                transport.abort()
        if self.runtime is not None:
            self.runtime.crashed = True
            self.runtime.groups.close()

    def stop(self, timeout_s: float = 60.0) -> None:
        """Kill the server (idempotent). Its state is lost; `start()` serves again on the same port."""
        loop, thread = self._loop, self._thread
        if loop is not None and thread is not None and thread.is_alive():
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(self._kill)
            thread.join(timeout_s)
        self._thread = None

    def __enter__(self) -> FakeSGLangServer:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- scripting (call from the test thread) -----------------------------------------------------

    def fail_next(self, path: str, status: int | None = None, body: Any = None, times: int = 1) -> None:
        """The next `times` requests to `path` get `status` with `body` (JSON-encoded unless bytes), or,
        with status None, a connection closed without an answer; the route does not run."""
        raw = body if isinstance(body, bytes) else b"" if body is None else json.dumps(body).encode()
        self.failures.append(ScriptedFailure(path, status, raw, times))

    def fault_next_update(self, fault: str, times: int = 1) -> None:
        """The next `times` /update_weights_from_distributed calls receive their broadcast but spoil it:
        "flip" loads every byte XOR 0x5A (received wrong), "drop" loads nothing (received, not applied);
        both answer success, as a server that does not notice would."""
        if fault not in ("flip", "drop"):
            raise ValueError(f"fault {fault!r}: expected 'flip' or 'drop'")
        self._in_loop(lambda rt: rt.faults.extend([fault] * times))

    def inject_abort(
        self,
        after_tokens: int,
        rid_prefix: str = "",
        status_code: int | None = None,
        message: str | None = None,
    ) -> None:
        """Abort the first running request matching `rid_prefix` once it has `after_tokens` tokens (see
        sglang_runtime.InjectedAbort): its next step still samples a token, then it ends as abort."""
        self._in_loop(
            lambda rt: rt.injected_aborts.append(
                InjectedAbort(after_tokens, rid_prefix, status_code, message)
            )
        )

    def _in_loop(self, fn: Callable[[Runtime], None]) -> None:
        done = threading.Event()
        assert self._loop is not None

        def call() -> None:
            try:
                assert self.runtime is not None
                fn(self.runtime)
            finally:
                done.set()

        self._loop.call_soon_threadsafe(call)
        if not done.wait(60):
            raise RuntimeError("fake SGLang server loop did not answer")

    @property
    def model(self) -> ToyModel:
        return self.cfg.model

    # -- ASGI --------------------------------------------------------------------------------------

    async def _asgi(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return
        path, method = scope["path"], scope["method"]
        self.calls.append((method, path))
        body = await _read_body(receive) if method in ("POST", "PUT") else b""
        for failure in self.failures:
            if failure.path == path and failure.times > 0:
                failure.times -= 1
                if failure.status is None:
                    self._drop(scope)
                    return
                await _respond(send, Answer(failure.status, failure.body))
                return
        route = self._routes.get(path)
        if route is None:  # Starlette's Router.not_found -> FastAPI's http_exception_handler
            await _respond(send, json_answer(404, {"detail": "Not Found"}))
            return
        methods, handler = route
        if method not in methods:
            await _respond(send, json_answer(405, {"detail": "Method Not Allowed"}))
            return
        query = scope.get("query_string", b"").decode()
        answer = await handler(body=body, query=query, receive=receive, send=send)
        if answer is not None:
            await _respond(send, answer)

    def _drop(self, scope: Scope) -> None:
        """Reset the connection `scope` arrived on, without an answer."""
        assert self._uvicorn is not None
        for conn in list(self._uvicorn.server_state.connections):
            cycle = getattr(conn, "cycle", None)
            if cycle is not None and cycle.scope is scope:
                conn.transport.abort()

    def _build_routes(self) -> None:
        f = self.cfg
        feats = Features(parse_version(f.version))
        get, post, both = frozenset({"GET"}), frozenset({"POST"}), frozenset({"GET", "POST"})
        r = self._routes
        r["/generate"] = (frozenset({"POST", "PUT"}), self._generate)
        r["/abort_request"] = (post, self._abort_request)
        r["/pause_generation"] = (post, self._pause_generation)
        r["/continue_generation"] = (post, self._continue_generation)
        r["/flush_cache"] = (both, self._flush_cache)
        r["/update_weights_from_disk"] = (post, self._update_weights_from_disk)
        r["/init_weights_update_group"] = (post, self._init_weights_update_group)
        r["/destroy_weights_update_group"] = (post, self._destroy_weights_update_group)
        r["/get_weights_by_name"] = (both, self._get_weights_by_name)
        r["/update_weights_from_distributed"] = (post, self._update_weights_from_distributed)
        r["/update_weight_version"] = (post, self._update_weight_version)
        r["/model_info"] = r["/get_model_info"] = (get, self._model_info)
        r["/server_info"] = r["/get_server_info"] = (get, self._server_info)
        r["/health"] = r["/health_generate"] = (get, self._health)
        if feats.ready_endpoint:
            r["/ready"] = (get, self._ready)
        if feats.loads_endpoint:
            r["/v1/loads"] = (get, self._v1_loads)
        if feats.legacy_endpoints:
            r["/get_load"] = (get, self._get_load)
            r["/weight_version"] = r["/get_weight_version"] = (get, self._weight_version)
        if feats.weight_update_session:
            r["/begin_weight_update"] = (post, self._begin_weight_update)
            r["/end_weight_update"] = (post, self._end_weight_update)

    @property
    def rt(self) -> Runtime:
        assert self.runtime is not None
        return self.runtime

    # -- /generate ------------------------------------------------------------------------------------

    async def _generate(self, body: bytes, receive: Receive, send: Send, **_: Any) -> Answer | None:
        """http_server.py: generate_request / serve_generate_request + tokenizer_manager.py:
        generate_request, _wait_one_response, _handle_abort_finish_reason."""
        rt = self.rt
        try:
            obj = parse_json_object(body)
            if rt.features.contract_check:
                check_contract(obj)
        except RequestError as e:
            return error_answer(e)
        if obj.get("stream"):
            await self._generate_stream(obj, send)
            return None
        try:
            state = rt.admit(obj)
        except RequestError as e:
            return error_answer(e)
        watcher = asyncio.ensure_future(_on_disconnect(receive, lambda: rt.abort_request(state.rid)))
        try:
            out = await self._run(state, obj)
        except RequestError as e:
            return error_answer(e)
        finally:
            watcher.cancel()
        fr = out["meta_info"].get("finish_reason") or {}
        status = fr.get("status_code") if isinstance(fr, dict) else None
        if fr.get("type") == "abort" and isinstance(status, int) and self._is_error_status(status):
            if status == 400:
                return error_answer(RequestError(400, fr.get("message", "")))
            return error_answer(RequestError(status, fr.get("message", ""), "http_exception"))
        out["meta_info"].setdefault("response_sent_to_client_ts", time.time())  # _stream_one_response
        return json_answer(200, out)

    def _is_error_status(self, status: int) -> bool:
        if self.rt.features.any_abort_status:
            return 400 <= status < 600
        return status in (400, 500, 503)

    async def _run(self, state: ReqState, obj: dict[str, Any]) -> dict[str, Any]:
        """Pause gate, reader lock, validation, dispatch, then wait for the final output."""
        rt = self.rt
        try:
            await rt.wait_unpaused()
            await rt.update_lock.acquire_read()
        except BaseException:
            rt.release(state)
            raise
        try:
            try:
                await rt.prepare(state, obj)
            except BaseException:
                rt.release(state)
                raise
            while True:
                await state.event.wait()
                state.event.clear()
                if rt.crashed:
                    raise ConnectionAbortedError("server killed")
                if state.finished and state.out_list:
                    return state.out_list[-1]
        finally:
            await rt.update_lock.release_read()

    async def _generate_stream(self, obj: dict[str, Any], send: Send) -> None:
        """http_server.py: stream_results: a 200 event stream of cumulative chunks (tokenizer_manager.py:
        _handle_batch_output, incremental_streaming_output False by default), ValueErrors as an error
        chunk, then `data: [DONE]`."""
        rt = self.rt
        await send(
            {
                "type": "http.response.start",
                "status": 200,
                "headers": [(b"content-type", b"text/event-stream; charset=utf-8")],
            }
        )

        async def chunk(data: Any) -> None:
            await send(
                {
                    "type": "http.response.body",
                    "body": b"data: " + json.dumps(data).encode() + b"\n\n",
                    "more_body": True,
                }
            )

        sent_ts = 0.0
        try:
            state = rt.admit(obj)
            await rt.wait_unpaused()
            await rt.update_lock.acquire_read()
            try:
                try:
                    await rt.prepare(state, obj)
                except BaseException:
                    rt.release(state)
                    raise
                while True:
                    await state.event.wait()
                    state.event.clear()
                    if rt.crashed:
                        raise ConnectionAbortedError("server killed")
                    if state.out_list:
                        out, state.out_list = state.out_list[-1], []
                        # _stream_one_response: stamped once, on the first chunk sent
                        if not sent_ts:
                            sent_ts = time.time()
                            out["meta_info"]["response_sent_to_client_ts"] = sent_ts
                        await chunk(out)
                    if state.finished:
                        break
            finally:
                await rt.update_lock.release_read()
        except RequestError as e:
            if e.kind == "internal":
                raise  # the response has started: uvicorn closes the connection mid-stream
            if rt.features.version >= (0, 5, 20):
                await chunk(
                    {
                        "error": {
                            "message": e.message,
                            "type": "invalid_request_error",
                            "code": 400,
                            "retryable": False,
                        }
                    }
                )
            else:
                await chunk({"error": {"message": e.message}})
        await send({"type": "http.response.body", "body": b"data: [DONE]\n\n", "more_body": False})

    # -- control endpoints ----------------------------------------------------------------------------

    async def _abort_request(self, body: bytes, **_: Any) -> Answer:
        """http_server.py: abort_request -> 200 with an empty body, whatever happened."""
        try:
            obj = parse_struct(body, {}, {"rid": (str, None), "abort_all": (bool, False)})
        except RequestError as e:
            return error_answer(e)
        self.rt.abort_request(rid=obj["rid"] or "", abort_all=obj["abort_all"])
        return Answer(200)

    async def _pause_generation(self, body: bytes, **_: Any) -> Answer:
        try:
            obj = parse_struct(body, {}, {"mode": (str, "abort")})
            if obj["mode"] not in ("abort", "retract", "in_place"):
                raise RequestError(
                    400,
                    f"mode: Input should be 'abort', 'retract' or 'in_place' (got {obj['mode']!r})",
                    "validation",
                )
        except RequestError as e:
            return error_answer(e)
        await self.rt.pause(obj["mode"])
        return json_answer(200, {"message": "Generation paused successfully.", "status": "ok"})

    async def _continue_generation(self, body: bytes, **_: Any) -> Answer:
        try:
            parse_struct(body, {}, {"torch_empty_cache": (bool, True)})
        except RequestError as e:
            return error_answer(e)
        await self.rt.resume()
        return json_answer(200, {"message": "Generation continued successfully.", "status": "ok"})

    async def _flush_cache(self, **_: Any) -> Answer:
        """http_server.py: flush_cache: 400 while requests run or wait (scheduler.py: flush_cache)."""
        ok = self.rt.flush_cache()
        text = (
            "Cache flushed.\nPlease check backend logs for more details. "
            "(When there are running or waiting requests, the operation will not be performed.)\n"
        )
        if not ok and self.rt.features.version >= (0, 5, 20):
            text = "Flush cache failed.\n"
        return Answer(200 if ok else 400, text.encode(), "text/plain; charset=utf-8")

    async def _with_update_lock(self, fn: Callable[[], Awaitable[Answer]]) -> Answer:
        """Weight updates take the model_update_lock as writer (waiting for every running /generate and
        holding new ones back) unless the server is paused (tokenizer_manager.py)."""
        rt = self.rt
        if rt.is_pause:
            return await fn()
        await rt.update_lock.acquire_write()
        try:
            return await fn()
        finally:
            await rt.update_lock.release_write()

    async def _update_weights_from_disk(self, body: bytes, **_: Any) -> Answer:
        """http_server.py: update_weights_from_disk; tokenizer_manager.py: update_weights_from_disk;
        weight_updater.py (scheduler and model runner). 200 or 400 with {success, message,
        num_paused_requests}."""
        rt = self.rt
        try:
            obj = parse_struct(
                body,
                {"model_path": str},
                {"load_format": (str, None), "abort_all_requests": (bool, False),
                 "weight_version": (str, None),
                 "flush_cache": (bool, True), "torch_empty_cache": (bool, False), "keep_pause": (bool, False),
                 "recapture_cuda_graph": (bool, False), "is_async": (bool, False), "token_step": (int, 0)},
            )  # fmt: skip
        except RequestError as e:
            return error_answer(e)
        if obj["abort_all_requests"]:
            rt.abort_request(abort_all=True)
        paused_056 = rt.is_pause and rt.features.version < (0, 5, 20)

        async def update() -> Answer:
            if rt.cfg.weights_load_s > 0:
                await asyncio.sleep(rt.cfg.weights_load_s)
            try:
                files = weight_files(obj["model_path"])
            except ValueError as e:
                return _weights_answer(False, f"Failed to get weights iterator: {e}.", paused=True)
            if rt.held is not None:  # weight_updater.py: update_weights_from_disk loads every file
                try:
                    await rt.off_loop(lambda: _load_files(rt, files))
                except Exception as e:
                    return _weights_answer(
                        False,
                        f"Failed to update weights: {e}.\nRolling back to original weights.",
                        paused=True,
                    )
            rt.loaded_weight_files.append(files)
            success, message = True, "Succeeded to update model weights."
            if not paused_056:
                rt._record_scheduler_version(obj["weight_version"])
            if obj["flush_cache"] and not rt.flush_cache():
                if not rt.features.flush_failure_is_reported:
                    rt.crash("Cache flush failed after updating weights")  # an AssertionError
                    raise ConnectionAbortedError("scheduler died")
                success, message = (
                    False,
                    (
                        "Weights were updated, but the cache was not flushed because requests are still "
                        "running or queued. Retract or finish them, then call /flush_cache."
                    ),
                )
            rt.model_path = obj["model_path"]
            if success and obj["weight_version"] is not None and not paused_056:
                rt.set_weight_version(obj["weight_version"])
                message += f" Weight version updated to {obj['weight_version']}."
            return _weights_answer(success, message, paused=True)

        return await self._with_update_lock(update)

    async def _init_weights_update_group(self, body: bytes, **_: Any) -> Answer:
        """http_server.py: init_weights_update_group (no model_update_lock: the scheduler joins between
        batches, blocked until every rank connected); sglang_weights.WeightGroups.init."""
        rt = self.rt
        try:
            obj = parse_struct(
                body,
                {"master_address": str, "master_port": int, "rank_offset": int, "world_size": int},
                {"group_name": (str, "weight_update_group"), "backend": (str, "nccl")},
            )
        except RequestError as e:
            return error_answer(e)
        success, message = await rt.off_loop(
            lambda: rt.groups.init(
                obj["master_address"], obj["master_port"], obj["rank_offset"], obj["world_size"],
                obj["group_name"], obj["backend"],
            )
        )  # fmt: skip
        return _weights_answer(success, message)

    async def _destroy_weights_update_group(self, body: bytes, **_: Any) -> Answer:
        """http_server.py: destroy_weights_update_group."""
        try:
            obj = parse_struct(body, {}, {"group_name": (str, "weight_update_group")})
        except RequestError as e:
            return error_answer(e)
        success, message = self.rt.groups.destroy(obj["group_name"])
        return _weights_answer(success, message)

    async def _get_weights_by_name(self, body: bytes, **_: Any) -> Answer:
        """http_server.py: get_weights_by_name: the first `truncate_size` rows as floats, or 400 "Get
        parameter by name failed" (sglang_weights.HeldModel.get_weights_by_name says when)."""
        rt = self.rt
        try:
            obj = parse_struct(body, {"name": str}, {"truncate_size": (int, 100)})
        except RequestError as e:
            return error_answer(e)
        rt.weights_reads.append(obj["name"])
        held = rt.held
        values = None if held is None else held.get_weights_by_name(obj["name"], obj["truncate_size"])
        if values is None:
            return json_answer(400, {"error": {"message": "Get parameter by name failed"}})
        return json_answer(200, values)

    async def _begin_weight_update(self, body: bytes, **_: Any) -> Answer:
        """weight_updater.py: begin_weight_update: a second begin while a session is open fails (400)."""
        rt = self.rt
        try:
            parse_struct(body, {}, {"selector": (str, "all")})
        except RequestError as e:
            return error_answer(e)

        async def begin() -> Answer:
            if rt.session_open:
                return _weights_answer(
                    False, "a weight-update session is already open; call end_weight_update() first"
                )
            rt.session_open = True
            return _weights_answer(True, "Success")

        return await self._with_update_lock(begin)

    async def _end_weight_update(self, body: bytes, **_: Any) -> Answer:
        rt = self.rt
        try:
            parse_struct(body, {}, {})
        except RequestError as e:
            return error_answer(e)

        async def end() -> Answer:
            if not rt.session_open:
                return _weights_answer(
                    False, "no weight-update session is open; call begin_weight_update() first"
                )
            rt.session_open = False
            return _weights_answer(True, "Success")

        return await self._with_update_lock(end)

    async def _update_weights_from_distributed(self, body: bytes, **_: Any) -> Answer:
        """scheduler_components/weight_updater.py: update_weights_from_distributed (refused outside a session
        from 0.5.21): receive (sglang_weights.WeightGroups.receive) on the group, then load into the held
        model; a scripted fault (`fault_next_update`) spoils what was received."""
        rt = self.rt
        try:
            obj = parse_struct(
                body,
                {"names": list, "dtypes": list, "shapes": list},
                {"group_name": (str, "weight_update_group"), "flush_cache": (bool, True),
                 "abort_all_requests": (bool, False), "weight_version": (str, None),
                 "load_format": (str, None),
                 "selector": (str, "all"), "torch_empty_cache": (bool, False)},
            )  # fmt: skip
        except RequestError as e:
            return error_answer(e)
        if obj["abort_all_requests"]:
            rt.abort_request(abort_all=True)

        async def update() -> Answer:
            if rt.features.weight_update_session and not rt.session_open:
                return _weights_answer(
                    False,
                    "update_weights_from_distributed must run between begin_weight_update() and "
                    "end_weight_update()",
                )
            try:
                weights = await rt.off_loop(
                    lambda: rt.groups.receive(
                        obj["names"], obj["dtypes"], obj["shapes"], obj["group_name"], obj["load_format"]
                    )
                )
            except Exception as e:
                return _weights_answer(False, f"Failed to receive weights: {e}")
            rt.distributed_updates.append([n for n, _ in weights])
            weights = _apply_fault(rt.faults.pop(0) if rt.faults else "", weights)
            if rt.held is not None:
                held = rt.held
                try:
                    await rt.off_loop(lambda: held.load_weights(weights))
                except Exception as e:
                    return _weights_answer(
                        False,
                        f"Failed to update parameter online: {e}. The full weights of the ModelRunner are "
                        "partially updated. Please discard the whole weights.",
                    )
            rt._record_scheduler_version(obj["weight_version"])
            success, message = True, "Succeeded to update parameter online."
            if obj["flush_cache"] and not rt.flush_cache():
                if not rt.features.flush_failure_is_reported:
                    rt.crash("Cache flush failed after updating weights")
                    raise ConnectionAbortedError("scheduler died")
                success, message = (
                    False,
                    (
                        "Weights were updated, but the cache was not flushed because requests are still "
                        "running or queued. Retract or finish them, then call /flush_cache."
                    ),
                )
            if success and obj["weight_version"] is not None:
                rt.set_weight_version(obj["weight_version"])
                message += f" Weight version updated to {obj['weight_version']}."
            return _weights_answer(success, message)

        return await self._with_update_lock(update)

    async def _update_weight_version(self, body: bytes, **_: Any) -> Answer:
        """http_server.py: update_weight_version (abort_all_requests defaults to True)."""
        rt = self.rt
        try:
            obj = parse_struct(body, {"new_version": str}, {"abort_all_requests": (bool, True)})
        except RequestError as e:
            return error_answer(e)
        if obj["abort_all_requests"]:
            rt.abort_request(abort_all=True)
        rt.set_weight_version(obj["new_version"])
        v = obj["new_version"]
        return json_answer(
            200, {"success": True, "message": f"Weight version updated to {v}", "new_version": v}
        )

    # -- information ----------------------------------------------------------------------------------

    async def _model_info(self, **_: Any) -> Answer:
        """http_server.py: model_info."""
        rt = self.rt
        info: dict[str, Any] = {
            "model_path": rt.model_path,
            "tokenizer_path": rt.cfg.model_path,
            "is_generation": True,
            "preferred_sampling_params": None,
            "weight_version": rt.weight_version,
            "has_image_understanding": False,
            "has_audio_understanding": False,
        }
        if rt.features.version >= (0, 5, 20):
            info.update(
                served_model_name=rt.model_path,
                load_format="auto",
                reasoning_parser=None,
                tool_call_parser=None,
            )
            info.update(model_type="fake", architectures=["FakeForCausalLM"])
        return json_answer(200, info)

    async def _server_info(self, **_: Any) -> Answer:
        """http_server.py: server_info: the launch arguments (server_args.resolved_dict()), the scheduler's
        handshake (scheduler.py: get_init_info: max_total_num_tokens, max_req_input_len) and `version`."""
        rt = self.rt
        c = rt.cfg
        return json_answer(200, {
            "model_path": c.model_path, "context_length": c.context_length,
            "skip_tokenizer_init": c.skip_tokenizer_init,
            "max_running_requests": c.max_running_requests, "weight_version": c.weight_version,
            "enable_deterministic_inference": c.enable_deterministic_inference, "random_seed": c.random_seed,
            "max_total_num_tokens": c.kv_capacity, "max_req_input_len": rt.max_req_input_len,
            "internal_states": [{"max_total_num_tokens": c.kv_capacity}], "version": c.version,
            "tp_size": 1, "dp_size": 1,
            "frontend": "python",
        })  # fmt: skip

    async def _health(self, **_: Any) -> Answer:
        """http_server.py: health_generate: a one-token probe, answered after at least one poll; a paused
        server never answers it, so after HEALTH_CHECK_TIMEOUT it is 503."""
        rt = self.rt
        waited = 0.0
        while True:
            await asyncio.sleep(rt.cfg.health_poll_s)
            waited += rt.cfg.health_poll_s
            if not rt.is_pause:
                return Answer(200)
            if waited >= rt.cfg.health_timeout_s:
                return Answer(503)

    async def _ready(self, **_: Any) -> Answer:
        return Answer(200)

    async def _v1_loads(self, query: str, **_: Any) -> Answer:
        """entrypoints/v1_loads.py: get_loads (the scheduler's last published snapshot). An unknown
        include section raises in to_dict, outside the handler's try: an HTTP 500."""
        from urllib.parse import parse_qs

        include = parse_qs(query).get("include", [""])[0]
        sections = {s.strip() for s in include.split(",")} if include else None
        valid = {"core", "memory", "spec", "lora", "disagg", "queues", "all"}
        if sections is not None and not sections <= valid:
            return Answer(500, b"Internal Server Error", "text/plain; charset=utf-8")
        return json_answer(200, {
            "timestamp": datetime.now(UTC).isoformat(), "version": self.cfg.version, "accelerator": None,
            "num_accelerators": 1, "loads": [dict(self.rt.loads_snapshot)],
        })  # fmt: skip

    async def _get_load(self, **_: Any) -> Answer:
        snap = self.rt.loads_snapshot
        row = {
            "dp_rank": 0,
            "num_reqs": snap["num_running_reqs"] + snap["num_waiting_reqs"],
            "num_waiting_reqs": snap["num_waiting_reqs"],
            "num_tokens": snap["num_total_tokens"],
        }
        return json_answer(200, [row])

    async def _weight_version(self, **_: Any) -> Answer:
        return json_answer(200, {"weight_version": self.rt.weight_version})


def _load_files(rt: Runtime, files: list[str]) -> None:
    """Every file's tensors into the held model (read first: a file that cannot be read loads nothing)."""
    from safetensors.torch import load_file

    assert rt.held is not None
    tensors: dict[str, Any] = {}
    for file in files:
        tensors.update(load_file(file))
    rt.held.load_weights(tensors.items())


def _apply_fault(fault: str, weights: list[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """A scripted fault on what a distributed update received: "flip" (every byte XOR 0x5A: received
    wrong) or "drop" (nothing loaded: received, not applied); "" leaves it."""
    if fault == "drop":
        return []
    if fault == "flip":
        spoiled = []
        for name, tensor in weights:
            raw = tensor.clone().reshape(-1).view(torch.uint8)
            raw ^= 0x5A
            spoiled.append((name, raw.view(tensor.dtype).view(tensor.shape)))
        return spoiled
    return weights


def _weights_answer(success: bool, message: str, paused: bool = False) -> Answer:
    body: dict[str, Any] = {"success": success, "message": message}
    if paused:
        body["num_paused_requests"] = 0
    return json_answer(200 if success else 400, body)


def parse_json_object(body: bytes) -> dict[str, Any]:
    """FastAPI's body parsing: invalid JSON or a non-object is a RequestValidationError (400)."""
    try:
        obj = json.loads(body or b"null")
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RequestError(400, f"JSON decode error: {e}", "validation") from None
    if not isinstance(obj, dict):
        raise RequestError(
            400, "Input should be a valid dictionary or object to extract fields from", "validation"
        )
    return obj


def parse_struct(
    body: bytes, required: dict[str, type], optional: dict[str, tuple[type, Any]]
) -> dict[str, Any]:
    """A control endpoint's body (io_struct.py msgspec structs validated by pydantic through
    utils/msgspec_utils.py: msgspec_struct_pydantic_core_schema: unknown keys ignored, missing or
    mistyped fields a 400 RequestValidationError)."""
    if not body.strip():
        raise RequestError(400, "body: Field required", "validation")
    obj = parse_json_object(body)
    out: dict[str, Any] = {}
    for name, (type_, default) in {**{k: (t, ...) for k, t in required.items()}, **optional}.items():
        value = obj.get(name, default)
        if value is ...:
            raise RequestError(400, f"body.{name}: Field required", "validation")
        if value is not None and value is not default and not _is_type(value, type_):
            raise RequestError(400, f"body.{name}: Input should be a valid {type_.__name__}", "validation")
        out[name] = value
    return out


def _is_type(value: Any, type_: type) -> bool:
    if type_ is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if type_ is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    return isinstance(value, type_)


async def _read_body(receive: Receive) -> bytes:
    chunks = []
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            break
    return b"".join(chunks)


async def _on_disconnect(receive: Receive, callback: Callable[[], None]) -> None:
    """tokenizer_manager.py: _stream_one_response aborts a request whose client went away (its partial
    output is lost)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            callback()
            return


async def _respond(send: Send, answer: Answer) -> None:
    headers = [(b"content-length", str(len(answer.body)).encode())]
    if answer.body or answer.content_type != JSON:
        headers.append((b"content-type", answer.content_type.encode()))
    await send({"type": "http.response.start", "status": answer.status, "headers": headers})
    await send({"type": "http.response.body", "body": answer.body})
