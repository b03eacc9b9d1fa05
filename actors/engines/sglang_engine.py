"""The SGLang adapter: drives one or more real SGLang servers over their HTTP API, token ids only.

Owns the contract with real SGLang servers: how a request becomes a `/generate` call and its answer a
`GenerationOutput`, how to abort without losing partial output, how weights are swapped, and how a
failing server shows through the `Engine` failure contract. Does not import sglang (the server is
another process, started by actors/engines/sglang_launch.py or given as URLs); one blocking `/generate`
per in-flight request, each on its own thread (a pool sized to `slots`). The request table is
`actors.engines.inflight.InFlight`'s and the HTTP exchange actors/engines/sglang_http.py's.

Checked against SGLang 0.5.6, 0.5.20, 0.5.21 and 0.5.23 (docs/engines.md says how); decisions that follow
from the server's behaviour (paths inside the wheel, `sglang/srt/...`):
  - The server runs on the worker's host: weights are handed over as a local directory. The learner
    publishes one file per version; SGLang loads every *.safetensors of a directory (model_loader/
    loader.py) and takes anything else for a Hugging Face repo id, so `load_weights` puts the verified
    file in a directory of its own (a hard link where the cache is on the same filesystem, else a copy)
    under the adapter's cache (`weights_dir`, default a temporary directory), loads that with
    `/update_weights_from_disk`, checks `/model_info`'s `weight_version`, and deletes the older versions'
    directories. The current one is kept: a server that restarted is reloaded from it by `probe`.
  - With the learner's broadcast (`load_broadcast`, actors/engines/sglang_broadcast.py) the servers are
    ranks of its group and receive each version's buckets themselves; every server's weight_version and
    a sampled tensor per bucket are read back before the version serves. A broadcast that fails or does
    not match leaves a server half-updated (SGLang does not roll a distributed update back), and a
    version that came by broadcast has no directory: a server in either state is reloaded from the
    current directory if there is one, else the engine raises WeightsLost (unavailable until the worker
    loads that version again from a file), so its version never goes back.
  - Budgets are clipped so that input + output stays one token short of the server's `max_req_input_len`
    (from /server_info): inside the tokenizer manager's context check and the scheduler's own cap, and
    every partial can be resumed there. An input too long for that fails its request (NONE).
  - Abort by rid, exactly (the tokenizer manager forwards only a rid it holds, tokenizer_manager.py:
    abort_request), re-sent while a /generate is still out: an abort that arrives before its request
    is dropped. From 0.5.20 a rid is forwarded only once, and an abort forwarded before the request
    reached the scheduler is lost there (scheduler.py: abort_request finds nothing); after
    `abort_all_after_s` the adapter falls back to `abort_all` on that server, which aborts other
    clients' requests too. A request is never aborted by closing its connection (that loses its partial)
    except when it cannot be stopped otherwise (`cut`).
  - Every token of one `/generate` carries the version loaded when the call started: weights are swapped
    only while nothing runs. `load_weights` parks in-flight requests (abort), loads, and resubmits them
    as `input + partial` with the rest of the budget, so a response spans two versions as with an engine
    that swaps between decode steps. Every answer must name the weight_version the adapter expects: one
    that does not (the server restarted with its launch weights, or another client changed them) makes
    the engine unavailable, and `probe` reloads the adapter's version (one that came by broadcast has no
    directory: WeightsLost).
  - Log-probs are `log_softmax(logits / temperature)` of the full distribution, except in a batch where
    every request is greedy (layers/sampler.py: is_all_greedy), where they are at temperature 1. A
    `greedy` request (an evaluation sample) is sent with top_k 1, SGLang's greedy path, and no seed; when
    only evaluation samples run, their log-probs are at temperature 1. They are never trained on.
    A server started with SGLANG_RETURN_ORIGINAL_LOGPROB=1 reports every log-prob at temperature 1; its
    environment is not visible over HTTP, so the adapter warns at start (launch refuses it).
  - `sampling_seed` is honoured only with --enable-deterministic-inference (/server_info says), where an
    unseeded request samples with seed 42: there every sampled request gets its own seed from
    (sampling.seed, request id, tokens done); elsewhere none is sent and the adapter warns at start.
  - Failures (actors/engine.py): a 4xx, or an abort the server gives a non-transient status, fails its
    request (NONE); a 5xx, a transient status-coded abort, or a dropped connection while the server still
    answers /server_info comes back as ABORT with the tokens known; a server that cannot be reached
    (/server_info refused or timing out on every try) makes every method raise EngineUnavailable with
    every request's partial, and `probe` raises until every server answers again. Every call has a timeout.
  - Several servers (one per GPU or TP group): requests are spread round-robin; the clip is the
    smallest server's.
  - Shared servers: see docs/engines.md (abort_all fallback, /update_weights_from_disk waiting for every
    client's requests, weight versions).
"""

