"""Decision tables for broker.policy: the scheduling rules of the three modes (docs/design.md section 4).

Pure functions of counts and versions, so every rule is a parametrized table with a readable id:
fresh-group allowance, round completion and aborts, the dynamic-sampling filter, dispatch order, the
async due rule, batch selection under the staleness bound (with a property test over any order of
events) and how leases are spread over workers.
"""

from __future__ import annotations

import itertools
from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from april.config import AlgoConfig, Mode
from april.records import FinishReason, Group, Sample, SampleStatus
from broker import policy
from broker.modes import PoolCounts, asynchronous, policy_for
from broker.policy import CompleteGroups, DispatchQueue

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
    assert policy_for(mode).fresh_group_allowance(ALGO, pool, version, round_open) == expected


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
    assert asynchronous.admission_limit(algo, version) == expected
    assert policy_for(Mode.ASYNC).fresh_group_allowance(algo, counts(), version, True) == expected


# ---------------------------------------------------------------------------------------------------
# round_complete / abort_on_new_version


@pytest.mark.parametrize(
    ("mode", "pool", "complete"),
    [
        pytest.param(Mode.APRIL, counts(complete=B - 1, in_flight=5), False, id="april-short"),
        pytest.param(Mode.APRIL, counts(complete=B, in_flight=4), True, id="april-B-complete"),
        pytest.param(Mode.APRIL, counts(complete=B + 2, in_flight=1), True, id="april-surplus"),
        pytest.param(Mode.SYNC, counts(complete=B - 1, in_flight=1), False, id="sync-short"),
        pytest.param(Mode.SYNC, counts(complete=B), True, id="sync-all-finished"),
        pytest.param(Mode.ASYNC, counts(complete=3 * B, in_flight=9), False, id="async-never"),
    ],
)
def test_round_complete(mode: Mode, pool: PoolCounts, complete: bool) -> None:
    assert policy_for(mode).round_complete(ALGO, pool) is complete


@pytest.mark.parametrize("in_flight", range(B + 1))
def test_a_sync_round_completes_with_nothing_in_flight(in_flight: int) -> None:
    """sync holds exactly B groups (in flight + complete <= B), so its round is complete only once no group
    is in flight: nothing is leased then, and no abort is ever sent (broker.core closes the round)."""
    for complete in range(B + 1 - in_flight):
        pool = counts(in_flight=in_flight, complete=complete)
        assert policy_for(Mode.SYNC).round_complete(ALGO, pool) is (in_flight == 0 and complete == B)


@pytest.mark.parametrize(
    ("mode", "expected"),
    [pytest.param(Mode.SYNC, False), pytest.param(Mode.APRIL, False), pytest.param(Mode.ASYNC, True)],
    ids=lambda v: str(v),
)
def test_abort_on_new_version(mode: Mode, expected: bool) -> None:
    assert policy_for(mode).abort_on_new_version is expected


@pytest.mark.parametrize(
    ("mode", "round_based", "target"),
    [
        pytest.param(Mode.SYNC, True, B, id="sync"),
        pytest.param(Mode.APRIL, True, OVER, id="april"),
        pytest.param(Mode.ASYNC, False, OVER, id="async"),
    ],
)
def test_round_based_and_target(mode: Mode, round_based: bool, target: int) -> None:
    assert policy_for(mode).round_based is round_based
    assert policy_for(mode).round_target(ALGO) == target


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
# take_batch


