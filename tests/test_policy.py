"""Decision tables for april.policy: the scheduling rules of the three modes (DESIGN.md section 4).

Pure functions of counts and versions, so every rule is a parametrized table with a readable id:
fresh-group allowance, round completion and aborts, the dynamic-sampling filter, dispatch order, the
async due rule and batch selection.
"""

from __future__ import annotations

import numpy as np
import pytest

from april import policy
from april.config import AlgoConfig, Mode
from april.policy import DispatchQueue, GroupAge, PoolCounts
from april.records import FinishReason, Group, Sample, SampleStatus

B, OVER = 4, 8
ALGO = AlgoConfig(
    rollout_batch_size=B, over_sampling_batch_size=OVER, n_samples_per_prompt=2, max_staleness=1
)


def counts(in_flight: int = 0, partial: int = 0, complete: int = 0, accepted: int = 0) -> PoolCounts:
    return PoolCounts(in_flight=in_flight, partial=partial, complete=complete, accepted=accepted)


# ---------------------------------------------------------------------------------------------------
# fresh_group_allowance


@pytest.mark.parametrize(
    ("mode", "pool", "version", "round_open", "expected"),
    [
        # sync: the round holds exactly B groups
        pytest.param(Mode.SYNC, counts(), 0, True, B, id="sync-empty-round-issues-B"),
        pytest.param(Mode.SYNC, counts(in_flight=3), 0, True, 1, id="sync-tops-up-in-flight"),
        pytest.param(Mode.SYNC, counts(in_flight=2, complete=1), 0, True, 1, id="sync-complete-counts"),
        pytest.param(Mode.SYNC, counts(in_flight=1, partial=2), 0, True, 1, id="sync-partial-counts"),
        pytest.param(Mode.SYNC, counts(in_flight=B), 0, True, 0, id="sync-full-round"),
        pytest.param(Mode.SYNC, counts(complete=B + 2), 0, True, 0, id="sync-over-full-never-negative"),
        pytest.param(Mode.SYNC, counts(), 0, False, 0, id="sync-round-closed"),
        pytest.param(Mode.SYNC, counts(accepted=100), 7, True, B, id="sync-ignores-accepted-and-version"),
        # april: the round holds over_sampling_batch_size groups; partials count (resumed first)
        pytest.param(Mode.APRIL, counts(), 0, True, OVER, id="april-empty-round-issues-over"),
        pytest.param(Mode.APRIL, counts(in_flight=5), 0, True, OVER - 5, id="april-tops-up-in-flight"),
        pytest.param(Mode.APRIL, counts(partial=6), 0, True, OVER - 6, id="april-partials-count"),
        pytest.param(
            Mode.APRIL, counts(in_flight=1, partial=2, complete=3), 0, True, 2, id="april-all-three-count"
        ),
        pytest.param(Mode.APRIL, counts(complete=OVER - 1), 0, True, 1, id="april-complete-surplus-counts"),
        pytest.param(Mode.APRIL, counts(partial=OVER + 3), 0, True, 0, id="april-never-negative"),
        pytest.param(Mode.APRIL, counts(), 0, False, 0, id="april-round-closed"),
        # async: admission (eta + v + 1) * B - accepted, rounds do not matter
        pytest.param(Mode.ASYNC, counts(), 0, True, 2 * B, id="async-v0-eta1"),
        pytest.param(Mode.ASYNC, counts(accepted=3), 0, True, 2 * B - 3, id="async-minus-accepted"),
        pytest.param(Mode.ASYNC, counts(accepted=2 * B), 0, True, 0, id="async-at-bound"),
        pytest.param(Mode.ASYNC, counts(accepted=5 * B), 0, True, 0, id="async-over-bound-never-negative"),
        pytest.param(Mode.ASYNC, counts(accepted=2 * B), 1, True, B, id="async-grows-with-version"),
        pytest.param(Mode.ASYNC, counts(accepted=2 * B), 3, True, 3 * B, id="async-grows-by-B-per-version"),
        pytest.param(Mode.ASYNC, counts(), 0, False, 2 * B, id="async-ignores-round-open"),
        pytest.param(
            Mode.ASYNC, counts(in_flight=7, partial=7, complete=7), 0, True, 2 * B, id="async-uses-accepted"
        ),
    ],
)
def test_fresh_group_allowance(
    mode: Mode, pool: PoolCounts, version: int, round_open: bool, expected: int
) -> None:
    assert policy.fresh_group_allowance(mode, ALGO, pool, version, round_open) == expected


