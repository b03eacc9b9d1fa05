"""Tests for april.records (Sample, Segment, Group) and april.wire_records (SampleBatch).

Fast, pure CPU: resume rules, staleness tags, group checks, the columnar round trip and every rejection
of `SampleBatch.validate`.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable
from typing import Any, TypeVar

import numpy as np
import pytest

from april import protocol
from april.records import (
    FinishReason,
    Group,
    Sample,
    SampleStatus,
    Segment,
    new_group_samples,
)
from april.wire_records import SampleBatch

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
    for before, resumes in ((fresh(), 0), (partial, 4)):
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
        (_with(good, segments=(Segment(0, 0, 3),)), "segments cover 3 of 4"),
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
    c = fresh(group_id=2, index=0).extend([5, 6], [-0.25, -1.5], 0, FinishReason.ABORT)
    d = fresh(group_id=2, index=1).extend([5, 6], [-0.25, -1.5], 0, FinishReason.ABORT)
    d = d.resumed().extend([7, 8, 9], [-0.1, -0.2, -0.3], 1, FinishReason.ABORT)
    d = d.resumed().extend([10], [0.0], 3, FinishReason.STOP).scored(1.0)
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


def test_validate_accepts_nan_reward_and_empty_batch() -> None:
    _good_batch().validate()  # unscored samples carry NaN rewards
    SampleBatch.from_samples([]).validate()


def test_validate_rejects_offsets_that_overflow_int64() -> None:
    b = SampleBatch.from_samples([fresh(group_id=i, index=0, prompt=()) for i in range(3)])
    b = _with(b, prompt_ids=ids(5, 6, 7), prompt_offsets=_i64(0, 2**63 - 1, -2, 3))
    with pytest.raises(ValueError, match="prompt_offsets"):
        b.validate()


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
        prompt_text=[s.prompt_text for s in samples],
        metadata=[dict(s.metadata) for s in samples],
        error=[s.error for s in samples],
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
