"""The in-flight request table the server-style adapters share (actors/engines/inflight.py), driven by a
scripted far side: submissions are futures the test completes, `halt` answers every running submission
with ABORT and the partial the test chose. What the adapters' own tests cannot provoke on demand lives
here: a submission that finishes or fails while a weights load parks the others, a halt that fails,
an engine that hands its parked requests back."""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field

import numpy as np
import pytest

from actors.engine import EngineError, EngineUnavailable, GenerationOutput, GenerationRequest
from actors.engines.inflight import Flight, InFlight, Segment
from april.records import FinishReason


@dataclass
class Submission:
    request_id: int
    input_ids: list[int]
    left: int
    version: int
    future: Future[Segment]


@dataclass
class FarSide:
    """Records every call in `log`; `partials[request_id]` is what a halt returns for that request."""

    partials: dict[int, list[int]] = field(default_factory=dict)
    refuse: set[int] = field(default_factory=set)  # request ids whose submission is refused
    halt_fails: bool = False
    submissions: list[Submission] = field(default_factory=list)
    log: list[str] = field(default_factory=list)

    def submit(self, flight: Flight) -> Future[Segment]:
        if flight.request_id in self.refuse:
            raise EngineError(f"request {flight.request_id} refused")
        flight.rid = f"r{len(self.submissions)}"
        future: Future[Segment] = Future()
        self.submissions.append(
            Submission(flight.request_id, flight.resume_input(), flight.left, flight.version, future)
        )
        self.log.append(f"submit {flight.request_id}")
        return future

    def halt(self, flights: Sequence[Flight]) -> None:
        self.log.append(f"halt {sorted(f.request_id for f in flights)}")
        if self.halt_fails:
            raise EngineError("far side did not go idle")
        for flight in flights:
            assert flight.future is not None
            if not flight.future.done():
                ids = self.partials.get(flight.request_id, [])
                flight.future.set_result(segment(ids, FinishReason.ABORT))

    def resume(self) -> None:
        self.log.append("resume")

    def last(self, request_id: int) -> Submission:
        return [s for s in self.submissions if s.request_id == request_id][-1]


def segment(ids: list[int], reason: FinishReason, **stats: float) -> Segment:
    return Segment(ids, [-0.5] * len(ids), reason, dict(stats))


def req(rid: int, ids: list[int], budget: int) -> GenerationRequest:
    return GenerationRequest(rid, np.asarray(ids, dtype=np.int32), budget)


def table(far: FarSide) -> InFlight:
    return InFlight("test engine", submit=far.submit, halt=far.halt, resume=far.resume)


def by_id(outputs: list[GenerationOutput]) -> dict[int, GenerationOutput]:
    return {o.request_id: o for o in outputs}


def test_finished_submissions_come_back_from_step_with_their_version() -> None:
    far = FarSide()
    flights = table(far)
    flights.add([req(1, [5, 6], 4), req(2, [7], 3)], slots=4, version=3)
    assert flights.active == flights.running == 2 and flights.step(0.0) == []
    far.last(1).future.set_result(segment([8, 9], FinishReason.STOP, cached_tokens=2.0))
    (out,) = flights.step(0.0)
    assert out.request_id == 1 and out.finish_reason == FinishReason.STOP
    assert out.token_ids.tolist() == [8, 9] and out.versions.tolist() == [3, 3]
    assert out.stats["cached_tokens"] == 2.0 and out.stats["engine_s"] >= 0
    assert flights.active == 1 and far.last(1).input_ids == [5, 6] and far.last(1).left == 4


def test_no_budget_finishes_at_once_without_a_submission() -> None:
    far = FarSide()
    flights = table(far)
    flights.add([req(1, [5, 6, 7], 10), req(2, [5], 0)], slots=4, version=0, context=3)
    outs = by_id(flights.step(0.0))
    assert set(outs) == {1, 2} and far.submissions == []  # request 1's input fills the context
    assert all(o.finish_reason == FinishReason.LENGTH and len(o.token_ids) == 0 for o in outs.values())
    flights.add([req(3, [5], 10)], slots=4, version=0, context=4)
    assert far.last(3).left == 3  # clipped to what fits after the input