@pytest.mark.parametrize(
    ("eta", "version", "expected"),
    [
        pytest.param(0, 0, B, id="eta0-v0"),
        pytest.param(0, 4, 5 * B, id="eta0-v4"),
        pytest.param(1, 0, 2 * B, id="eta1-v0"),
        pytest.param(3, 2, 6 * B, id="eta3-v2"),
    ],
)
def test_admission_limit(eta: int, version: int, expected: int) -> None:
    algo = AlgoConfig(rollout_batch_size=B, over_sampling_batch_size=OVER, max_staleness=eta)
    assert policy.admission_limit(algo, version) == expected
    assert policy.fresh_group_allowance(Mode.ASYNC, algo, counts(), version, True) == expected


# ---------------------------------------------------------------------------------------------------
# round_complete / abort_due / abort_on_new_version


@pytest.mark.parametrize(
    ("mode", "pool", "leased", "complete", "abort"),
    [
        pytest.param(Mode.APRIL, counts(complete=B - 1, in_flight=5), 3, False, False, id="april-short"),
        pytest.param(Mode.APRIL, counts(complete=B, in_flight=4), 5, True, True, id="april-B-complete-abort"),
        pytest.param(Mode.APRIL, counts(complete=B + 2, in_flight=1), 1, True, True, id="april-surplus"),
        pytest.param(Mode.APRIL, counts(complete=B, partial=4), 0, True, False, id="april-nothing-leased"),
        pytest.param(Mode.SYNC, counts(complete=B - 1, in_flight=1), 2, False, False, id="sync-short"),
        pytest.param(Mode.SYNC, counts(complete=B), 0, True, False, id="sync-all-finished"),
        pytest.param(Mode.ASYNC, counts(complete=3 * B, in_flight=9), 9, False, False, id="async-never"),
    ],
)
def test_round_complete_and_abort_due(
    mode: Mode, pool: PoolCounts, leased: int, complete: bool, abort: bool
) -> None:
    assert policy.round_complete(mode, ALGO, pool) is complete
    assert policy.abort_due(mode, ALGO, pool, leased) is abort


@pytest.mark.parametrize("in_flight", range(B + 1))
def test_sync_never_needs_an_abort(in_flight: int) -> None:
    """sync holds exactly B groups, so whenever in_flight + complete <= B no abort is ever due."""
    for complete in range(B + 1 - in_flight):
        pool = counts(in_flight=in_flight, complete=complete)
        # leased samples belong to in-flight groups: at most every sample of every in-flight group
        leased = in_flight * ALGO.n_samples_per_prompt
        assert not policy.abort_due(Mode.SYNC, ALGO, pool, leased)


@pytest.mark.parametrize("leased", [0, 1, 100])
@pytest.mark.parametrize("complete", [0, B, 10 * B])
def test_async_never_aborts_on_round(leased: int, complete: int) -> None:
    assert not policy.abort_due(Mode.ASYNC, ALGO, counts(complete=complete, in_flight=3), leased)


@pytest.mark.parametrize(
    ("mode", "expected"),
    [pytest.param(Mode.SYNC, False), pytest.param(Mode.APRIL, False), pytest.param(Mode.ASYNC, True)],
    ids=lambda v: str(v),
)
def test_abort_on_new_version(mode: Mode, expected: bool) -> None:
    assert policy.abort_on_new_version(mode) is expected


