"""The inside of the fake SGLang server (tests/sglang_server.py): a TokenizerManager and a Scheduler rebuilt
from SGLang's source, driving a deterministic toy model instead of a GPU.

Paths in the comments are inside the SGLang wheel (`sglang/srt/...` unless they start with `sglang/`), read
at 0.5.23 and cross-checked with 0.5.6, 0.5.20 and 0.5.21; `Features` says which behaviour changed where.
Everything runs on the HTTP server's event loop (one thread), as SGLang's TokenizerManager does; the
scheduler is one asyncio task standing in for the scheduler process, with the ZeroMQ hop between them
reduced to a function call (its latency is `dispatch_delay_s`).

Owns: the admission of a parsed /generate body (normalize, context length; the sampling checks are
tests/sglang_contract.py's), the request states a /generate waits on, the waiting queue and running
batch, finish reasons, aborts, retraction, pause/continue, weight versions and the load snapshot. Does
not own HTTP (routes, status codes, bodies: sglang_server.py) and is not SGLang: where the fake
simplifies, the comment says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import random
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sglang_contract import Features, RequestError, Sampling, build_sampling, parse_version
from sglang_weights import HeldModel, WeightGroups, weight_files  # noqa: F401  # weight_files: was here

FORCE_STREAM_INTERVAL = 50  # environ.py: SGLANG_FORCE_STREAM_INTERVAL default
PAUSE_ABORT_POLL_S = 1.0  # tokenizer_manager.py: pause_generation(mode="abort") re-aborts every 1 s

# -- the toy model ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class ToyModel:
    """A deterministic stand-in for a causal LM over `vocab_size` ids. The next token is a hash of the
    weights version, the previous token, the sequence length and the sampler's draw, so resending
    `input + partial` continues exactly where an uninterrupted greedy (or seeded) request would have gone,
    and new weights change what is generated. `eos_per_mille` of the argmax tokens are the EOS id;
    `eos_at` forces EOS as the n-th (1-based) output token of every request."""

    vocab_size: int = 1000
    eos_token_id: int = 2
    eos_per_mille: int = 0
    eos_at: int | None = None

    def next_token(self, weights: str, prev: int, seq_len: int, draw: int, n_out: int) -> tuple[int, float]:
        """(token id, its log-prob at temperature 1) for the `n_out`-th output token."""
        h = int.from_bytes(
            hashlib.blake2b(f"{weights}|{prev}|{seq_len}|{draw}".encode(), digest_size=8).digest()
        )
        if (self.eos_at is not None and n_out == self.eos_at) or h % 1000 < self.eos_per_mille:
            token = self.eos_token_id
        else:
            token = 3 + (h >> 10) % (self.vocab_size - 3)
        return token, -(0.05 + ((h >> 40) % 1000) / 200.0)

    def greedy(self, weights: str, input_ids: list[int], n: int) -> list[int]:
        """The tokens a greedy request generates (stop tokens not applied): for assertions in tests."""
        seq, out = list(input_ids), []
        for i in range(n):
            token, _ = self.next_token(weights, seq[-1], len(seq), 0, i + 1)
            seq.append(token)
            out.append(token)
        return out


# -- requests ---------------------------------------------------------------------------------------------


@dataclass(slots=True)
class Req:
    """managers/schedule_batch.py: Req, the scheduler's side of one request."""

    rid: str
    input_ids: list[int]
    sampling: Sampling
    return_logprob: bool
    stream: bool
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    to_finish: dict[str, Any] | None = None  # set by an abort; wins over what the next step samples
    finished_reason: dict[str, Any] | None = None
    retraction_count: int = 0
    send_offset: int = 0  # output tokens already sent to the TokenizerManager
    version_events: list[tuple[str, int]] = field(default_factory=list)  # (old version, tokens so far)

    def seq_len(self) -> int:
        return len(self.input_ids) + len(self.output_ids)


@dataclass(slots=True)
class ReqState:
    """tokenizer_manager.py: ReqState, what a /generate handler waits on."""

    rid: str
    stream: bool
    return_logprob: bool
    event: asyncio.Event = field(default_factory=asyncio.Event)
    out_list: list[dict[str, Any]] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    logprobs: list[tuple[float, int, None]] = field(default_factory=list)
    finished: bool = False
    abort_sent: bool = False
    dispatched: bool = False
    created_s: float = field(default_factory=time.perf_counter)


