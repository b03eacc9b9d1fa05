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
    a response spans two versions, as with an engine that swaps weights between decode steps;
  - the failure contract of `actors.engine`: a failed request comes back with `error` set, and a far side
    that is down empties the whole table into one `EngineUnavailable`.

`_absorb` is the one place where a submission's answer becomes its request's outcome:
  - a Segment ending in ABORT whose last token is a stop id is STOP (the abort landed in the step that
    sampled the stop token: SGLang reports the abort, the sample is finished); one that used the whole
    budget is LENGTH. Everywhere: in `step`, `abort`, `park` and the failure paths.
  - a Segment with `error` is a failed request: with ABORT a transient failure (the request resumes
    later from the tokens it has), with NONE a request the far side refuses (the sample fails).
  - a submission that raised `EngineUnavailable` means the far side is down: the call that saw it empties
    the table into one EngineUnavailable carrying every request (see `_unavailable`).
  - any other exception fails its request (NONE, the exception's first line as the error): a transport
    classifies the failures it knows to be transient itself, by answering a Segment with ABORT and an
    error, so an unknown one (a malformed answer, a bug) is never retried forever.
Nothing is lost: a request leaves the table only inside an output or an EngineUnavailable's partials.

Does not know the transport: the adapter passes `submit` (start one submission; may raise EngineError
when refused), `halt` (stop every submission and return once each future is done, aborted ones with
their partial; may leave the far side paused), `resume` (serve again after `halt`) and `cut` (stop
waiting for submissions that `halt` could not stop: their futures may never be done, and what they
generated is lost). Sampling, weights and the far side's health are the adapter's business too.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field

from actors.engine import EngineError, EngineUnavailable, GenerationOutput, GenerationRequest, admit
from april.records import FinishReason

log = logging.getLogger(__name__)

# the finish reasons servers report (SGLang's finish_reason.type, vLLM's finish_reason), as ours
FINISH_REASONS: Mapping[str, FinishReason] = {
    "stop": FinishReason.STOP,
    "length": FinishReason.LENGTH,
    "abort": FinishReason.ABORT,
}


@dataclass(frozen=True, slots=True)
class Segment:
    """What one submission generated: its new tokens, their log-probs, why it ended, and the transport's
    stats for it (summed over a request's submissions). `error` says why the request failed: with ABORT
    a transient failure (the tokens are those the far side still returned), with NONE a refusal."""

    token_ids: list[int]
    logprobs: list[float]
    finish_reason: FinishReason
    stats: dict[str, float] = field(default_factory=dict)
    error: str = ""


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

    def output(self, reason: FinishReason, error: str = "") -> GenerationOutput:
        stats = {**self.stats, "engine_s": time.perf_counter() - self.added_s}
        return GenerationOutput.of(
            self.request_id, self.done_ids, self.done_logprobs, self.done_versions, reason, stats, error
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
        cut: Callable[[Sequence[Flight]], None] = lambda flights: None,
        stop_token_ids: Iterable[int] = (),
    ) -> None:
        self.engine = engine  # names the engine in errors
        self.stop_token_ids = frozenset(int(t) for t in stop_token_ids)
        self._submit_call = submit
        self._halt = halt
        self._resume = resume
        self._cut = cut
        self._running: dict[int, Flight] = {}
        self._ready: list[GenerationOutput] = []
        self._down = ""  # why a submission said the far side is down, until the table is emptied

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
        `context` (the longest sequence, input plus output, the far side generates), a budget is clipped
        to what fits after the input; a request with no budget finishes at once with LENGTH and one whose
        input is longer than `context` fails (NONE): neither reaches the far side."""
        known = set(self._running) | {o.request_id for o in self._ready}
        inputs = admit(self.engine, self.active, slots, requests, known, vocab_size)
        now = time.perf_counter()
        for req, ids in zip(requests, inputs, strict=True):
            budget = int(req.max_new_tokens)
            too_long = context is not None and len(ids) > context and budget > 0
            if context is not None:
                budget = min(budget, context - len(ids))
            flight = Flight(req.request_id, ids, budget, greedy=req.greedy, added_s=now)
            if too_long:
                error = f"input of {len(ids)} tokens is longer than the {context} the engine generates from"
                self._ready.append(flight.output(FinishReason.NONE, self._error(flight, error)))
            elif budget <= 0:
                self._ready.append(flight.output(FinishReason.LENGTH))
            else:
                self._submit(flight, version)
        self._raise_if_down()

    def step(self, poll_s: float) -> list[GenerationOutput]:
        """Wait up to `poll_s` for a submission to finish (not at all when some request is ready), then
        return every finished request. EngineUnavailable (the table emptied) if the far side is down."""
        futures = [f.future for f in self._running.values() if f.future is not None]
        if futures and not self._ready:
            wait(futures, timeout=poll_s, return_when=FIRST_COMPLETED)
        self._collect(self._done_flights())
        self._raise_if_down()
        return self._take_ready()

    def abort(self) -> list[GenerationOutput]:
        """Halt and resume the far side, then return every request: finished ones with their reason,
        aborted ones with ABORT and their partial tokens. If the far side cannot be halted or is down:
        EngineUnavailable carrying all of them, the table emptied."""
        if self._running:
            try:
                self._halt(list(self._running.values()))
            except Exception as e:
                self._safely(self._resume)
                raise self._unavailable(f"abort failed: {first_line(e)}", halt=False) from None
            try:
                self._resume()
            except Exception as e:
                raise self._unavailable(f"resume failed: {first_line(e)}", halt=False) from None
        self._collect(self._done_flights())
        if self._running:  # a halt that returned with submissions still out: not idle
            raise self._unavailable("abort left submissions running", halt=False)
        self._raise_if_down()
        return self._take_ready()

    def park(self) -> list[Flight]:
        """Halt the far side (also with nothing running: the caller is about to swap weights) and take
        back every request that has budget left, with what it generated; requests that finished or failed
        meanwhile become ready. Leaves the far side halted: follow with `resubmit`, `hand_back` or
        `unavailable`. If the far side cannot be halted or is down: EngineUnavailable, the table emptied."""
        try:
            self._halt(list(self._running.values()))
        except Exception as e:
            self._safely(self._resume)
            raise self._unavailable(f"halt failed: {first_line(e)}", halt=False) from None
        parked: list[Flight] = []
        for flight in self._take_running():
            if flight.future is not None and not flight.future.done():
                self._running[flight.request_id] = flight  # still out: _unavailable below cuts it
                self._down = self._down or "halt left submissions running"
                continue
            reason, error = self._absorb(flight)
            if reason == FinishReason.ABORT and not error:
                parked.append(flight)
            else:
                self._ready.append(flight.output(reason, error))
        if self._down:
            self._safely(self._resume)
            raise self._unavailable(self._down, parked, halt=False)
        return parked

    def resubmit(self, parked: Sequence[Flight], version: int) -> None:
        """Resume the far side and send the parked requests again, their new tokens carrying `version`."""
        try:
            self._resume()
        except Exception as e:
            raise self._unavailable(f"resume failed: {first_line(e)}", parked, halt=False) from None
        for flight in parked:
            self._submit(flight, version)
        self._raise_if_down()

    def hand_back(self, parked: Sequence[Flight]) -> None:
        """Return the parked requests as ABORT with their partials (the engine cannot go on with them;
        the worker resumes them elsewhere)."""
        self._ready += [flight.output(FinishReason.ABORT) for flight in parked]

    def unavailable(self, reason: str, parked: Sequence[Flight] = ()) -> EngineUnavailable:
        """The EngineUnavailable to raise when the adapter finds the far side down (e.g. during a weights
        load): every request, `parked` ones included, in its partials; the table emptied."""
        return self._unavailable(reason, parked)

    def close(self) -> None:
        """Abort what still runs, ignoring errors: the engine is going away."""
        if self._running:
            with contextlib.suppress(EngineError):
                self.abort()

    # -- internals ----------------------------------------------------------------------------------

    def _submit(self, flight: Flight, version: int) -> None:
        flight.version = version
        try:
            flight.future = self._submit_call(flight)
        except EngineUnavailable as e:
            self._down = self._down or first_line(e)
            self._ready.append(flight.output(FinishReason.ABORT, self._error(flight, first_line(e))))
            return
        except EngineError as e:
            self._ready.append(flight.output(FinishReason.NONE, self._error(flight, first_line(e))))
            return
        self._running[flight.request_id] = flight

    def _error(self, flight: Flight, text: str) -> str:
        return f"{self.engine}: request {flight.request_id}: {text}"

    def _absorb(self, flight: Flight) -> tuple[FinishReason, str]:
        """Append the finished submission's tokens to its request; return the request's outcome (its
        finish reason and error, "" when it did not fail). See the module docstring."""
        future, flight.future = flight.future, None
        assert future is not None and future.done(), "a running flight has a finished submission"
        try:
            segment = future.result()
        except EngineUnavailable as e:  # the far side is down: the submission's own tokens are lost
            self._down = self._down or first_line(e)
            return FinishReason.ABORT, self._error(flight, first_line(e))
        except Exception as e:  # whatever else the transport raised: the request fails, named
            return FinishReason.NONE, self._error(flight, first_line(e))
        flight.done_ids += segment.token_ids
        flight.done_logprobs += segment.logprobs
        flight.done_versions += [flight.version] * len(segment.token_ids)
        for key, value in segment.stats.items():
            flight.stats[key] = flight.stats.get(key, 0.0) + value
        reason, error = segment.finish_reason, segment.error
        if reason == FinishReason.ABORT:
            if segment.token_ids and segment.token_ids[-1] in self.stop_token_ids:
                reason, error = FinishReason.STOP, ""  # the abort landed in the step that sampled a stop
            elif flight.left <= 0:
                reason, error = FinishReason.LENGTH, ""  # ... or in the step that used the last of the budget
        elif reason == FinishReason.NONE and not error:
            error = "finished without a reason"
        return reason, self._error(flight, error) if error else ""

    def _done_flights(self) -> list[Flight]:
        return [f for f in self._running.values() if f.future is not None and f.future.done()]

    def _collect(self, flights: Sequence[Flight]) -> None:
        """Move these finished submissions' requests to the ready list with their outcome."""
        for flight in flights:
            del self._running[flight.request_id]
            self._ready.append(flight.output(*self._absorb(flight)))

    def _raise_if_down(self) -> None:
        if self._down:
            raise self._unavailable(self._down)

    def _unavailable(
        self, reason: str, parked: Sequence[Flight] = (), *, halt: bool = True
    ) -> EngineUnavailable:
        """Empty the table into an EngineUnavailable: halt what still runs (best effort, `halt`), cut what
        the halt could not stop (its current submission's tokens are lost, earlier ones kept), and carry
        every request: unfinished ones as ABORT with the tokens known, finished ones with their reason."""
        if halt and self._running:
            self._safely(lambda: self._halt(list(self._running.values())))
            self._safely(self._resume)
        self._collect(self._done_flights())
        stuck = list(self._running.values())
        if stuck:
            self._safely(lambda: self._cut(stuck))
        outputs = self._take_ready()
        outputs += [f.output(FinishReason.ABORT, self._error(f, reason)) for f in stuck]
        outputs += [f.output(FinishReason.ABORT, self._error(f, reason)) for f in parked]
        self._running, self._down = {}, ""
        return EngineUnavailable(f"{self.engine}: {reason}", outputs)

    def _safely(self, call: Callable[[], None]) -> None:
        """A step of a failure path: its own failure is logged, never raised over the first one."""
        try:
            call()
        except Exception as e:
            log.warning("%s: %s", self.engine, first_line(e))

    def _take_running(self) -> list[Flight]:
        flights, self._running = list(self._running.values()), {}
        return flights

    def _take_ready(self) -> list[GenerationOutput]:
        out, self._ready = self._ready, []
        return out
