"""The SGLang adapter: drives one or more real SGLang servers over their HTTP API, token ids only.

Owns the HTTP contract with a real SGLang server: how a request becomes a `/generate` call,
how its answer becomes a `GenerationOutput`, how to abort so that no partial output is lost, and how
weights are swapped. Does not import sglang (the server is another process, started here with
`python -m sglang.launch_server` or given as URLs) and uses only the standard library for HTTP: one
blocking `/generate` per in-flight request, each on its own thread (a pool sized to `slots`). The
request table (what was submitted, what came back, park and resubmit around a weights load) is
`actors.engines.inflight.InFlight`'s; this module is the transport under it.

Decisions that follow from the server's behaviour:
  - rids are uuid4 hex (fixed length), because abort matches rids by prefix.
  - A request is never aborted by closing its connection (that loses the partial output).
    `abort` sends `abort_all` to every server, then polls `/v1/loads` and re-sends `abort_all` until
    every server reports no running or waiting request *and* every in-flight `/generate` has returned:
    an abort that reaches the server before the request reaches its scheduler is silently lost, and
    from 0.5.21 a repeated abort of the same rid is ignored, so per-rid aborts are never used.
  - Every token of one `/generate` call carries the version loaded when the call started: weights are
    only swapped while nothing runs. `load_weights` called with requests in flight parks them
    (abort), loads, and resubmits them as `input + partial` with the reduced budget, so a response
    spans two versions exactly as with an engine that swaps between decode steps.
  - Weights: `/update_weights_from_disk` with `flush_cache`, checked against `/model_info`'s
    `weight_version`; the NCCL path (`init_weight_group` + `load_weights_distributed`) brackets the
    update with begin/end_weight_update from 0.5.21, as `/server_info`'s version says.
  - Several servers (one per GPU or TP group): requests are spread round-robin.
  - A `greedy` request is sent with `top_k` 1 (SGLang's greedy path) and no sampling seed; the
    temperature stays, so its log-probs are on the same scale as the others.
  - An answer ending in ABORT that we did not ask for (someone else aborted the server) is returned
    by `step` as ABORT: the sample is resumed like any interrupted one.
"""

from __future__ import annotations

import http.client
import json
import re
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from actors.engine import (
    EngineError,
    EngineUnavailable,
    GenerationOutput,
    GenerationRequest,
    SamplingParams,
    WeightLoadError,
)
from actors.engines.inflight import FINISH_REASONS, Flight, InFlight, Segment

MIN_VERSION = (0, 5, 6)


@dataclass(frozen=True, slots=True)
class ServerFeatures:
    """Behaviour chosen from the server's version (`/server_info`)."""

    version: tuple[int, int, int]

    @property
    def weight_update_bracket(self) -> bool:
        """Distributed weight updates must sit between begin/end_weight_update (0.5.21+)."""
        return self.version >= (0, 5, 21)

    @property
    def repeated_rid_abort_ignored(self) -> bool:
        return self.version >= (0, 5, 21)


def parse_version(text: str) -> tuple[int, int, int]:
    m = re.match(r"\s*v?(\d+)\.(\d+)(?:\.(\d+))?", text)
    if not m:
        raise EngineError(f"sglang: cannot read server version {text!r} (expected like 0.5.23)")
    return int(m[1]), int(m[2]), int(m[3] or 0)


class HTTPStatusError(EngineError):
    def __init__(self, url: str, status: int, body: str) -> None:
        super().__init__(f"sglang {url}: HTTP {status}: {_error_text(body)}")
        self.status = status


def _error_text(body: str) -> str:
    try:
        data = json.loads(body)
    except json.JSONDecodeError:
        return body.strip()[:300] or "(empty body)"
    if isinstance(data, dict):
        err = data.get("error")
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])
        for key in ("message", "detail"):
            if key in data:
                return str(data[key])
    return body.strip()[:300]