@dataclass(slots=True)
class InjectedAbort:
    """A scripted abort: applied to a running request (rid starting with `rid_prefix`) once it holds
    `after_tokens` output tokens, exactly as an /abort_request landing at that moment would be
    (status_code None), or as the scheduler's own status-coded aborts are (e.g. 503 after a retraction
    without KV backup, schedule_batch.py: retract_decode)."""

    after_tokens: int
    rid_prefix: str = ""
    status_code: int | None = None
    message: str | None = None


class RWLock:
    """The model_update_lock (sglang/srt/aio_rwlock.py): /generate holds it as a reader from before
    tokenizing until its answer; weight updates take it as a writer unless the server is paused."""

    def __init__(self) -> None:
        self._cond = asyncio.Condition()
        self.readers = 0
        self.writer = False
        self.writers_waiting = 0

    async def acquire_read(self) -> None:
        async with self._cond:
            await self._cond.wait_for(lambda: not self.writer and self.writers_waiting == 0)
            self.readers += 1

    async def release_read(self) -> None:
        async with self._cond:
            self.readers -= 1
            self._cond.notify_all()

    async def acquire_write(self) -> None:
        async with self._cond:
            self.writers_waiting += 1
            await self._cond.wait_for(lambda: not self.writer and self.readers == 0)
            self.writers_waiting -= 1
            self.writer = True

    async def release_write(self) -> None:
        async with self._cond:
            self.writer = False
            self._cond.notify_all()

    @property
    def locked(self) -> bool:
        return self.readers > 0 or self.writer


@dataclass
class RuntimeConfig:
    """What the fake server is launched with (the subset of server_args.py that shows over HTTP)."""

    version: str = "0.5.23"
    model_path: str = "fake-model"
    weight_version: str = "default"  # arg_groups/fields/serving.py: weight_version default
    context_length: int = 4096
    max_running_requests: int = 8
    kv_capacity: int = 1 << 20  # tokens in the KV pool (retraction and OOM aborts when exceeded)
    skip_tokenizer_init: bool = True
    enable_deterministic_inference: bool = False
    return_original_logprob: bool = False  # SGLANG_RETURN_ORIGINAL_LOGPROB=1
    random_seed: int = 0
    token_delay_s: float = 0.002  # one decode step
    dispatch_delay_s: float = 0.0  # tokenizer -> scheduler hop: an abort sent in this window is lost
    weights_load_s: float = 0.0  # how long /update_weights_from_disk takes
    health_poll_s: float = 1.0  # http_server.py: health_generate sleeps 1 s before looking
    health_timeout_s: float = 20.0  # HEALTH_CHECK_TIMEOUT
    model: ToyModel = field(default_factory=ToyModel)
    # a model directory (config.json, *.safetensors): the launch weights the server holds, which its tokens
    # then depend on (sglang_weights.HeldModel); model_path defaults to it. Empty: it holds no tensors
    model_dir: str = ""
    group_timeout_s: float = 1800.0  # a weights group's collective timeout (torch's default_pg_timeout)

    def __post_init__(self) -> None:
        if self.model_dir and self.model_path == "fake-model":
            self.model_path = self.model_dir


