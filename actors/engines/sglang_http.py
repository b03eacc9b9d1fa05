"""The HTTP side of the SGLang adapter: one exchange with an SGLang server, what a /generate body holds,
and what the answers mean.

Owns how a call travels (standard library `http.client`, a fresh connection per call, an origin-form
request target: SGLang serves with uvicorn, whose h11 parser takes an absolute-form target
`http://host:port/path` as the path and answers 404), the timeout every call has, how an error body
reads as one line, which statuses are transient, what `/server_info` says about a server, and how a
`/generate` answer becomes a `Segment`. Does not know about requests in flight, weights or several
servers: that is actors/engines/sglang_engine.py. Paths in comments are inside the SGLang wheel
(`sglang/srt/...`), read at 0.5.23 and checked against 0.5.6, 0.5.20 and 0.5.21.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import re
import socket
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from actors.engine import EngineError, EngineUnavailable, SamplingParams
from actors.engines.inflight import FINISH_REASONS, Flight, Segment
from april.records import FinishReason

MIN_VERSION = (0, 5, 6)


class ServerUnreachable(EngineUnavailable):
    """No answer at all: the connection was refused, reset or timed out. Unavailable, not wrong: a server
    that is still starting (or restarting) answers this way, so a worker building its engine retries."""


class HTTPStatusError(EngineError):
    """An answer other than 200; `text` is its body as one line."""

    def __init__(self, where: str, status: int, body: str) -> None:
        self.status = status
        self.text = error_text(body)
        super().__init__(f"{where}: HTTP {status}: {self.text}")


def error_text(body: str) -> str:
    """The message of an SGLang error body, whichever of its shapes: {"error": "..."} (0.5.23's contract
    gate, entrypoints/api_contract.py), {"error": {"message": ...}} (tokenizer_manager.py's ValueErrors),
    an ErrorResponse {"message": ...} (entrypoints/openai/protocol.py), {"detail": ...} (FastAPI), or
    plain text. One line."""
    try:
        data = json.loads(body)
    except json.JSONDecodeError:
        data = None
    text = None
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, str):
            text = err
        elif isinstance(err, dict) and "message" in err:
            text = str(err["message"])
        else:
            text = next((str(data[k]) for k in ("message", "detail") if k in data), None)
    text = body if text is None else text
    lines = text.strip().splitlines()
    return lines[0][:300] if lines else "(empty body)"


def transient(status: int) -> bool:
    """A status that says "not now" rather than "not this request": a retry may succeed."""
    return status >= 500 or status in (408, 425, 429)


class Exchange:
    """One HTTP call that another thread may cut short (`cut`: the socket is shut down, the call raises
    in its thread; SGLang aborts a /generate whose client went away, so its partial output is lost)."""

    def __init__(self, base: str) -> None:
        parts = urlsplit(base)
        self.base = base.rstrip("/")
        self.prefix = parts.path.rstrip("/")  # a server behind a path prefix keeps it in the target
        self.host = parts.hostname or "127.0.0.1"
        self.port = parts.port
        self.https = parts.scheme == "https"
        self.cut_short = False
        self._conn: http.client.HTTPConnection | None = None
        self._lock = threading.Lock()

    def send(self, method: str, path: str, body: Any, timeout_s: float) -> tuple[int, str]:
        """(status, body text). ServerUnreachable when no answer came (or the call was cut)."""
        conn_type = http.client.HTTPSConnection if self.https else http.client.HTTPConnection
        conn = conn_type(self.host, self.port, timeout=timeout_s)
        try:
            conn.connect()
            with self._lock:  # from here `cut` can reach the socket
                self._conn = conn
                if self.cut_short:
                    raise ConnectionAbortedError("cut short before it was sent")
            data = None if body is None else json.dumps(body).encode()
            headers = {"Content-Type": "application/json"} if data is not None else {}
            conn.request(method, self.prefix + path, body=data, headers=headers)  # origin-form target
            resp = conn.getresponse()
            return resp.status, resp.read().decode(errors="replace")
        except (OSError, http.client.HTTPException) as e:
            raise ServerUnreachable(f"{self.base}{path}: {type(e).__name__}: {e}") from None
        finally:
            with self._lock:
                self._conn = None
            conn.close()

    def cut(self) -> None:
        with self._lock:
            self.cut_short = True
            sock = self._conn.sock if self._conn is not None else None
        if sock is not None:
            with contextlib.suppress(OSError):  # already closed
                sock.shutdown(socket.SHUT_RDWR)


def http_call(base: str, method: str, path: str, body: Any = None, timeout_s: float = 10.0) -> Any:
    """One exchange on a fresh connection; the decoded JSON body (the text if not JSON, None if empty).
    HTTPStatusError on a non-200 answer, ServerUnreachable when there was no answer."""
    status, raw = Exchange(base).send(method, path, body, timeout_s)
    if status != 200:
        raise HTTPStatusError(f"sglang {base.rstrip('/')}{path}", status, raw)
    if not raw.strip():
        return None
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def request_seed(seed: int, request_id: int, tokens_done: int) -> int:
    """The sampling_seed of one submission: its own per request and resubmission, reproducible per run."""
    return (seed * 1_000_003 + request_id * 7919 + tokens_done) % (1 << 31)


def generate_body(
    flight: Flight, sampling: SamplingParams, extra: Mapping[str, Any], seeded: bool
) -> dict[str, Any]:
    """The /generate body of `flight`'s next submission (token ids in, log-probs out, no streaming).
    `seeded`: the server honours sampling_seed (--enable-deterministic-inference)."""
    top_k = sampling.top_k if sampling.top_k > 0 else -1  # SGLang: -1 = off
    params: dict[str, Any] = {
        **extra,
        "max_new_tokens": flight.left,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": 1 if flight.greedy else top_k,  # top_k 1: SGLang's greedy path
    }
    if sampling.stop_token_ids:
        params["stop_token_ids"] = list(sampling.stop_token_ids)
    if seeded and not flight.greedy:  # every request its own, or a group's samples would be identical
        params["sampling_seed"] = request_seed(sampling.seed, flight.request_id, len(flight.done_ids))
    return {
        "rid": flight.rid,
        "input_ids": flight.resume_input(),
        "sampling_params": params,
        "return_logprob": True,
        "logprob_start_len": -1,
        "stream": False,
    }


def parse_version(text: str) -> tuple[int, int, int]:
    m = re.match(r"\s*v?(\d+)\.(\d+)(?:\.(\d+))?", text)
    if not m:
        raise EngineError(f"sglang: cannot read server version {text!r} (expected like 0.5.23)")
    return int(m[1]), int(m[2]), int(m[3] or 0)


@dataclass(frozen=True, slots=True)
class ServerInfo:
    """What the adapter needs to know of one server, from its `/server_info` (the launch arguments plus
    the scheduler's handshake, entrypoints/http_server.py: server_info)."""

    version: tuple[int, int, int]
    max_req_input_len: int | None  # an input this long or longer is refused (managers/utils.py)
    deterministic: bool  # --enable-deterministic-inference: sampling_seed is honoured only then
    tp_size: int = 1  # ranks it takes in a weights-update group (one per tensor-parallel rank)

    @property
    def weight_update_bracket(self) -> bool:
        """Distributed weight updates must sit between begin/end_weight_update (0.5.21+,
        managers/scheduler_components/weight_updater.py)."""
        return self.version >= (0, 5, 21)

    @property
    def repeated_rid_abort_ignored(self) -> bool:
        """A second abort of the same rid is dropped by the tokenizer manager (0.5.20+,
        managers/tokenizer_manager.py: abort_request, state.abort_sent)."""
        return self.version >= (0, 5, 20)

    @property
    def longest_sequence(self) -> int | None:
        """Input plus output the adapter lets a request reach: one token short of what the server still
        accepts as an input, so that every partial it returns can be resumed there. Inside the
        scheduler's own cap (it ends generation at max_req_len - input - 1, managers/scheduler.py:
        init_req_max_new_tokens, with max_req_len = max_req_input_len + 5, managers/tp_worker.py) and the
        tokenizer manager's (input + max_new_tokens <= context_length)."""
        return None if self.max_req_input_len is None else self.max_req_input_len - 1


def parse_server_info(url: str, info: Any) -> ServerInfo:
    """The `ServerInfo` a /server_info answer reports; EngineError naming the field when unusable."""
    if not isinstance(info, dict) or not isinstance(info.get("version"), str):
        raise EngineError(f"sglang {url}/server_info: no version field (got {str(info)[:200]})")
    version = parse_version(info["version"])
    if version < MIN_VERSION:
        need = ".".join(map(str, MIN_VERSION))
        raise EngineError(f"sglang {url}: server version {info['version']}, expected >= {need}")
    limit = info.get("max_req_input_len")
    context = info.get("context_length")
    if not isinstance(limit, int) and isinstance(context, int):
        limit = context - 6  # tp_worker.py: (context_length - 1) - 5 when the KV pool is not smaller
    tp_size = info.get("tp_size")
    return ServerInfo(
        version=version,
        max_req_input_len=limit if isinstance(limit, int) else None,
        deterministic=info.get("enable_deterministic_inference") is True,
        tp_size=tp_size if isinstance(tp_size, int) and tp_size >= 1 else 1,
    )


def parse_generate(url: str, answer: Any) -> tuple[Segment, str | None]:
    """The `Segment` a 200 /generate answer reports, and the weight_version it names (None if absent).
    EngineError if malformed. A status-coded abort that still came as a 200 (0.5.6 answers only 400, 500
    and 503 with an HTTP error, managers/tokenizer_manager.py: _handle_abort_finish_reason) keeps its
    tokens and carries the server's message as the error."""
    meta = answer.get("meta_info") if isinstance(answer, dict) else None
    if not isinstance(meta, dict):
        raise EngineError(f"sglang {url}/generate: answer without meta_info: {str(answer)[:200]}")
    fr = meta.get("finish_reason") or {}
    kind = fr.get("type") if isinstance(fr, dict) else None
    reason = FINISH_REASONS.get(kind) if isinstance(kind, str) else None
    if reason is None:
        raise EngineError(f"sglang {url}/generate: finish_reason {fr!r}, expected stop, length or abort")
    entries = meta.get("output_token_logprobs") or []
    try:
        ids = [int(e[1]) for e in entries]
        lps = [float(e[0]) for e in entries]
    except (TypeError, ValueError, IndexError):
        raise EngineError(f"sglang {url}/generate: malformed output_token_logprobs") from None
    n_out = len(answer.get("output_ids", ids))
    if n_out != len(ids):
        raise EngineError(f"sglang {url}/generate: {n_out} output ids but {len(ids)} log-probs")
    stats = {
        "e2e_latency_s": float(meta.get("e2e_latency", 0.0) or 0.0),
        "cached_tokens": float(meta.get("cached_tokens", 0) or 0),
    }
    error = ""
    status = fr.get("status_code")
    if isinstance(status, int) and status >= 400:
        error = f"aborted by the server ({status}): {fr.get('message', '')}"
        if not transient(status):
            reason = FinishReason.NONE
    weight_version = meta.get("weight_version")
    return Segment(ids, lps, reason, stats, error), None if weight_version is None else str(weight_version)