def test_admission_refusals_name_the_engine() -> None:
    flights = table(FarSide())
    flights.add([req(1, [5], 2)], slots=2, version=0)
    with pytest.raises(EngineError, match="test engine: request 1 is already active"):
        flights.add([req(1, [5], 2)], slots=2, version=0)
    with pytest.raises(EngineError, match="test engine: 1 active"):
        flights.add([req(2, [5], 2), req(3, [5], 2)], slots=2, version=0)
    with pytest.raises(EngineError, match=r"input_ids must be non-empty ids in \[0, 10\)"):
        flights.add([req(4, [12], 2)], slots=2, version=0, vocab_size=10)
    assert flights.active == 1


def test_a_failed_submission_fails_its_request_only() -> None:
    far = FarSide()
    flights = table(far)
    flights.add([req(1, [5], 4), req(2, [6], 4), req(3, [7], 4)], slots=4, version=0)
    far.last(1).future.set_result(segment([8], FinishReason.LENGTH))
    far.last(2).future.set_exception(RuntimeError("HTTP 400: too long\nsecond line"))
    outs = by_id(flights.step(0.0))
    assert outs[1].finish_reason == FinishReason.LENGTH and outs[1].error == ""
    assert outs[2].finish_reason == FinishReason.NONE  # an unknown failure: the request is failed
    assert outs[2].error == "test engine: request 2: HTTP 400: too long"
    assert flights.active == 1  # 3 still runs
    far.last(3).future.set_result(segment([9], FinishReason.STOP))
    assert [o.request_id for o in flights.step(0.0)] == [3] and flights.active == 0


def test_a_transient_failure_returns_the_tokens_of_earlier_submissions() -> None:
    far = FarSide(partials={1: [8, 9]})
    flights = table(far)
    flights.add([req(1, [5], 10)], slots=4, version=0)
    flights.resubmit(flights.park(), version=1)
    far.last(1).future.set_result(Segment([], [], FinishReason.ABORT, error="HTTP 503: overloaded"))
    (out,) = flights.step(0.0)
    assert (
        out.finish_reason == FinishReason.ABORT
        and out.error == "test engine: request 1: HTTP 503: overloaded"
    )
    assert out.token_ids.tolist() == [8, 9] and out.versions.tolist() == [0, 0]


def test_an_input_longer_than_the_context_fails_without_a_submission() -> None:
    far = FarSide()
    flights = table(far)
    flights.add([req(1, [5, 6, 7, 8], 10), req(2, [5, 6, 7, 8], 0)], slots=4, version=0, context=3)
    outs = by_id(flights.step(0.0))
    assert far.submissions == []
    assert outs[1].finish_reason == FinishReason.NONE and "input of 4 tokens" in outs[1].error
    assert outs[2].finish_reason == FinishReason.LENGTH  # no budget asked: nothing to fail


@pytest.mark.parametrize("where", ["step", "abort", "park"])
def test_an_abort_on_a_stop_token_is_stop_and_one_at_full_budget_is_length(where: str) -> None:
    """The one place where an answer becomes an outcome: whichever call collects it."""
    far = FarSide(partials={1: [8, 2], 2: [8, 9, 10]})
    flights = InFlight("test engine", submit=far.submit, halt=far.halt, resume=far.resume, stop_token_ids=[2])
    flights.add([req(1, [5], 10), req(2, [6], 3), req(3, [7], 10)], slots=4, version=0)
    if where == "step":
        far.last(1).future.set_result(segment([8, 2], FinishReason.ABORT))
        far.last(2).future.set_result(segment([8, 9, 10], FinishReason.ABORT))
        outs = by_id(flights.step(0.0))
    elif where == "abort":
        outs = by_id(flights.abort())
    else:
        parked = flights.park()
        assert [f.request_id for f in parked] == [3]  # only the one with budget left and no stop
        outs = by_id(flights.step(0.0))
    assert outs[1].finish_reason == FinishReason.STOP and outs[1].token_ids.tolist() == [8, 2]
    assert outs[2].finish_reason == FinishReason.LENGTH and outs[2].token_ids.tolist() == [8, 9, 10]
    assert outs[1].error == outs[2].error == ""