@pytest.mark.parametrize(
    ("mode", "round_based", "target"),
    [
        pytest.param(Mode.SYNC, True, B, id="sync"),
        pytest.param(Mode.APRIL, True, OVER, id="april"),
        pytest.param(Mode.ASYNC, False, OVER, id="async"),
    ],
)
def test_round_based_and_target(mode: Mode, round_based: bool, target: int) -> None:
    assert policy.is_round_based(mode) is round_based
    assert policy.round_target(mode, ALGO) == target


# ---------------------------------------------------------------------------------------------------
# drop_reason


def finished(index: int, reward: float) -> Sample:
    s = Sample(group_id=1, index=index, prompt_ids=np.array([5, 6], dtype=np.int32))
    return s.extend([7, 8], [-0.5, -0.25], version=0, finish_reason=FinishReason.STOP).scored(reward)


def make_group(*rewards: float, failed_index: int | None = None) -> Group:
    samples = [finished(i, r) for i, r in enumerate(rewards)]
    if failed_index is not None:
        samples[failed_index] = samples[failed_index].failed("reward timeout")
    return Group(1, tuple(samples))


@pytest.mark.parametrize(
    ("group", "dynamic", "expected"),
    [
        pytest.param(make_group(1.0, 0.0, 1.0), False, None, id="mixed-off"),
        pytest.param(make_group(1.0, 0.0, 1.0), True, None, id="mixed-dynamic"),
        pytest.param(make_group(1.0, 1.0, 1.0), False, None, id="uniform-off-kept"),
        pytest.param(make_group(1.0, 1.0, 1.0), True, "dynamic_filter", id="uniform-ones-dynamic"),
        pytest.param(make_group(0.0, 0.0), True, "dynamic_filter", id="uniform-zeros-dynamic"),
        pytest.param(make_group(0.5, 0.0, 1.0, failed_index=1), False, "failed", id="failed-off"),
        pytest.param(make_group(1.0, 1.0, failed_index=0), True, "failed", id="failed-beats-filter"),
    ],
)
def test_drop_reason(group: Group, dynamic: bool, expected: str | None) -> None:
    algo = AlgoConfig(rollout_batch_size=B, over_sampling_batch_size=OVER, dynamic_sampling=dynamic)
    assert policy.drop_reason(group, algo) == expected


def test_failed_group_is_marked_failed() -> None:
    g = make_group(1.0, 0.0, failed_index=1)
    assert g.failed and g.samples[1].status == SampleStatus.FAILED


# ---------------------------------------------------------------------------------------------------
# dispatch order


@pytest.mark.parametrize(
    ("pushes", "expected"),
    [
        pytest.param(
            [((3, 0), None), ((1, 1), None), ((1, 0), None), ((2, 0), None)],
            [(1, 0), (1, 1), (2, 0), (3, 0)],
            id="fresh-by-group-then-index",
        ),
        pytest.param(
            [((0, 0), None), ((9, 1), 2), ((5, 0), 0), ((7, 0), 1)],
            [(5, 0), (7, 0), (9, 1), (0, 0)],
            id="partials-oldest-version-first-then-fresh",
        ),
        pytest.param(
            [((4, 1), 1), ((4, 0), 1), ((2, 3), 1), ((8, 0), 0)],
            [(8, 0), (2, 3), (4, 0), (4, 1)],
            id="same-version-by-group-then-index",
        ),
        pytest.param(
            [((0, 0), None), ((0, 1), 0), ((0, 2), None)],
            [(0, 1), (0, 0), (0, 2)],
            id="partial-of-a-group-before-its-fresh-siblings",
        ),
    ],
)
def test_dispatch_queue_order(
    pushes: list[tuple[tuple[int, int], int | None]], expected: list[tuple[int, int]]
) -> None:
    q = DispatchQueue()
    for key, version in pushes:
        q.push(key, version)
    assert len(q) == len(pushes)
    assert q.ordered() == expected
    assert len(q) == len(pushes)  # ordered() does not consume
    assert [q.pop() for _ in range(len(pushes))] == expected
    assert len(q) == 0


