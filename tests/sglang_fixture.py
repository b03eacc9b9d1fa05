"""A contract fixture for SGLang's HTTP API: a small threaded server that behaves like the parts of an
SGLang 0.5.x server a rollout worker uses (see actors/engines/sglang_engine.py).

What it reproduces, because the adapter must survive it:
  - request validation as in 0.5.23: unknown `sampling_params` key -> 400 "unknown field", a
    non-integer `max_new_tokens` -> 400, prompt + max_new_tokens over the context length -> 400;
    error bodies shaped `{"error": {"message": ...}}`;
  - a scheduler with `max_running` slots (others wait in a queue) that decodes one token per request
    every `token_delay_s`;
  - the abort races: an abort that arrives before a request reaches the scheduler (`schedule_delay_s`
    after its /generate arrived) is silently lost; a queued request aborts at once with
    `{"type":"abort","message":"Abort in waiting queue"}` and no `prompt_tokens`; a running request
    takes one more decode step and returns its partial tokens and log-probs; from 0.5.21 a repeated
    abort of the same rid is ignored; rids match by prefix;
  - /v1/loads (waiting + running, not the requests still on their way to the scheduler), /server_info,
    /model_info, /update_weights_from_disk (waits for in-flight requests; a missing path fails),
    /flush_cache (400 while requests run), /health, and the NCCL endpoints (recorded; from 0.5.21
    /update_weights_from_distributed outside begin/end -> 400).

Two test hooks make the races above certain rather than likely on a busy machine (never a sleep and a
hope): `stall_at` stops a running request at that many tokens until an abort reaches it, and
`lose_aborts` keeps requests on their way to the scheduler until that many aborts have missed them.

Tokens are a deterministic function of the previous token, so resuming `prompt + partial` continues
exactly the sequence an uninterrupted request would have produced. Token = 10 + (31 * prev + 7) % 5000,
log-prob = -0.1 - (token % 10) / 100. Not an SGLang implementation: only its observable contract.
"""

from __future__ import annotations

import json
import re
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

SAMPLING_KEYS = frozenset(
    {
        "max_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids", "ignore_eos",
        "skip_special_tokens", "no_stop_trim", "min_new_tokens", "n", "repetition_penalty",
        "frequency_penalty", "presence_penalty", "logit_bias", "sampling_seed", "stream_interval",
        "custom_params", "json_schema", "regex", "ebnf", "structural_tag",
    }
)  # fmt: skip


def next_token(prev: int) -> int:
    return 10 + (31 * prev + 7) % 5000


def token_logprob(token: int) -> float:
    return -0.1 - (token % 10) / 100


def expected_tokens(input_ids: list[int], n: int) -> list[int]:
    """What an uninterrupted request generates (before any stop token)."""
    out, prev = [], input_ids[-1]
    for _ in range(n):
        prev = next_token(prev)
        out.append(prev)
    return out


def _version_tuple(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in re.findall(r"\d+", v)[:3])


@dataclass
class _Request:
    rid: str
    input_ids: list[int]
    max_new_tokens: int
    stop_ids: frozenset[int]
    arrived: float
    state: str = "arriving"  # arriving -> waiting -> running -> done
    abort: bool = False
    out: list[int] = field(default_factory=list)
    result: dict[str, Any] | None = None
    done: threading.Event = field(default_factory=threading.Event)


class BadRequest(Exception):
    pass