def ages(*pairs: tuple[int, int | None]) -> CompleteGroups:
    """Complete groups from (group id, oldest token version), added in the order given."""
    complete = CompleteGroups()
    for gid, version in pairs:
        complete.add(gid, version)
    return complete


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
def test_take_batch(mode: Mode, complete: CompleteGroups, version: int, expected: list[int] | None) -> None:
    chosen = policy.take_batch(policy_for(mode), ALGO, complete, version)
    assert chosen == expected
    if chosen is not None:
        assert len(chosen) == B and len(set(chosen)) == B


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["add", "take"]), st.one_of(st.none(), st.integers(0, 6)), st.integers(0, 5)
        ),
        max_size=60,
    ),
    st.integers(6, 8),
)
def test_complete_groups_keeps_the_order_a_full_sort_gives(
    events: list[tuple[str, int | None, int]], learner_version: int
) -> None:
    """Groups added in any order, batches taken off the front: what is left, and the counts per version,
    always equal a sort of every waiting group by (oldest version, or the learner's when it has none;
    group id), the order take_batch takes them in."""
    complete, waiting, next_gid = CompleteGroups(), {}, 0
    for what, version, n in events:
        if what == "add":
            gid = next_gid = next_gid + 1 + n  # ids rise with gaps, in completion order
            complete.add(gid, version)
            waiting[gid] = version
            continue
        order = sorted(waiting, key=lambda g: (learner_version if waiting[g] is None else waiting[g], g))
        assert complete.oldest(n, learner_version) == order[:n]
        complete.remove_oldest(n, learner_version)
        for gid in order[:n]:
            del waiting[gid]
        assert len(complete) == len(waiting)
        assert complete.versions() == Counter(waiting.values())
    order = sorted(waiting, key=lambda g: (learner_version if waiting[g] is None else waiting[g], g))
    assert complete.oldest(len(waiting) + 1, learner_version) == order


@pytest.mark.parametrize(
    ("mode", "incomplete", "formed"),
    [
        pytest.param(Mode.ASYNC, [0], False, id="async-waits-for-due-group"),
        pytest.param(Mode.ASYNC, [1, None], True, id="async-nothing-due"),
        pytest.param(Mode.APRIL, [0, 0, 0], True, id="april-ignores-due"),
        pytest.param(Mode.SYNC, [0, 0, 0], True, id="sync-ignores-due"),
    ],
)
def test_take_batch_waits_for_incomplete_due(mode: Mode, incomplete: list[int | None], formed: bool) -> None:
    """Version 1, eta 1: groups 0 and 1 (v0 tokens) are due, 2..5 (v1) are not."""
    complete = ages(*((g, 0 if g < 2 else 1) for g in range(B + 2)))
    chosen = policy.take_batch(policy_for(mode), ALGO, complete, 1, incomplete)
    assert (chosen is not None) is formed
    if formed:
        assert chosen == list(range(B))


# ---------------------------------------------------------------------------------------------------
# slack and keeps_staleness_bound (async)


def due(min_version: int | None, learner_version: int, max_staleness: int) -> bool:
    """The reference: a group with a token of version m cannot wait for the next step (trained at v + 1)
    without its staleness v + 1 - m passing the bound."""
    return min_version is not None and learner_version + 1 - min_version > max_staleness


@pytest.mark.parametrize(
    ("min_version", "version", "eta", "expected"),
    [
        pytest.param(None, 4, 2, 2, id="no-token-full-slack"),
        pytest.param(4, 4, 2, 2, id="current-version-full-slack"),
        pytest.param(3, 4, 2, 1, id="one-behind"),
        pytest.param(2, 4, 2, 0, id="two-behind-due"),
        pytest.param(0, 4, 2, 0, id="overdue-counts-as-due"),
        pytest.param(4, 4, 0, 0, id="eta0-always-due"),
    ],
)
def test_slack(min_version: int | None, version: int, eta: int, expected: int) -> None:
    assert asynchronous.slack(min_version, version, eta) == expected
    assert (expected == 0 and min_version is not None) is due(min_version, version, eta)


ETA2 = AlgoConfig(rollout_batch_size=2, over_sampling_batch_size=2, max_staleness=2)


