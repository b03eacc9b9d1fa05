"""Whether a returned sample is a valid return of what was leased: the broker's trust boundary for results.

`check_continues` is the rule, one sample at a time: the same sample, a returnable status, within its
budget, continuing the leased response token for token (log-probs, version tags and an episode's
observation spans unchanged), an episode state of bounded size, no version newer than the broker's, the
same task, and a reward on a finished sample. Both the training books (`broker.state`) and evaluations
(`broker.evaluation`) apply it.

`plainly_valid` applies the same rule to a whole `SampleBatch` at once with array operations, for the
case that is almost every result: a sample leased fresh (no response yet) and returned finished. It only
vouches: a sample it does not pass (a resumed partial, or anything it finds wrong) goes through
`check_continues`, which gives the verdict and the reason. So the two can never disagree on a rejection,
and a test holds them to agreeing on acceptance.

`holds_already` says whether a state the books hold of a sample is a returned one, or a later one: a
result sent again (after a reconnect) that the books took the first time.

Knows nothing of leases, groups or sockets: callers hand it the samples as leased and as returned.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from april.records import (
    ABORT_CODE,
    FINISHED_CODE,
    INTERRUPTED_CODE,
    SETTLED,
    FinishReason,
    Sample,
    SampleStatus,
)
from april.wire_records import SampleBatch

# the statuses a worker may return, and the finish reasons of a finished sample: both checks read these
_RETURNABLE = (SampleStatus.FINISHED, SampleStatus.FAILED, SampleStatus.INTERRUPTED)
_FINISH_OF_FINISHED = (FinishReason.STOP, FinishReason.LENGTH)
# the same as plain codes (april.records), for comparisons with code arrays
_RETURNABLE_CODES = tuple(map(int, _RETURNABLE))
_FINISH_OF_FINISHED_CODES = tuple(map(int, _FINISH_OF_FINISHED))
MAX_EPISODE_BYTES = 1 << 20  # an episode state larger than this is refused (docs/protocol.md section 6)


class ResultRejected(Exception):
    """A returned sample that does not match its lease. `reason` is the counter key."""

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


def check_continues(before: Sample, after: Sample, max_new_tokens: int, version: int) -> None:
    """Raise ResultRejected unless `after` is a valid return of the sample leased as `before`: same
    sample, a returnable status, within budget, continuing the old response unchanged, no version newer
    than the broker's `version`, the same task, and a reward on a finished sample."""
    if after.key != before.key:
        raise ResultRejected("wrong_sample", f"lease was for {before.key}, result is {after.key}")
    if after.status not in _RETURNABLE:
        raise ResultRejected("bad_status", f"sample {after.key} returned {after.status.name}")
    n0, n1, budget = before.response_len, after.response_len, before.budget(max_new_tokens)
    if n1 < n0 or n1 - n0 > budget:
        raise ResultRejected(
            "bad_length", f"sample {after.key}: {n1} response tokens after {n0}, budget {budget}"
        )
    if not _continues(before, after):
        raise ResultRejected("not_a_continuation", f"sample {after.key} rewrote its earlier response")
    if len(after.episode) > MAX_EPISODE_BYTES:
        raise ResultRejected(
            "episode_too_large",
            f"sample {after.key}: episode state of {len(after.episode)} bytes, limit {MAX_EPISODE_BYTES}",
        )
    if after.segments and after.segments[-1].version > version:
        raise ResultRejected(
            "future_version", f"sample {after.key} claims version {after.segments[-1].version}"
        )
    resumes = before.resumes + (1 if n0 else 0)  # as leased (see Sample.resumed)
    if (after.prompt_text, after.metadata, after.resumes) != (
        before.prompt_text,
        before.metadata,
        resumes,
    ):
        raise ResultRejected(
            "task_changed", f"sample {after.key} changed its prompt text, metadata or resumes"
        )
    if before.prompt_ids.shape[0] and not np.array_equal(before.prompt_ids, after.prompt_ids):
        raise ResultRejected("prompt_changed", f"sample {after.key} changed its prompt")
    if n1 and after.prompt_ids.shape[0] == 0:
        raise ResultRejected("no_prompt_ids", f"sample {after.key} has a response but no prompt_ids")
    if after.status == SampleStatus.FINISHED and (
        after.finish_reason not in _FINISH_OF_FINISHED or not np.isfinite(after.reward)
    ):
        raise ResultRejected("bad_finish", f"finished sample {after.key} needs stop/length and a reward")
    if after.status == SampleStatus.INTERRUPTED and after.finish_reason != FinishReason.ABORT:
        raise ResultRejected("bad_finish", f"interrupted sample {after.key} needs finish_reason abort")


def holds_already(held: Sample, returned: Sample) -> bool:
    """Whether `held`, the books' state of a sample, is `returned` or a later state of it: its response
    starts with `returned`'s, token and log-prob for token, and, as long as it, it settled where
    `returned` is a partial, or it has the same episode state and either `returned` is a partial or both
    settled alike."""
    n = returned.response_len
    if held.key != returned.key or held.response_len < n:
        return False
    if n and not (
        np.array_equal(held.response_ids[:n], returned.response_ids)
        and np.array_equal(held.response_logprobs[:n], returned.response_logprobs)
    ):
        return False
    if held.response_len > n:
        return True
    if returned.status == SampleStatus.INTERRUPTED and held.status in SETTLED:
        return True  # settled since with nothing more generated (a step that ended the episode)
    return held.episode == returned.episode and (
        returned.status == SampleStatus.INTERRUPTED or held.status == returned.status
    )