def test_dispatch_queue_rebuilt_from_entries_keeps_order() -> None:
    q = DispatchQueue()
    for key, version in [((3, 0), None), ((1, 0), 2), ((2, 1), 0), ((2, 0), None)]:
        q.push(key, version)
    rebuilt = DispatchQueue(list(q._heap))
    assert rebuilt.ordered() == q.ordered() == [(2, 1), (1, 0), (2, 0), (3, 0)]


def test_dispatch_key_puts_never_generated_after_every_partial() -> None:
    assert policy.dispatch_key(0, 0, None) > policy.dispatch_key(10**9, 10**3, 10**9)
    assert policy.dispatch_key(5, 1, 3) == (3, 5, 1)


# ---------------------------------------------------------------------------------------------------
# is_due (async)


@pytest.mark.parametrize(
    ("min_version", "learner_version", "eta", "due"),
    [
        pytest.param(None, 5, 0, False, id="no-tokens-never-due"),
        pytest.param(3, 3, 1, False, id="fresh-eta1"),
        pytest.param(2, 3, 1, True, id="one-behind-eta1-due"),
        pytest.param(3, 3, 0, True, id="eta0-current-version-due"),
        pytest.param(1, 3, 2, True, id="two-behind-eta2-due"),
        pytest.param(2, 3, 2, False, id="one-behind-eta2"),
        pytest.param(0, 0, 1, False, id="v0-eta1"),
    ],
)
def test_is_due(min_version: int | None, learner_version: int, eta: int, due: bool) -> None:
    assert policy.is_due(min_version, learner_version, eta) is due


# ---------------------------------------------------------------------------------------------------
# select_batch


def ages(*pairs: tuple[int, int | None]) -> list[GroupAge]:
    return [GroupAge(gid, v) for gid, v in pairs]


@pytest.mark.parametrize("mode", list(Mode), ids=str)
@pytest.mark.parametrize(
    ("complete", "version", "expected"),
    [
        pytest.param(ages((0, 0), (1, 0), (2, 0)), 0, None, id="fewer-than-B"),
        pytest.param(ages((3, 0), (1, 0), (2, 0), (0, 0)), 0, [0, 1, 2, 3], id="exactly-B-by-group-id"),
        pytest.param(
            ages((5, 2), (4, 1), (6, 0), (7, 2), (8, 1), (9, 0)),
            2,
            [6, 9, 4, 8],
            id="oldest-version-first-surplus-left",
        ),
        pytest.param(
            ages((0, None), (1, 3), (2, 1), (3, 2), (4, 3)),
            2,
            [2, 0, 3, 1],
            id="no-tokens-sorts-as-learner-version",
        ),
    ],
)
def test_select_batch(mode: Mode, complete: list[GroupAge], version: int, expected: list[int] | None) -> None:
    chosen = policy.select_batch(mode, ALGO, complete, version)
    assert chosen == expected
    if chosen is not None:
        assert len(chosen) == B and len(set(chosen)) == B


@pytest.mark.parametrize(
    ("mode", "incomplete_due", "formed"),
    [
        pytest.param(Mode.ASYNC, 1, False, id="async-waits-for-due-group"),
        pytest.param(Mode.ASYNC, 0, True, id="async-nothing-due"),
        pytest.param(Mode.APRIL, 3, True, id="april-ignores-due"),
        pytest.param(Mode.SYNC, 3, True, id="sync-ignores-due"),
    ],
)
def test_select_batch_incomplete_due(mode: Mode, incomplete_due: int, formed: bool) -> None:
    complete = ages(*((g, 0) for g in range(B + 2)))
    chosen = policy.select_batch(mode, ALGO, complete, 1, incomplete_due=incomplete_due)
    assert (chosen is not None) is formed
    if formed:
        assert chosen == list(range(B))