from __future__ import annotations

import contextlib
import json
import logging
import subprocess
import time
import uuid
from collections.abc import Mapping, Sequence
from concurrent.futures import ALL_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import TYPE_CHECKING, Any

from actors.engine import (
    EngineError,
    EngineUnavailable,
    GenerationOutput,
    GenerationRequest,
    SamplingParams,
    WeightLoadError,
    WeightsLost,
)
from actors.engines.inflight import Flight, InFlight, Segment
from actors.engines.sglang_broadcast import ServerGroup, check_version, concurrently, receive_version
from actors.engines.sglang_http import (
    Exchange,
    HTTPStatusError,
    ServerInfo,
    ServerUnreachable,
    generate_body,
    http_call,
    parse_generate,
    parse_server_info,
    transient,
)
from actors.engines.weight_dirs import VersionDirs
from april.records import FinishReason

if TYPE_CHECKING:
    from actors.weight_receive import Offer

log = logging.getLogger(__name__)

REACH_TRIES = 3  # /server_info tries before a server counts as unreachable
REACH_GAP_S = 0.2
ABORT_RESEND_S = 0.2  # how often an abort by rid is re-sent while its /generate is still out
UNKNOWN = "?"  # expected weight_version of a server whose weights are not a whole version now


class SGLangEngine:
    """An Engine over SGLang servers at `urls` (see the module docstring)."""

    name = "sglang"
    # the adapter flushes the radix cache with every update (/update_weights_from_disk flush_cache true,
    # /flush_cache after a broadcast) and resubmits parked requests: a resume recomputes its prefix
    can_reuse_kv = False

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
        abort_all_after_s: float = 5.0,
        weights_timeout_s: float = 900.0,
        weights_dir: Path | str | None = None,
        extra_sampling_params: Mapping[str, Any] | None = None,
        processes: Sequence[subprocess.Popen[bytes]] = (),
    ) -> None:
        """`extra_sampling_params`: more SGLang sampling keys sent as given (e.g. min_p,
        repetition_penalty); the server refuses unknown keys, which fails each request (NONE).
        `weights_dir`: where the per-version weight directories go (default: a temporary directory,
        removed on close); on the weights' filesystem they are hard links, elsewhere copies."""
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
        self.abort_all_after_s = abort_all_after_s
        self.weights_timeout_s = weights_timeout_s
        self._processes = list(processes)
        self._dirs = VersionDirs(weights_dir)
        self._loaded: Path | None = None  # what self.version was loaded from (None: the launch weights)
        self._exchanges: dict[str, tuple[int, Exchange]] = {}  # rid -> (server index, its /generate)
        self._next_server = 0
        self.servers = [self._server_info(u) for u in self.urls]
        self._expected = [self._weight_version(u) for u in self.urls]  # what each server's answers name
        self._group = ServerGroup(self.urls, control_timeout_s, weights_timeout_s)
        self._flights = InFlight(
            "sglang",
            submit=self._submit,
            halt=self._halt,
            cut=self._cut,
            stop_token_ids=self.sampling.stop_token_ids,
        )
        self._pool = ThreadPoolExecutor(max_workers=slots, thread_name_prefix="sglang-generate")
        self._warn_at_start()

    # -- the Engine interface ---------------------------------------------------------------------

    @property
    def placement(self) -> str:
        """The servers it drives: their URLs ("http://10.0.0.5:30000, http://10.0.0.5:30001"), or the
        first and how many more past two."""
        if len(self.urls) <= 2:
            return ", ".join(self.urls)
        return f"{self.urls[0]} and {len(self.urls) - 1} more servers"

    @property
    def active(self) -> int:
        return self._flights.active

    @property
    def context(self) -> int | None:
        """The longest input + output a request may reach on every server (None: a server did not say)."""
        limits = [s.longest_sequence for s in self.servers]
        return None if any(x is None for x in limits) else min(x for x in limits if x is not None)

    def add(self, requests: Sequence[GenerationRequest]) -> None:
        self._flights.add(requests, self.slots, self.version, context=self.context)

    def step(self) -> list[GenerationOutput]:
        return self._flights.step(self.poll_s)

    def abort(self) -> list[GenerationOutput]:
        return self._flights.abort()

    def load_weights(self, path: Path | str, version: int) -> None:
        """Load `version` from `path` (a verified .safetensors file, or a directory the server can read)
        into every server. WeightLoadError leaves the old weights serving; EngineUnavailable if a server
        cannot be reached."""
        parked = self._flights.park()
        try:
            model_path = self._dirs.make(Path(path), version)
        except OSError as e:
            self._flights.resubmit(parked, self.version)
            raise WeightLoadError(f"sglang: cannot put {path} in a directory for the server: {e}") from None
        try:
            for i, url in enumerate(self.urls):
                self._update(i, url, "/update_weights_from_disk", self._disk_body(model_path, version))
            self._check_version(version)
        except ServerUnreachable as e:
            self._dirs.drop(version)
            raise self._flights.unavailable(str(e), parked) from None
        except BaseException:
            self._dirs.drop(version)
            self._flights.resubmit(parked, self.version)
            raise
        self._loaded_version(version, model_path)
        self._flights.resubmit(parked, self.version)

    def probe(self) -> None:
        """Return once every server answers /server_info (re-read: a server may have come back with other
        settings) and serves the adapter's weights version (a restarted server is reloaded from the
        current version's directory); EngineUnavailable otherwise."""
        for i, url in enumerate(self.urls):
            try:
                self.servers[i] = self._server_info(url)
                live = self._weight_version(url)
            except EngineError as e:
                raise self._flights.unavailable(f"sglang {url} does not answer: {e}") from None
            if live != self._expected[i]:
                self._restore(i, url, live)

    def close(self) -> None:
        try:
            self._flights.close()
        finally:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._dirs.close()
            for proc in self._processes:
                stop_server(proc)
            self._processes.clear()

    # -- the learner's broadcast (actors/engines/sglang_broadcast.py) -----------------------------

    @property
    def broadcast_servers(self) -> ServerGroup:
        """The servers as ranks of the learner's broadcast group, for the worker's member thread."""
        return self._group

    def load_broadcast(self, offer: Offer) -> None:
        """Receive `offer`'s version on every server while the learner's hub sends it, check what each then
        holds (its weight_version and each bucket's sampled tensor), and serve it. Requests are parked
        meanwhile (the update waits for running ones) and resubmitted after.

        A failed or mismatched update leaves a server with some buckets of each version (SGLang does not
        roll it back): with the current version's directory every server reloads it, then WeightLoadError;
        with none (it came by broadcast too) WeightsLost, as when a server cannot be reached or reloaded:
        EngineUnavailable."""
        parked = self._flights.park()
        errors = concurrently(
            self.urls, lambda i, url: receive_version(url, self.servers[i], offer, self._post_update)
        )
        unreachable = [e for e in errors if isinstance(e, ServerUnreachable)]
        if unreachable:
            raise self._flights.unavailable(str(unreachable[0]), parked)
        wrong = str(errors[0]) if errors else ""
        try:
            for url in self.urls:
                if wrong:
                    break
                wrong = check_version(url, offer, self._call)
        except EngineError as e:
            wrong = str(e)
        if not wrong:
            self._loaded_version(offer.version, None)  # nothing on disk: see WeightsLost
            self._flights.resubmit(parked, self.version)
            return
        wrong = f"broadcast v{offer.version}: {wrong}"
        self._expected = [UNKNOWN] * len(self.urls)  # until reloaded
        if self._loaded is None:
            lost = self._flights.unavailable(f"{wrong}; v{self.version} has no copy on disk", parked)
            raise WeightsLost(str(lost), lost.partials, self.version)
        try:
            for url in self.urls:
                self._update(0, url, "/update_weights_from_disk", self._disk_body(self._loaded, self.version))
        except EngineError as e:
            raise self._flights.unavailable(
                f"{wrong}; reloading v{self.version} failed: {e}", parked
            ) from None
        self._expected = [str(self.version)] * len(self.urls)
        self._flights.resubmit(parked, self.version)
        raise WeightLoadError(f"{wrong} (v{self.version} reloaded from disk)")

    # -- requests ---------------------------------------------------------------------------------

    def _submit(self, flight: Flight) -> Future[Segment]:
        """One blocking /generate on a pool thread, next server in turn."""
        index = self._next_server % len(self.urls)
        self._next_server += 1
        flight.rid = uuid.uuid4().hex
        body = generate_body(
            flight, self.sampling, self.extra_sampling_params, self.servers[index].deterministic
        )
        exchange = Exchange(self.urls[index])
        self._exchanges[flight.rid] = (index, exchange)
        expected = self._expected[index]

        def generate() -> Segment:
            try:
                return self._generate(exchange, body, expected)
            finally:
                self._exchanges.pop(body["rid"], None)

        return self._pool.submit(generate)

    def _generate(self, exchange: Exchange, body: dict[str, Any], expected: str) -> Segment:
        """The Segment of one /generate (see the failure rules in the module docstring)."""
        url = exchange.base
        try:
            status, raw = exchange.send("POST", "/generate", body, self.request_timeout_s)
        except ServerUnreachable as e:
            if exchange.cut_short:
                return Segment([], [], FinishReason.ABORT, error="cut short")
            self._ensure_reachable(url, str(e))
            return Segment([], [], FinishReason.ABORT, error=f"{e} (the server still answers)")
        if status != 200:
            error = str(HTTPStatusError(f"sglang {url}/generate", status, raw))
            reason = FinishReason.ABORT if transient(status) else FinishReason.NONE
            return Segment([], [], reason, error=error)
        segment, weight_version = parse_generate(url, http_answer(raw))
        if weight_version is not None and weight_version != expected:
            raise EngineUnavailable(
                f"sglang {url} answered with weight_version {weight_version}, expected {expected} "
                "(restarted, or changed by another client)"
            )
        return segment

    def _halt(self, flights: Sequence[Flight]) -> None:
        """Abort `flights` by rid and return once each /generate has returned (see the module
        docstring); EngineError if they do not within abort_timeout_s."""
        pending = [f for f in flights if f.future is not None and not f.future.done()]
        start = time.monotonic()
        unreachable: set[int] = set()
        while pending:
            late = time.monotonic() - start
            if late > self.abort_timeout_s:
                raise EngineError(
                    f"sglang: {len(pending)} requests still running {self.abort_timeout_s:g}s after abort"
                )
            abort_all: set[int] = set()
            for flight in pending:
                index = self._exchanges.get(flight.rid, (-1, None))[0]
                if index < 0 or index in unreachable or index in abort_all:
                    continue
                body: dict[str, Any] = {"rid": flight.rid}
                if late > self.abort_all_after_s and self.servers[index].repeated_rid_abort_ignored:
                    log.warning(
                        "sglang %s: an abort by rid was lost (sent before its request reached the "
                        "scheduler); aborting every request on that server",
                        self.urls[index],
                    )
                    body = {"abort_all": True}
                    abort_all.add(index)
                try:
                    self._call(self.urls[index], "POST", "/abort_request", body)
                except EngineError:  # its requests fail on their own; the caller sees them
                    unreachable.add(index)
            futures = [f.future for f in pending if f.future is not None]
            wait(futures, timeout=ABORT_RESEND_S, return_when=ALL_COMPLETED)
            pending = [f for f in pending if f.future is not None and not f.future.done()]

    def _cut(self, flights: Sequence[Flight]) -> None:
        for flight in flights:
            entry = self._exchanges.get(flight.rid)
            if entry is not None:
                entry[1].cut()

    # -- servers ----------------------------------------------------------------------------------

    def _call(
        self, url: str, method: str, path: str, body: Any = None, timeout_s: float | None = None
    ) -> Any:
        return http_call(url, method, path, body, timeout_s or self.control_timeout_s)

    def _server_info(self, url: str) -> ServerInfo:
        return parse_server_info(url, self._call(url, "GET", "/server_info"))

    def _weight_version(self, url: str) -> str:
        info = self._call(url, "GET", "/model_info")
        live = info.get("weight_version") if isinstance(info, dict) else None
        return str(live)

    def _ensure_reachable(self, url: str, why: str) -> None:
        """Return if the server answers /server_info within REACH_TRIES tries; else EngineUnavailable."""
        for attempt in range(REACH_TRIES):
            try:
                self._call(url, "GET", "/server_info")
                return
            except EngineError as e:
                last = e
            if attempt + 1 < REACH_TRIES:
                time.sleep(REACH_GAP_S)
        raise EngineUnavailable(f"sglang {url} cannot be reached ({why}; then {last})")

    def _warn_at_start(self) -> None:
        plain = [u for u, s in zip(self.urls, self.servers, strict=True) if not s.deterministic]
        if plain:
            log.warning(
                "sglang %s: started without --enable-deterministic-inference: sampling_seed has no effect, "
                "so the run's seed does not make sampling reproducible",
                ", ".join(plain),
            )
        if self.sampling.temperature != 1.0:
            log.warning(
                "sglang: make sure the servers do not run with SGLANG_RETURN_ORIGINAL_LOGPROB=1 (not "
                "visible over HTTP): they would report log-probs at temperature 1, not %g",
                self.sampling.temperature,
            )

    # -- weights ----------------------------------------------------------------------------------

    def _disk_body(self, model_path: Path, version: int) -> dict[str, Any]:
        return {"model_path": str(model_path), "weight_version": str(version), "flush_cache": True}

    def _loaded_version(self, version: int, model_path: Path | None) -> None:
        """Every server now serves `version` (from `model_path`); the older directories go."""
        self.version = version
        self._loaded = model_path
        self._expected = [str(version)] * len(self.urls)
        self._dirs.keep_only(version)

    def _restore(self, index: int, url: str, live: str) -> None:
        """A server that answers with another weight_version than expected (it restarted, or a failed
        broadcast left its weights unknown): reload the current version from its directory. With none:
        WeightsLost when the engine serves a version (it came by broadcast), else (the launch weights)
        take the server's version as it is."""
        if self._loaded is None and (self.version > 0 or self._expected[index] == UNKNOWN):
            self._expected[index] = UNKNOWN
            why = f"sglang {url} serves weight_version {live}; v{self.version} has no copy on disk to reload"
            lost = self._flights.unavailable(why)
            raise WeightsLost(str(lost), lost.partials, self.version)
        if self._loaded is None:
            log.warning(
                "sglang %s: serves weight_version %s, expected %s, and there is no copy to reload",
                url,
                live,
                self._expected[index],
            )
            self._expected[index] = live
            self.version = int(live) if live.isdigit() else 0
            return
        try:
            self._update(0, url, "/update_weights_from_disk", self._disk_body(self._loaded, self.version))
        except EngineError as e:
            raise self._flights.unavailable(
                f"sglang {url} came back with weight_version {live}; reloading v{self.version} failed: {e}"
            ) from None
        self._expected[index] = str(self.version)
        log.warning("sglang %s: came back with weight_version %s; reloaded v%d", url, live, self.version)

    def _post_update(self, url: str, path: str, body: dict[str, Any]) -> None:
        """One weights call of a broadcast: EngineError when it fails or answers success false."""
        answer = self._call(url, "POST", path, body, self.weights_timeout_s)
        if isinstance(answer, dict) and answer.get("success") is False:
            raise EngineError(f"sglang {url}{path}: {answer.get('message', 'failed')}")

    def _update(self, index: int, url: str, path: str, body: dict[str, Any]) -> None:
        try:
            answer = self._call(url, "POST", path, body, self.weights_timeout_s)
        except ServerUnreachable:
            raise
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
            live = self._weight_version(url)
            if live != str(version):
                raise WeightLoadError(
                    f"sglang {url}: weight_version is {live} after loading, expected {version}"
                )


def http_answer(raw: str) -> Any:
    """A 200 answer's JSON; EngineError when it is not JSON."""
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        raise EngineError(f"sglang /generate: answer is not JSON: {raw.strip()[:200]}") from None


def stop_server(proc: subprocess.Popen[bytes], grace_s: float = 30.0) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=grace_s)