class Runtime:
    """TokenizerManager + Scheduler on one event loop (see the module docstring). Created inside the loop."""

    def __init__(self, cfg: RuntimeConfig) -> None:
        self.cfg = cfg
        self.features = Features(parse_version(cfg.version))
        self.model = cfg.model
        self.weight_version = cfg.weight_version  # the TokenizerManager's (model_info, meta_info)
        self.scheduler_weight_version = cfg.weight_version  # the scheduler's (weight_versions spans)
        self.model_path = cfg.model_path
        self.rid_to_state: dict[str, ReqState] = {}
        self.waiting: list[Req] = []
        self.running: list[Req] = []
        self.is_pause = False  # TokenizerManager: new requests wait
        self.engine_paused = False  # Scheduler: no steps (retract / in_place pause)
        self.pause_cond = asyncio.Condition()
        self.update_lock = RWLock()
        self.session_open = False  # weight-update session (0.5.21+)
        self.groups = WeightGroups(cfg.group_timeout_s)  # /init_weights_update_group's
        self.held = HeldModel.from_dir(cfg.model_dir) if cfg.model_dir else None
        self.blocked = 0  # weight calls running off the loop: the scheduler process would be busy with them
        self.faults: list[str] = []  # scripted faults of the next distributed updates ("flip" or "drop")
        self.weights_reads: list[str] = []  # every get_weights_by_name name, in order
        self.crashed = False  # the scheduler died (an `assert` before 0.5.23): the server must stop
        self.on_crash: Callable[[], None] = lambda: None
        self.loads_snapshot: dict[str, Any] = self._snapshot()
        self.rng = random.Random(cfg.random_seed)
        self.injected_aborts: list[InjectedAbort] = []
        self.generate_bodies: list[dict[str, Any]] = []  # every /generate body accepted so far
        self.loaded_weight_files: list[list[str]] = []  # the files of each successful disk update
        self.distributed_updates: list[list[str]] = []  # the names of each distributed update received
        self.aborts_lost = 0  # abort_request calls that reached the scheduler before their request
        self.aborts_ignored = 0  # dropped by the TokenizerManager (unknown rid, or repeated from 0.5.20)
        self._wakeup = asyncio.Event()
        self._task = asyncio.get_running_loop().create_task(self._loop())

    # -- TokenizerManager: generate ------------------------------------------------------------------

    def admit(self, body: dict[str, Any]) -> ReqState:
        """generate_request up to _init_req_state: normalize (io_struct.py: GenerateReqInput.
        normalize_batch_and_arguments) and register the rid. RequestError when refused."""
        ids = body.get("input_ids")
        if body.get("text") is None and ids is None and body.get("input_embeds") is None:
            raise RequestError(400, "Either text, input_ids or input_embeds should be provided.")
        if body.get("text") is not None or ids is None:
            # The fake has no tokenizer: it serves token ids only, like --skip-tokenizer-init.
            raise RequestError(
                400,
                "The engine initialized with skip_tokenizer_init=True cannot accept text prompts. Please "
                "provide input_ids or re-initialize the engine with skip_tokenizer_init=False.",
            )
        if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
            if isinstance(ids, list) and ids and isinstance(ids[0], list):
                raise RequestError(
                    501, "the fake SGLang server does not model batch requests", "http_exception"
                )
            raise RequestError(400, "input_ids: expected a list of integers", "validation")
        if not ids:
            raise RequestError(400, "input_ids cannot be empty.")
        sp = body.get("sampling_params") or {}
        if not isinstance(sp, dict):
            raise RequestError(501, "the fake SGLang server does not model batch requests", "http_exception")
        if (sp.get("n") or 1) > 1:
            raise RequestError(
                501, "the fake SGLang server does not model parallel sampling (n > 1)", "http_exception"
            )
        rid = body.get("rid") or uuid.uuid4().hex
        if not isinstance(rid, str):
            raise RequestError(501, "the fake SGLang server does not model batch requests", "http_exception")
        if rid in self.rid_to_state:
            raise RequestError(400, f"Duplicate request ID detected: {rid}")
        state = ReqState(rid, bool(body.get("stream")), bool(body.get("return_logprob")))
        self.rid_to_state[rid] = state
        return state

    async def prepare(self, state: ReqState, body: dict[str, Any]) -> Req:
        """From the pause gate to the scheduler (tokenizer_manager.py: generate_request,
        _tokenize_one_request, _validate_one_request, _create_tokenized_object, _send_one_request).
        The caller holds the model_update_lock as a reader."""
        ids: list[int] = list(body["input_ids"])
        sp = dict(body.get("sampling_params") or {})
        c = self.cfg.context_length
        if len(ids) >= c:
            raise RequestError(
                400, f"The input ({len(ids)} tokens) is longer than the model's context length ({c} tokens)."
            )
        max_new = sp.get("max_new_tokens")
        if isinstance(max_new, int) and (
            max_new + len(ids) >= c if self.features.total_tokens_inclusive else max_new + len(ids) > c
        ):
            raise RequestError(
                400,
                f"Requested token count exceeds the model's maximum context length of {c} tokens. You "
                f"requested a total of {max_new + len(ids)} tokens: {len(ids)} tokens from the input "
                "messages "
                f"and {max_new} tokens for the completion. Please reduce the number of tokens in the input "
                "messages or the completion to fit within the limit.",
            )
        sampling = build_sampling(sp, self.model.vocab_size, self.features, not self.cfg.skip_tokenizer_init)
        self.generate_bodies.append(body)
        if self.cfg.dispatch_delay_s > 0:
            await asyncio.sleep(self.cfg.dispatch_delay_s)
        req = Req(state.rid, ids, sampling, state.return_logprob, state.stream)
        state.dispatched = True
        self._handle_generate_request(req)
        return req

    def release(self, state: ReqState) -> None:
        """_release_req_states_on_failure: a request refused before the scheduler leaves no state."""
        if self.rid_to_state.get(state.rid) is state:
            del self.rid_to_state[state.rid]

    # -- TokenizerManager: control -----------------------------------------------------------------------

    def abort_request(self, rid: str = "", abort_all: bool = False) -> None:
        """tokenizer_manager.py: abort_request. A rid is forwarded only when it is exactly one this
        TokenizerManager holds (so /abort_request never aborts by prefix from HTTP, although the scheduler
        matches with startswith); from 0.5.20 only once per rid."""
        if not abort_all:
            state = self.rid_to_state.get(rid) if rid else None
            if state is None or (self.features.abort_dedupe and state.abort_sent):
                self.aborts_ignored += 1
                return
            state.abort_sent = True
        self._scheduler_abort(rid, abort_all)

    async def pause(self, mode: str) -> None:
        """tokenizer_manager.py: pause_generation. abort: abort_all until no /generate holds the
        model_update_lock; retract / in_place: the scheduler stops stepping (scheduler.py:
        pause_generation), retract moving running requests back to the waiting queue."""
        async with self.pause_cond:
            self.is_pause = True
            if mode != "abort":
                self._scheduler_pause(mode)
                return
            while True:
                self.abort_request(abort_all=True)
                if not self.update_lock.locked:
                    break
                await asyncio.sleep(PAUSE_ABORT_POLL_S)

    async def resume(self) -> None:
        async with self.pause_cond:
            self.is_pause = False
            self.engine_paused = False
            self._wakeup.set()
            self.pause_cond.notify_all()

    async def wait_unpaused(self) -> None:
        async with self.pause_cond:
            await self.pause_cond.wait_for(lambda: not self.is_pause)

    def flush_cache(self) -> bool:
        """scheduler.py: flush_cache succeeds only when fully idle (waiting requests ignored while paused)."""
        return not self.running and (self.engine_paused or not self.waiting)

    def set_weight_version(self, version: str | None) -> None:
        """tokenizer_control_mixin.py: _update_weight_version_if_provided, and the scheduler's
        record_weight_version_change (requests that hold output record the old version)."""
        if version is None:
            return
        self.weight_version = version
        self._record_scheduler_version(version)

    def _record_scheduler_version(self, version: str | None) -> None:
        if version is None or version == self.scheduler_weight_version:
            return
        for req in self.running + self.waiting:
            if req.output_ids:
                req.version_events.append((self.scheduler_weight_version, len(req.output_ids)))
        self.scheduler_weight_version = version

    def crash(self, reason: str) -> None:
        """The scheduler process died (an AssertionError in it): SGLang's launcher kills the server."""
        self.crashed = True
        self.crash_reason = reason
        self.on_crash()

    @property
    def weights_key(self) -> str:
        """What the toy model's tokens depend on: the held weights' fingerprint, or (holding none) the
        scheduler's weight version."""
        return self.held.fingerprint if self.held is not None else self.scheduler_weight_version

    async def off_loop(self, fn: Callable[[], Any]) -> Any:
        """Run a blocking weights call (a collective, a disk load) in a thread; the scheduler takes no step
        meanwhile, as SGLang's scheduler process runs it inline."""
        self.blocked += 1
        try:
            return await asyncio.to_thread(fn)
        finally:
            self.blocked -= 1

    # -- Scheduler ------------------------------------------------------------------------------------

    @property
    def max_req_len(self) -> int:
        """tp_worker.py: min(context_len - 1, KV capacity - 1)."""
        return min(self.cfg.context_length - 1, self.cfg.kv_capacity - 1)

    @property
    def max_req_input_len(self) -> int:
        return self.max_req_len - 5

    def _handle_generate_request(self, req: Req) -> None:
        """scheduler.py: handle_generate_request -> init_req_max_new_tokens, validate_input_length."""
        max_req_len, max_req_input_len = self.max_req_len, self.max_req_input_len
        n_in = len(req.input_ids)
        req.sampling.max_new_tokens = max(
            0, min(req.sampling.max_new_tokens, max_req_len - n_in - 1, self.cfg.kv_capacity - n_in - 2)
        )
        if n_in >= max_req_input_len:
            # managers/utils.py: validate_input_length -> set_finish_with_abort (status 400); the request
            # still goes through the queue and finishes at its first step.
            req.to_finish = {
                "type": "abort",
                "message": f"Input length ({n_in} tokens) exceeds the maximum allowed length "
                f"({max_req_input_len} tokens). Use a shorter input or enable --allow-auto-truncate.",
                "status_code": 400,
                "err_type": "BadRequestError",
            }
            req.return_logprob = False
        self.waiting.append(req)
        self._wakeup.set()

    def _scheduler_abort(self, rid: str, abort_all: bool) -> None:
        """scheduler.py: abort_request. Waiting requests leave at once ("Abort in waiting queue"); running
        ones get to_finish and run one more step. A rid the scheduler does not hold yet is lost."""
        hit = False
        for req in [r for r in self.waiting if abort_all or r.rid.startswith(rid)]:
            self.waiting.remove(req)
            self._send_abort_output(req, None)
            hit = True
        for req in self.running:
            if req.finished_reason is None and (abort_all or req.rid.startswith(rid)):
                req.to_finish = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
                hit = True
        if not hit and not abort_all:
            self.aborts_lost += 1

    def _scheduler_pause(self, mode: str) -> None:
        self.engine_paused = True
        if mode == "retract":
            for req in list(self.running):
                self._retract(req)

    def _retract(self, req: Req) -> None:
        """schedule_batch.py: release_req + reset_for_retract: the request keeps its output, goes back
        to the waiting queue and is recomputed when admitted again (clients see only num_retractions)."""
        self.running.remove(req)
        req.retraction_count += 1
        self.waiting.append(req)

    async def _loop(self) -> None:
        while not self.crashed:
            self._wakeup.clear()
            if not self.engine_paused and not self.blocked and (self.waiting or self.running):
                self._step()
                await asyncio.sleep(self.cfg.token_delay_s)
            else:
                self.loads_snapshot = self._snapshot()  # the fully-idle publish
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wakeup.wait(), timeout=0.05)

    def _step(self) -> None:
        """One scheduler iteration: admit (prefill samples a first token), keep the KV pool within
        capacity (retract_decode), decode one token per running request, stream what is due."""
        for inj in list(self.injected_aborts):
            for req in self.running:
                if req.rid.startswith(inj.rid_prefix) and len(req.output_ids) >= inj.after_tokens:
                    msg = inj.message or "Aborted"
                    req.to_finish = {
                        "type": "abort",
                        "message": msg,
                        "status_code": inj.status_code,
                        "err_type": None,
                    }
                    self.injected_aborts.remove(inj)
                    break
        used = sum(r.seq_len() for r in self.running)
        while self.waiting and len(self.running) < self.cfg.max_running_requests:
            req = self.waiting[0]
            if used + req.seq_len() + 1 > self.cfg.kv_capacity and self.running:
                break
            self.waiting.pop(0)
            self.running.append(req)
            used += req.seq_len()
        self._retract_decode()
        greedy_batch = all(r.sampling.top_k <= 1 for r in self.running)  # sampling_batch_info.py
        for req in list(self.running):
            self._decode(req, greedy_batch)
        self.running = [r for r in self.running if r.finished_reason is None]
        self.loads_snapshot = self._snapshot()

    def _retract_decode(self) -> None:
        """schedule_batch.py: retract_decode: while the next step does not fit, retract the request with
        the longest output (ties: shortest input); the last one left that still does not fit is aborted
        with status 500 (a non-stream client gets an HTTP 500 and loses its partial output)."""
        while sum(r.seq_len() + 1 for r in self.running) > self.cfg.kv_capacity:
            order = sorted(self.running, key=lambda r: (len(r.output_ids), -len(r.input_ids)))
            if len(order) == 1:
                last = order[0]
                last.to_finish = {
                    "type": "abort",
                    "message": "Out of memory even after retracting all other requests in the decode batch. "
                    "Aborting the last request.",
                    "status_code": 500,
                    "err_type": None,
                }
                self.running.remove(last)
                self._send_abort_output(last, last.to_finish)
                return
            self._retract(order[-1])

    def _decode(self, req: Req, greedy_batch: bool) -> None:
        """batch_result_processor.py: process_batch_result_decode -> Req.update_finish_state: the sampled
        token is appended first; then to_finish (an abort) beats a stop token, which beats the length
        budget (schedule_batch.py)."""
        if req.to_finish is not None and req.to_finish.get("status_code") == 400:
            req.finished_reason = req.to_finish  # set_finish_with_abort: no token is generated
            self._stream(req)
            return
        s = req.sampling
        if s.top_k <= 1:
            draw = 0
        elif self.cfg.enable_deterministic_inference:  # sampler.py: the seed is used only then (else 42)
            draw = int.from_bytes(
                hashlib.blake2b(
                    f"{s.sampling_seed if s.sampling_seed is not None else 42}|{req.seq_len()}".encode(),
                    digest_size=4,
                ).digest()
            )
        else:
            draw = self.rng.getrandbits(32)
        prev = (req.input_ids + req.output_ids)[-1]
        token, raw = self.model.next_token(
            self.weights_key, prev, req.seq_len(), draw, len(req.output_ids) + 1
        )
        # layers/sampler.py: log_softmax(logits / T) is reported, except for an all-greedy batch and with
        # SGLANG_RETURN_ORIGINAL_LOGPROB, which report log_softmax(logits): the fake divides its raw
        # log-prob by T the same way (a stand-in, not a renormalised distribution).
        logprob = raw if (greedy_batch or self.cfg.return_original_logprob) else raw / s.temperature
        req.output_ids.append(token)
        req.logprobs.append(logprob)
        if req.to_finish is not None:
            req.finished_reason, req.to_finish = req.to_finish, None
        elif not s.ignore_eos and (token in s.stop_token_ids or token == self.model.eos_token_id):
            req.finished_reason = {"type": "stop", "matched": token}
        elif len(req.output_ids) >= s.max_new_tokens:
            req.finished_reason = {"type": "length", "length": s.max_new_tokens}
        self._stream(req)

    def _stream(self, req: Req) -> None:
        """scheduler_components/output_streamer.py: accept: finished requests always; stream requests
        every stream_interval tokens; others every SGLANG_FORCE_STREAM_INTERVAL tokens. The batch goes to
        the TokenizerManager (_handle_batch_output)."""
        finished = req.finished_reason is not None
        if not finished:
            unsent = len(req.output_ids) - req.send_offset
            if req.stream:
                interval = req.sampling.stream_interval or 1
                if not (interval == 1 or unsent >= interval or (req.send_offset == 0 and unsent > 0)):
                    return
            elif len(req.output_ids) % FORCE_STREAM_INTERVAL != 0:
                return
        new_ids = req.output_ids[req.send_offset :]
        new_lps = req.logprobs[req.send_offset :]
        req.send_offset = len(req.output_ids)
        state = self.rid_to_state.get(req.rid)
        if state is None:
            return
        self._handle_batch_output(state, req, new_ids, new_lps)

    def _handle_batch_output(
        self, state: ReqState, req: Req, new_ids: list[int], new_lps: list[float]
    ) -> None:
        """tokenizer_manager.py: _handle_batch_output for one request (BatchTokenIDOutput: no "text" with
        --skip-tokenizer-init)."""
        f = self.features
        meta: dict[str, Any] = {
            "id": req.rid,
            "finish_reason": req.finished_reason,
            "prompt_tokens": len(req.input_ids),
            "weight_version": self.weight_version,
            f.retractions_key: req.retraction_count,
        }
        state.output_ids.extend(new_ids)
        if state.return_logprob:
            state.logprobs.extend((lp, t, None) for lp, t in zip(new_lps, new_ids, strict=True))
            meta["input_token_logprobs"] = []
            meta["output_token_logprobs"] = list(state.logprobs)
            meta["output_token_logprobs_length"] = len(state.logprobs)
        if f.version >= (0, 5, 20):
            meta["reasoning_tokens"] = 0
        meta["completion_tokens"] = len(req.output_ids)
        meta["cached_tokens"] = 0
        finished = req.finished_reason is not None
        if finished and f.weight_version_spans:
            self._add_weight_versions(meta, req.version_events, len(req.output_ids))
        if finished:
            meta["e2e_latency"] = time.perf_counter() - state.created_s
            state.finished = True
            self.rid_to_state.pop(req.rid, None)
        out: dict[str, Any] = {"output_ids": list(state.output_ids), "meta_info": meta}
        if not self.cfg.skip_tokenizer_init:
            out = {"text": " ".join(map(str, state.output_ids)), **out}
        if finished or state.stream:
            state.out_list.append(out)
            state.event.set()

    def _add_weight_versions(self, meta: dict[str, Any], events: list[tuple[str, int]], n_out: int) -> None:
        """utils/weight_versions.py: compute_weight_version_spans + add_weight_versions_to_meta_info:
        the spans of output tokens each weights version generated; meta_info["weight_version"] becomes the
        last span's (the scheduler's) version."""
        spans: list[dict[str, Any]] = []
        for version, end in [*events, (self.scheduler_weight_version, n_out)]:
            end = min(end, n_out)
            if spans and end <= spans[-1]["end"]:
                continue
            if spans and version == spans[-1]["version"]:
                spans[-1]["end"] = end
                continue
            spans.append({"version": version, "start": spans[-1]["end"] if spans else 0, "end": end})
        visible = [s for s in spans if s["start"] < n_out or s["start"] == 0]
        meta["weight_versions"] = visible
        meta["weight_version"] = visible[-1]["version"]

    def _send_abort_output(self, req: Req, finished_reason: dict[str, Any] | None) -> None:
        """scheduler.py: send_abort_output -> tokenizer_manager.py: _handle_abort_req: the answer of a
        request the scheduler ends outside a step (aborted while waiting, or OOM-aborted). Its output_ids
        are what the TokenizerManager already received (for a non-stream request: whole multiples of
        SGLANG_FORCE_STREAM_INTERVAL); no prompt_tokens."""
        state = self.rid_to_state.pop(req.rid, None)
        if state is None:
            return
        state.finished = True
        meta: dict[str, Any] = {
            "id": req.rid,
            "finish_reason": finished_reason or {"type": "abort", "message": "Abort in waiting queue"},
        }
        if self.features.version >= (0, 5, 20):
            meta["weight_version"] = self.weight_version
            meta["e2e_latency"] = time.perf_counter() - state.created_s
            self._add_weight_versions(meta, req.version_events, len(state.output_ids))
        if state.return_logprob:
            meta["input_token_logprobs"] = []
            meta["output_token_logprobs"] = list(state.logprobs)
            meta["output_token_logprobs_length"] = len(state.logprobs)
        meta["completion_tokens"] = len(state.output_ids)
        ids = list(state.output_ids)
        if state.stream and self.features.version < (0, 5, 20):
            ids = ids[-1:]  # 0.5.6: a streamed queued abort reports only the last id
        out: dict[str, Any] = {"text": "", "output_ids": ids, "meta_info": meta}
        state.out_list.append(out)
        state.event.set()

    def _snapshot(self) -> dict[str, Any]:
        """managers/load_snapshot.py: LoadSnapshot core keys, as published by the scheduler after each
        step and when idle (so /v1/loads lags the requests still on their way to the scheduler)."""
        used = sum(r.seq_len() for r in self.running)
        return {
            "timestamp": time.time(), "dp_rank": 0, "num_running_reqs": len(self.running),
            "num_waiting_reqs": len(self.waiting),
            "num_waiting_uncached_tokens": sum(r.seq_len() for r in self.waiting), "num_used_tokens": used,
            "num_total_tokens": used + sum(r.seq_len() for r in self.waiting), "num_active_tokens": used,
            "num_prealloc_ready_tokens": 0, "max_total_num_tokens": self.cfg.kv_capacity,
            "max_running_requests": self.cfg.max_running_requests,
            "token_usage": round(used / max(1, self.cfg.kv_capacity), 4), "gen_throughput": 0.0,
            "cache_hit_rate": 0.0, "utilization": 0.0, "total_prefill_uncached_tokens": 0,
            "total_prefill_busy_us": 0, "decode_moments": None,
        }  # fmt: skip

    async def close(self) -> None:
        self.crashed = True
        self.groups.close()
        self._task.cancel()
        for state in list(self.rid_to_state.values()):
            state.event.set()
