"""The inference-engine interface every rollout worker drives, whatever the engine.

One small synchronous interface so the worker loop (actors/worker.py) reads the same for the built-in
torch engine, a real SGLang server, vLLM and the simulation engine. Token ids only: tokenization and
chat templates are the worker's business; sockets and leases are the worker's business too.

Life of a request: `add` it (input = prompt + response so far, budget = tokens it may still generate);
call `step` repeatedly to make progress and collect the requests that finished (stop or length).
Tokens are drawn with the engine's `SamplingParams`, except for a request marked `greedy`: its tokens
are the argmax (the broker's evaluation samples; their log-probs are not used for training).
`abort` stops everything and returns every unfinished request with the tokens it generated so far,
returning only once the engine is really idle. `load_weights` runs between steps; a failed load raises
`WeightLoadError` and leaves the old weights serving. Each generated token carries the weights version
that produced it, so a load between decode steps splits a response into two segments.

When an engine fails (a remote server can), the failure is as small as it can be:
  - one request fails: `step` returns it with `error` set. With finish reason ABORT the failure was
    transient (the server ran out of memory, restarted, dropped the connection): the output carries the
    tokens generated before it, and the worker returns the sample as a partial that resumes later. With
    finish reason NONE the request itself is at fault (a prompt over the context, a parameter the server
    refuses): retrying would fail again, so the worker fails the sample with that reason.
  - the whole engine cannot serve (its server is down or restarting): any method raises
    `EngineUnavailable` carrying every request the engine held, each with the tokens it still knows, and
    the engine is left empty. The worker returns them as partials, tells the broker its engine is down,
    leases nothing, and calls `probe` with backoff until the engine serves again.

Heavy imports (torch, transformers, HTTP clients) live in the engine modules under actors/engines/, never
here, and `make_engine` imports only the one asked for.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from april.records import FinishReason

if TYPE_CHECKING:
    import torch

    from actors.weight_receive import GroupServers, Offer

ENGINES = ("torch", "sglang", "vllm", "sim")


class EngineError(Exception):
    """The engine cannot serve (bad model directory, server unreachable, ...). One readable line."""


class WeightLoadError(EngineError):
    """A new weights version could not be loaded; the engine keeps serving the old one."""


class EngineUnavailable(EngineError):
    """The engine as a whole cannot serve now (its server is down, restarting or unreachable).

    `partials` are every request it held, each with the tokens it still knows: finish reason ABORT, except
    a request that had finished before the failure and was not yet returned, which keeps its reason (STOP,
    LENGTH, or NONE with its error), as `abort` would return it; the engine holds none after raising this.
    `probe` says when it serves again."""

    def __init__(self, message: str, partials: Sequence[GenerationOutput] = ()) -> None:
        super().__init__(message)
        self.partials = list(partials)


class WeightsLost(EngineUnavailable):
    """The engine's servers answer but hold no whole version it can restore by itself (one restarted with
    its launch weights, or a broadcast failed half-way, and the version it served came by broadcast, so
    no copy is on disk). It stays unavailable until `load_weights` gives it `version`, or a newer one;
    meanwhile its version does not go back (tokens never carry an older version than before)."""

    def __init__(self, message: str, partials: Sequence[GenerationOutput] = (), version: int = 0) -> None:
        super().__init__(message, partials)
        self.version = version


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How tokens are drawn. Log-probs are always those of the temperature-scaled full distribution
    (before top-p/top-k truncation), which is what the learner recomputes."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    stop_token_ids: tuple[int, ...] = ()
    seed: int = 0


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    request_id: int  # the worker uses the broker's lease id
    input_ids: npt.NDArray[np.int32]  # prompt + response so far
    max_new_tokens: int  # budget; 0 means finished at once with reason LENGTH
    greedy: bool = False  # argmax decoding for this request (an evaluation sample), whatever the sampling


@dataclass(frozen=True, slots=True)
class GenerationOutput:
    """What one request generated since it was added (new tokens only)."""

    request_id: int
    token_ids: npt.NDArray[np.int32]
    logprobs: npt.NDArray[np.float32]
    versions: npt.NDArray[np.int32]  # weights version that produced each token
    finish_reason: FinishReason  # STOP, LENGTH, ABORT (from `abort`, or a transient failure), NONE (failed)
    stats: dict[str, float] = field(default_factory=dict)  # engine-specific timings, optional
    error: str = ""  # why the engine could not finish this request (one line); "" when it did

    @classmethod
    def of(
        cls,
        request_id: int,
        token_ids: Sequence[int],
        logprobs: Sequence[float],
        versions: Sequence[int],
        finish_reason: FinishReason,
        stats: dict[str, float] | None = None,
        error: str = "",
    ) -> GenerationOutput:
        """From plain lists, as engines accumulate them."""
        return cls(
            request_id,
            np.asarray(token_ids, dtype=np.int32),
            np.asarray(logprobs, dtype=np.float32),
            np.asarray(versions, dtype=np.int32),
            finish_reason,
            dict(stats or {}),
            error,
        )


class Engine(Protocol):
    name: str
    slots: int  # most requests it runs at once
    # whether a prefix cache can outlive a weight update (worker.resume_kv = "reuse"); engines that flush
    # it on every update, as SGLang and vLLM do, say False and the worker refuses "reuse" at start
    can_reuse_kv: bool
    version: int  # weights version loaded now

    @property
    def placement(self) -> str:
        """Where and how the engine runs, for people (the status shows it): "cuda:0, cuda graphs", a
        server's URL, "sim". One line; it does not change while the engine lives."""
        ...

    @property
    def active(self) -> int:
        """Requests added and not yet returned."""
        ...

    def add(self, requests: Sequence[GenerationRequest]) -> None:
        """Start generating; the caller never exceeds `slots` active requests."""
        ...

    def step(self) -> list[GenerationOutput]:
        """Make progress (one decode step, or a short poll for remote engines); return the requests that
        finished since the last call. Returns promptly when nothing is active."""
        ...

    def abort(self) -> list[GenerationOutput]:
        """Stop everything; return every request not yet returned (finished ones with their reason,
        unfinished ones with ABORT and their partial tokens). On return the engine is idle."""
        ...

    def load_weights(self, path: Path, version: int) -> None:
        """Swap in weights `version` from `path` (a verified safetensors file or HF directory)."""
        ...

    def probe(self) -> None:
        """Return if the engine can serve now; raise EngineUnavailable (holding nothing) if it cannot.
        In-process engines always can."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class CostModelled(Protocol):
    """An engine that models its own cost (the sim engine): cumulative model seconds in decode steps, the
    part re-prefilling resumed partials, and tokens drawn attending to KV of older weights (reported in
    `EngineUsage`, for the re-prefill share of a real run)."""

    elapsed_s: float
    reprefill_s: float
    stale_kv_tokens: int


@runtime_checkable
class TensorLoading(Protocol):
    """An engine that can take a version as named tensors in this process (the collective broadcast,
    `actors.weight_receive`) instead of a file: the built-in torch engine. Same contract as
    `load_weights`: between steps, and a failed load raises WeightLoadError and keeps the old weights."""

    def load_tensors(self, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        """Swap in weights `version` from `tensors` (name -> tensor, the model's state-dict names)."""
        ...


@runtime_checkable
class BroadcastReceiving(Protocol):
    """An engine whose servers receive the learner's broadcast themselves (SGLang: they are ranks of its
    group, `actors.engines.sglang_broadcast`): the worker's broadcast member has `broadcast_servers` join
    each group, and the worker loop calls `load_broadcast` when a version is on its way. Same contract as
    `load_weights`: between steps; WeightLoadError leaves a whole older version serving."""

    @property
    def broadcast_servers(self) -> GroupServers:
        """The servers as group ranks (called from the member's thread)."""
        ...

    def load_broadcast(self, offer: Offer) -> None:
        """Receive and check version `offer.version` while the learner sends it."""
        ...


def run_to_completion(engine: Engine, requests: Sequence[GenerationRequest]) -> list[GenerationOutput]:
    """Keep the engine full (requests join as slots free up) until every request finished; outputs in
    the order they finished. For callers without a broker: `april generate`, `april sft`'s evaluation,
    benchmarks and tests."""
    pending = list(requests)
    done: list[GenerationOutput] = []
    while pending or engine.active:
        free = engine.slots - engine.active
        if pending and free > 0:
            engine.add(pending[:free])
            pending = pending[free:]
        done.extend(engine.step())
    return done


def check_engine_args(engine: str, slots: int, sampling: SamplingParams) -> None:
    """The start-up checks every model engine makes: at least one slot and sampling settings it runs."""
    if slots < 1:
        raise EngineError(f"{engine} engine: slots must be >= 1, got {slots}")
    if not sampling.temperature > 0:
        raise EngineError(f"{engine} engine: temperature must be > 0, got {sampling.temperature}")
    if not 0 < sampling.top_p <= 1 or sampling.top_k < 0:
        raise EngineError(
            f"{engine} engine: need 0 < top_p <= 1 and top_k >= 0, got {sampling.top_p}, {sampling.top_k}"
        )


def admit(
    engine: str,
    active: int,
    slots: int,
    requests: Sequence[GenerationRequest],
    known: set[int],
    vocab_size: int | None = None,
) -> list[list[int]]:
    """Check requests before an engine takes any of them; returns each request's input ids as a list.

    Refuses (EngineError naming the engine) more requests than free slots, a request id already active
    (`known`) or repeated in `requests`, and, given `vocab_size`, empty input or ids outside the vocabulary.
    """
    if active + len(requests) > slots:
        raise EngineError(f"{engine}: {active} active + {len(requests)} added > {slots} slots")
    seen = set(known)
    inputs: list[list[int]] = []
    for req in requests:
        if req.request_id in seen:
            raise EngineError(f"{engine}: request {req.request_id} is already active")
        ids = [int(t) for t in np.asarray(req.input_ids).reshape(-1)]
        if vocab_size is not None and (not ids or min(ids) < 0 or max(ids) >= vocab_size):
            raise EngineError(
                f"{engine}: request {req.request_id}: input_ids must be non-empty ids in [0, {vocab_size}), "
                f"got {len(ids)} ids"
            )
        seen.add(req.request_id)
        inputs.append(ids)
    return inputs
