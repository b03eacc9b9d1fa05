"""`over_sampling = "auto"`: how many groups an april round keeps in flight, chosen from what was observed.

Owns `plan_round_target`, called when a round opens. For each candidate target O (from the batch B up to
`over_sampling_batch_size`, the cap) it predicts the round's length by replaying the round a few times
on the run's own recent response lengths (`broker.length_history`):
  - the round's samples are the unfinished ones carried over (partials, with the tokens they have: a
    partial's total length is drawn from the observed lengths longer than it already is) followed by the
    samples of O minus the live groups fresh groups, in dispatch order;
  - `slots` sequences run at once, each sample taking one step per token it still has to generate (a
    free slot takes the next sample), so a round lasts until the B-th group finishes.
More groups in flight never make a round longer here (nothing is thrown away: unfinished work is carried
to the next round), but past the point where every slot stays busy until the round ends they only add
partials, whose tokens grow staler each round they wait. So the plan is the smallest O whose predicted
round is within `KNEE` of the shortest predicted: the knee of the curve, not its end.

Time is counted in decode steps, not seconds: the broker does not know the engines' step cost, and a
step with more sequences costs a little more on a GPU (the knee's tolerance absorbs it). Before
`MIN_OBSERVED` lengths were seen there is nothing to draw from and the cap is used. Pure numpy, seeded
by the caller: the broker and `april simulate` plan the same rounds.
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

KNEE = 0.05  # a target within 5% of the shortest predicted round is as good
REPLAYS = 4  # replays averaged per candidate
MIN_OBSERVED = 64  # finished lengths needed before planning
CANDIDATES = 9  # targets tried between B and the cap


@dataclass(frozen=True, slots=True)
class CarriedGroup:
    """A live group of the round that is not complete: the tokens of each unfinished sample so far."""

    progress: tuple[int, ...]  # one entry per unfinished sample (0: not started)


def candidate_targets(batch: int, cap: int) -> list[int]:
    """Up to CANDIDATES targets from `batch` to `cap`, both included, ascending."""
    if cap <= batch:
        return [batch]
    return sorted({round(float(x)) for x in np.linspace(batch, cap, CANDIDATES)})


def predict_round_steps(
    carried: Sequence[CarriedGroup],
    fresh_groups: int,
    group_size: int,
    needed: int,
    slots: int,
    ordered: npt.NDArray[np.int64],
    rng: np.random.Generator,
) -> float:
    """Decode steps until `needed` of the round's incomplete groups finish (one replay; see module).
    `ordered`: the observed lengths, sorted ascending (sorted once per plan, not per replay)."""
    if needed <= 0:
        return 0.0
    remaining: list[int] = []
    owner: list[int] = []
    for g, group in enumerate(carried):
        for p in group.progress:
            longer = ordered[np.searchsorted(ordered, p, side="right") :]
            total = int(rng.choice(longer)) if longer.shape[0] else p + 1
            remaining.append(max(1, total - p))
            owner.append(g)
    n_fresh = fresh_groups * group_size
    remaining.extend(np.maximum(1, rng.choice(ordered, size=n_fresh)).tolist() if n_fresh else [])
    for f in range(fresh_groups):
        owner.extend([len(carried) + f] * group_size)
    groups = len(carried) + fresh_groups
    if groups < needed:
        return float("inf")
    finish = np.zeros(groups)
    free = [0.0] * min(slots, len(remaining))  # when each slot is next free
    heapq.heapify(free)
    for r, g in zip(remaining, owner, strict=True):
        start = heapq.heappop(free)
        end = start + r
        heapq.heappush(free, end)
        finish[g] = max(finish[g], end)
    return float(np.partition(finish, needed - 1)[needed - 1])


def plan_round_target(
    batch: int,
    cap: int,
    complete: int,
    carried: Sequence[CarriedGroup],
    group_size: int,
    slots: int,
    observed: npt.NDArray[np.int64],
    seed: int,
) -> int:
    """The round's target (groups kept in flight + partial + complete), in [batch, cap] (module docstring).

    `complete`: groups of the round already complete; `carried`: the round's other live groups."""
    if observed.shape[0] < MIN_OBSERVED or slots <= 0:
        return cap
    ordered = np.sort(observed)
    live = complete + len(carried)
    needed = batch - complete
    predicted: list[tuple[int, float]] = []
    for target in candidate_targets(max(batch, live), max(cap, live)):
        rng = np.random.default_rng([seed, target])
        steps = [
            predict_round_steps(carried, target - live, group_size, needed, slots, ordered, rng)
            for _ in range(REPLAYS)
        ]
        predicted.append((target, float(np.mean(steps))))
    best = min(p for _, p in predicted)
    return next(t for t, p in predicted if p <= best * (1 + KNEE))