def test_abort_halts_resumes_and_returns_partials() -> None:
    far = FarSide(partials={1: [8, 9]})
    flights = table(far)
    flights.add([req(1, [5], 10), req(2, [6], 10)], slots=4, version=0)
    far.last(2).future.set_result(segment([7], FinishReason.STOP))
    outs = by_id(flights.abort())
    assert far.log[-2:] == ["halt [1, 2]", "resume"] and flights.active == 0
    assert outs[1].finish_reason == FinishReason.ABORT and outs[1].token_ids.tolist() == [8, 9]
    assert outs[2].finish_reason == FinishReason.STOP  # finished before the halt: its own reason
    assert flights.abort() == [] and far.log[-1] == "resume"  # nothing running: the far side is left alone


def test_a_failed_halt_empties_the_table_into_engine_unavailable() -> None:
    far = FarSide(halt_fails=True)
    cut: list[int] = []
    flights = InFlight(
        "test engine",
        submit=far.submit,
        halt=far.halt,
        resume=far.resume,
        cut=lambda stuck: cut.extend(f.request_id for f in stuck),
    )
    flights.add([req(1, [5], 10), req(2, [6], 10)], slots=4, version=0)
    far.last(2).future.set_result(segment([7], FinishReason.STOP))
    with pytest.raises(EngineUnavailable, match="abort failed: far side did not go idle") as err:
        flights.abort()
    assert far.log[-1] == "resume" and flights.active == 0 and cut == [1]  # nothing lost, nothing left
    outs = by_id(err.value.partials)
    assert outs[1].finish_reason == FinishReason.ABORT and "did not go idle" in outs[1].error
    assert outs[2].finish_reason == FinishReason.STOP  # it had finished: it keeps its reason


def test_a_far_side_that_is_down_empties_the_table_with_every_partial() -> None:
    far = FarSide(partials={2: [9]})
    flights = table(far)
    flights.add([req(1, [5], 10), req(2, [6], 10), req(3, [7], 10)], slots=4, version=0)
    flights.resubmit(flights.park(), version=1)  # request 2 now holds [9] from its first submission
    far.partials.clear()  # its second submission has generated nothing when the far side goes down
    far.last(3).future.set_result(segment([4], FinishReason.STOP))
    far.last(1).future.set_exception(EngineUnavailable("server gone"))
    with pytest.raises(EngineUnavailable, match=r"^test engine: server gone$") as err:
        flights.step(0.0)
    assert flights.active == 0 and far.log[-2:] == ["halt [2]", "resume"]  # the rest halted for partials
    outs = by_id(err.value.partials)
    assert set(outs) == {1, 2, 3}
    assert outs[1].finish_reason == FinishReason.ABORT and outs[1].error.endswith("server gone")
    assert outs[2].finish_reason == FinishReason.ABORT and outs[2].token_ids.tolist() == [9]
    assert outs[3].finish_reason == FinishReason.STOP
    assert flights.step(0.0) == []  # and it serves again


def test_unavailable_during_a_load_carries_the_parked_requests() -> None:
    far = FarSide(partials={1: [8]})
    flights = table(far)
    flights.add([req(1, [5], 10)], slots=4, version=0)
    parked = flights.park()
    with pytest.raises(EngineUnavailable) as err:
        raise flights.unavailable("server gone", parked)
    (out,) = err.value.partials
    assert out.request_id == 1 and out.token_ids.tolist() == [8] and out.finish_reason == FinishReason.ABORT
    assert flights.active == 0