@pytest.mark.parametrize(
    ("complete", "incomplete", "version", "keeps"),
    [
        # B = 2, eta = 2, version 2: slack = min_version (0 due, 1 next batch, 2 the one after)
        pytest.param([2, 2], [None, None], 2, True, id="only-fresh-work-running"),
        pytest.param([2, 2], [0], 2, False, id="a-due-group-runs"),
        pytest.param([0, 2], [1, 1], 2, True, id="two-slack-1-fit-the-next-batch"),
        pytest.param([2, 2], [1, 1, 1], 2, False, id="three-slack-1-need-one-now"),
        pytest.param([1, 2], [1, 1], 2, True, id="one-slack-1-now-two-next"),
        pytest.param([2, 2], [1, 1], 2, True, id="two-slack-1-wait-for-the-next"),
        pytest.param([0, 0], [0], 2, True, id="more-due-than-a-batch-takes-a-full-batch-of-them"),
        pytest.param([0, 2], [0, 0], 2, False, id="more-due-than-a-batch-needs-a-full-batch-of-them"),
    ],
)
def test_keeps_staleness_bound(
    complete: list[int | None], incomplete: list[int | None], version: int, keeps: bool
) -> None:
    assert asynchronous.keeps_staleness_bound(ETA2, complete, incomplete, version) is keeps


@pytest.mark.parametrize("eta", [0, 1])
def test_keeps_staleness_bound_up_to_eta_1_is_the_due_rule(eta: int) -> None:
    """With eta <= 1 the rule is exactly "no incomplete group is due", in every state the rule and
    admission allow (at most a batch of due groups, at most eta + 1 batches of untrained groups)."""
    b = 2
    algo = AlgoConfig(rollout_batch_size=b, over_sampling_batch_size=b, max_staleness=eta)
    versions: list[int | None] = [None, 2, 3]
    checked = 0
    for complete in itertools.product(versions, repeat=b):
        for n in range(3):
            for incomplete in itertools.product(versions, repeat=n):
                every = [*complete, *incomplete]
                if len(every) > (eta + 1) * b or sum(asynchronous.slack(m, 3, eta) == 0 for m in every) > b:
                    continue
                any_due = any(due(m, 3, eta) for m in incomplete)
                assert asynchronous.keeps_staleness_bound(algo, complete, list(incomplete), 3) is not any_due
                checked += 1
    assert checked >= 9  # the allowed states of eta 0; more for eta 1


def staleness_rule_by_every_k(
    b: int, eta: int, complete: list[int | None], incomplete: list[int | None], v: int
) -> bool:
    """The rule as its docstring states it, checked at every k in 0..eta: the slow, obvious reference."""
    for k in range(eta + 1):
        n_k = sum(asynchronous.slack(m, v, eta) <= k for m in [*complete, *incomplete])
        c_k = sum(asynchronous.slack(m, v, eta) <= k for m in complete)
        if c_k < min(b, n_k - k * b):
            return False
    return True


@settings(max_examples=300, deadline=None)
@given(
    b=st.integers(1, 4),
    eta=st.integers(0, 6),
    v=st.integers(0, 8),
    complete=st.lists(st.none() | st.integers(0, 8), max_size=10),
    incomplete=st.lists(st.none() | st.integers(0, 8), max_size=10),
)
def test_keeps_staleness_bound_equals_the_rule_checked_at_every_k(
    b: int, eta: int, v: int, complete: list[int | None], incomplete: list[int | None]
) -> None:
    algo = AlgoConfig(rollout_batch_size=b, over_sampling_batch_size=b, max_staleness=eta)
    expected = staleness_rule_by_every_k(b, eta, complete, incomplete, v)
    assert asynchronous.keeps_staleness_bound(algo, complete, incomplete, v) is expected


def test_keeps_staleness_bound_costs_groups_not_eta() -> None:
    """A huge bound (a benchmark's "unbounded" 1e9) is answered from the groups alone; it used to build
    two lists of eta + 1 counts (gigabytes) on every batch."""
    algo = AlgoConfig(rollout_batch_size=2, over_sampling_batch_size=2, max_staleness=10**9)
    assert asynchronous.keeps_staleness_bound(algo, [5, 5], [0, None], 5) is True
    assert asynchronous.keeps_staleness_bound(algo, [None, None], [0], 10**9 + 5) is False  # a due group runs


NO_TOKEN = 1  # a group's oldest token version relative to the learner's: 0, -1, ...; this when it has none
GroupState = tuple[tuple[int, bool], ...]  # sorted (relative oldest version, complete) of untrained groups


