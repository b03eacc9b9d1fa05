"""In-flight requests of a server-style engine: the request bookkeeping the SGLang and vLLM adapters share.

A server-style engine generates elsewhere (an SGLang server over HTTP, vLLM's async engine on its own
event loop) and hears back once per submission, through a future of that submission's `Segment`.
`InFlight` owns what does not depend on how the submission travels:
  - what was submitted: a `Flight` per request the worker added, with its input, its budget and the
    future of its current submission; `done_*` hold what its earlier submissions generated, each token
    with the weights version passed when its submission started;
  - what came back: `step` polls the futures and returns the requests that finished; `abort` halts the
    far side and returns every request, the unfinished ones with ABORT and their partial tokens;
  - park and resubmit around a weights load: `park` halts the far side and takes every request back
    with its partial; `resubmit` sends each again as `input + partial` with the rest of its budget, so
    a response spans two versions, as with an engine that swaps weights between decode steps.

`_absorb` is the one place where a submission's answer becomes its request's outcome: how the finish
reason is taken and what a failed submission does. Today a failed submission fails its own request
(it leaves the table, with the error naming it); the other requests' results are kept and the first
error is raised by the call that collected it.

Does not know the transport: the adapter passes `submit` (start one submission; may raise EngineError
when refused), `halt` (stop every submission and return once each future is done, aborted ones with
their partial; may leave the far side paused) and `resume` (serve again after `halt`). Sampling,
weights and the far side's health are the adapter's business too.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field

from actors.engine import EngineError, GenerationOutput, GenerationRequest, admit
from april.records import FinishReason

# the finish reasons servers report (SGLang's finish_reason.type, vLLM's finish_reason), as ours
FINISH_REASONS: Mapping[str, FinishReason] = {
    "stop": FinishReason.STOP,
    "length": FinishReason.LENGTH,
    "abort": FinishReason.ABORT,
}


@dataclass(frozen=True, slots=True)
class Segment:
    """What one submission generated: its new tokens, their log-probs, why it ended, and the transport's
    stats for it (summed over a request's submissions)."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    stats: dict[str, float] = field(default_factory=dict)


@dataclass(slots=True)
class Flight:
    """One request the worker added, over one or more submissions (resubmitted after a weights load)."""

    request_id: int
    input_ids: list[int]
    max_new_tokens: int  # budget over all submissions (clipped to the context where the adapter knows it)
    greedy: bool = False  # argmax decoding (an evaluation request)
    added_s: float = 0.0  # time.perf_counter() when the worker added it
    rid: str = ""  # the transport's id of the current submission, set by `submit` where it needs one
    version: int = 0  # weights version when the current submission started
    future: Future[Segment] | None = None  # the current submission; None between submissions
    done_ids: list[int] = field(default_factory=list)
    done_logprobs: list[float] = field(default_factory=list)
    done_versions: list[int] = field(default_factory=list)
    stats: dict[str, float] = field(default_factory=dict)

    @property
    def left(self) -> int:
        """Tokens the next submission may still generate."""
        return self.max_new_tokens - len(self.done_ids)

    def resume_input(self) -> list[int]:
        """What the next submission is given: the input and everything generated so far."""
        return self.input_ids + self.done_ids

    def output(self, reason: FinishReason) -> GenerationOutput:
        stats = {**self.stats, "engine_s": time.perf_counter() - self.added_s}
        return GenerationOutput.of(
            self.request_id, self.done_ids, self.done_logprobs, self.done_versions, reason, stats
        )


def first_line(exc: BaseException) -> str:
    """An exception as one readable line (its first line, or its type when it says nothing)."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


class InFlight:
    """The requests a server-style engine holds: running (a submission out) or ready (finished, not yet
    returned by `step` or `abort`). See the module docstring."""

    def __init__(
        self,
        engine: str,
        *,
        submit: Callable[[Flight], Future[Segment]],
        halt: Callable[[Sequence[Flight]], None],
        resume: Callable[[], None] = lambda: None,
    ) -> None:
        self.engine = engine  # names the engine in errors
        self._submit_call = submit
        self._halt = halt
        self._resume = resume
        self._running: dict[int, Flight] = {}
        self._ready: list[GenerationOutput] = []

    @property
    def active(self) -> int:
        """Requests added and not yet returned."""
        return len(self._running) + len(self._ready)

    @property
    def running(self) -> int:
        """Requests with a submission out."""
        return len(self._running)

    def add(
        self,
        requests: Sequence[GenerationRequest],
        slots: int,
        version: int,
        *,
        vocab_size: int | None = None,
        context: int | None = None,
    ) -> None:
        """Admit `requests` (see `actors.engine.admit`) and submit them with weights `version`. Given
        `context`, a budget is clipped to what fits after the input; a request with no budget finishes
        at once with LENGTH and never reaches the far side."""
        known = set(self._running) | {o.request_id for o in self._ready}
        inputs = admit(self.engine, self.active, slots, requests, known, vocab_size)
        now = time.perf_counter()
        flights = []
        for req, ids in zip(requests, inputs, strict=True):
            budget = int(req.max_new_tokens)
            if context is not None:
                budget = min(budget, context - len(ids))
            flights.append(Flight(req.request_id, ids, budget, greedy=req.greedy, added_s=now))
        for flight in flights:
            if flight.max_new_tokens <= 0:
                self._ready.append(flight.output(FinishReason.LENGTH))
            else:
                self._submit(flight, version)

    def step(self, poll_s: float) -> list[GenerationOutput]:
        """Wait up to `poll_s` for a submission to finish (not at all when some request is ready), then
        return every finished request."""
        futures = [f.future for f in self._running.values() if f.future is not None]
        if futures and not self._ready:
            wait(futures, timeout=poll_s, return_when=FIRST_COMPLETED)
        self._collect(only_done=True)
        return self._take_ready()

    def abort(self) -> list[GenerationOutput]:
        """Halt and resume the far side, then return every request: finished ones with their reason,
        aborted ones with ABORT and their partial tokens."""
        if self._running:
            try:
                self._halt(list(self._running.values()))
            finally:
                self._resume()
        self._collect(only_done=False)
        return self._take_ready()

    def park(self) -> list[Flight]:
        """Halt the far side (also with nothing running: the caller is about to swap weights) and take
        back every request that has budget left, with what it generated; requests that finished
        meanwhile become ready. Leaves the far side halted: follow with `resubmit` or `hand_back`.
        On a failed submission the parked requests are resubmitted and the first error raised."""
        self._halt(list(self._running.values()))
        parked: list[Flight] = []
        errors: list[EngineError] = []
        for flight in self._take_running():
            try:
                reason = self._absorb(flight)
            except EngineError as e:
                errors.append(e)
                continue
            if reason == FinishReason.ABORT and flight.left > 0:
                parked.append(flight)
            else:  # finished on its own meanwhile (or used its whole budget by the abort step)
                self._ready.append(
                    flight.output(FinishReason.LENGTH if reason == FinishReason.ABORT else reason)
                )
        if errors:
            self._resume()
            for flight in parked:  # nothing was loaded: they go on with the version they had
                self._submit(flight, flight.version)
            raise errors[0]
        return parked

    def resubmit(self, parked: Sequence[Flight], version: int) -> None:
        """Resume the far side and send the parked requests again, their new tokens carrying `version`."""
        self._resume()
        for flight in parked:
            self._submit(flight, version)

    def hand_back(self, parked: Sequence[Flight]) -> None:
        """Return the parked requests as ABORT with their partials (the engine cannot go on with them;
        the worker resumes them elsewhere)."""
        self._ready += [flight.output(FinishReason.ABORT) for flight in parked]

    def close(self) -> None:
        """Abort what still runs, ignoring errors: the engine is going away."""
        if self._running:
            with contextlib.suppress(EngineError):
                self.abort()

    # -- internals ----------------------------------------------------------------------------------

    def _submit(self, flight: Flight, version: int) -> None:
        flight.version = version
        flight.future = self._submit_call(flight)
        self._running[flight.request_id] = flight

    def _absorb(self, flight: Flight) -> FinishReason:
        """Append the finished submission's tokens to its request; return the submission's finish
        reason. EngineError naming the request if the submission failed."""
        future, flight.future = flight.future, None
        assert future is not None, "a running flight has a submission out"
        try:
            segment = future.result()
        except Exception as e:  # whatever the transport raised: one line naming the request
            raise EngineError(f"{self.engine}: request {flight.request_id}: {first_line(e)}") from e
        flight.done_ids += segment.token_ids
        flight.done_logprobs += segment.logprobs
        flight.done_versions += [flight.version] * len(segment.token_ids)
        for key, value in segment.stats.items():
            flight.stats[key] = flight.stats.get(key, 0.0) + value
        return segment.finish_reason

    def _collect(self, only_done: bool) -> None:
        """Move finished submissions (all of them when not only_done: the far side is halted) to the
        ready list. On a failed one the other results are kept and the first error is raised."""
        errors: list[EngineError] = []
        for request_id, flight in list(self._running.items()):
            if only_done and not (flight.future is not None and flight.future.done()):
                continue
            del self._running[request_id]
            try:
                self._ready.append(flight.output(self._absorb(flight)))
            except EngineError as e:
                errors.append(e)
        if errors:
            raise errors[0]

    def _take_running(self) -> list[Flight]:
        flights, self._running = list(self._running.values()), {}
        return flights

    def _take_ready(self) -> list[GenerationOutput]:
        out, self._ready = self._ready, []
        return out