def http_call(base: str, method: str, path: str, body: Any = None, timeout_s: float = 10.0) -> Any:
    """One HTTP exchange on a fresh connection; the decoded JSON body (None when empty).
    Raises HTTPStatusError on a non-200 answer, EngineError when the server cannot be reached."""
    parts = urlsplit(base)
    conn_type = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = conn_type(parts.hostname or "127.0.0.1", parts.port, timeout=timeout_s)
    url = base.rstrip("/") + path
    try:
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"} if data is not None else {}
        conn.request(method, url, body=data, headers=headers)
        resp = conn.getresponse()
        raw = resp.read().decode(errors="replace")
    except (OSError, http.client.HTTPException) as e:
        raise EngineError(f"sglang {url}: {type(e).__name__}: {e}") from None
    finally:
        conn.close()
    if resp.status != 200:
        raise HTTPStatusError(url, resp.status, raw)
    if not raw.strip():
        return None
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def parse_generate(url: str, answer: Any) -> Segment:
    """The `Segment` a /generate answer reports; EngineError if malformed."""
    meta = answer.get("meta_info") if isinstance(answer, dict) else None
    if not isinstance(meta, dict):
        raise EngineError(f"sglang {url}/generate: answer without meta_info: {str(answer)[:200]}")
    fr = meta.get("finish_reason") or {}
    kind = fr.get("type") if isinstance(fr, dict) else None
    reason = FINISH_REASONS.get(kind) if isinstance(kind, str) else None
    if reason is None:
        raise EngineError(f"sglang {url}/generate: finish_reason {fr!r}, expected stop, length or abort")
    status = fr.get("status_code")
    if isinstance(status, int) and status >= 400:  # the scheduler rejected it (e.g. too long)
        raise EngineError(f"sglang {url}/generate: rejected ({status}): {fr.get('message', '')}")
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
        "e2e_latency_s": float(meta.get("e2e_latency", 0.0)),
        "cached_tokens": float(meta.get("cached_tokens", 0)),
    }
    return Segment(ids, lps, reason, stats)