def test_park_and_resubmit_split_a_response_into_versions() -> None:
    far = FarSide(partials={1: [8, 9]})
    flights = table(far)
    flights.add([req(1, [5], 6)], slots=4, version=0)
    parked = flights.park()
    assert [f.request_id for f in parked] == [1] and flights.active == 0 and far.log[-1] == "halt [1]"
    flights.resubmit(parked, version=1)
    again = far.last(1)
    assert far.log[-2:] == ["resume", "submit 1"] and again.version == 1
    assert again.input_ids == [5, 8, 9] and again.left == 4  # input + partial, the rest of the budget
    again.future.set_result(segment([10, 11, 12, 13], FinishReason.LENGTH))
    (out,) = flights.step(0.0)
    assert out.token_ids.tolist() == [8, 9, 10, 11, 12, 13] and out.versions.tolist() == [0, 0, 1, 1, 1, 1]
    assert out.finish_reason == FinishReason.LENGTH


def test_park_keeps_what_finished_meanwhile() -> None:
    far = FarSide(partials={2: [8, 9, 10]})  # request 2 used its whole budget by the abort step
    flights = table(far)
    flights.add([req(1, [5], 6), req(2, [6], 3), req(3, [7], 6)], slots=4, version=0)
    far.last(1).future.set_result(segment([4], FinishReason.STOP))
    parked = flights.park()
    assert [f.request_id for f in parked] == [3]
    outs = by_id(flights.step(0.0))
    assert outs[1].finish_reason == FinishReason.STOP
    assert outs[2].finish_reason == FinishReason.LENGTH and outs[2].token_ids.tolist() == [8, 9, 10]
    assert flights.active == 0  # the parked request is the caller's until resubmitted


def test_park_with_nothing_running_still_halts() -> None:
    far = FarSide()
    flights = table(far)
    assert flights.park() == [] and far.log == ["halt []"]
    flights.resubmit([], version=1)
    assert far.log == ["halt []", "resume"]


def test_park_with_a_failed_submission_parks_the_others() -> None:
    far = FarSide(partials={1: [8]})
    flights = table(far)
    flights.add([req(1, [5], 6), req(2, [6], 6)], slots=4, version=2)
    far.last(2).future.set_exception(EngineError("server said no"))
    parked = flights.park()
    assert [f.request_id for f in parked] == [1]
    (failed,) = flights.step(0.0)
    assert failed.request_id == 2 and failed.finish_reason == FinishReason.NONE
    assert failed.error == "test engine: request 2: server said no"
    flights.resubmit(parked, version=3)
    assert far.last(1).version == 3 and far.last(1).input_ids == [5, 8]


def test_hand_back_returns_parked_requests_as_partials() -> None:
    far = FarSide(partials={1: [8, 9]})
    flights = table(far)
    flights.add([req(1, [5], 6)], slots=4, version=0)
    flights.hand_back(flights.park())
    (out,) = flights.step(0.0)
    assert out.finish_reason == FinishReason.ABORT and out.token_ids.tolist() == [8, 9]
    assert far.log == ["submit 1", "halt [1]"]  # the far side is not resumed


def test_stats_add_up_over_submissions() -> None:
    far = FarSide()
    flights = table(far)
    flights.add([req(1, [5], 6)], slots=4, version=0)
    far.last(1).future.set_result(segment([8], FinishReason.ABORT, e2e_latency_s=0.5))
    flights.resubmit(flights.park(), version=1)
    far.last(1).future.set_result(segment([9], FinishReason.STOP, e2e_latency_s=0.25))
    (out,) = flights.step(0.0)
    assert out.stats["e2e_latency_s"] == 0.75 and out.token_ids.tolist() == [8, 9]
