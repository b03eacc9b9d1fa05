"""`plainly_valid` (a whole result at once) against `check_continues` (one sample, the rule).

`plainly_valid` may only vouch for what `check_continues` accepts; it must vouch for a plain fresh return
(else it saves nothing); and it sends everything else, partials included, to `check_continues`.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable

import numpy as np
import pytest
from episode_samples import episodes
from hypothesis import given, settings
from hypothesis import strategies as st
from test_snapshot_episodes import worker_turns

from april.config import Mode
from april.records import FinishReason, Sample, SampleStatus, Segment, Span, new_group_samples
from april.wire_records import SampleBatch
from broker.result_check import MAX_EPISODE_BYTES, ResultRejected, check_continues, plainly_valid

MAX_NEW = 16
VERSION = 3


def leased(n: int, seed: int) -> list[Sample]:
    """n fresh samples as leased (status as queued: PENDING), over a few groups and prompts."""
    rng = np.random.default_rng(seed)
    out: list[Sample] = []
    gid = 0
    while len(out) < n:
        prompt = rng.integers(3, 100, int(rng.integers(1, 6)), dtype=np.int32)
        out += new_group_samples(gid, 4, prompt, f"prompt {gid}", {"answer": str(gid)})
        gid += 1
    return out[:n]


def returned(s: Sample, rng: random.Random) -> Sample:
    """A valid return of fresh `s`: finished, failed, or interrupted with tokens."""
    kind = rng.choice(["stop", "length", "failed", "abort", "empty-abort"])
    k = 0 if kind == "empty-abort" else rng.randint(1, MAX_NEW)
    finish = {"stop": FinishReason.STOP, "length": FinishReason.LENGTH}.get(kind, FinishReason.ABORT)
    version = rng.randint(0, VERSION)
    out = s.extend(list(range(3, 3 + k)), [-0.5] * k, version, finish)
    if kind == "failed":
        return out.failed("reward function raised")
    return out.scored(float(rng.random())) if finish != FinishReason.ABORT else out


Mutation = Callable[[Sample], Sample]
MUTATIONS: dict[str, Mutation] = {
    "wrong group": lambda s: dataclasses.replace(s, group_id=s.group_id + 1000),
    "wrong index": lambda s: dataclasses.replace(s, index=s.index + 1),
    "still running": lambda s: dataclasses.replace(s, status=SampleStatus.RUNNING),
    "pending": lambda s: dataclasses.replace(s, status=SampleStatus.PENDING),
    "no reward": lambda s: dataclasses.replace(s, reward=float("nan")),
    "finished by abort": lambda s: dataclasses.replace(s, finish_reason=FinishReason.ABORT),
    "interrupted by stop": lambda s: dataclasses.replace(
        s, status=SampleStatus.INTERRUPTED, finish_reason=FinishReason.STOP
    ),
    "future version": lambda s: dataclasses.replace(
        s, segments=tuple(Segment(VERSION + 1, g.start, g.end) for g in s.segments)
    ),
    "over budget": lambda s: (
        s.extend([7] * (MAX_NEW + 1), [-0.1] * (MAX_NEW + 1), VERSION, s.finish_reason)
        if s.finish_reason != FinishReason.NONE
        else s
    ),
    "prompt changed": lambda s: dataclasses.replace(s, prompt_ids=np.flip(s.prompt_ids) + 1),
    "prompt shortened": lambda s: dataclasses.replace(s, prompt_ids=s.prompt_ids[:-1]),
    "text changed": lambda s: dataclasses.replace(s, prompt_text=s.prompt_text + "!"),
    "metadata changed": lambda s: dataclasses.replace(s, metadata={**s.metadata, "answer": "x"}),
    "resumes changed": lambda s: dataclasses.replace(s, resumes=s.resumes + 1),
}


def verdict(before: Sample, after: Sample) -> bool:
    try:
        check_continues(before, after, MAX_NEW, VERSION)
    except ResultRejected:
        return False
    return True


def test_it_vouches_for_every_plain_fresh_return() -> None:
    rng = random.Random(0)
    before = leased(32, seed=0)
    after = [returned(s, rng) for s in before]
    assert all(verdict(b, a) for b, a in zip(before, after, strict=True))
    assert plainly_valid(before, SampleBatch.from_samples(after), MAX_NEW, VERSION) == [True] * 32


@pytest.mark.parametrize("seed", range(40))
def test_it_vouches_only_for_what_the_rule_accepts(seed: int) -> None:
    """Mix valid returns with returns broken one way each: whatever it vouches for, the rule accepts;
    whatever the rule rejects, it does not vouch for; a broken sample never spoils its neighbours."""
    rng = random.Random(seed)
    before = leased(rng.randint(1, 24), seed)
    after, broken = [], []
    for s in before:
        a = returned(s, rng)
        if rng.random() < 0.4:
            a = MUTATIONS[rng.choice(sorted(MUTATIONS))](a)
            broken.append(True)
        else:
            broken.append(False)
        after.append(a)
    try:
        batch = SampleBatch.from_samples(after)
        batch.validate()
    except ValueError:
        pytest.skip("a mutation made the batch itself malformed (the codec refuses it before any lease)")
    vouched = plainly_valid(before, batch, MAX_NEW, VERSION)
    for b, a, v, bad in zip(before, after, vouched, broken, strict=True):
        ok = verdict(b, a)
        assert not v or ok, f"vouched for a return the rule rejects: {a}"
        if not bad:
            assert v, "a valid fresh return next to broken ones lost its voucher"


@pytest.mark.parametrize("name", sorted(MUTATIONS))
def test_each_way_of_breaking_a_return_is_not_vouched_for(name: str) -> None:
    before = leased(8, seed=1)
    for seed in range(50):  # a draw where the mutation breaks sample 3 (no reward breaks only a finished one)
        rng = random.Random(seed)
        after = [returned(s, rng) for s in before]
        after[3] = MUTATIONS[name](after[3])
        if not verdict(before[3], after[3]):
            break
    else:
        pytest.fail(f"{name} never broke a return")
    vouched = plainly_valid(before, SampleBatch.from_samples(after), MAX_NEW, VERSION)
    assert vouched[3] is False
    assert [v for i, v in enumerate(vouched) if i != 3] == [True] * 7


def test_partials_and_unknown_leases_go_to_the_rule() -> None:
    """A resumed partial (a response and segments already) and a sample with no lease are not vouched
    for, even when their return is valid: `check_continues` gives their verdict."""
    rng = random.Random(2)
    before = leased(3, seed=2)
    partial = before[1].extend([5, 6], [-0.1, -0.2], 0, FinishReason.ABORT)  # as queued, before its lease
    before[1] = partial
    after = [
        returned(before[0], rng),
        partial.resumed().extend([9], [-0.3], 1, FinishReason.STOP).scored(1.0),
        returned(before[2], rng),
    ]
    assert verdict(before[1], after[1])
    with_unknown: list[Sample | None] = [before[0], before[1], None]
    vouched = plainly_valid(with_unknown, SampleBatch.from_samples(after), MAX_NEW, VERSION)
    assert vouched == [True, False, False]


def test_the_books_take_a_whole_result_vouched_for_and_refuse_a_broken_sample_in_it() -> None:
    """BrokerState.vouch against real leases: only the leasing worker's fresh samples, only in a result
    of VOUCH_MIN_SAMPLES or more; accept_result then takes the vouched ones without checking again and
    still rejects the broken one, which the voucher left to the rule."""
    from test_broker_state import make_state

    from broker.state import VOUCH_MIN_SAMPLES

    state = make_state(Mode.ASYNC, b=8, over=8, n=4)
    work = state.take_work("w0", VOUCH_MIN_SAMPLES)
    assert len(work) == VOUCH_MIN_SAMPLES
    returns = [  # finished under the broker's version 0, within budget
        sample.extend([3] * min(2, budget), [-0.5] * min(2, budget), 0, FinishReason.STOP).scored(1.0)
        for _, budget, sample in work
    ]
    returns[5] = dataclasses.replace(returns[5], prompt_text="changed")
    lease_ids = [lease_id for lease_id, _, _ in work]
    batch = SampleBatch.from_samples(returns)
    vouched = state.vouch("w0", lease_ids, batch)
    assert vouched == [i != 5 for i in range(VOUCH_MIN_SAMPLES)]
    assert state.vouch("w1", lease_ids, batch) == [False] * VOUCH_MIN_SAMPLES  # not w1's leases
    few = SampleBatch.from_samples(returns[:3])
    assert state.vouch("w0", lease_ids[:3], few) == [False] * 3  # too few to be worth it
    for lease_id, sample, ok in zip(lease_ids, returns, vouched, strict=True):
        if ok:
            state.accept_result("w0", lease_id, sample, vouched=True)
        else:
            with pytest.raises(ResultRejected) as exc:
                state.accept_result("w0", lease_id, sample, vouched=False)
            assert exc.value.reason == "task_changed"
    assert set(state.leases) == {lease_ids[5]}
    state.check_ledger("after a vouched result")


# ---------------------------------------------------------------------------------------------------
# episodes: observations are kept as leased, the episode state may change within its bound


def reason(before: Sample, after: Sample, max_new: int = MAX_NEW, version: int = VERSION) -> str | None:
    """The rule's verdict: None when it accepts `after`, else the rejection's reason."""
    try:
        check_continues(before, after, max_new, version)
    except ResultRejected as exc:
        return exc.reason
    return None


def partial_episode() -> Sample:
    """As queued after an abort: a model turn [0, 2) under version 0, then an observation [2, 5)."""
    fresh = Sample(4, 1, np.array([11, 12], np.int32), prompt_text="p", metadata={"answer": "3"}).resumed()
    turn = fresh.extend([21, 22], [-0.5, -0.25], 0, FinishReason.NONE).observed([31, 32, 33])
    return turn.with_episode(b'{"turns": 1}').extend([], [], 0, FinishReason.ABORT)


def rewritten(leased: Sample, segments: tuple[Segment, ...], observations: tuple[Span, ...]) -> Sample:
    """`leased` returned finished with one token more under version 0, its spans replaced."""
    return dataclasses.replace(
        leased.extend([41], [-0.125], 0, FinishReason.STOP).scored(1.0),
        segments=segments,
        observations=observations,
    )


def test_a_segment_may_not_grow_over_an_observation() -> None:
    """(0, 0, 6) replacing (0, 0, 2) over the observation (2, 5): the tokens, log-probs and versions of
    the old segments are a prefix, and the batch is valid on the wire (its segments alone tile the
    response), but the observation's tokens would be trained as the model's."""
    before = partial_episode()
    after = rewritten(before.resumed(), (Segment(0, 0, 6),), ())
    after.check()
    SampleBatch.from_samples([after]).validate()
    assert reason(before, after) == "not_a_continuation"


@pytest.mark.parametrize(
    ("segments", "observations"),
    [
        ((Segment(0, 0, 2), Segment(0, 4, 6)), (Span(2, 4),)),  # the observation cut short
        ((Segment(0, 0, 2), Segment(1, 2, 6)), ()),  # the observation re-tagged as version 1's
        ((Segment(0, 0, 2), Segment(0, 3, 6)), (Span(2, 3),)),  # cut shorter
    ],
    ids=["shortened", "retagged", "cut"],
)
def test_old_observations_are_returned_as_leased(
    segments: tuple[Segment, ...], observations: tuple[Span, ...]
) -> None:
    before = partial_episode()
    after = rewritten(before.resumed(), segments, observations)
    after.check()  # a well-formed sample: only the comparison with the lease finds it out
    assert reason(before, after) == "not_a_continuation"


def test_an_episode_goes_on_after_its_observation() -> None:
    """The next model turn (a new segment), more of the observation the response ends with (a tool's
    output that went on), a new episode state: all continue the lease."""
    before = partial_episode()
    leased = before.resumed()
    turn = leased.extend([51, 52], [-0.5, -0.5], 1, FinishReason.STOP).scored(1.0)
    assert turn.segments == (Segment(0, 0, 2), Segment(1, 5, 7)) and reason(before, turn) is None
    more = leased.observed([34]).with_episode(b'{"turns": 2}').extend([53], [-0.5], 0, FinishReason.ABORT)
    assert more.observations == (Span(2, 6),) and reason(before, more) is None
    single = (
        Sample(0, 0, np.array([1], np.int32)).resumed().extend([2, 3], [-0.5, -0.5], 0, FinishReason.ABORT)
    )
    grown = single.resumed().extend([4], [-0.5], 0, FinishReason.STOP).scored(0.0)
    assert grown.segments == (Segment(0, 0, 3),) and reason(single, grown) is None  # it ended the response


def test_a_segment_grows_only_where_the_old_response_ended() -> None:
    """Checked on its own (segments and observations that need not tile, as no decoder has seen them):
    the old last segment (0, 0, 2) may not grow past the observation that followed it."""
    before = partial_episode()
    after = dataclasses.replace(rewritten(before.resumed(), (Segment(0, 0, 3),), (Span(2, 5),)))
    assert reason(before, after) == "not_a_continuation"


def test_the_budget_counts_observation_tokens() -> None:
    """An episode's budget is its context: observation tokens count as the model's do (5 leased, 16 at
    most)."""
    before = partial_episode()
    leased = before.resumed()
    full = leased.observed(list(range(100, 110))).extend([9], [-0.5], 0, FinishReason.LENGTH).scored(0.0)
    assert full.response_len == MAX_NEW and reason(before, full) is None
    over = leased.observed(list(range(100, 111))).extend([9], [-0.5], 0, FinishReason.LENGTH).scored(0.0)
    assert reason(before, over) == "bad_length"


def test_an_episode_state_over_the_bound_is_refused_by_name() -> None:
    before = partial_episode()
    done = before.resumed().extend([51], [-0.5], 0, FinishReason.STOP).scored(1.0)
    assert reason(before, done.with_episode(b"s" * MAX_EPISODE_BYTES)) is None
    assert reason(before, done.with_episode(b"s" * (MAX_EPISODE_BYTES + 1))) == "episode_too_large"
    fresh = leased(4, seed=5)
    after = [s.extend([3], [-0.5], 0, FinishReason.STOP).scored(1.0) for s in fresh]
    after[2] = after[2].with_episode(b"s" * (MAX_EPISODE_BYTES + 1))
    after[3] = after[3].with_episode(b"s" * MAX_EPISODE_BYTES)
    assert plainly_valid(fresh, SampleBatch.from_samples(after), MAX_NEW, VERSION) == [
        True,
        True,
        False,
        True,
    ]


@settings(max_examples=150, deadline=None)
@given(data=st.data())
def test_every_continuation_an_episode_driver_makes_is_accepted_and_a_moved_observation_is_not(
    data: st.DataObject,
) -> None:
    """A partial episode (any mix of turns, observations, aborts and resumes), leased again and driven on
    by a worker: accepted; the same return with one old observation span starting a token later: refused."""
    partial = data.draw(episodes(steps=10), label="partial")
    version = partial.segments[-1].version if partial.segments else 0
    before = partial.extend([], [], version, FinishReason.ABORT)
    leased_again = before.resumed()
    budget = before.budget(64)
    after = data.draw(
        worker_turns(leased_again, version + data.draw(st.integers(0, 1)), budget), label="turns"
    )
    after = after.extend(
        [], [], after.segments[-1].version if after.segments else version, FinishReason.ABORT
    )
    far = {"max_new": 64, "version": 1 << 20}  # the rule's other limits out of the way
    assert reason(before, after, **far) is None
    if before.observations:
        i = data.draw(st.integers(0, len(before.observations) - 1), label="moved span")
        old = before.observations[i]  # the returned span i starts there and ends there or later
        moved = (*after.observations[:i], Span(old.start + 1, old.end), *after.observations[i + 1 :])
        assert reason(before, dataclasses.replace(after, observations=moved), **far) == "not_a_continuation"
