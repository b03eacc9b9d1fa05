"""async: no rounds; an admission bound and a batch rule keep every trained group within `max_staleness`.

AReaL's admission bound, `accepted <= (max_staleness + version + 1) x B`, caps the groups ever issued and
not dropped (trained, waiting, in flight or partial), and a batch of complete groups is taken only when
it leaves every untrained group a batch in time (`keeps_staleness_bound`, with its proof). Every new
weight version aborts what is leased, so that it resumes under the new weights. Counts and versions only:
no books, no samples.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import ClassVar

from april.config import AlgoConfig
from broker.modes.base import ModePolicy, PoolCounts


class Async(ModePolicy):
    """Generation never stops: the admission bound holds new groups back, the batch rule the learner."""

    name: ClassVar[str] = "async"
    round_based: ClassVar[bool] = False
    abort_on_new_version: ClassVar[bool] = True
    needs_incomplete_versions: ClassVar[bool] = True

    def round_target(self, algo: AlgoConfig, planned: int | None = None) -> int:
        """No rounds: the over-sampled batch, as april's configured target."""
        return algo.over_sampling_batch_size if planned is None else planned

    def fresh_group_allowance(
        self, algo: AlgoConfig, counts: PoolCounts, version: int, round_open: bool, planned: int | None = None
    ) -> int:
        """The admission bound, whatever the round."""
        return max(0, admission_limit(algo, version) - counts.accepted)

    def batch_may_form(
        self,
        algo: AlgoConfig,
        complete_versions: Counter[int | None],
        incomplete_versions: Sequence[int | None],
        learner_version: int,
    ) -> bool:
        """Only a batch that keeps the staleness bound for every group, this batch's and the later ones'."""
        return keeps_staleness_bound(algo, complete_versions, incomplete_versions, learner_version)

    def held_by_admission(self, algo: AlgoConfig, counts: PoolCounts, version: int) -> bool:
        return counts.accepted >= admission_limit(algo, version)


def admission_limit(algo: AlgoConfig, version: int) -> int:
    """async: the most groups ever accepted by learner version `version`: (eta + v + 1) x B."""
    return (algo.max_staleness + version + 1) * algo.rollout_batch_size


def slack(min_version: int | None, learner_version: int, max_staleness: int) -> int:
    """async: how many later batches this group may still wait, 0..eta (0: it is due: the next batch
    must take it).

    A group whose oldest token is of version m must be trained at a version <= m + eta (its deadline); its
    slack is deadline - learner_version. A group with no token yet gets its first under the learner's
    version or later: slack eta. An overdue group (left by an earlier setting or a restart) counts as due.
    """
    oldest = learner_version if min_version is None else min_version
    return min(max_staleness, max(0, oldest + max_staleness - learner_version))


def keeps_staleness_bound(
    algo: AlgoConfig,
    complete: Iterable[int | None],
    incomplete: Iterable[int | None],
    learner_version: int,
) -> bool:
    """async: whether a batch taken now (the B complete groups of least slack) leaves every untrained group
    a batch in time. Groups are given by their oldest token version (None: no token yet), listed or
    counted (a Counter by version: then it costs O(versions), not O(groups)).

    One batch of B groups is trained per version. Let N(k) be the untrained groups (complete or not, none
    in the unacked batch) with slack <= k, C(k) the complete ones. The rule: for every k in 0..eta,

        C(k) >= min(B, N(k) - k x B)

    (the groups due within k versions that the k later batches cannot hold must be in this one, so they
    must be complete). Proof that no trained group ever exceeds max_staleness, by the invariant
    I: N(k) <= (k + 1) x B for k = 0..eta, whenever the learner waits for a batch at version v:
      - k = eta, always: every untrained group has slack <= eta, and admission keeps them at most
        accepted - trained <= (eta + v + 1) x B - v x B = (eta + 1) x B.
      - k < eta: N(k) counts only groups holding a token older than v. While v stands no event adds one
        (new tokens are of version v; completing and dropping only remove), so I is kept between batches.
      - Taking the B complete groups of least slack puts min(B, C(k)) groups of slack <= k in the batch for
        every k at once (no choice puts more), so after it N'(k) = N(k) - min(B, C(k)) <= max(N(k) - B,
        k x B) <= k x B by the rule and I. At v + 1 every slack drops by one: N(k - 1) <= k x B, which is I.
      - At k = 0, N'(0) <= 0: every due group is in the batch, so none is trained after its deadline.
    The learner never waits for fresh work: under I the rule holds as soon as B groups are complete and
    every group with slack < eta (one holding a token older than v) is complete. With eta <= 1 the rule is
    just "every due group is complete" (admission alone makes due groups fit in one batch); with eta >= 2
    it also keeps a batch from being filled with young groups while older ones run, after which more than
    a batch of them could fall due at one version. The proof assumes tokens are generated under the
    learner's version (async relays new weights and aborts before leasing again); if I is broken anyway,
    min(B, .) asks for at most a batch of the most urgent groups, so batches still form.
    """
    b, eta = algo.rollout_batch_size, algo.max_staleness
    total: Counter[int] = Counter()  # untrained groups by slack
    ready: Counter[int] = Counter()  # complete ones by slack
    for m, count in _counted(complete).items():
        k = slack(m, learner_version, eta)
        total[k] += count
        ready[k] += count
    for m, count in _counted(incomplete).items():
        total[slack(m, learner_version, eta)] += count
    # Between two slack values that occur, N(k) and C(k) stay put while min(B, N(k) - k x B) only falls,
    # so the rule need only be checked at k = 0 and where a group's slack is: O(groups), whatever eta
    # (a list per k in 0..eta made a large max_staleness cost gigabytes and minutes per batch).
    n = c = 0
    for k in sorted(total.keys() | {0}):
        n, c = n + total[k], c + ready[k]
        if c < min(b, n - k * b):
            return False
    return True


def _counted(versions: Iterable[int | None]) -> Counter[int | None]:
    return versions if isinstance(versions, Counter) else Counter(versions)