class FakeSGLangServer:
    """Start with `with FakeSGLangServer(...) as server:`; `server.url` is its base URL."""

    def __init__(
        self,
        *,
        version: str = "0.5.23",
        max_running: int = 4,
        token_delay_s: float = 0.002,
        schedule_delay_s: float = 0.0,
        context_len: int = 4096,
        weight_version: str = "0",
        model_path: str = "fake-model",
        has_loads: bool = True,
        stall_at: int = 0,
        lose_aborts: int = 0,
    ) -> None:
        self.version = version
        self.max_running = max_running
        self.token_delay_s = token_delay_s
        self.schedule_delay_s = schedule_delay_s
        self.context_len = context_len
        self.weight_version = weight_version
        self.model_path = model_path
        self.has_loads = has_loads
        # test hooks: a running request with `stall_at` (> 0) tokens decodes no more until an abort
        # reaches a running request, which also clears `stall_at` (so parked and resumed requests run
        # on); requests leave "arriving" only once `lose_aborts` aborts have been lost
        self.stall_at = stall_at
        self.lose_aborts = lose_aborts
        # observations for tests
        self.calls: list[tuple[str, dict[str, Any]]] = []  # (path, body) of every POST
        self.lost_aborts = 0
        self.ignored_aborts = 0
        self._lock = threading.Condition()
        self._reqs: dict[str, _Request] = {}
        self._aborted_rids: set[str] = set()
        self._in_bracket = False
        self._stop = threading.Event()
        self._http = ThreadingHTTPServer(("127.0.0.1", 0), self._handler_class())
        self._http.daemon_threads = True
        self.url = f"http://127.0.0.1:{self._http.server_address[1]}"
        self._threads = [
            threading.Thread(target=self._http.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True),
            threading.Thread(target=self._schedule_loop, daemon=True),
        ]

    def __enter__(self) -> FakeSGLangServer:
        for t in self._threads:
            t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            for r in self._reqs.values():
                r.done.set()  # release handler threads still waiting
        self._http.shutdown()
        self._http.server_close()
        for t in self._threads:
            t.join(timeout=2)

    def posts(self, path: str) -> list[dict[str, Any]]:
        return [body for p, body in self.calls if p == path]

    def running_tokens(self) -> list[int]:
        """How many tokens each running request has decoded so far (for tests to wait on)."""
        with self._lock:
            return sorted(len(r.out) for r in self._live("running"))

    # -- the scheduler ---------------------------------------------------------------------------

    def _live(self, state: str) -> list[_Request]:
        return [r for r in self._reqs.values() if r.state == state]

    def _schedule_loop(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                now = time.monotonic()
                for r in self._live("arriving"):
                    if now - r.arrived >= self.schedule_delay_s and self.lost_aborts >= self.lose_aborts:
                        r.state = "waiting"
                waiting = self._live("waiting")
                for r in waiting[: max(0, self.max_running - len(self._live("running")))]:
                    r.state = "running"
                for r in self._live("running"):
                    if r.abort or not self.stall_at or len(r.out) < self.stall_at:
                        self._decode(r)
                self._lock.notify_all()
            time.sleep(self.token_delay_s)

    def _decode(self, r: _Request) -> None:
        tok = next_token(r.out[-1] if r.out else r.input_ids[-1])
        r.out.append(tok)
        if r.abort:  # an aborted running request takes this one more step
            self._finish(r, {"type": "abort", "message": "Aborted"})
        elif tok in r.stop_ids:
            self._finish(r, {"type": "stop", "matched": tok})
        elif len(r.out) >= r.max_new_tokens:
            self._finish(r, {"type": "length", "length": len(r.out)})

    def _finish(self, r: _Request, reason: dict[str, Any], queued: bool = False) -> None:
        meta: dict[str, Any] = {
            "id": r.rid,
            "finish_reason": reason,
            "completion_tokens": len(r.out),
            "cached_tokens": 0,
            "weight_version": self.weight_version,
            "e2e_latency": time.monotonic() - r.arrived,
            "output_token_logprobs": [[token_logprob(t), t, None] for t in r.out],
        }
        if not queued:
            meta["prompt_tokens"] = len(r.input_ids)
        r.result = {"output_ids": list(r.out), "meta_info": meta}
        r.state = "done"
        del self._reqs[r.rid]
        r.done.set()

    # -- endpoints ---------------------------------------------------------------------------------

    def generate(self, body: dict[str, Any]) -> dict[str, Any]:
        r = self._validate(body)
        with self._lock:
            if r.rid in self._reqs:
                raise BadRequest(f"Duplicate request ID {r.rid}")
            self._reqs[r.rid] = r
        r.done.wait()
        if r.result is None:
            raise BadRequest("server shutting down")
        return r.result

    def _validate(self, body: dict[str, Any]) -> _Request:
        if "text" in body or not isinstance(body.get("input_ids"), list) or not body["input_ids"]:
            raise BadRequest("input_ids (a non-empty list of ints) is required with --skip-tokenizer-init")
        if body.get("stream"):
            raise BadRequest("fixture: streaming is not implemented")
        ids = body["input_ids"]
        if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise BadRequest("input_ids must be integers")
        sp = body.get("sampling_params") or {}
        for key in sp:
            if key not in SAMPLING_KEYS:
                raise BadRequest(f"sampling_params: unknown field '{key}'")
        mnt = sp.get("max_new_tokens", 128)
        if not isinstance(mnt, int) or isinstance(mnt, bool) or mnt < 0:
            raise BadRequest(f"sampling_params.max_new_tokens must be a non-negative integer, got {mnt!r}")
        if len(ids) + mnt > self.context_len:
            raise BadRequest(
                f"Requested token count exceeds the model's maximum context length of {self.context_len} "
                f"tokens. You requested a total of {len(ids) + mnt} tokens"
            )
        rid = str(body.get("rid") or f"auto{time.monotonic_ns()}")
        stop = frozenset(int(t) for t in sp.get("stop_token_ids") or ())
        return _Request(rid, list(ids), mnt, stop, time.monotonic())

    def abort_request(self, body: dict[str, Any]) -> None:
        with self._lock:
            if body.get("abort_all"):
                targets = list(self._reqs.values())
            else:
                rid = str(body.get("rid", ""))
                if rid in self._aborted_rids and _version_tuple(self.version) >= (0, 5, 21):
                    self.ignored_aborts += 1
                    return
                self._aborted_rids.add(rid)
                targets = [r for r in self._reqs.values() if r.rid.startswith(rid)]
            for r in targets:
                if r.state == "arriving":
                    self.lost_aborts += 1  # not in the scheduler yet: the abort never reaches it
                elif r.state == "waiting":
                    self._finish(r, {"type": "abort", "message": "Abort in waiting queue"}, queued=True)
                else:
                    r.abort = True
                    self.stall_at = 0

    def loads(self) -> dict[str, Any]:
        with self._lock:
            running, waiting = len(self._live("running")), len(self._live("waiting"))
        return {
            "loads": [
                {
                    "dp_rank": 0,
                    "num_running_reqs": running,
                    "num_waiting_reqs": waiting,
                    "token_usage": 0.0,
                    "gen_throughput": 0.0,
                }
            ]
        }

    def update_weights_from_disk(self, body: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        with self._lock:  # waits for in-flight requests (no pause in this fixture)
            self._lock.wait_for(lambda: not self._reqs or self._stop.is_set(), timeout=60)
            path = str(body.get("model_path", ""))
            if not Path(path).exists():
                message = f"Failed to get weights iterator: {path} (repository not found)."
                return 400, {"success": False, "message": message, "num_paused_requests": 0}
            self.model_path = path
            if body.get("weight_version") is not None:
                self.weight_version = str(body["weight_version"])
        return 200, {
            "success": True,
            "message": "Succeeded to update model weights.",
            "num_paused_requests": 0,
        }

    def update_weights_from_distributed(self, body: dict[str, Any]) -> dict[str, Any]:
        if _version_tuple(self.version) >= (0, 5, 21) and not self._in_bracket:
            raise BadRequest("update_weights_from_distributed outside begin_weight_update/end_weight_update")
        if body.get("weight_version") is not None:
            self.weight_version = str(body["weight_version"])
        return {"success": True, "message": "Succeeded to update parameter online."}

    def flush_cache(self) -> str:
        with self._lock:
            if self._reqs:
                raise BadRequest("Cache not flushed because there are pending requests.")
        return "Cache flushed."

    def post(self, path: str, body: dict[str, Any]) -> tuple[int, Any]:
        self.calls.append((path, body))
        if path == "/generate":
            return 200, self.generate(body)
        if path == "/abort_request":
            self.abort_request(body)
            return 200, None
        if path == "/update_weights_from_disk":
            return self.update_weights_from_disk(body)
        if path == "/update_weights_from_distributed":
            return 200, self.update_weights_from_distributed(body)
        if path == "/flush_cache":
            return 200, self.flush_cache()
        if path in ("/begin_weight_update", "/end_weight_update"):
            self._in_bracket = path == "/begin_weight_update"
            return 200, {"success": True}
        if path == "/init_weights_update_group":
            return 200, {"success": True, "message": "Succeeded to initialize custom process group."}
        return 404, {"detail": "Not Found"}

    def get(self, path: str) -> tuple[int, Any]:
        if path == "/health":
            return 200, None
        if path == "/server_info":
            return 200, {"version": self.version, "max_running_requests": self.max_running}
        if path == "/model_info":
            return 200, {"model_path": self.model_path, "weight_version": self.weight_version}
        if path == "/v1/loads" and self.has_loads:
            return 200, self.loads()
        return 404, {"detail": "Not Found"}

    def _handler_class(self) -> type[BaseHTTPRequestHandler]:
        server = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:
                pass

            def _reply(self, status: int, payload: Any) -> None:
                data = b"" if payload is None else json.dumps(payload).encode()
                if isinstance(payload, str):
                    data = payload.encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self._reply(*server.get(urlsplit(self.path).path))

            def do_POST(self) -> None:
                raw = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                try:
                    body = json.loads(raw or b"{}")
                    if not isinstance(body, dict):
                        raise BadRequest("body must be a JSON object")
                    self._reply(*server.post(urlsplit(self.path).path, body))
                except (BadRequest, json.JSONDecodeError) as e:
                    self._reply(400, {"error": {"message": str(e)}})

        return Handler