def async_successors(algo: AlgoConfig, state: GroupState) -> list[GroupState]:
    """Every next state of an async run as the policy sees it, checking each batch against the bound.

    Events: a group's first token (under the learner's version), a group completing, a group dropped (the
    filter), and a learner step whenever `take_batch` gives a batch (versions shift by one). Admission
    then refills to (eta + 1) x B untrained groups, the most it allows. Version numbers are relative, so a
    run of any length visits finitely many states.
    """
    b, eta, v = algo.rollout_batch_size, algo.max_staleness, 100

    def admitted(groups: list[tuple[int, bool]]) -> GroupState:
        return tuple(sorted(groups + [(NO_TOKEN, False)] * ((eta + 1) * b - len(groups))))

    out: list[GroupState] = []
    for i, (rel, done) in enumerate(state):
        rest = list(state[:i] + state[i + 1 :])
        if not done:
            if rel == NO_TOKEN:
                out.append(admitted([*rest, (0, False)]))
            out.append(admitted([*rest, (min(rel, 0), True)]))
            out.append(admitted(rest))
    complete = ages(*((i, v + rel) for i, (rel, done) in enumerate(state) if done))
    incomplete = [None if rel == NO_TOKEN else v + rel for rel, done in state if not done]
    chosen = policy.take_batch(policy_for(Mode.ASYNC), algo, complete, v, incomplete)
    if chosen is None:
        if len(complete) >= b:  # the learner waits only for groups holding tokens older than its version
            assert any(m is not None and m < v for m in incomplete), f"waited for fresh work in {state}"
        return out
    for i in chosen:
        assert -state[i][0] <= eta, f"batch {chosen} of {state} trains a group {-state[i][0]} versions stale"
    kept = [(rel if rel == NO_TOKEN else rel - 1, d) for i, (rel, d) in enumerate(state) if i not in chosen]
    return [*out, admitted(kept)]


@pytest.mark.parametrize("eta", [0, 1, 2, 3])
@pytest.mark.parametrize("b", [1, 2, 3])
def test_async_never_trains_a_group_past_the_staleness_bound(b: int, eta: int) -> None:
    """Exhaustive over every reachable state of small async runs (any order of tokens, completions,
    drops and learner steps): no batch trains a group staler than max_staleness, and the learner never
    waits for groups whose tokens are all current. (The rule before eta-aware batching fails this at
    eta >= 2 within a few steps.)"""
    algo = AlgoConfig(rollout_batch_size=b, over_sampling_batch_size=b, max_staleness=eta)
    start: GroupState = tuple([(NO_TOKEN, False)] * ((eta + 1) * b))
    seen, todo = {start}, [start]
    while todo:
        for nxt in async_successors(algo, todo.pop()):
            if nxt not in seen:
                seen.add(nxt)
                todo.append(nxt)
    assert len(seen) > eta  # the search went somewhere


def test_async_eta_2_batch_of_young_groups_waits_for_the_old() -> None:
    """The case the simulator found (B=1, eta 2): at v1, g1 and g2 hold v0 tokens and run, g3 (v1) is
    complete. Training g3 now would leave g1 and g2 both due at v2, one batch for two: so it waits."""
    algo = AlgoConfig(rollout_batch_size=1, over_sampling_batch_size=1, max_staleness=2)
    assert policy.take_batch(policy_for(Mode.ASYNC), algo, ages((3, 1)), 1, [0, 0]) is None
    assert policy.take_batch(policy_for(Mode.ASYNC), algo, ages((3, 1), (1, 0)), 1, [0]) == [1]


# ---------------------------------------------------------------------------------------------------
# spread_leases


@pytest.mark.parametrize(
    ("available", "free", "slots", "expected"),
    [
        pytest.param(100, [3, 0, 5], [8, 8, 8], [3, 0, 5], id="work-for-every-slot-fills-all"),
        pytest.param(8, [8, 8], [8, 8], [4, 4], id="even-split"),
        pytest.param(6, [8, 4], [8, 8], [5, 1], id="levels-the-busier-worker"),
        pytest.param(6, [8, 16], [8, 16], [2, 4], id="relative-to-size"),
        pytest.param(3, [2, 2, 2], [4, 4, 4], [1, 1, 1], id="one-each"),
        pytest.param(5, [64, 0, 64, 64], [64] * 4, [2, 0, 2, 1], id="ties-go-to-the-earlier-worker"),
        pytest.param(0, [4, 4], [4, 4], [0, 0], id="no-work"),
        pytest.param(-3, [4], [4], [0], id="negative-work-is-none"),
        pytest.param(5, [], [], [], id="no-workers"),
    ],
)
def test_spread_leases(available: int, free: list[int], slots: list[int], expected: list[int]) -> None:
    assert policy.spread_leases(available, free, slots) == expected