def _continues(before: Sample, after: Sample) -> bool:
    """`after` keeps every earlier token, behaviour log-prob, version tag and observation span of `before`
    unchanged.

    Old segments and observations are kept as they were, except that the one the old response ends with
    may grow (a segment when generation went on under the same version, an observation when the
    environment's reply went on); tokens and log-probs of the old response are byte-identical.
    """
    n0 = before.response_len
    if not _spans_continue(before.segments, after.segments, n0):
        return False
    if (before.observations or after.observations) and not _spans_continue(
        before.observations, after.observations, n0
    ):
        return False
    return n0 == 0 or (
        np.array_equal(after.response_ids[:n0], before.response_ids)
        and np.array_equal(after.response_logprobs[:n0], before.response_logprobs)
    )


def _spans_continue(old: Sequence[tuple[int, ...]], new: Sequence[tuple[int, ...]], n0: int) -> bool:
    """`new` (segments or observation spans, each ending with `end`) keeps `old` as a prefix, except that
    the last old one may end later, and only if the old response (`n0` tokens) ended with it."""
    if not old:
        return True
    last = len(old) - 1
    if len(new) < len(old) or new[:last] != old[:last]:
        return False
    was, now = old[last], new[last]
    if now[:-1] != was[:-1] or now[-1] < was[-1]:  # a segment's tokens may not be re-tagged newer
        return False
    return now[-1] == was[-1] or was[-1] == n0


def plainly_valid(
    before: Sequence[Sample | None], after: SampleBatch, max_new_tokens: int, version: int
) -> list[bool]:
    """For each returned sample of `after`, True when `check_continues(before[i], sample i)` would pass
    and the sample was leased fresh (`before[i]` has no response and no segments); False otherwise,
    including `before[i]` None (no such lease), so False means "check it one by one", not "reject".

    Costs a few array operations per result plus one comparison of prompt text and metadata per sample,
    where `check_continues` costs a dozen Python calls per sample."""
    n = len(after)
    fresh = [b is not None and not b.segments and b.response_ids.shape[0] == 0 for b in before]
    if not any(fresh):
        return [False] * n
    plain = [b if ok else None for b, ok in zip(before, fresh, strict=True)]
    ok = np.array(fresh, dtype=bool)
    ok &= after.group_id == np.array([-1 if b is None else b.group_id for b in plain], dtype=np.int64)
    ok &= after.index == np.array([-1 if b is None else b.index for b in plain], dtype=np.int64)
    ok &= after.resumes == np.array([-1 if b is None else b.resumes for b in plain], dtype=np.int64)
    status, reason = after.status, after.finish_reason
    ok &= _any_of(status, _RETURNABLE_CODES)
    lengths = np.diff(after.response_offsets)
    ok &= lengths <= max(0, max_new_tokens)  # a fresh sample's budget
    seg = after.segments.reshape(-1, 3)
    has_seg = after.segment_offsets[1:] > after.segment_offsets[:-1]
    if seg.shape[0]:
        last_version = seg[np.maximum(after.segment_offsets[1:] - 1, 0), 0]
        ok &= ~has_seg | (last_version <= version)
    prompt_lengths = np.diff(after.prompt_offsets)
    leased_lengths = np.array([0 if b is None else b.prompt_ids.shape[0] for b in plain], dtype=np.int64)
    ok &= (leased_lengths == 0) | (prompt_lengths == leased_lengths)
    ok &= (lengths == 0) | (prompt_lengths > 0)
    finished = status == FINISHED_CODE
    ok &= ~finished | (_any_of(reason, _FINISH_OF_FINISHED_CODES) & np.isfinite(after.reward))
    ok &= (status != INTERRUPTED_CODE) | (reason == ABORT_CODE)
    if any(after.episode):  # an episode's states (a single-turn result has none: a pass that reads no sizes)
        ok &= np.fromiter(map(len, after.episode), dtype=np.int64, count=n) <= MAX_EPISODE_BYTES
    ok &= ~_prompt_ids_differ(plain, after, ok & (leased_lengths > 0))
    return [
        bool(good) and b is not None and b.prompt_text == text and b.metadata == meta
        for good, b, text, meta in zip(ok.tolist(), plain, after.prompt_text, after.metadata, strict=True)
    ]


def _any_of(codes: np.ndarray, members: Sequence[int]) -> np.ndarray:
    """codes == any of members, elementwise (np.isin costs ten times more on a result's few samples)."""
    out: np.ndarray = codes == members[0]
    for member in members[1:]:
        out |= codes == member
    return out


def _prompt_ids_differ(
    before: Sequence[Sample | None], after: SampleBatch, compare: np.ndarray
) -> np.ndarray:
    """True for each `compare`d sample whose returned prompt ids differ from the leased ones (each has
    its leased prompt's length already); False elsewhere."""
    differ = np.zeros(len(after), dtype=bool)
    if not compare.any():
        return differ
    offsets = after.prompt_offsets
    leased = [
        b.prompt_ids if want and b is not None else after.prompt_ids[offsets[i] : offsets[i + 1]]
        for i, (b, want) in enumerate(zip(before, compare.tolist(), strict=True))
    ]
    tokens = np.flatnonzero(np.concatenate(leased) != after.prompt_ids)
    differ[np.searchsorted(offsets, tokens, side="right") - 1] = True
    return differ
