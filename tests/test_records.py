"""Tests for april.records (Sample, Segment, Group) and april.wire_records (SampleBatch).

Fast, pure CPU: resume rules, staleness tags, group checks, the columnar round trip and every rejection
of `SampleBatch.validate`.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
from collections.abc import Callable
from typing import Any, TypeVar

import msgpack
import numpy as np
import pytest
from episode_samples import episodes
from hypothesis import given, settings
from hypothesis import strategies as st

from april import codec, protocol
from april.records import (
    FinishReason,
    Group,
    LeaseSpan,
    Sample,
    SampleStatus,
    Segment,
    Span,
    new_group_samples,
)
from april.wire_records import EPISODE_COLUMNS, LEASE_COLUMNS, SampleBatch, add_missing_columns

# ---------------------------------------------------------------------------------------------------
# helpers


def ids(*xs: int) -> np.ndarray:
    return np.array(xs, dtype=np.int32)


def fresh(group_id: int = 7, index: int = 0, prompt: tuple[int, ...] = (11, 12, 13)) -> Sample:
    return Sample(group_id=group_id, index=index, prompt_ids=ids(*prompt), metadata={"answer": "42"})


def assert_samples_equal(a: Sample, b: Sample) -> None:
    """Field by field; arrays with np.array_equal (and the same dtype), NaN rewards equal."""
    for f in dataclasses.fields(Sample):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, np.ndarray):
            assert isinstance(y, np.ndarray), f.name
            assert x.dtype == y.dtype, f"{f.name}: {x.dtype} vs {y.dtype}"
            assert np.array_equal(x, y), f"{f.name}: {x} vs {y}"
        elif isinstance(x, float) and math.isnan(x):
            assert isinstance(y, float) and math.isnan(y), f"{f.name}: {x} vs {y}"
        else:
            assert x == y, f"{f.name}: {x!r} vs {y!r}"
            assert type(x) is type(y), f"{f.name}: {type(x)} vs {type(y)}"


# ---------------------------------------------------------------------------------------------------
# Sample


def test_fresh_sample_defaults() -> None:
    s = fresh()
    assert s.status == SampleStatus.PENDING
    assert s.finish_reason == FinishReason.NONE
    assert s.response_len == 0 and s.segments == () and s.resumes == 0
    assert math.isnan(s.reward)
    assert s.min_version is None
    assert s.key == (7, 0)
    s.check()


def test_extend_opens_segment_and_sets_status() -> None:
    s = fresh().extend([1, 2, 3], [-0.1, -0.2, -0.3], version=2, finish_reason=FinishReason.NONE)
    assert s.status == SampleStatus.RUNNING
    assert s.segments == (Segment(2, 0, 3),)
    assert s.response_ids.dtype == np.int32 and s.response_logprobs.dtype == np.float32
    assert s.response_ids.tolist() == [1, 2, 3]
    np.testing.assert_allclose(s.response_logprobs, [-0.1, -0.2, -0.3], rtol=1e-6)
    s.check()


@pytest.mark.parametrize(
    ("reason", "status"),
    [
        (FinishReason.NONE, SampleStatus.RUNNING),
        (FinishReason.ABORT, SampleStatus.INTERRUPTED),
        (FinishReason.STOP, SampleStatus.FINISHED),
        (FinishReason.LENGTH, SampleStatus.FINISHED),
    ],
)
def test_extend_status_from_finish_reason(reason: FinishReason, status: SampleStatus) -> None:
    s = fresh().extend([5], [-1.0], version=0, finish_reason=reason)
    assert s.status == status
    assert s.finish_reason == reason


def test_extend_same_version_merges_segments() -> None:
    s = fresh().extend([1, 2], [-1.0, -1.0], 3, FinishReason.ABORT)
    s = s.resumed().extend([3], [-0.5], 3, FinishReason.ABORT)
    s = s.resumed().extend([4, 5], [-0.5, -0.5], 3, FinishReason.STOP)
    assert s.segments == (Segment(3, 0, 5),)
    assert s.response_ids.tolist() == [1, 2, 3, 4, 5]
    s.check()


def test_extend_new_version_appends_segment() -> None:
    s = fresh().extend([1, 2], [-1.0, -1.0], 0, FinishReason.ABORT)
    s = s.resumed().extend([3, 4, 5], [-1.0, -1.0, -1.0], 2, FinishReason.ABORT)
    s = s.resumed().extend([6], [-1.0], 2, FinishReason.LENGTH)
    assert s.segments == (Segment(0, 0, 2), Segment(2, 2, 6))
    assert s.min_version == 0
    s.check()


def test_extend_with_no_tokens_keeps_arrays_and_segments() -> None:
    s = fresh().extend([1], [-1.0], 1, FinishReason.NONE)
    t = s.extend([], [], 1, FinishReason.ABORT)
    assert t.status == SampleStatus.INTERRUPTED
    assert t.segments == s.segments
    assert t.response_ids is s.response_ids
    # and a zero-token extend never opens an empty segment, even at a newer version
    u = s.extend([], [], 5, FinishReason.ABORT)
    assert u.segments == (Segment(1, 0, 1),)
    u.check()


def test_extend_rejects_length_mismatch_and_older_version() -> None:
    s = fresh().extend([1], [-1.0], 4, FinishReason.ABORT)
    with pytest.raises(ValueError, match=r"token ids of shape \(2,\) but log-probs of shape \(1,\)"):
        s.extend([1, 2], [-1.0], 4, FinishReason.NONE)
    with pytest.raises(ValueError, match="version 3 older than last segment 4"):
        s.extend([1], [-1.0], 3, FinishReason.NONE)


def test_extend_rejects_scalar_input_with_value_error() -> None:
    with pytest.raises(ValueError):
        fresh().extend(5, -1.0, 0, FinishReason.NONE)  # type: ignore[arg-type]


def test_extend_does_not_mutate_original() -> None:
    s = fresh().extend([1, 2], [-1.0, -1.0], 0, FinishReason.ABORT)
    before = s.response_ids.copy()
    t = s.resumed().extend([3], [-1.0], 1, FinishReason.STOP)
    assert np.array_equal(s.response_ids, before)
    assert s.segments == (Segment(0, 0, 2),)
    assert t.response_len == 3


def test_resumed_counts_only_real_resumes() -> None:
    s = fresh()
    leased = s.resumed()
    assert leased.status == SampleStatus.RUNNING and leased.resumes == 0  # fresh lease is not a resume
    interrupted = leased.extend([1], [-1.0], 0, FinishReason.ABORT)
    again = interrupted.resumed()
    assert again.status == SampleStatus.RUNNING
    assert again.finish_reason == FinishReason.NONE
    assert again.resumes == 1
    assert again.resumed().resumes == 2
    # interrupted before generating anything: not a resume either
    empty_abort = leased.extend([], [], 0, FinishReason.ABORT).resumed()
    assert empty_abort.resumes == 0


def test_resumed_is_replace_with_running_none_and_a_resume_counted() -> None:
    """`resumed` builds the Sample positionally: every field must land where `dataclasses.replace`
    would put it (a field added or moved would break this, not the broker silently)."""
    partial = _with(
        fresh().resumed().extend([4, 5], [-0.5, -0.25], 2, FinishReason.ABORT).scored(0.5),
        error="kept",
        resumes=3,
        prompt_text="p",
    )
    episode = two_turns().extend([], [], 0, FinishReason.ABORT)  # observations and a state to carry
    only_observed = fresh().resumed().observed([5]).extend([], [], 0, FinishReason.ABORT)
    for before, resumes in ((fresh(), 0), (partial, 4), (episode, 1), (only_observed, 1)):
        expected = dataclasses.replace(
            before, status=SampleStatus.RUNNING, finish_reason=FinishReason.NONE, resumes=resumes
        )
        assert_samples_equal(before.resumed(), expected)


def test_scored_and_failed() -> None:
    s = fresh().extend([1], [-1.0], 0, FinishReason.STOP).scored(1)
    assert s.reward == 1.0 and type(s.reward) is float
    f = fresh().failed("reward timeout")
    assert f.status == SampleStatus.FAILED and f.error == "reward timeout"


@pytest.mark.parametrize(("have", "max_new", "budget"), [(0, 10, 10), (4, 10, 6), (10, 10, 0), (12, 10, 0)])
def test_budget(have: int, max_new: int, budget: int) -> None:
    s = fresh().extend(list(range(have)), [-1.0] * have, 0, FinishReason.ABORT)
    assert s.budget(max_new) == budget


def test_resume_input() -> None:
    s = fresh(prompt=(11, 12))
    assert s.resume_input().tolist() == [11, 12]
    s = s.extend([1, 2], [-1.0, -1.0], 0, FinishReason.ABORT)
    r = s.resume_input()
    assert r.tolist() == [11, 12, 1, 2]
    assert r.dtype == np.int32


def test_staleness() -> None:
    s = fresh()
    assert s.staleness(5) == 0  # no tokens: not stale
    s = s.extend([1], [-1.0], 2, FinishReason.ABORT).resumed().extend([2], [-1.0], 4, FinishReason.STOP)
    assert s.staleness(4) == 2  # learner version minus the OLDEST segment
    assert s.staleness(7) == 5


T = TypeVar("T", Sample, SampleBatch)


def _with(obj: T, **changes: Any) -> T:
    return dataclasses.replace(obj, **changes)


def test_check_accepts_valid_and_rejects_each_broken_invariant() -> None:
    good = fresh().extend([1, 2, 3], [-1.0, -0.5, 0.0], 0, FinishReason.ABORT)
    good = good.resumed().extend([4], [-1.0], 1, FinishReason.STOP)
    good.check()
    bad: list[tuple[Sample, str]] = [
        (_with(good, response_logprobs=np.zeros(3, np.float32)), "3 log-probs for 4"),
        (_with(good, segments=(Segment(0, 0, 3),)), "segments and observations cover 3 of 4"),
        (_with(good, leases=(LeaseSpan("w", 3), LeaseSpan("w", 2))), "lease spans ending at \\[3, 2\\]"),
        (_with(good, leases=(LeaseSpan("w", 5),)), "expected rising within \\[0, 4\\]"),
        (_with(good, leases=(LeaseSpan("", 4),)), "worker is not 1..128 characters"),
        (_with(good, segments=(Segment(0, 1, 3), Segment(1, 3, 4))), "bad segment"),
        (_with(good, segments=(Segment(0, 0, 2), Segment(1, 3, 4))), "bad segment"),
        (_with(good, segments=(Segment(1, 0, 3), Segment(0, 3, 4))), "bad segment"),
        (_with(good, segments=(Segment(0, 0, 0), Segment(0, 0, 4))), "bad segment"),
        (_with(good, segments=(Segment(-1, 0, 4),)), "bad segment"),
        (_with(good, response_logprobs=np.array([-1, np.nan, -1, -1], np.float32)), "non-finite"),
        (_with(good, response_logprobs=np.array([-1, -np.inf, -1, -1], np.float32)), "non-finite"),
        (_with(good, response_logprobs=np.array([-1, 0.5, -1, -1], np.float32)), "positive log-prob"),
        (_with(good, prompt_ids=np.zeros((1, 2), np.int32)), "1-D"),
    ]
    for sample, message in bad:
        with pytest.raises(ValueError, match=message):
            sample.check()


def test_new_group_samples() -> None:
    samples = new_group_samples(3, 4, ids(1, 2), "1+1?", {"answer": "2"})
    assert [s.key for s in samples] == [(3, i) for i in range(4)]
    assert all(s.status == SampleStatus.PENDING and s.prompt_text == "1+1?" for s in samples)
    assert samples[0].prompt_ids.dtype == np.int32
    samples[0].metadata["answer"] = "x"
    assert samples[1].metadata["answer"] == "2"  # each sample owns its metadata
    # built positionally: equal to samples built with keywords and the defaults
    for i, s in enumerate(new_group_samples(3, 4, ids(1, 2), "1+1?", {"answer": "2"})):
        expected = Sample(
            group_id=3, index=i, prompt_ids=ids(1, 2), prompt_text="1+1?", metadata={"answer": "2"}
        )
        assert_samples_equal(s, expected)


# ---------------------------------------------------------------------------------------------------
# Episodes: observations between model turns


def two_turns() -> Sample:
    """Turn [1, 2] (v0), observation [90, 91, 92], turn [3] (v0, a new segment), observation [93]."""
    s = fresh().resumed().extend([1, 2], [-0.5, -0.25], 0, FinishReason.NONE)
    s = s.observed([90, 91, 92]).with_episode(b'{"turns": 1}')
    return s.extend([3], [-1.0], 0, FinishReason.NONE).observed(ids(93))


def test_observed_appends_a_span_with_zero_logprobs_and_keeps_the_status() -> None:
    s = two_turns()
    assert s.response_ids.tolist() == [1, 2, 90, 91, 92, 3, 93]
    assert s.response_ids.dtype == np.int32 and s.response_logprobs.dtype == np.float32
    assert s.response_logprobs.tolist() == [-0.5, -0.25, 0.0, 0.0, 0.0, -1.0, 0.0]
    assert s.observations == (Span(2, 5), Span(6, 7))
    assert s.status == SampleStatus.RUNNING and s.finish_reason == FinishReason.NONE
    assert s.episode == b'{"turns": 1}'
    s.check()


def test_extend_never_merges_a_segment_across_an_observation() -> None:
    s = two_turns()
    assert s.segments == (Segment(0, 0, 2), Segment(0, 5, 6))  # one version, two segments
    t = s.extend([4], [-0.5], 0, FinishReason.STOP)
    assert t.segments == (Segment(0, 0, 2), Segment(0, 5, 6), Segment(0, 7, 8))
    assert t.extend([], [], 0, FinishReason.ABORT).segments == t.segments  # no empty segment either
    u = s.extend([3], [-0.5], 0, FinishReason.NONE).extend([4], [-0.5], 0, FinishReason.NONE)
    assert u.segments[-1] == Segment(0, 7, 9)  # right after a segment, the same version still merges
    t.check()
    u.check()


def test_consecutive_observations_are_one_span_and_empty_ones_change_nothing() -> None:
    s = two_turns()
    t = s.observed([94, 95]).observed(ids(96))
    assert t.observations == (Span(2, 5), Span(6, 10))
    assert s.observed([]) is s
    t.check()


def test_observed_rejects_settled_samples_and_non_flat_ids() -> None:
    finished = two_turns().extend([4], [-0.5], 0, FinishReason.STOP)
    with pytest.raises(ValueError, match=r"observed: sample \(7, 0\) is FINISHED, expected unsettled"):
        finished.observed([1])
    with pytest.raises(ValueError, match="FAILED"):
        two_turns().failed("tool crashed").observed([1])
    with pytest.raises(ValueError, match=r"shape \(1, 2\)"):
        two_turns().observed([[1, 2]])  # type: ignore[list-item]


def test_model_tokens_staleness_and_budget_of_an_episode() -> None:
    s = (
        two_turns()
        .extend([4], [-0.5], 0, FinishReason.ABORT)
        .resumed()
        .extend([5], [-0.5], 3, FinishReason.STOP)
    )
    assert s.response_len == 9 and s.model_tokens == 5  # observations: 3 + 1 tokens
    assert fresh().model_tokens == 0
    assert s.staleness(4) == 4 and s.min_version == 0  # versions of model tokens only
    assert s.budget(12) == 3  # the budget counts every response token: the context is the limit
    assert s.resume_input().tolist() == [11, 12, 13, 1, 2, 90, 91, 92, 3, 93, 4, 5]
    only_observed = fresh().resumed().observed([1, 2])
    assert only_observed.model_tokens == 0 and only_observed.staleness(5) == 0
    only_observed.check()


def test_resumed_and_scored_keep_observations_and_episode_state() -> None:
    s = two_turns().extend([], [], 0, FinishReason.ABORT)
    again = s.resumed()
    assert again.observations == s.observations and again.episode == s.episode
    assert again.resumes == s.resumes + 1
    done = again.extend([4], [-0.5], 1, FinishReason.STOP).scored(1.0)
    assert done.observations == s.observations and done.episode == s.episode


def test_with_episode_replaces_the_state_only() -> None:
    s = two_turns()
    t = s.with_episode(b"next")
    assert t.episode == b"next" and s.episode == b'{"turns": 1}'
    assert t.response_ids is s.response_ids and t.observations == s.observations


def test_check_rejects_each_broken_episode_invariant() -> None:
    good = two_turns()  # segments (0,0,2), (0,5,6); observations [2,5), [6,7); 7 tokens
    good.check()
    lps_with_logprob_at_2 = good.response_logprobs.copy()
    lps_with_logprob_at_2[2] = -0.5
    bad: list[tuple[Sample, str]] = [
        (_with(good, observations=(Span(2, 5),)), "cover 6 of 7"),
        (_with(good, observations=(Span(2, 4), Span(6, 7))), r"bad segment Segment\(version=0, start=5"),
        (_with(good, observations=(Span(2, 6), Span(6, 7))), "bad segment"),  # overlaps the segment
        (_with(good, observations=(Span(1, 5), Span(6, 7))), "bad observation"),
        (_with(good, observations=(Span(2, 5), Span(5, 5), Span(6, 7))), "bad observation"),
        (_with(good, observations=(Span(6, 7), Span(2, 5))), "bad segment"),  # out of order: 5 follows 2
        (_with(good, observations=(Span(2, 5), Span(6, 8))), "cover 8 of 7"),  # past the end
        (_with(good, segments=(Segment(0, 0, 3), Segment(0, 5, 6))), "bad observation"),
        (_with(good, segments=(Segment(0, 0, 2),)), "bad observation"),  # a model turn left uncovered
        (_with(good, segments=(Segment(1, 0, 2), Segment(0, 5, 6))), "bad segment"),  # version decreases
        (_with(good, response_logprobs=lps_with_logprob_at_2), "observation Span.* log-probs other than 0.0"),
    ]
    for sample, message in bad:
        with pytest.raises(ValueError, match=message):
            sample.check()


@st.composite
def _span_layouts(draw: st.DrawFn) -> Sample:
    """A sample whose segments and observations are drawn freely (valid or not) over a response of
    random length, with log-probs 0.0 or not at random: for comparing `check` with `validate`."""
    n = draw(st.integers(0, 12), label="response length")
    cuts = sorted(draw(st.sets(st.integers(1, max(n - 1, 1)), max_size=5), label="cuts") - {n})
    bounds = [0, *cuts, n] if n else [0]
    segments, observations, versions = [], [], draw(st.integers(0, 2), label="first version")
    for a, b in itertools.pairwise(bounds):
        if draw(st.booleans(), label="observation"):
            observations.append(Span(a, b))
        else:
            versions += draw(st.integers(0, 1), label="version step")
            segments.append(Segment(versions, a, b))
    edit = draw(st.sampled_from(["none", "none", "shift", "drop", "swap", "version", "logprob", "empty"]))
    if edit == "shift" and (segments or observations):
        spans: list[Any] = (
            segments if segments and (not observations or draw(st.booleans())) else observations
        )
        k = draw(st.integers(0, len(spans) - 1), label="which")
        delta = draw(st.sampled_from([-1, 1]), label="delta")
        spans[k] = spans[k]._replace(start=spans[k].start + delta)
    elif edit == "drop" and (segments or observations):
        spans = segments if segments and (not observations or draw(st.booleans())) else observations
        del spans[draw(st.integers(0, len(spans) - 1), label="dropped")]
    elif edit == "swap" and (len(segments) >= 2 or len(observations) >= 2):
        spans = (
            segments
            if len(segments) >= 2 and (len(observations) < 2 or draw(st.booleans()))
            else observations
        )
        spans[0], spans[1] = spans[1], spans[0]
    elif edit == "version" and len(segments) >= 2:
        segments[-1] = segments[-1]._replace(version=segments[0].version - 1)
    elif edit == "empty":
        observations.append(Span(n, n))
    lps = -np.asarray(draw(st.lists(st.sampled_from([0.0, 0.5]), min_size=n, max_size=n)), np.float32)
    for span in observations:
        if edit != "logprob":
            lps[max(span.start, 0) : max(span.end, 0)] = 0.0
    # lease spans ending anywhere from -1 to n + 1, in any order: valid ones rise within [0, n]
    ends = draw(st.lists(st.integers(-1, n + 1), max_size=3), label="lease ends")
    if draw(st.booleans(), label="rising ends"):
        ends.sort()
    return _with(
        fresh(),
        response_ids=np.arange(n, dtype=np.int32),
        response_logprobs=lps,
        segments=tuple(segments),
        observations=tuple(observations),
        leases=tuple(LeaseSpan(f"w{i}", e) for i, e in enumerate(ends)),
    )


@settings(max_examples=400, deadline=None)
@given(st.lists(_span_layouts(), min_size=1, max_size=4))
def test_validate_accepts_exactly_the_samples_check_accepts(samples: list[Sample]) -> None:
    """The vectorised `SampleBatch.validate` against the scalar walk of `Sample.check`, sample by sample:
    a batch is valid iff every sample is, and a rejection that names a sample names a bad one."""
    broken = []
    for i, sample in enumerate(samples):
        try:
            sample.check()
        except ValueError:
            broken.append(i)
    batch = SampleBatch.from_samples(samples)
    if not broken:
        batch.validate()
        return
    with pytest.raises(ValueError) as info:
        batch.validate()
    named = re.match(r"sample (\d+):", str(info.value))
    assert named is None or int(named.group(1)) in broken, (str(info.value), broken)


@settings(max_examples=200, deadline=None)
@given(st.lists(episodes(), min_size=0, max_size=5))
def test_episodes_round_trip_through_sample_batch(samples: list[Sample]) -> None:
    samples = [_with(s, index=i) for i, s in enumerate(samples)]
    for s in samples:
        s.check()
        assert s.model_tokens + sum(o.end - o.start for o in s.observations) == s.response_len
    batch = SampleBatch.from_samples(samples)
    batch.validate()
    assert_batches_equal(batch, field_by_field(samples))
    assert batch.model_tokens == sum(s.model_tokens for s in samples)
    for original, back in zip(samples, batch.to_samples(), strict=True):
        assert_samples_equal(original, back)


# ---------------------------------------------------------------------------------------------------
# Group


def _finished(index: int, reward: float, version: int = 0, group_id: int = 1) -> Sample:
    s = fresh(group_id=group_id, index=index).extend([1], [-1.0], version, FinishReason.STOP)
    return s.scored(reward)


def test_group_complete_and_failed() -> None:
    g = Group(1, tuple(_finished(i, float(i)) for i in range(3)))
    assert g.complete and not g.failed
    running = fresh(group_id=1, index=3).resumed()
    g2 = Group(1, (*g.samples, running))
    assert not g2.complete and not g2.failed
    g3 = Group(1, (*g.samples, fresh(group_id=1, index=3).failed("boom")))
    assert not g3.complete and g3.failed
    interrupted = fresh(group_id=1, index=3).extend([1], [-1.0], 0, FinishReason.ABORT)
    assert not Group(1, (*g.samples, interrupted)).complete


def test_group_uniform_reward() -> None:
    assert Group(1, tuple(_finished(i, 1.0) for i in range(4))).uniform_reward
    assert Group(1, tuple(_finished(i, 0.0) for i in range(4))).uniform_reward
    assert not Group(1, (_finished(0, 1.0), _finished(1, 0.0))).uniform_reward
    assert Group(1, tuple(_finished(i, 1.0) for i in range(4))).rewards == [1.0] * 4


def test_group_staleness_uses_oldest_sample() -> None:
    g = Group(1, (_finished(0, 1.0, version=3), _finished(1, 0.0, version=5), fresh(group_id=1, index=2)))
    assert g.min_version() == 3
    assert g.staleness(6) == 3
    assert Group(1, (fresh(group_id=1),)).staleness(9) == 0


# ---------------------------------------------------------------------------------------------------
# SampleBatch: round trip


def _mixed_samples() -> list[Sample]:
    """Fresh, empty-prompt (text only), interrupted, multi-segment finished, failed."""
    a = fresh(group_id=1, index=0)
    b = Sample(group_id=1, index=1, prompt_ids=ids(), prompt_text="What is 6 x 7?", metadata={})
    c = fresh(group_id=2, index=0).extend([5, 6], [-0.25, -1.5], 0, FinishReason.ABORT).returned_by("w0", ())
    d = fresh(group_id=2, index=1).extend([5, 6], [-0.25, -1.5], 0, FinishReason.ABORT).returned_by("w0", ())
    d = d.resumed().extend([7, 8, 9], [-0.1, -0.2, -0.3], 1, FinishReason.ABORT)
    d = d.returned_by("wörker-1", d.leases).resumed().extend([10], [0.0], 3, FinishReason.STOP).scored(1.0)
    d = d.returned_by("w0", d.leases)
    e = fresh(group_id=3, index=2).resumed().extend([], [], 0, FinishReason.ABORT).failed("engine crashed")
    f = _with(fresh(group_id=2**40, index=3), metadata={"answer": "é", "k": ""}, resumes=7)
    return [a, b, c, d, e, f]


@pytest.mark.parametrize("n", [0, 1, 6])
def test_sample_batch_round_trip(n: int) -> None:
    samples = _mixed_samples()[:n]
    batch = SampleBatch.from_samples(samples)
    batch.validate()
    assert len(batch) == n
    back = batch.to_samples()
    assert len(back) == n
    for original, decoded in zip(samples, back, strict=True):
        assert_samples_equal(original, decoded)
        decoded.check()


def test_sample_batch_columnar_layout() -> None:
    samples = _mixed_samples()
    batch = SampleBatch.from_samples(samples)
    assert batch.prompt_offsets.tolist() == [0, 3, 3, 6, 9, 12, 15]
    assert batch.response_offsets.tolist() == [0, 0, 0, 2, 8, 8, 8]
    assert batch.segment_offsets.tolist() == [0, 0, 0, 1, 4, 4, 4]
    assert batch.segments.tolist() == [0, 0, 2, 0, 0, 2, 1, 2, 5, 3, 5, 6]
    assert batch.status.tolist() == [0, 0, 2, 3, 4, 0]
    assert batch.finish_reason.tolist() == [0, 0, 3, 1, 3, 0]
    assert batch.response_tokens == 8
    dtypes = {
        "group_id": "<i8",
        "index": "<i4",
        "status": "|u1",
        "finish_reason": "|u1",
        "resumes": "<i4",
        "reward": "<f8",
        "prompt_offsets": "<i8",
        "prompt_ids": "<i4",
        "response_offsets": "<i8",
        "response_ids": "<i4",
        "response_logprobs": "<f4",
        "segment_offsets": "<i8",
        "segments": "<i8",
    }
    for name, dtype in dtypes.items():
        assert getattr(batch, name).dtype.str == dtype, name


def test_to_samples_are_views() -> None:
    batch = SampleBatch.from_samples(_mixed_samples())
    out = batch.to_samples()
    assert np.shares_memory(out[3].response_ids, batch.response_ids)
    assert np.shares_memory(out[0].prompt_ids, batch.prompt_ids)


# ---------------------------------------------------------------------------------------------------
# SampleBatch.validate rejections


def _good_batch() -> SampleBatch:
    return SampleBatch.from_samples(_mixed_samples())


def _two() -> SampleBatch:
    """Two samples with tokens: [0,3) by v0 + [3,5) by v1, and [0,2) by v2."""
    s0 = fresh(group_id=1, index=0).extend([1, 2, 3], [-1.0] * 3, 0, FinishReason.ABORT)
    s0 = s0.resumed().extend([4, 5], [-1.0] * 2, 1, FinishReason.STOP)
    s1 = fresh(group_id=1, index=1).extend([6, 7], [-1.0] * 2, 2, FinishReason.LENGTH)
    return SampleBatch.from_samples([s0, s1])


def _i64(*xs: int) -> np.ndarray:
    return np.array(xs, dtype=np.int64)


Mutation = Callable[[SampleBatch], SampleBatch]

REJECTIONS: dict[str, tuple[Mutation, str]] = {
    "index_short": (lambda b: _with(b, index=b.index[:-1]), "index has 1 entries for 2"),
    "status_long": (lambda b: _with(b, status=np.zeros(3, np.uint8)), "status has 3 entries"),
    "finish_short": (lambda b: _with(b, finish_reason=b.finish_reason[:1]), "finish_reason has 1"),
    "resumes_short": (lambda b: _with(b, resumes=b.resumes[:1]), "resumes has 1"),
    "reward_short": (lambda b: _with(b, reward=b.reward[:1]), "reward has 1"),
    "prompt_text_short": (lambda b: _with(b, prompt_text=[""]), "prompt_text has 1"),
    "metadata_long": (lambda b: _with(b, metadata=[{}, {}, {}]), "metadata has 3"),
    "error_short": (lambda b: _with(b, error=[]), "error has 0"),
    "prompt_offsets_count": (lambda b: _with(b, prompt_offsets=_i64(0, 6)), "prompt_offsets has 2 entries"),
    "prompt_offsets_start": (lambda b: _with(b, prompt_offsets=_i64(1, 3, 6)), "prompt_offsets must rise"),
    "prompt_offsets_end": (lambda b: _with(b, prompt_offsets=_i64(0, 3, 5)), "prompt_offsets must rise"),
    "prompt_offsets_decreasing": (lambda b: _with(b, prompt_offsets=_i64(0, 7, 6)), "prompt_offsets must"),
    "response_offsets_end": (
        lambda b: _with(b, response_offsets=_i64(0, 5, 8)),
        "response_offsets must rise from 0 to 7",
    ),
    "response_offsets_decreasing": (
        lambda b: _with(b, response_offsets=_i64(0, 8, 7)),
        "response_offsets must rise",
    ),
    "segment_offsets_start": (lambda b: _with(b, segment_offsets=_i64(1, 2, 3)), "segment_offsets must"),
    "segment_offsets_end": (lambda b: _with(b, segment_offsets=_i64(0, 2, 2)), "segment_offsets must"),
    "segments_not_triples": (lambda b: _with(b, segments=b.segments[:-1]), "not a multiple of 3"),
    "logprobs_short": (lambda b: _with(b, response_logprobs=b.response_logprobs[:-1]), "6 log-probs for 7"),
    "status_code": (lambda b: _with(b, status=np.array([3, 5], np.uint8)), "code out of range"),
    "finish_code": (lambda b: _with(b, finish_reason=np.array([1, 4], np.uint8)), "code out of range"),
    "negative_group_id": (lambda b: _with(b, group_id=_i64(1, -1)), "negative group_id"),
    "negative_index": (lambda b: _with(b, index=np.array([0, -1], np.int32)), "negative group_id, index"),
    "negative_resumes": (lambda b: _with(b, resumes=np.array([-1, 0], np.int32)), "resumes"),
    "negative_prompt_id": (
        lambda b: _with(b, prompt_ids=np.array([11, 12, -13, 11, 12, 13], np.int32)),
        "negative prompt token id",
    ),
    "negative_response_id": (
        lambda b: _with(b, response_ids=np.array([1, 2, 3, 4, -5, 6, 7], np.int32)),
        "negative response token id",
    ),
    "nan_logprob": (
        lambda b: _with(b, response_logprobs=np.array([-1, -1, np.nan, -1, -1, -1, -1], np.float32)),
        "finite and <= 0",
    ),
    "inf_logprob": (
        lambda b: _with(b, response_logprobs=np.array([-1, -1, -np.inf, -1, -1, -1, -1], np.float32)),
        "finite and <= 0",
    ),
    "positive_logprob": (
        lambda b: _with(b, response_logprobs=np.array([-1, -1, 0.1, -1, -1, -1, -1], np.float32)),
        "finite and <= 0",
    ),
    "infinite_reward": (lambda b: _with(b, reward=np.array([np.inf, 0.0])), "reward is infinite"),
    # segments: [(0,0,3), (1,3,5)] for sample 0 (5 tokens) and [(2,0,2)] for sample 1 (2 tokens)
    "segment_gap": (
        lambda b: _with(b, segments=_i64(0, 0, 3, 1, 4, 5, 2, 0, 2)),
        "sample 0: segments do not",
    ),
    "segment_overlap": (lambda b: _with(b, segments=_i64(0, 0, 3, 1, 2, 5, 2, 0, 2)), "sample 0"),
    "segment_not_from_zero": (lambda b: _with(b, segments=_i64(0, 0, 3, 1, 3, 5, 2, 1, 2)), "sample 1"),
    "segment_short": (lambda b: _with(b, segments=_i64(0, 0, 3, 1, 3, 4, 2, 0, 2)), "tile [0, 5)"),
    "segment_long": (lambda b: _with(b, segments=_i64(0, 0, 3, 1, 3, 5, 2, 0, 3)), "tile [0, 2)"),
    "segment_versions_decrease": (
        lambda b: _with(b, segments=_i64(1, 0, 3, 0, 3, 5, 2, 0, 2)),
        "non-decreasing versions",
    ),
    "segment_empty": (lambda b: _with(b, segments=_i64(0, 0, 3, 1, 3, 3, 2, 0, 2)), "end > start"),
    "segment_negative_version": (
        lambda b: _with(b, segments=_i64(0, 0, 3, 1, 3, 5, -2, 0, 2)),
        "version >= 0",
    ),
    "observation_offsets_without_observations": (
        lambda b: _with(b, observation_offsets=_i64(0, 1, 1)),
        "observation_offsets must rise from 0 to 0",
    ),
    "observation_offsets_count_without_observations": (
        lambda b: _with(b, observation_offsets=_i64(0, 0)),
        "observation_offsets has 2 entries, expected 3",
    ),
    "episode_long": (lambda b: _with(b, episode=[b"", b"", b""]), "episode has 3 entries for 2"),
    # lease spans: none in `_two`; sample 0 has 5 response tokens, sample 1 has 2
    "lease_ends_past_the_response": (
        lambda b: _with(b, lease_offsets=_i64(0, 1, 2), lease_ends=_i64(3, 3), lease_workers=["w", "w"]),
        "sample 1: lease ends must rise within [0, 2]",
    ),
    "lease_ends_falling": (
        lambda b: _with(b, lease_offsets=_i64(0, 2, 2), lease_ends=_i64(3, 1), lease_workers=["w", "w"]),
        "sample 0: lease ends must rise",
    ),
    "lease_end_negative": (
        lambda b: _with(b, lease_offsets=_i64(0, 1, 1), lease_ends=_i64(-1), lease_workers=["w"]),
        "sample 0: lease ends",
    ),
    "lease_workers_short": (
        lambda b: _with(b, lease_offsets=_i64(0, 1, 1), lease_ends=_i64(3), lease_workers=[]),
        "lease_workers has 0 entries for 1 ends",
    ),
    "lease_worker_empty": (
        lambda b: _with(b, lease_offsets=_i64(0, 1, 1), lease_ends=_i64(3), lease_workers=[""]),
        "lease_workers must be 1..128 characters",
    ),
    "lease_offsets_end": (
        lambda b: _with(b, lease_offsets=_i64(0, 1, 1), lease_ends=_i64(3, 4), lease_workers=["w", "w"]),
        "lease_offsets must rise from 0 to 2",
    ),
    "tokens_without_segment": (
        lambda b: _with(b, segments=_i64(0, 0, 3, 1, 3, 5), segment_offsets=_i64(0, 2, 2)),
        "sample 1: 2 response tokens but no segment",
    ),
}


def test_two_sample_fixture_is_valid() -> None:
    b = _two()
    b.validate()
    assert b.segments.tolist() == [0, 0, 3, 1, 3, 5, 2, 0, 2]
    assert b.response_offsets.tolist() == [0, 5, 7]
    assert b.prompt_offsets.tolist() == [0, 3, 6]


@pytest.mark.parametrize("case", sorted(REJECTIONS))
def test_sample_batch_validate_rejects(case: str) -> None:
    mutate, message = REJECTIONS[case]
    batch = mutate(_two())
    with pytest.raises(ValueError, match=re.escape(message)):
        batch.validate()


def _episode_batch() -> SampleBatch:
    """An episode, segments (0,0,2), (0,5,6) and observations [2,5), [6,7); then a single-turn sample
    with segment (1,0,2)."""
    single = fresh(group_id=7, index=1).extend([6, 7], [-1.0] * 2, 1, FinishReason.NONE)
    return SampleBatch.from_samples([two_turns(), single])


def test_episode_batch_columns() -> None:
    b = _episode_batch()
    b.validate()
    assert b.observation_offsets.tolist() == [0, 2, 2]
    assert b.observations.tolist() == [2, 5, 6, 7]
    assert b.observation_offsets.dtype.str == "<i8" and b.observations.dtype.str == "<i8"
    assert b.segments.tolist() == [0, 0, 2, 0, 5, 6, 1, 0, 2]
    assert b.episode == [b'{"turns": 1}', b""]
    assert b.response_tokens == 9 and b.model_tokens == 5
    empty = SampleBatch.from_samples([fresh()])
    assert empty.observation_offsets.tolist() == [0, 0] and empty.observations.shape == (0,)
    assert empty.episode == [b""]


EPISODE_REJECTIONS: dict[str, tuple[Mutation, str]] = {
    "episode_short": (lambda b: _with(b, episode=[b""]), "episode has 1 entries for 2"),
    "observations_not_pairs": (lambda b: _with(b, observations=_i64(2, 5, 6)), "not a multiple of 2"),
    "observation_offsets_count": (
        lambda b: _with(b, observation_offsets=_i64(0, 2)),
        "observation_offsets has 2 entries, expected 3",
    ),
    "observation_offsets_end": (
        lambda b: _with(b, observation_offsets=_i64(0, 1, 1)),
        "observation_offsets must rise from 0 to 2",
    ),
    "observation_empty": (lambda b: _with(b, observations=_i64(2, 5, 6, 6)), "observations need end > start"),
    "observation_overlaps_segment": (
        lambda b: _with(b, observations=_i64(2, 6, 6, 7)),
        "sample 0: segments and observations do not tile [0, 7)",
    ),
    "observation_gap": (lambda b: _with(b, observations=_i64(2, 4, 6, 7)), "sample 0: segments and"),
    "observation_past_the_end": (lambda b: _with(b, observations=_i64(2, 5, 6, 8)), "tile [0, 7)"),
    "observations_out_of_order": (
        lambda b: _with(b, observations=_i64(6, 7, 2, 5)),
        "sample 0: segments and",
    ),
    "observation_moved_to_a_single_turn_sample": (
        lambda b: _with(b, observation_offsets=_i64(0, 1, 2)),
        "sample 0: segments and observations do not tile [0, 7)",
    ),
    "segment_across_an_observation": (
        lambda b: _with(b, segments=_i64(0, 0, 6, 1, 0, 2), segment_offsets=_i64(0, 1, 2)),
        "sample 0: segments and",
    ),
    "segment_versions_decrease": (
        lambda b: _with(b, segments=_i64(2, 0, 2, 1, 5, 6, 1, 0, 2)),
        "non-decreasing versions",
    ),
    "segments_out_of_order": (lambda b: _with(b, segments=_i64(0, 5, 6, 0, 0, 2, 1, 0, 2)), "sample 0:"),
    "segment_missing_in_the_other_sample": (
        lambda b: _with(b, segments=_i64(0, 0, 2, 0, 5, 6), segment_offsets=_i64(0, 2, 2)),
        "sample 1: segments and observations do not tile [0, 2)",
    ),
    "observation_logprob": (
        lambda b: _with(b, response_logprobs=np.array([-0.5, -0.25, 0, -0.5, 0, -1, 0, -1, -1], np.float32)),
        "sample 0: observation tokens need log-prob 0.0",
    ),
}


@pytest.mark.parametrize("case", sorted(EPISODE_REJECTIONS))
def test_sample_batch_validate_rejects_broken_episodes(case: str) -> None:
    mutate, message = EPISODE_REJECTIONS[case]
    batch = mutate(_episode_batch())
    with pytest.raises(ValueError, match=re.escape(message)):
        batch.validate()


def test_validate_accepts_nan_reward_and_empty_batch() -> None:
    _good_batch().validate()  # unscored samples carry NaN rewards
    SampleBatch.from_samples([]).validate()


def test_validate_rejects_offsets_that_overflow_int64() -> None:
    b = SampleBatch.from_samples([fresh(group_id=i, index=0, prompt=()) for i in range(3)])
    b = _with(b, prompt_ids=ids(5, 6, 7), prompt_offsets=_i64(0, 2**63 - 1, -2, 3))
    with pytest.raises(ValueError, match="prompt_offsets"):
        b.validate()


# ---------------------------------------------------------------------------------------------------
# SampleBatch records written before protocol 3 or 4 (files of older formats)


def _without(columns: tuple[str, ...], inline: int) -> tuple[SampleBatch, list[bytes], dict[str, Any]]:
    """A batch whose samples have neither episodes nor lease spans, and its frames and body as an earlier
    version wrote them: without `columns` (the new arrays' frames come last: dropped too)."""
    batch = SampleBatch.from_samples([dataclasses.replace(s, leases=()) for s in _mixed_samples()])
    frames = [bytes(f) for f in codec.encode_frames(2, 0, batch, inline)]
    old = msgpack.unpackb(frames[1], raw=False)
    refs = [old.pop(name) for name in columns]
    gone = sorted(ref[0] for ref in refs if isinstance(ref, list) and len(ref) == 3 and type(ref[0]) is int)
    assert gone == list(range(len(frames) - len(gone), len(frames)))
    return (
        batch,
        [frames[0], msgpack.packb(old, use_bin_type=True), *frames[2 : len(frames) - len(gone)]],
        old,
    )


@pytest.mark.parametrize("inline", [0, 1 << 16], ids=["frames", "inline"])
@pytest.mark.parametrize(
    ("columns", "missing"),
    [
        (EPISODE_COLUMNS + LEASE_COLUMNS, "observation_offsets, observations, episode, lease_offsets"),
        (LEASE_COLUMNS, "lease_offsets, lease_ends, lease_workers"),
    ],
    ids=["before protocol 3", "protocol 3"],
)
def test_a_batch_encoded_by_an_earlier_protocol_reads_with_the_new_columns_empty(
    inline: int, columns: tuple[str, ...], missing: str
) -> None:
    batch, frames, old = _without(columns, inline)
    with pytest.raises(codec.ProtocolError, match=re.escape(f"missing field(s) {missing}")):
        codec.decode_body(SampleBatch, frames)
    upgraded = add_missing_columns(old, frames)
    assert_batches_equal(
        codec.decode_body(SampleBatch, [frames[0], msgpack.packb(upgraded), *frames[2:]]), batch
    )
    assert add_missing_columns(upgraded, frames) == upgraded  # a map with the columns is left alone


def test_add_missing_columns_leaves_what_it_cannot_count_to_the_decoder() -> None:
    _, frames, old = _without(EPISODE_COLUMNS + LEASE_COLUMNS, 0)  # 6 samples, arrays in frames
    for ref in ([old["group_id"][0], "<i8", 7], [99, "<i8", 6], [b"\x00" * 8, "<i8", 6], "x", None):
        assert add_missing_columns({**old, "group_id": ref}, frames) == {**old, "group_id": ref}
    assert add_missing_columns([1, 2], frames) == [1, 2]


# ---------------------------------------------------------------------------------------------------
# SampleBatch.from_samples (one pass over the samples) against reading each field of each sample


def assert_batches_equal(a: SampleBatch, b: SampleBatch) -> None:
    """Every field: arrays of the same dtype and bytes, lists equal."""
    for f in dataclasses.fields(SampleBatch):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if isinstance(x, np.ndarray):
            assert isinstance(y, np.ndarray) and x.dtype == y.dtype, f"{f.name}: {x.dtype} vs {y.dtype}"
            assert x.shape == y.shape and x.tobytes() == y.tobytes(), f"{f.name}: {x} vs {y}"
        else:
            assert type(x) is type(y) and x == y, f"{f.name}: {x!r} vs {y!r}"


def _leased_group(group_id: int, n: int, prompt: tuple[int, ...]) -> list[Sample]:
    return [s.resumed() for s in new_group_samples(group_id, n, ids(*prompt), "t", {"answer": "1"})]


def _lease_mixes() -> dict[str, list[Sample]]:
    mixed = _mixed_samples()
    partials = [s.resumed() for s in mixed if s.status == SampleStatus.INTERRUPTED and s.response_len]
    fresh_leases = _leased_group(5, 4, (1, 2, 3)) + _leased_group(6, 3, (9,)) + _leased_group(7, 1, ())
    return {
        "empty": [],
        "one fresh": fresh_leases[:1],
        "fresh groups": fresh_leases,
        "partials": partials,
        "fresh and partials": fresh_leases[:3] + partials + fresh_leases[3:],
        "every kind": mixed + fresh_leases,
        "no response, logprobs only": [_with(fresh(), response_logprobs=np.zeros(1, np.float32))],
        "episodes": [two_turns().extend([], [], 0, FinishReason.ABORT).resumed(), *fresh_leases[:2]],
        "no response, an observation only": [_with(fresh(), observations=(Span(0, 1),))],
    }


def field_by_field(samples: list[Sample]) -> SampleBatch:
    """The obviously correct construction: each column read sample by sample."""

    def offsets(lengths: list[int]) -> np.ndarray:
        return np.array([0, *np.cumsum(lengths, dtype=np.int64).tolist()], dtype=np.int64)

    def cat(arrays: list[np.ndarray], dtype: type) -> np.ndarray:
        return np.concatenate([np.asarray(a, dtype) for a in arrays]) if arrays else np.zeros(0, dtype)

    return SampleBatch(
        group_id=np.array([s.group_id for s in samples], dtype=np.int64),
        index=np.array([s.index for s in samples], dtype=np.int32),
        status=np.array([int(s.status) for s in samples], dtype=np.uint8),
        finish_reason=np.array([int(s.finish_reason) for s in samples], dtype=np.uint8),
        resumes=np.array([s.resumes for s in samples], dtype=np.int32),
        reward=np.array([s.reward for s in samples], dtype=np.float64),
        prompt_offsets=offsets([len(s.prompt_ids) for s in samples]),
        prompt_ids=cat([s.prompt_ids for s in samples], np.int32),
        response_offsets=offsets([len(s.response_ids) for s in samples]),
        response_ids=cat([s.response_ids for s in samples], np.int32),
        response_logprobs=cat([s.response_logprobs for s in samples], np.float32),
        segment_offsets=offsets([len(s.segments) for s in samples]),
        segments=np.array(
            [x for s in samples for g in s.segments for x in (g.version, g.start, g.end)], np.int64
        ),
        observation_offsets=offsets([len(s.observations) for s in samples]),
        observations=np.array(
            [x for s in samples for o in s.observations for x in (o.start, o.end)], np.int64
        ),
        prompt_text=[s.prompt_text for s in samples],
        metadata=[dict(s.metadata) for s in samples],
        error=[s.error for s in samples],
        episode=[s.episode for s in samples],
        lease_offsets=offsets([len(s.leases) for s in samples]),
        lease_ends=np.array([span.end for s in samples for span in s.leases], np.int64),
        lease_workers=[span.worker for s in samples for span in s.leases],
    )


@pytest.mark.parametrize("case", list(_lease_mixes()))
def test_from_samples_reads_every_field_of_every_sample(case: str) -> None:
    samples = _lease_mixes()[case]
    assert_batches_equal(SampleBatch.from_samples(samples), field_by_field(samples))
    assert_batches_equal(SampleBatch.from_samples(tuple(samples)), field_by_field(samples))


@pytest.mark.parametrize("case", ["fresh groups", "fresh and partials", "every kind"])
def test_lease_frames_from_samples_are_those_of_the_field_by_field_batch(case: str) -> None:
    samples = _lease_mixes()[case]
    n = len(samples)
    lease_ids = np.arange(n, dtype=np.int64) + (3 << 40)
    budgets = np.full(n, 17, dtype=np.int32)
    greedy = (np.arange(n) < 2).astype(np.uint8)

    def frames(batch: SampleBatch) -> list[bytes]:
        return [bytes(f) for f in protocol.encode(protocol.Lease(lease_ids, budgets, greedy, batch))]

    assert frames(SampleBatch.from_samples(samples)) == frames(field_by_field(samples))


def test_with_leases_puts_the_given_samples_spans_in_place_of_the_batchs_own() -> None:
    returned = _mixed_samples()  # as a worker sends them: their spans as leased
    kept = [s.returned_by("w9", s.leases) for s in returned]  # as the books keep them
    batch = SampleBatch.from_samples(returned).with_leases(kept)
    batch.validate()
    assert_batches_equal(batch, field_by_field(kept))
    with pytest.raises(ValueError, match="2 samples for a batch of 6"):
        SampleBatch.from_samples(returned).with_leases(kept[:2])