@given(
    st.integers(0, 300),
    st.lists(st.tuples(st.integers(1, 64), st.integers(0, 64)), max_size=12),
)
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])  # no clock
def test_spread_leases_levels_free_fractions(available: int, workers: list[tuple[int, int]]) -> None:
    """Every sample that can be leased is, within each worker's free slots, and no single sample moved
    from one worker to another would leave the receiver freer than the giver was before it."""
    slots = [s for s, _ in workers]
    free = [min(f, s) for s, f in workers]
    shares = policy.spread_leases(available, free, slots)
    assert sum(shares) == min(available, sum(free))
    assert all(0 <= x <= f for x, f in zip(shares, free, strict=True))
    for i, (fi, xi, si) in enumerate(zip(free, shares, slots, strict=True)):
        for j, (fj, xj, sj) in enumerate(zip(free, shares, slots, strict=True)):
            if i != j and xi < fi and xj > 0:
                assert (fj - xj + 1) * si >= (fi - xi) * sj


def reference_spread(available: int, free: list[int], slots: list[int]) -> list[int]:
    """spread_leases as its docstring says, slowly: one sample at a time to the worker with the most free
    slots relative to its size, ties to more free slots, then to the earlier worker."""
    shares = [0] * len(free)
    for _ in range(max(0, available)):
        open_ = [i for i in range(len(free)) if free[i] - shares[i] > 0]
        if not open_:
            break
        best = min(
            open_, key=lambda i: (-(free[i] - shares[i]) / max(1, slots[i]), -(free[i] - shares[i]), i)
        )
        shares[best] += 1
    return shares


@example(3, [3, 5], 8, [0] * 16)  # a worker with exactly the level free, before a freer one
@example(7, [4, 6, 4, 6], 8, [0] * 16)
@given(
    st.integers(-2, 400),
    st.lists(st.one_of(st.integers(-1, 8), st.integers(0, 64)), max_size=16),
    st.one_of(st.just(None), st.integers(0, 128)),
    st.lists(st.integers(0, 128), min_size=16, max_size=16),
)
@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])  # no clock
def test_spread_leases_is_the_one_at_a_time_greedy(
    available: int, free: list[int], size: int | None, sizes: list[int]
) -> None:
    """Equal sizes (every worker `size`, the usual case, computed by levels) and mixed sizes alike."""
    slots = [size] * len(free) if size is not None else sizes[: len(free)]
    assert policy.spread_leases(available, free, slots) == reference_spread(available, free, slots)


def test_spread_leases_rejects_mismatched_lists() -> None:
    with pytest.raises(ValueError, match="2 free counts for 1 workers"):
        policy.spread_leases(3, [1, 2], [4])


def test_work_goes_to_workers_on_current_weights_or_failed_within_the_staleness_bound() -> None:
    algo = AlgoConfig(max_staleness=1)
    assert policy.serves_current_weights(3, -1, 3, algo)  # serves the broker's version
    assert policy.serves_current_weights(4, -1, 3, algo)  # a newer one (the broker heard of it later)
    assert not policy.serves_current_weights(2, -1, 3, algo)  # still getting v3: nothing meanwhile
    assert not policy.serves_current_weights(2, 2, 3, algo)  # failed an older version, v3 not answered
    assert policy.serves_current_weights(2, 3, 3, algo)  # cannot load v3: works on v2, 1 behind
    assert not policy.serves_current_weights(1, 3, 3, algo)  # 2 behind: past max_staleness 1
    assert policy.serves_current_weights(1, 3, 3, AlgoConfig(max_staleness=2))