class SGLangEngine:
    """An Engine over SGLang servers at `urls` (see the module docstring)."""

    name = "sglang"

    def __init__(
        self,
        urls: Sequence[str],
        *,
        slots: int = 8,
        sampling: SamplingParams | None = None,
        version: int = 0,
        poll_s: float = 0.02,
        request_timeout_s: float = 3600.0,
        control_timeout_s: float = 10.0,
        abort_timeout_s: float = 60.0,
        weights_timeout_s: float = 900.0,
        extra_sampling_params: Mapping[str, Any] | None = None,
        processes: Sequence[subprocess.Popen[bytes]] = (),
    ) -> None:
        """`extra_sampling_params`: more SGLang sampling keys sent as given (e.g. min_p,
        repetition_penalty); the server rejects unknown keys with 400, surfaced as EngineError."""
        if not urls:
            raise EngineError("sglang: no server URLs given")
        if slots < 1:
            raise EngineError(f"sglang: slots = {slots}, expected >= 1")
        self.urls = [u.rstrip("/") for u in urls]
        self.slots = slots
        self.sampling = sampling or SamplingParams()
        self.extra_sampling_params = dict(extra_sampling_params or {})
        self.version = version
        self.poll_s = poll_s
        self.request_timeout_s = request_timeout_s
        self.control_timeout_s = control_timeout_s
        self.abort_timeout_s = abort_timeout_s
        self.weights_timeout_s = weights_timeout_s
        self._processes = list(processes)
        self._flights = InFlight("sglang", submit=self._submit, halt=self._abort_until_idle)
        self._next_server = 0
        self._loads_supported = True
        self.server_versions = [self._server_version(u) for u in self.urls]
        self.features = ServerFeatures(min(self.server_versions))
        self._pool = ThreadPoolExecutor(max_workers=slots, thread_name_prefix="sglang-generate")

    def _server_version(self, url: str) -> tuple[int, int, int]:
        info = self._call(url, "GET", "/server_info")
        text = info.get("version") if isinstance(info, dict) else None
        if not isinstance(text, str):
            raise EngineError(f"sglang {url}/server_info: no version field")
        version = parse_version(text)
        if version < MIN_VERSION:
            need = ".".join(map(str, MIN_VERSION))
            raise EngineError(f"sglang {url}: server version {text}, expected >= {need}")
        return version

    def _call(
        self, url: str, method: str, path: str, body: Any = None, timeout_s: float | None = None
    ) -> Any:
        return http_call(url, method, path, body, timeout_s or self.control_timeout_s)

    # -- the Engine interface ---------------------------------------------------------------------

    @property
    def active(self) -> int:
        return self._flights.active

    def add(self, requests: Sequence[GenerationRequest]) -> None:
        self._flights.add(requests, self.slots, self.version)

    def step(self) -> list[GenerationOutput]:
        return self._flights.step(self.poll_s)

    def abort(self) -> list[GenerationOutput]:
        return self._flights.abort()

    def load_weights(self, path: Path | str, version: int) -> None:
        parked = self._flights.park()
        try:
            for i, url in enumerate(self.urls):
                body = {"model_path": str(path), "weight_version": str(version), "flush_cache": True}
                self._update(i, url, "/update_weights_from_disk", body)
            self._check_version(version)
            self.version = version
        finally:
            self._flights.resubmit(parked, self.version)

    def probe(self) -> None:
        """Every server answers /server_info, or EngineUnavailable."""
        for url in self.urls:
            try:
                self._call(url, "GET", "/server_info")
            except EngineError as e:
                raise EngineUnavailable(f"sglang {url} does not answer: {e}") from None

    def close(self) -> None:
        try:
            self._flights.close()
        finally:
            self._pool.shutdown(wait=False, cancel_futures=True)
            for proc in self._processes:
                stop_server(proc)
            self._processes.clear()

    # -- NCCL weights path (one server per replica; the trainer is rank 0) ----------------------

    def init_weight_group(
        self,
        master_address: str,
        master_port: int,
        world_size: int,
        group_name: str = "april",
        tp_size: int = 1,
    ) -> None:
        """Join every server to the trainer's NCCL group. Blocks until the trainer joins too: call it
        while the trainer runs its side (rank 0); server i takes ranks 1 + i * tp_size onwards."""

        def join(i: int, url: str) -> None:
            body = {
                "master_address": master_address,
                "master_port": master_port,
                "rank_offset": 1 + i * tp_size,
                "world_size": world_size,
                "group_name": group_name,
                "backend": "nccl",
            }
            self._call(url, "POST", "/init_weights_update_group", body, self.weights_timeout_s)

        errors = self._concurrently(join)
        if errors:
            raise EngineError(f"sglang: cannot join the NCCL weights group: {errors[0]}")

    def load_weights_distributed(
        self,
        names: Sequence[str],
        dtypes: Sequence[str],
        shapes: Sequence[Sequence[int]],
        version: int,
        group_name: str = "april",
    ) -> None:
        """Receive `version` by NCCL broadcast from the trainer, which broadcasts while this runs."""
        parked = self._flights.park()
        body = {
            "names": list(names),
            "dtypes": list(dtypes),
            "shapes": [list(s) for s in shapes],
            "group_name": group_name,
            "flush_cache": False,
            "weight_version": str(version),
        }

        def update(i: int, url: str) -> None:
            if self.features.weight_update_bracket:
                self._call(url, "POST", "/begin_weight_update", {"selector": "all"})
            self._update(0, url, "/update_weights_from_distributed", body)
            if self.features.weight_update_bracket:
                self._call(url, "POST", "/end_weight_update", {})
            self._call(url, "POST", "/flush_cache", {})

        try:
            errors = self._concurrently(update)
            if errors and len(errors) < len(self.urls):  # some replicas switched, some did not
                raise EngineError(
                    f"{errors[0]} ({len(self.urls) - len(errors)} servers loaded the new weights)"
                )
            if errors:
                raise WeightLoadError(str(errors[0]))
            self._check_version(version)
            self.version = version
        finally:
            self._flights.resubmit(parked, self.version)

    # -- internals ----------------------------------------------------------------------------------

    def _payload(self, flight: Flight) -> dict[str, Any]:
        s = self.sampling
        top_k = s.top_k if s.top_k > 0 else -1  # SGLang: -1 = off
        params: dict[str, Any] = {
            **self.extra_sampling_params,
            "max_new_tokens": flight.left,
            "temperature": s.temperature,
            "top_p": s.top_p,
            "top_k": 1 if flight.greedy else top_k,  # top_k 1: SGLang's greedy path
        }
        if s.stop_token_ids:
            params["stop_token_ids"] = list(s.stop_token_ids)
        if s.seed and not flight.greedy:  # per request, or every sample of a group would draw the same tokens
            params["sampling_seed"] = (
                s.seed * 1_000_003 + flight.request_id * 7919 + len(flight.done_ids)
            ) % (1 << 31)
        return {
            "rid": flight.rid,
            "input_ids": flight.resume_input(),
            "sampling_params": params,
            "return_logprob": True,
            "logprob_start_len": -1,
            "stream": False,
        }

    def _submit(self, flight: Flight) -> Future[Segment]:
        """One blocking /generate on a pool thread, next server in turn; the answer parsed there."""
        url = self.urls[self._next_server % len(self.urls)]
        self._next_server += 1
        flight.rid = uuid.uuid4().hex
        payload = self._payload(flight)

        def generate() -> Segment:
            return parse_generate(url, http_call(url, "POST", "/generate", payload, self.request_timeout_s))

        return self._pool.submit(generate)

    def _load(self) -> int:
        """Requests running or waiting on all servers (0 where /v1/loads is missing)."""
        total = 0
        for url in self.urls:
            if not self._loads_supported:
                break
            try:
                info = self._call(url, "GET", "/v1/loads?include=core")
            except HTTPStatusError as e:
                if e.status != 404:
                    raise
                self._loads_supported = False  # older server: rely on the /generate calls returning
                break
            for row in info.get("loads", []) if isinstance(info, dict) else []:
                total += int(row.get("num_running_reqs", 0)) + int(row.get("num_waiting_reqs", 0))
        return total

    def _abort_until_idle(self, flights: Sequence[Flight]) -> None:
        """`abort_all` to every server, again until every call has returned and no server holds a
        request (see the module docstring)."""
        if not flights:
            return
        deadline = time.monotonic() + self.abort_timeout_s
        while True:
            for url in self.urls:
                self._call(url, "POST", "/abort_request", {"abort_all": True})
            futures = [f.future for f in flights if f.future is not None]
            wait(futures, timeout=max(self.poll_s, 0.01))
            pending = sum(1 for f in futures if not f.done())
            load = self._load()
            if pending == 0 and load == 0:
                return
            if time.monotonic() > deadline:
                raise EngineError(
                    f"sglang: not idle {self.abort_timeout_s:g}s after abort_all "
                    f"({pending} calls pending, {load} requests on the servers)"
                )

    def _update(self, index: int, url: str, path: str, body: dict[str, Any]) -> None:
        try:
            answer = self._call(url, "POST", path, body, self.weights_timeout_s)
        except EngineError as e:
            raise self._weights_error(index, f"{e}") from None
        if isinstance(answer, dict) and answer.get("success") is False:
            raise self._weights_error(index, f"sglang {url}{path}: {answer.get('message', 'failed')}")

    def _weights_error(self, index: int, message: str) -> EngineError:
        if index == 0:
            return WeightLoadError(message)
        # Earlier servers already switched: the replicas now disagree, so this is not a clean failure.
        return EngineError(f"{message} (servers 0..{index - 1} already loaded the new weights)")

    def _check_version(self, version: int) -> None:
        for url in self.urls:
            info = self._call(url, "GET", "/model_info")
            live = info.get("weight_version") if isinstance(info, dict) else None
            if live is not None and str(live) != str(version):
                raise WeightLoadError(
                    f"sglang {url}: weight_version is {live} after loading, expected {version}"
                )

    def _concurrently(self, call: Callable[[int, str], None]) -> list[EngineError]:
        """Run call(i, url) for every server at once (NCCL calls block until all ranks join); the
        errors, in server order."""
        errors: list[EngineError | None] = [None] * len(self.urls)

        def run(i: int, url: str) -> None:
            try:
                call(i, url)
            except EngineError as e:  # re-raised by the caller, in its thread
                errors[i] = e

        threads = [threading.Thread(target=run, args=(i, u), daemon=True) for i, u in enumerate(self.urls)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        return [e for e in errors if e is not None]


def stop_server(proc: subprocess.Popen[bytes], grace_s: float = 30.0) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
